"""Named results and handles of normal-mode layout, dispatch and combine,
within and across nodes, and the event of a call (EventHandle, which
low-latency mode returns too). Below every mode: it imports none."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

import numpy as np


class EventHandle:
    """A CUDA event recorded on the communication stream after an operation.

    ``current_stream_wait()`` makes the caller's current stream wait for it.
    """

    def __init__(self, event):
        self.event = event

    def current_stream_wait(self) -> None:
        import cupy
        cupy.cuda.get_current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


@dataclass
class LayoutResult:
    """Output of :meth:`Buffer.get_dispatch_layout` (device arrays).

    Attributes:
        num_tokens_per_rank: [R] int32.
        num_tokens_per_expert: [E] int32.
        is_token_in_rank: [T, R] bool.
        event: EventHandle.
        num_tokens_per_rdma_rank: [num_nodes] int32 across nodes (tokens with an
            expert on each node; DeepEP's name), None within a node.
    """
    num_tokens_per_rank: object
    num_tokens_per_expert: object
    is_token_in_rank: object
    event: EventHandle | None = None
    num_tokens_per_rdma_rank: object = None


@dataclass(frozen=True)
class ExpandTables:
    """Where a direct-transport dispatch's (token, slot) pairs go in the
    receivers' expert blocks (filled by its notify pass; see
    cuda_src/normal/notify.cuh, expand_tables).

    Attributes:
        carved: the cupyep.arrays.Carved of the handle's arrays that holds
            them, as "expand_base" and "expert_meta";
        base: [R, E_local + 1] int32 device; [d, e]: the expert-major row at
            rank d of this rank's first pair for d's local expert e; [d, E_local]:
            the expert-major rows d lays out.
        meta: [2 E_local + 1] int32 device: this rank's block offsets [E_local + 1]
            (aligned), then its unaligned pair counts [E_local].
        alignment: the expert_alignment the tables were made with.
        most_rows: the most expert-major rows any rank lays out (host), -1 in
            worst-token mode.
    """
    carved: object
    alignment: int
    most_rows: int

    @property
    def base(self):
        return self.carved["expand_base"]

    @property
    def meta(self):
        return self.carved["expert_meta"]

    def ptrs(self) -> tuple[int, int]:
        """Device addresses of (base, meta), without views."""
        return self.carved.ptr("expand_base"), self.carved.ptr("expert_meta")


def evolve(obj, **changes):
    """A copy of the dataclass ``obj`` (frozen or not, without __slots__ or
    __post_init__) with ``changes``: ``dataclasses.replace`` without
    re-running __init__ over every field, for the calls' host path.
    TypeError for a name that is not a field."""
    unknown = changes.keys() - obj.__dataclass_fields__.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass(frozen=True)
class DispatchHandle:
    """What combine and cached dispatch need from a dispatch (device arrays).

    Attributes:
        rank_prefix_matrix: [R, R] int32; entry [i, j] = tokens sources 0..i send to rank j.
        recv_channel_prefix: [R, C + 1] int32; rows from source s in channel c are
            [recv_rank_offset[s] + p[s, c], recv_rank_offset[s] + p[s, c + 1]).
        recv_rank_offset: [R + 1] int32; first row of each source's block.
        recv_src_idx: [N] int32; source token index of each received row.
        is_token_in_rank: [T, R] bool.
        send_head: [T, R] int32; position of token t in stream (channel(t), rank), -1 if not sent.
        send_list: [R, T] int32; tokens of each destination's stream, channel-major.
        send_channel_prefix: [R, C + 1] int32.
        num_recv_tokens: N (-1 when unknown on the host: worst-token mode).
        num_worst_tokens: rows allocated in worst-token mode, else 0.
        recv_expert_row: [N, k] int32, expert-major row of each (row, slot) pair, -1 for
            slots of other ranks; None unless dispatch ran with expert_major=True.
        num_expert_rows: M_cap, rows of the expert-major arrays (0 without expert_major).
        recv_expert_counts: tuple of E_local host ints, the (row, slot) pairs of each
            local expert this routing delivers, before alignment (what a cached dispatch
            aligns for its num_recv_tokens_per_expert); None in worst-token mode,
            where the counts never reach the host.
        transport: "queue" or "direct", the transport of the dispatch that made the
            handle; its combine and cached dispatches use the same one.
        counts: numpy [R, R] int64 host count matrix, entry [s, d] = rows rank s sends
            rank d (every rank has the same); None in worst-token mode.
        expand: ExpandTables of a direct-transport dispatch (where its pairs
            go in expert-major dispatches), else None.
        lease: the direct transport's cupyep.slots.Lease of the dispatch slot
            that holds this dispatch's rows (its zero-copy combine buffer is
            that slot's), else None. The routing above is the handle's own:
            combine and cached dispatch take the handle whatever became of
            the slot.

    A handle made by a notify pass holds its routing arrays as parts of one
    allocation (:func:`carved_handle`): each becomes a CuPy array when first
    read, and kernels take their addresses (:meth:`array_ptr`) without one.
    """
    rank_prefix_matrix: object
    recv_channel_prefix: object
    recv_rank_offset: object
    recv_src_idx: object
    is_token_in_rank: object
    send_head: object
    send_list: object
    send_channel_prefix: object
    num_recv_tokens: int
    num_worst_tokens: int
    num_tokens: int
    hidden: int
    num_experts: int
    num_channels: int
    buffer_id: int
    # Expert-major layout (dispatch(..., expert_major=True)); see cupyep.normal.expert_major.
    recv_expert_row: object = None
    num_expert_rows: int = 0
    recv_expert_counts: tuple | None = None
    transport: str = "queue"
    counts: object = None
    expand: object = None
    lease: object = None

    def __getattr__(self, name):
        """A routing array of a handle made by :func:`carved_handle`, viewed
        from its allocation when first read (the view is then kept)."""
        carved = self.__dict__.get("_carved")
        key = CARVED_FIELDS.get(name)
        if carved is None or key is None or key not in carved:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        if name == "recv_src_idx":  # carved for the slot's rows: the handle's are the first N
            view = carved.view(key, (self.num_worst_tokens or self.num_recv_tokens,))
        else:
            view = carved[key]
        self.__dict__[name] = view
        return view

    def array_ptr(self, name: str) -> int:
        """Device address of the routing array ``name`` (0 for None), without
        making a view of a carved one."""
        if name in self.__dict__:  # set, or viewed already
            value = self.__dict__[name]
            return value.data.ptr if value is not None else 0
        return self.__dict__["_carved"].ptr(CARVED_FIELDS[name])  # only a carved handle leaves one unset


#: The routing arrays of a DispatchHandle and their names in its carved allocation (cupyep.normal.node).
CARVED_FIELDS = {"rank_prefix_matrix": "rpm", "recv_channel_prefix": "recv_cp", "recv_rank_offset": "recv_off",
                  "recv_src_idx": "src_idx", "is_token_in_rank": "in_rank", "send_head": "send_head",
                  "send_list": "send_list", "send_channel_prefix": "send_cp"}
_HANDLE_DEFAULTS = {f.name: f.default for f in fields(DispatchHandle) if f.default is not MISSING}


class CarvedRouting:
    """The routing arrays' addresses of a handle still being made (the
    notify pass's carved arrays), by DispatchHandle's names, as
    :meth:`DispatchHandle.array_ptr` gives a handle's."""

    __slots__ = ("carved",)

    def __init__(self, carved):
        self.carved = carved

    def array_ptr(self, name: str) -> int:
        return self.carved.ptr(CARVED_FIELDS[name])


def carved_handle(carved, **values) -> DispatchHandle:
    """A DispatchHandle whose routing arrays are the parts of ``carved`` (a
    cupyep.arrays.Carved holding "rpm", "recv_cp", "recv_off", "in_rank",
    "send_head", "send_list", "send_cp" and, where carved, "src_idx"),
    viewed when first read; ``values``: the other fields (recv_src_idx None
    unless carved). Built without the dataclass's __init__ (host path)."""
    handle = object.__new__(DispatchHandle)
    d = handle.__dict__
    d.update(_HANDLE_DEFAULTS)
    d.update(values)
    if "src_idx" not in carved:
        d.setdefault("recv_src_idx", None)
    d["_carved"] = carved
    return handle


@dataclass
class DispatchResult:
    """Output of :meth:`cupyep.Buffer.dispatch`.

    Attributes:
        recv_x: [N, H] uint16 (BF16 bits) or uint8 (FP8 e4m3 bits); None for an
            expert-major dispatch on the direct transport (the rows exist only in
            expert_x).
        recv_x_scales: [N, H / 128] float32 for FP8, else None (and None where
            recv_x is).
        recv_topk_idx: [N, k] int64 local expert ids, -1 for slots of other ranks (None in cached mode
            without topk_idx).
        recv_topk_weights: [N, k] float32, 0 where recv_topk_idx is -1 (None without weights).
        num_recv_tokens_per_expert: list of E_local ints, the (row, slot) pairs of each local
            expert, each rounded up to expert_alignment; a cached dispatch gives those of the
            handle's routing (aligned to this call's expert_alignment). None in worst-token
            mode (also for a cached dispatch with a worst-token handle): the host never
            waits for the counts.
        handle: DispatchHandle for combine and cached dispatch.
        event: EventHandle recorded after the dispatch on the communication stream.

    Worst-token mode (num_worst_tokens = N > 0): rows at or after the received count
    (``handle.recv_rank_offset[R]``, on the device) are padding: recv_topk_idx and
    ``handle.recv_src_idx`` hold -1 there and recv_topk_weights 0, filled by the dispatch
    kernel itself (no host work, also in a CUDA-graph replay and with a cached handle).
    recv_x and recv_x_scales padding rows are not written: their contents are unspecified
    (zeroing them would write every padding row on every call); skip them by their
    -1 ids.

    Lifetime: on the queue route every array is the caller's own. On the
    one-copy direct routes (within and across nodes) the receive arrays are
    views of one of the buffer's ``num_in_flight`` pool slots, and ``lease``
    says which: reading any of them through this result after the slot went
    to a later dispatch raises cupyep.StaleResultError. An array taken out of
    the result earlier is not checked; ``dispatch(..., fresh=True)`` copies
    the rows into arrays of the caller's own instead (lease None).

    With ``expert_major=True`` (see cupyep.normal.expert_major; None otherwise):
        expert_x: [M_cap, H], dtype of x: the (row, local expert) pairs in
            per-expert blocks; alignment padding rows inside the blocks are zero; rows
            at or after expert_offsets[E_local] (M_cap is a bound: worst-token mode and
            cached dispatch) are not written, their contents unspecified.
        expert_x_scales: [M_cap, H / 128] float32 for FP8, else None; rows as expert_x's.
        expert_offsets: [E_local + 1] int32 device array: block e is rows
            [expert_offsets[e], expert_offsets[e + 1]), a multiple of expert_alignment long.
        expert_src_row: [M_cap] int32: recv_x row of each expert-major row, -1 for every
            padding row (inside the blocks and at or after expert_offsets[E_local]).
    """
    recv_x: object
    recv_x_scales: object
    recv_topk_idx: object
    recv_topk_weights: object
    num_recv_tokens_per_expert: list | None = None
    handle: DispatchHandle | None = None
    event: EventHandle | None = None
    expert_x: object = None
    expert_x_scales: object = None
    expert_offsets: object = None
    expert_src_row: object = None
    lease: object = None
    pooled: frozenset = None  # the fields that are views of the lease's slot (None: every POOL_FIELDS one)

    def __getattribute__(self, name):
        if name in POOL_FIELDS:  # a view of a pool slot: valid while the slot holds this dispatch
            lease = object.__getattribute__(self, "lease")
            pooled = object.__getattribute__(self, "pooled")
            if lease is not None and (pooled is None or name in pooled):
                lease.check(name)
        return object.__getattribute__(self, name)

    @property
    def stale(self) -> bool:
        """True once the pool slot this result's arrays live in went to a later dispatch."""
        return self.lease is not None and not self.lease.valid


# DispatchResult fields that may be views of a pool slot (those of a result's ``pooled``, else all of them).
POOL_FIELDS = frozenset({"recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "expert_x",
                         "expert_x_scales", "expert_src_row"})
# The rank-major ones: a result's ``pooled`` when its expert-major arrays are its own.
RECEIVE_FIELDS = frozenset({"recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights"})


@dataclass
class CombineResult:
    """Output of :meth:`cupyep.Buffer.combine`.

    Attributes:
        combined_x: [T, H] uint16 (BF16 bits), FP32-accumulated sum over ranks.
        combined_topk_weights: [T, k] float32 or None.
        event: EventHandle recorded after the combine.
        expert_reduced_x: [N, H] uint16 (BF16 bits) when x was expert-major: the
            per-received-row reduction of the expert outputs that was combined
            (kept here so a captured CUDA graph's temporary stays alive; in
            worst-token mode rows at or after the received count are not written); else None
            (and None for a zero-copy combine, whose reduce wrote the handle's buffer).
    """
    combined_x: object
    combined_topk_weights: object
    event: EventHandle | None = None
    expert_reduced_x: object = None


def check_hidden(hidden: int) -> None:
    """ValueError unless ``hidden`` (H) is a positive multiple of 128 (the FP8 scale groups)."""
    if hidden <= 0 or hidden % 128:
        raise ValueError(f"hidden size must be a positive multiple of 128, got {hidden}")


def aligned_expert_counts(recv_expert_counts, expert_alignment: int) -> list[int] | None:
    """DispatchResult.num_recv_tokens_per_expert from a handle's host counts.

    Arguments:
        recv_expert_counts: E_local ints, (row, slot) pairs per local expert before
            alignment (DispatchHandle.recv_expert_counts), or None (worst-token mode).
        expert_alignment: A >= 1.

    Returns:
        list of E_local ints, each rounded up to a multiple of A; None when the
        counts are None (never an empty list for unknown counts).
    """
    if recv_expert_counts is None:
        return None
    if expert_alignment == 1:
        return list(recv_expert_counts)
    a = np.asarray(recv_expert_counts, dtype=np.int64)
    return (-(-a // expert_alignment) * expert_alignment).tolist()


def dispatch_result(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle, event,
                    em) -> DispatchResult:
    """The DispatchResult of a dispatch, with its expert-major arrays when ``em`` is given."""
    result = DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle, event)
    if em is not None:
        result.expert_x, result.expert_x_scales = em.expert_x, em.expert_x_scales
        result.expert_offsets, result.expert_src_row = em.expert_offsets, em.expert_src_row
    return result
