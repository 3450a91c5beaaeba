"""Normal-mode dispatch across nodes, two hops, on the device.

``TwoHopDispatch(group, max_tokens, hidden, num_topk, num_experts)`` moves
one call's rows as the hierarchical mode does (cuda_src/normal/internode.cu):
a token crosses to another node once, over NVSHMEM put-with-signal, to its
rail peer, which forwards it over the node's IPC peer pointers to every
destination rank there; tokens for the own node go straight over IPC. Every
rank receives exactly what the dispatch within a node gives (one row per
(token, rank), by source rank then source token), so the oracle is
``cupyep.reference.intranode_dispatch``. With ``route="direct"`` there is
no node dedup and no forwarding: each row for a rank of another node is put
straight into its final row there (the receive pools on the NVSHMEM heap),
and the combine returns each row to its owner, which sums over the ranks.

Each dispatch runs two kernels on the current stream: the notify pass across
nodes (the layout, the count exchange over put with signal, the plan and the
cumulative targets, all on the device; it is also the barrier between calls)
and the dispatch. A combine runs the combine kernel (twice with top-k
weights), behind a GPU barrier over every rank when the call before it was
a combine too. The host reads back only how many rows it received from each
source (mapped memory), to shape the outputs.

Lifetime: the received rows are views of one of ``num_in_flight`` slots of
the receive pool, taken round-robin by the dispatches (cupyep.slots; the
result's ``lease`` says whether its slot still holds it). Everything a
combine needs is in the dispatch's handle (TwoHopHandle): any live handle
can be combined, any number of times, in any order.

Shapes: x [T, H] uint16 (BF16 bits), or uint8 (FP8 e4m3) with x_scales
[T, H / 128] float32; topk_idx [T, k] int64, topk_weights [T, k] float32 or
None; T <= max_tokens, H <= hidden (a multiple of 128), k <= num_topk, the
same H and k on every rank in one call. The combine takes BF16 rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import jit
from ..errors import GUARD_DTYPE
from ..slots import DEFAULT_IN_FLIGHT

THREADS = 512
NOTIFY_THREADS = 1024
MAX_RANKS_PER_NODE = 32  # two_hop_combine: a network row's destinations in its node, one bit each
INT32_MAX = 2**31 - 1
u64, i64, i32 = np.uint64, np.int64, np.int32
NOTIFY_ARGS_DTYPE = jit.struct_dtype([
    ("topk_idx", u64), ("in_rank", u64), ("send_head", u64), ("rdma_slot", u64), ("rank_prefix", u64),
    ("net_count", u64), ("node_tokens", u64), ("send_node", u64), ("row", u64), ("matrix", u64),
    ("row_signal", u64), ("state", u64), ("host", u64),
    ("capacity", i32), ("delta", u64), ("cached", i32), ("kernel_time", u64), ("num_tokens", i32), ("num_topk", i32),
    ("num_experts", i32), ("num_ranks", i32), ("ranks_per_node", i32), ("rank", i32), ("guard", GUARD_DTYPE)])
ARGS_DTYPE = jit.struct_dtype([
    ("x", u64), ("x_scales", u64), ("topk_idx", u64), ("topk_weights", u64), ("rdma_slot", u64),
    ("send_head", u64), ("rank_prefix", u64), ("node_tokens", u64), ("send_node", u64), ("staging", u64),
    ("net_rows", u64), ("net_signal", u64),
    ("net_target", u64), ("net_count", u64), ("pools", u64), ("out_x", i64), ("out_idx", i64), ("out_w", i64),
    ("out_src", i64), ("out_slot", i64), ("arrived", u64), ("arrived_target", u64), ("row_stride", i64),
    ("out_scales", i64), ("notify_ok", u64), ("capacity", i64), ("rdma_chunk", i32), ("nvlink_chunk", i32),
    ("direct", i32), ("heap_pool", u64), ("direct_signal", u64), ("direct_stage", u64), ("hop_ns", u64),
    ("kernel_time", u64), ("num_tokens", i32),
    ("num_topk", i32), ("x_int4", i32), ("num_scales", i32), ("num_ranks", i32), ("ranks_per_node", i32),
    ("num_local_experts", i32), ("rank", i32), ("guard", GUARD_DTYPE)])
COMBINE_ARGS_DTYPE = jit.struct_dtype([
    ("y", u64), ("recv_src_rank", u64), ("recv_src_idx", u64), ("recv_slot", u64), ("pools", u64),
    ("direct_in", i64), ("gather", i64), ("counters", u64), ("targets", u64), ("net_rows", u64),
    ("row_stride", i64), ("meta_offset", i64), ("net_count", u64), ("staging", u64), ("net_in", u64),
    ("net_signal", u64), ("net_target", u64), ("send_head", u64), ("direct", i32), ("rank_in", u64),
    ("rank_signal", u64), ("rank_target", u64), ("rank_stage", u64), ("out", u64), ("notify_ok", u64),
    ("hop_ns", u64), ("kernel_time", u64), ("num_recv", i32), ("num_tokens", i32), ("max_tokens", i32), ("x_int4", i32),
    ("num_topk", i32), ("num_ranks", i32), ("ranks_per_node", i32), ("rank", i32), ("guard", GUARD_DTYPE)])


# The hop metric (TwoHop*Args::hop_ns): the stamps to start a call from, and
# the hops each kernel's four stamps delimit ((name, first stamp, last stamp)).
HOP_STAMPS_INIT = (2**64 - 1, 0, 0, 0)
DISPATCH_HOPS = (("network", 0, 1), ("forward", 1, 2), ("total", 0, 3))
COMBINE_HOPS = (("node", 0, 1), ("network", 1, 2), ("reduce", 2, 3), ("total", 0, 3))


def hop_times_us(stamps, hops) -> dict:
    """{hop: microseconds} from one call's four %globaltimer stamps (host
    ints) and DISPATCH_HOPS or COMBINE_HOPS; None for a hop whose stamps
    were not both written."""
    st = [int(v) for v in stamps]
    if len(st) != 4:
        raise ValueError(f"a call has four hop stamps, got {len(st)}")
    unset = (HOP_STAMPS_INIT[0], 0)
    return {name: ((st[b] - st[a]) / 1e3 if st[a] not in unset and st[b] not in unset else None)
            for name, a, b in hops}


def _check_stamps(arr, name: str, dtype, n: int):
    """A stamps argument: None, or a cupy ``dtype`` [n] array (ValueError otherwise)."""
    if arr is None:
        return None
    from ..arrays import as_cupy, check
    return check(as_cupy(arr, name), name, dtype, shape=(n,))


def _check_hop(hop_ns):
    return _check_stamps(hop_ns, "hop_ns", np.uint64, 4)


def _check_kernel_ns(arr, name: str):
    """Kernel stamps (cupyep.lab.bench.stamps.new_kernel_stamps, a row): int64 [2]."""
    return _check_stamps(arr, name, np.int64, 2)


def _signals(core, n: int):
    """n NVSHMEM signal words on the symmetric heap (uint64), zeroed."""
    sig = core.array((n,), dtype="uint64")
    sig[...] = 0
    return sig


def spec(num_threads: int = THREADS) -> jit.KernelSpec:
    """The two-hop notify, dispatch and combine (one module: they share the NVSHMEM registration)."""
    return jit.KernelSpec(name=f"two_hop_threads_{num_threads}", source="normal/internode.cu",
                          kernels=(f"cupyep::normal::two_hop_dispatch<{num_threads}, false>",
                                   f"cupyep::normal::two_hop_combine<{num_threads}, false>",
                                   f"cupyep::normal::two_hop_notify<{NOTIFY_THREADS}>",
                                   f"cupyep::normal::two_hop_combine<{num_threads}, true>",
                                   f"cupyep::normal::two_hop_dispatch<{num_threads}, true>"), nvshmem=True)


def state_words(num_ranks: int, ranks_per_node: int) -> int:
    """int64 words of the notify's private state (two_hop_state_words in two_hop.cu)."""
    n = num_ranks // ranks_per_node
    return 2 + n + num_ranks + 1 + ranks_per_node + n + num_ranks


def state_slices(num_ranks: int, ranks_per_node: int) -> dict:
    """Where each part of the state lies: {"calls", "ok", "net_total",
    "arrived_total", "combine_total", "combine_net_total",
    "combine_rank_total"} -> slice."""
    R, N = num_ranks, num_ranks // ranks_per_node
    out, off = {"calls": slice(0, 1), "ok": slice(1, 2)}, 2
    for name, n in (("net_total", N), ("arrived_total", R), ("combine_total", 1 + ranks_per_node),
                    ("combine_net_total", N),
                    ("combine_rank_total", R)):
        out[name] = slice(off, off + n)
        off += n
    return out


COMBINE_TARGETS = ("combine_total", "combine_net_total", "combine_rank_total")  # the state's combine part, in order


def kernel_specs() -> list[jit.KernelSpec]:
    return [spec()]


def notify_smem(num_ranks: int, num_nodes: int) -> int:
    """Dynamic shared memory of the notify (two_hop_notify): my counts per rank
    and node and the slot bases (int64), then each warp's positions per column
    (int32 [NOTIFY_THREADS / 32][R + N])."""
    return 8 * (num_ranks + 2 * num_nodes) + 4 * (NOTIFY_THREADS // 32) * (num_ranks + num_nodes)


DEFAULT_DYNAMIC_SMEM = 48 * 1024  # a kernel's dynamic shared memory without the opt-in attribute


def check_notify_smem(num_ranks: int, num_nodes: int, optin_limit: int) -> int:
    """The notify's dynamic shared memory (:func:`notify_smem`), or ValueError
    when it exceeds ``optin_limit``, the device's opt-in maximum per block
    (MaxSharedMemoryPerBlockOptin): a world too large for one notify block."""
    smem = notify_smem(num_ranks, num_nodes)
    if smem > optin_limit:
        raise ValueError(f"the two-hop notify needs {smem} bytes of shared memory for {num_ranks} ranks in "
                         f"{num_nodes} nodes; this GPU gives a block at most {optin_limit}")
    return smem


ROUTES = ("two_hop", "direct")


def direct_row_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of a staged row of the direct route (DirectRow in two_hop.cu: the
    payload, the scales, k int64 ids, k float32 weights, the source index and
    the slot, each part at a 16-byte boundary), the larger of BF16 and FP8."""
    a16 = lambda n: -(-n // 16) * 16  # noqa: E731
    rest = a16(8 * num_topk) + a16(4 * num_topk) + 32
    return max(a16(2 * hidden) + rest, a16(hidden + 4 * (hidden // 128)) + rest)


def check_route(route) -> str:
    """A route of TwoHopDispatch (one of ROUTES); ValueError otherwise."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    return route


def check_num_experts(num_experts, num_ranks: int) -> int:
    """E as an int >= 1 that the ``num_ranks`` ranks divide; ValueError otherwise."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the {num_ranks} ranks")
    return int(num_experts)


def check_chunk(name: str, value) -> int:
    """A chunk knob of the two-hop dispatch: an int >= 1; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def row_stride(hidden: int, num_topk: int, ranks_per_node: int, fp8: bool = False) -> int:
    """Bytes of a network row: the payload (BF16: 2 H bytes; FP8: H), then
    the source token, the k top-k ids, the k weights (each in an int64-sized
    word), the positions for the node's K ranks, and for FP8 the H / 128
    float32 scales, rounded up to 16 bytes. A BF16 row is the longer."""
    payload = hidden if fp8 else hidden * 2
    n = payload + 8 * (1 + 2 * num_topk + ranks_per_node) + (4 * (hidden // 128) if fp8 else 0)
    return -(-n // 16) * 16


def meta_words(num_topk: int, ranks_per_node: int) -> int:
    """int64 words of a network row's metadata (two_hop_dispatch's staging row):
    the source token, k top-k ids, k weights, K positions in the node."""
    return 1 + 2 * num_topk + ranks_per_node


def receive_layout(rows: int, hidden: int, num_topk: int) -> tuple[dict, int]:
    """One slot of the receive pool, for ``rows`` rows of at most ``hidden``
    channels and ``num_topk`` ids: ({array: byte offset in the slot}, the
    slot's bytes). The arrays, each at a 256-byte boundary: "x" recv_x
    [rows, H] (BF16 bytes, the larger), "idx" recv_topk_idx [rows, k] int64,
    "w" recv_topk_weights [rows, k] float32, "src" recv_src_idx [rows] int32,
    "slot" the network slot of each row [rows] int64, "scales" recv_x_scales
    [rows, H / 128] float32. A call of smaller H or k lays its arrays at the
    same offsets, shorter. Slot s starts at s * slot bytes."""
    lay, off = {}, 0
    for name, nbytes in (("x", rows * hidden * 2), ("idx", rows * num_topk * 8), ("w", rows * num_topk * 4),
                         ("src", rows * 4), ("slot", rows * 8), ("scales", rows * (hidden // 128) * 4)):
        lay[name] = off
        off += -(-nbytes // 256) * 256
    return lay, off


def slot_layout(lay: dict, slot: int, slot_bytes: int) -> dict:
    """The byte offsets of slot ``slot``'s arrays in the receive pool, from
    :func:`receive_layout`'s offsets ``lay`` and slot size."""
    return {name: off + slot * slot_bytes for name, off in lay.items()}


def meta_block(rows: int, payload: int, stride: int, num_topk: int, ranks_per_node: int) -> tuple:
    """(byte offset, shape, byte strides) of the int64 metadata words of the
    first ``rows`` network rows in the network buffer: rows of ``stride``
    bytes whose metadata starts after ``payload`` bytes (the dispatch's row
    bytes), meta_words(k, K) words each. A handle keeps a C-contiguous copy
    of that block, which the combine reads as rows of 8 * meta_words bytes
    from offset 0."""
    return payload, (rows, meta_words(num_topk, ranks_per_node)), (stride, 8)


def heap_table(route: str, num_ranks: int, ranks_per_node: int, max_tokens: int, hidden: int, num_topk: int,
               pool_bytes: int) -> dict:
    """{array: bytes} of everything a TwoHopDispatch takes from the NVSHMEM heap
    (the signal words aside), reserved together before the first is taken:
    the network buffer, the notify's row and matrices, the combine's inputs
    from other nodes (rows and top-k weights), the world barrier's words,
    and on the direct route the receive pool (``pool_bytes``: its
    num_in_flight slots), the staged rows and the combine's per-rank inputs
    and staging."""
    R, K = num_ranks, ranks_per_node
    N = R // K
    W = R + N + 1  # TwoHopNotifyArgs::row: counts per rank, per node, then the capacity
    row, wrow = hidden * 2, -(-num_topk // 4) * 16  # a BF16 row; k float32 in whole int4 words
    cap = R * max_tokens
    heap = {"net_rows": max(1, (N - 1) * max_tokens) * row_stride(hidden, num_topk, K), "row": 8 * W,
            "matrix": 8 * 2 * R * W, "cnet_in": N * max_tokens * row, "wnet_in": N * max_tokens * wrow,
            "barrier": 8 * R}
    if route == "direct":
        heap.update(pool=pool_bytes, direct_stage=max_tokens * R * direct_row_bytes(hidden, num_topk),
                    **{f"{name}_{part}": (max_tokens * R if part == "in" else cap) * nbytes
                       for name, nbytes in (("rows", row), ("weights", wrow)) for part in ("in", "stage")})
    return heap


def combine_needs_barrier(previous_call: str | None, capturing: bool = False) -> bool:
    """Whether a combine must wait at a GPU barrier over every rank first
    (TwoHopDispatch's NOTES): when the engine's previous call was a combine,
    when it was captured in a CUDA graph ("graph": replays may run between
    it and this call), and when this combine is captured (what a replay
    follows is unknown)."""
    return capturing or previous_call in ("combine", "graph")


@dataclass
class TwoHopHandle:
    """What a combine and a cached dispatch of a counted dispatch's routing
    need, all of it the handle's own (cupy arrays; nothing in a pool a later
    call overwrites). Made by the TwoHopDispatch ``owner`` (its id) on its
    ``route``; a cached dispatch returns the handle it was given.

    Attributes:
        topk_idx: [T, k] int64, the routing.
        plan: the notify's plan: "head" send_head [T, R] int64, "slot" the
            network slots [T, N] int64, "rpm" rank_prefix_matrix [R, R]
            int64, "net_count" rows from each source node in this rank's
            network buffer [N] int64, and the notify's scratch.
        delta: [state_words - 2] int64, the call's steps of the cumulative
            targets (a combine adds its combine part each time).
        num_rows: n, the rows received (the count, or num_worst_tokens).
        num_worst_tokens: > 0 in worst-token mode, else 0.
        src_rank: [n] int32, each row's source rank (-1: padding).
        num_experts: E of the routing.
        recv_src_idx: [n] int32, each row's source token (-1: padding).
        recv_slot: [n] int64, the network slot a forwarded row came through
            at its rail peer (-1: a direct row or padding).
        net_meta: [rows, meta_words(k, K)] int64 or None (direct route): the
            metadata of this rank's network rows as a rail peer (source
            token, k ids, k weights, K positions); rows = the network rows
            received, or (N - 1) * max_tokens in worst-token mode (the count
            is on the device: net_count).
        ok: [1] int64, the notify's verdict (1: it succeeded); the combine
            runs only then.
        recv_expert_counts: unaligned per-local-expert pair counts (host
            ints, set by cupyep.Buffer), None where unknown.
        expert_map: cupyep.Buffer's expert-major map of the dispatch
            (cupyep.normal.internode.ExpertMap), or None.
    """
    owner: int
    topk_idx: object
    plan: dict
    delta: object
    num_rows: int
    num_worst_tokens: int
    src_rank: object
    num_experts: int = 0
    recv_src_idx: object = None
    recv_slot: object = None
    net_meta: object = None
    ok: object = None
    route: str = "two_hop"
    recv_expert_counts: tuple | None = None
    expert_map: object = None

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])

    @property
    def num_topk(self) -> int:
        return int(self.topk_idx.shape[1])


@dataclass
class TwoHopResult:
    """What this rank received, all cupy: recv_x [N, H] uint16 (FP8: uint8,
    with recv_x_scales [N, H / 128] float32; None for BF16), recv_topk_idx
    [N, k] int64 (local ids, -1 elsewhere), recv_topk_weights [N, k] float32
    (0 there; None for a dispatch without topk_weights), recv_src_idx [N]
    int32, recv_src_rank [N] int32, rank_prefix_matrix [R, R] int64. N: the
    rows received, or num_worst_tokens in worst-token mode (padding rows
    past the count: -1 ids, sources and ranks, 0 weights). recv_x,
    recv_x_scales, recv_topk_idx and recv_topk_weights are views of the
    receive pool slot ``lease`` names (cupyep.slots.Lease), valid while
    ``lease.valid``; the rest are the handle's. ``handle``: for combine and
    cached calls of the same routing."""
    recv_x: object
    recv_topk_idx: object
    recv_topk_weights: object
    recv_src_idx: object
    recv_src_rank: object
    rank_prefix_matrix: object
    handle: TwoHopHandle = None
    recv_x_scales: object = None
    lease: object = None


class TwoHopDispatch:
    """The two-hop dispatch and its combine. Collective over every rank
    (nodes from the group: real or emulated with ``--ranks-per-node``):
    every rank makes the same calls in the same order. Every call runs on
    the current stream, the same one for all calls. Each dispatch (counted
    or cached) takes the next of ``num_in_flight`` receive pool slots; its
    result's rows live there until the slot is taken again. ``combine(y,
    handle)`` takes any live handle of this object, any number of times, in
    any order.

    NOTES (what keeps the calls from racing each other across ranks): a
    dispatch's notify pass is a barrier over every rank (a rank puts its
    row of counts only after its stream has finished the calls before it),
    so a dispatch finds every peer done with what the calls before it read,
    and so does a combine right after a dispatch. Two combines in a row have
    no such pass between them: a fast rank's second combine would write a
    peer's combine inputs (direct_in and gather over IPC, net_in and the
    direct route's rank_in by puts) and move its counters while that peer
    still sums the first. So a combine whose previous call was a combine
    waits at a GPU barrier over every rank first (cupyep.barrier.WorldBarrier,
    in stream order: a rank passes it once every rank's stream has finished
    the first combine, both its passes). A graph's replays run between the
    host's calls unseen, so a captured combine always waits at the barrier,
    and so does the first combine after a captured call unless a dispatch
    came between. Within one combine the top-k weights' pass needs none
    after the rows' pass: it has pools, counters, signals and targets of its
    own.

    Worst-token calls (num_worst_tokens) read nothing back on the host, so
    a CUDA graph can capture a dispatch and its combine; the arrays such a
    graph uses live as long as this object. A captured dispatch pins its
    receive pool slot while its result's lease lives (cupyep.slots), so no
    eager dispatch takes the slot its replays write. Needs NVSHMEM (cupyep.nvshmem), which it initialises.
    After a device error (a timeout) its state is undefined: later calls
    raise until it is destroyed."""

    def __init__(self, group, max_tokens: int, hidden: int, num_topk: int, num_experts: int | None = None,
                 num_sms: int = 0, rdma_chunk: int = 1, nvlink_chunk: int = 1, route: str = "two_hop",
                 num_in_flight: int = DEFAULT_IN_FLIGHT):
        """Collective. Sized for at most ``max_tokens`` tokens per rank of at
        most ``hidden`` channels and ``num_topk`` experts each (a call may
        pass fewer); ``num_experts``: the calls' default E (None: every
        dispatch passes its own), divisible by the world size.
        ``num_in_flight``: receive pool slots (results in use at once).
        ``num_sms``: blocks per rank of the dispatch and the
        combine (0: the rank's share of the GPU's SMs); every rank's blocks
        must fit on the GPU at once, or ValueError names the most that do.
        The dispatch's knobs (attributes of the same names, settable between
        calls, alike on every rank): ``rdma_chunk``, how many of a rank's
        rows for one node a warp stages and sends with one put (consecutive
        network rows, one signal); ``nvlink_chunk``, how many consecutive
        network rows a warp of the rail peer forwards.

        ``route``: "two_hop" (the default: one network row per (token, node)
        to the rail peer, which forwards it in its node; the combine reduces
        in the node first) or "direct" (no node dedup: every row to a rank
        of another node is put straight into its final row there, the
        receive pools on the NVSHMEM heap, and the combine sends each row
        back to its owner, which sums over the ranks in rank order in FP32).
        The outputs are the same; the chunk knobs apply to "two_hop"."""
        import cupy

        from .. import nvshmem as NV
        from ..barrier import WorldBarrier
        from ..ipc import SymmetricBuffer
        from ..slots import InFlightSlots, check_num_in_flight
        if group.num_nodes < 2:
            raise ValueError("the two-hop dispatch needs ranks on at least two nodes (or --ranks-per-node)")
        if group.local_size > MAX_RANKS_PER_NODE:
            raise ValueError(f"the two-hop kernels take at most {MAX_RANKS_PER_NODE} ranks per node (a rail peer "
                             f"keeps the ranks of its node a network row goes to in one 32-bit mask), got "
                             f"{group.local_size}")
        if hidden % 128 or hidden <= 0:
            raise ValueError(f"hidden must be a positive multiple of 128, got {hidden}")
        self.group, self.R, self.K = group, group.world_size, group.local_size
        self.N, self.me = self.R // self.K, group.rank
        if num_experts is not None:
            check_num_experts(num_experts, self.R)
        if not (isinstance(num_sms, (int, np.integer)) and num_sms >= 0):
            raise ValueError(f"num_sms must be an integer >= 0 (0: the rank's share of the SMs), got {num_sms!r}")
        num_in_flight = check_num_in_flight(num_in_flight)
        rt, device = cupy.cuda.runtime, cupy.cuda.Device()
        self._notify_smem = check_notify_smem(
            self.R, self.N, rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device.id))
        self.num_sms = int(num_sms) or group.sm_share
        self.max_tokens, self.hidden, self.k = int(max_tokens), int(hidden), int(num_topk)
        self.E = None if num_experts is None else int(num_experts)
        self.rdma_chunk, self.nvlink_chunk = check_chunk("rdma_chunk", rdma_chunk), check_chunk("nvlink_chunk",
                                                                                                nvlink_chunk)
        self.route = check_route(route)
        self.direct = self.route == "direct"
        NV.init(group)
        import nvshmem.core as core
        self._core = core
        fns = jit.load(spec())  # built, loaded and registered with NVSHMEM (after its init)
        self.fn = fns[spec().kernels[4 if self.direct else 0]]
        self.combine_fn = fns[spec().kernels[1]]
        self.notify_fn = fns[spec().kernels[2]]
        self.combine_weights_fn = fns[spec().kernels[3]]  # the float32 rows of the top-k weights
        if self._notify_smem > DEFAULT_DYNAMIC_SMEM:  # large worlds: the opt-in, checked against the device above
            self.notify_fn.max_dynamic_shared_size_bytes = self._notify_smem
        try:  # before anything is allocated: the same verdict on every rank
            for fn, what in ((self.fn, "two-hop dispatch"), (self.combine_fn, "two-hop combine"),
                             (self.combine_weights_fn, "two-hop combine of the top-k weights")):
                jit.require_resident(what, jit.max_resident_blocks(fn, THREADS), self.num_sms, THREADS,
                                     group.co_resident_ranks, group.num_sms, "num_sms")
        except ValueError:
            NV.finalize()
            raise
        self.stride = row_stride(hidden, num_topk, self.K)
        cap_net = max(1, (self.N - 1) * self.max_tokens)
        cap = self.R * self.max_tokens  # the most rows a rank can receive
        W = self.R + self.N + 1  # TwoHopNotifyArgs::row: counts per rank, per node, then the capacity
        row = hidden * 2
        wrow = -(-num_topk // 4) * 16  # k float32, whole int4 words
        # The receive pool: num_in_flight slots of one layout, taken round-robin by the dispatches.
        self._lay, self.slot_bytes = receive_layout(cap, hidden, num_topk)
        self.slots = InFlightSlots(num_in_flight, f"two-hop receive pool ({self.route} route)")
        # Every array this object takes from the NVSHMEM heap (bytes; the signal words aside), checked
        # against the GPU's free memory before the first is allocated.
        heap = heap_table(self.route, self.R, self.K, self.max_tokens, hidden, num_topk,
                          num_in_flight * self.slot_bytes)
        try:
            NV.reserve_heap(group, sum(heap.values()), "TwoHopDispatch")
        except MemoryError:
            NV.finalize()
            raise
        self.net_rows = core.array((heap["net_rows"],), dtype="uint8")
        self._net_bytes = heap["net_rows"]
        self.net_signal = _signals(core, self.N)
        if self.direct:  # rows from other nodes are put straight into it: the pool is on the NVSHMEM heap
            from ..nvshmem import HeapBuffer
            self.pool = HeapBuffer(group, heap["pool"])
            node = self.me // self.K
            self.pool_ptrs = cupy.asarray(np.asarray(self.pool.peer_ptr_list[node * self.K:(node + 1) * self.K],
                                                     dtype=u64))
            self.direct_signal = _signals(core, self.R)
            self.direct_stage = core.array((heap["direct_stage"],), dtype="uint8")
        else:
            self.pool = SymmetricBuffer(group, num_in_flight * self.slot_bytes)
            self.pool_ptrs = self.pool.peer_ptrs
        self.sync = SymmetricBuffer(group, -(-self.R * 8 // 256) * 256)
        self.arrived_ptrs = cupy.asarray(np.asarray([self.sync.peer_ptr_list[j] for j in range(self.K)], dtype=u64))
        # The notify pass: my row of counts, every PE's rows (two matrices, by call parity), their signals,
        # the private cumulative state, and the mapped host ints it reports to.
        self.row = core.array((W,), dtype="int64")
        self.matrix = core.array((2 * self.R * W,), dtype="int64")
        self.row_signal = _signals(core, self.R)
        self.state = cupy.zeros(state_words(self.R, self.K), dtype=np.int64)
        self._state = {name: self.state[sl] for name, sl in state_slices(self.R, self.K).items()}
        self._host_ptr = cupy.cuda.runtime.hostAlloc(4 * (2 + self.R), 2)  # cudaHostAllocMapped
        import ctypes
        self._host = np.frombuffer((ctypes.c_int32 * (2 + self.R)).from_address(self._host_ptr), dtype=np.int32)
        self.calls = 0
        # Combine: direct rows from my node's ranks and the node's rows I reduce as a rail peer (IPC), the
        # partials from other nodes (NVSHMEM), and the counters of both.
        # The top-k weights' pass (combine(..., topk_weights=)) has resources of its own: it runs right after
        # the rows' pass with no barrier between them, so it must not write what that pass still reads.
        self._clay, off = {}, 0
        for name, nbytes in (("direct", self.max_tokens * self.K * row), ("gather", cap_net * self.K * row),
                             ("wdirect", self.max_tokens * self.K * wrow), ("wgather", cap_net * self.K * wrow)):
            self._clay[name] = off
            off += -(-nbytes // 256) * 256
        self.cpool = SymmetricBuffer(group, off)
        # int64 counters of each pass, [1 + K]: direct rows in, then gather rows in from each rank of the
        # node (so a rail peer's wait names the rank whose rows are missing); the rows' pass, then the weights'
        pass_words = 1 + self.K
        self.csync = SymmetricBuffer(group, -(-2 * pass_words * 8 // 256) * 256)
        self.counter_ptrs = cupy.asarray(np.asarray(self.csync.peer_ptr_list, dtype=u64))
        self.wcounter_ptrs = self.counter_ptrs + np.uint64(8 * pass_words)
        self.cnet_in = core.array((heap["cnet_in"],), dtype="uint8")
        self.cnet_signal = _signals(core, self.N)
        self.wnet_in = core.array((heap["wnet_in"],), dtype="uint8")
        self.wnet_signal = _signals(core, self.N)
        # the weights' pass: its own copy of the state's combine targets (COMBINE_TARGETS, the same layout)
        sl = state_slices(self.R, self.K)
        base = sl[COMBINE_TARGETS[0]].start
        wtargets = cupy.zeros(sl[COMBINE_TARGETS[-1]].stop - base, dtype=np.int64)
        self._wtargets = {n: wtargets[sl[n].start - base:sl[n].stop - base] for n in COMBINE_TARGETS}
        self._rank = {}  # the direct route's combine: rows from each rank of another node, per pass
        if self.direct:
            for name in ("rows", "weights"):
                self._rank[name] = dict(rank_in=core.array((heap[f"{name}_in"],), dtype="uint8"),
                                        rank_signal=_signals(core, self.R),
                                        rank_stage=core.array((heap[f"{name}_stage"],), dtype="uint8"))
        self.barrier = WorldBarrier(group)  # between two combines in a row (class NOTES)
        self._previous = None  # the kind of the latest call launched: "dispatch" or "combine"
        self._failed = None  # the error that left the state undefined, once one has
        self._captured = []  # arrays of the calls captured in CUDA graphs, alive as long as this object
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()

    def _usable(self) -> None:
        """RuntimeError once a call has failed; else raise (and remember) a device
        error an earlier call left (worst-token calls do not wait for theirs)."""
        if self._failed is not None:
            raise RuntimeError(f"rank {self.me}: this TwoHopDispatch failed ({self._failed}); its state is "
                               "undefined: destroy it and make a new one")
        self._check_errors()

    def _check_errors(self) -> None:
        try:
            self.group.check_errors()
        except Exception as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise

    def dispatch(self, x, topk_idx=None, topk_weights=None, hop_ns=None, num_worst_tokens: int = 0,
                 validate: bool = True, handle: TwoHopHandle | None = None, x_scales=None,
                 kernel_ns=None, notify_ns=None, num_experts: int | None = None) -> TwoHopResult:
        """One two-hop dispatch (collective), into the next receive pool slot.

        Arguments:
            x, topk_idx, topk_weights: see the module docstring (topk_weights
                None: the rows carry weight 0 and recv_topk_weights is None).
                x may also be FP8: [T, H] uint8 (e4m3 bytes)
                with x_scales [T, H / 128] float32 (or a tuple (x, x_scales)),
                which travel with the rows (recv_x_scales).
            num_experts: E of topk_idx's ids (default: the constructor's),
                divisible by the world size; with a handle, the handle's.
            handle: a TwoHopHandle of an earlier call of this object: reuse
                its routing and plan ("cached dispatch": topk_idx must be None,
                num_worst_tokens is the handle's); the notify pass is then only
                the barrier between calls. Returns that handle again.
            hop_ns: cupy uint64 [4] or None, the hop metric: set it to
                :data:`HOP_STAMPS_INIT` before the call and the kernel writes
                its stamps (TwoHopDispatchArgs::hop_ns; :func:`hop_times_us`
                turns them into each hop's time).
            kernel_ns, notify_ns: cupy int64 [2] or None, kernel stamps (a
                row of cupyep.lab.bench.stamps.new_kernel_stamps): the dispatch
                kernel's, and the notify kernel's, first block start (min) and
                last block end (max) in %globaltimer ns.
            num_worst_tokens: if > 0, the outputs hold this many rows and the
                host reads nothing back (CUDA-graph capturable): rows past the
                received count are padding (recv_topk_idx, recv_src_idx,
                recv_src_rank -1, recv_topk_weights 0, recv_x not written);
                more rows to receive is a DeviceCapacityError, never a drop.
                At most R * max_tokens.
            validate: check the expert ids on the host first (skipped under
                graph capture, where nothing may wait for the device).

        Returns:
            TwoHopResult (its pool arrays valid while ``lease.valid``); the
            host waits for the kernels unless worst-token mode, whose device
            errors the next call (or group.check_errors()) raises.
        """
        import cupy

        from ..arrays import FP8, as_cupy, check, check_expert_ids, dispatch_rows
        self._usable()
        x, x_scales = dispatch_rows(x, x_scales)
        T, H = x.shape
        fp8 = x.dtype == FP8
        ns = H // 128 if fp8 else 0
        hop_ns = _check_hop(hop_ns)
        kernel_ns, notify_ns = _check_kernel_ns(kernel_ns, "kernel_ns"), _check_kernel_ns(notify_ns, "notify_ns")
        if H <= 0 or H % 128 or H > self.hidden or T > self.max_tokens:
            raise ValueError(f"x is [{T}, {H}]; this TwoHopDispatch takes at most {self.max_tokens} tokens of at "
                             f"most {self.hidden} channels (a multiple of 128)")
        if handle is not None:
            self._check_handle(handle)
            if topk_idx is not None:
                raise ValueError("a cached dispatch reuses the handle's topk_idx: pass topk_idx=None")
            if T != handle.num_tokens:
                raise ValueError(f"the handle was made for {handle.num_tokens} tokens, x has {T}")
            topk_idx, num_worst_tokens, E = handle.topk_idx, handle.num_worst_tokens, handle.num_experts
        else:
            if topk_idx is None:
                raise ValueError("dispatch needs topk_idx (or a handle)")
            if num_experts is None and self.E is None:
                raise ValueError("dispatch needs num_experts (this TwoHopDispatch was made without a default)")
            E = check_num_experts(self.E if num_experts is None else num_experts, self.R)
            topk_idx = check(as_cupy(topk_idx, "topk_idx"), "topk_idx", np.int64, ndim=2)
            if topk_idx.shape[0] != T:
                raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows, x has {T}")
        k = int(topk_idx.shape[1])
        if not 1 <= k <= self.k:
            raise ValueError(f"topk_idx has {k} experts per token; this TwoHopDispatch takes 1 to {self.k} "
                             f"(its num_topk)")
        weighted = topk_weights is not None
        if weighted:
            topk_weights = check(as_cupy(topk_weights, "topk_weights"), "topk_weights", np.float32, shape=(T, k))
        R, N = self.R, self.N
        worst = int(num_worst_tokens) > 0
        if worst and num_worst_tokens > R * self.max_tokens:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} exceeds the {R} x {self.max_tokens} rows a rank "
                             "can receive")
        capturing = cupy.cuda.get_current_stream().is_capturing()
        if validate and not capturing and handle is None:
            check_expert_ids(topk_idx, E)
        if capturing and not worst:
            raise ValueError("a two-hop dispatch inside graph capture needs num_worst_tokens (no host read)")
        if not weighted:  # the rows always carry weights: zeros
            topk_weights = cupy.zeros((T, k), dtype=np.float32)
        if handle is None:
            dev = {"in_rank": cupy.empty((max(T, 1), R), dtype=np.uint8),
                   "head": cupy.empty((max(T, 1), R), np.int64), "slot": cupy.empty((max(T, 1), N), np.int64),
                   "rpm": cupy.empty((R, R), np.int64), "net_count": cupy.empty(N, np.int64),
                   "node_tokens": cupy.empty((N, max(T, 1)), np.int32), "send_node": cupy.empty(N, np.int64)}
            delta = cupy.empty(state_words(R, self.K) - 2, dtype=np.int64)
        else:
            dev, delta = handle.plan, handle.delta
        stride = row_stride(H, k, self.K, fp8)  # at most self.stride, which the network buffer holds
        staging = cupy.empty((max(1, T * N), stride), dtype=np.uint8)
        lease = self.slots.take(f"TwoHopDispatch.dispatch ({self.route} route)", pin=capturing)
        lay = slot_layout(self._lay, lease.slot, self.slot_bytes)
        self._order("dispatch", capturing)
        self.calls += 1
        if not worst:
            self._host[:] = 0
        guard = self.group.guard("two_hop_notify")
        nargs = jit.pack(
            NOTIFY_ARGS_DTYPE, topk_idx=topk_idx.data.ptr, in_rank=dev["in_rank"].data.ptr,
            send_head=dev["head"].data.ptr, rdma_slot=dev["slot"].data.ptr, rank_prefix=dev["rpm"].data.ptr,
            net_count=dev["net_count"].data.ptr, node_tokens=dev["node_tokens"].data.ptr,
            send_node=dev["send_node"].data.ptr, row=self.row.data.ptr, matrix=self.matrix.data.ptr,
            row_signal=self.row_signal.data.ptr, state=self.state.data.ptr, host=0 if worst else self._host_ptr,
            capacity=int(num_worst_tokens) if worst else INT32_MAX, delta=delta.data.ptr,
            cached=int(handle is not None), kernel_time=jit.ptr(notify_ns), num_tokens=T, num_topk=k,
            num_experts=E, num_ranks=R, ranks_per_node=self.K, rank=self.me, guard=guard)
        notify_start, notify_end = cupy.cuda.Event(), cupy.cuda.Event()
        notify_start.record()
        self.notify_fn((1,), (NOTIFY_THREADS,), (nargs,), shared_mem=self._notify_smem)
        notify_end.record()
        args = jit.pack(
            ARGS_DTYPE, x=x.data.ptr, x_scales=jit.ptr(x_scales), topk_idx=topk_idx.data.ptr,
            topk_weights=topk_weights.data.ptr,
            rdma_slot=dev["slot"].data.ptr, send_head=dev["head"].data.ptr, rank_prefix=dev["rpm"].data.ptr,
            node_tokens=dev["node_tokens"].data.ptr, send_node=dev["send_node"].data.ptr, staging=staging.data.ptr,
            net_rows=self.net_rows.data.ptr, net_signal=self.net_signal.data.ptr,
            net_target=self._state["net_total"].data.ptr, net_count=dev["net_count"].data.ptr,
            pools=self.pool_ptrs.data.ptr, out_x=lay["x"], out_idx=lay["idx"], out_w=lay["w"], out_src=lay["src"],
            out_slot=lay["slot"], arrived=self.arrived_ptrs.data.ptr,
            arrived_target=self._state["arrived_total"].data.ptr,
            row_stride=stride, out_scales=lay["scales"], notify_ok=self._state["ok"].data.ptr,
            capacity=int(num_worst_tokens) if worst else 0, rdma_chunk=check_chunk("rdma_chunk", self.rdma_chunk),
            nvlink_chunk=check_chunk("nvlink_chunk", self.nvlink_chunk), direct=int(self.direct),
            heap_pool=self.pool.ptr if self.direct else 0,
            direct_signal=self.direct_signal.data.ptr if self.direct else 0,
            direct_stage=self.direct_stage.data.ptr if self.direct else 0, hop_ns=jit.ptr(hop_ns),
            kernel_time=jit.ptr(kernel_ns), num_tokens=T, num_topk=k,
            x_int4=H * x.dtype.itemsize // 16, num_scales=ns, num_ranks=self.R, ranks_per_node=self.K,
            num_local_experts=E // self.R,
            rank=self.me, guard=self.group.guard("two_hop_dispatch"))
        self._launch(self.fn, args, wait=not worst)
        if not worst:
            self.last_notify_us = cupy.cuda.get_elapsed_time(notify_start, notify_end) * 1e3
            if self._host[0] != 1:  # the kernels ended without a device error (checked above) but no counts
                raise RuntimeError(f"rank {self.me}: the two-hop notify ended without publishing its counts "
                                   f"(status {int(self._host[0])})")
        if handle is not None:
            made, keep = handle, ()
        else:
            made, keep = self._handle(topk_idx, dev, delta, int(num_worst_tokens) if worst else 0, E, lay,
                                      H * x.dtype.itemsize, stride)
        if capturing:  # a graph keeps raw pointers: its memory must outlive it
            self._captured.append((x, x_scales, topk_idx, topk_weights, staging, made, *keep))
        n = made.num_rows
        view = self.pool.view
        return TwoHopResult(recv_x=view(lay["x"], (n, H), x.dtype),
                            recv_x_scales=view(lay["scales"], (n, ns), np.float32) if fp8 else None,
                            recv_topk_idx=view(lay["idx"], (n, k), np.int64),
                            recv_topk_weights=view(lay["w"], (n, k), np.float32) if weighted else None,
                            recv_src_idx=made.recv_src_idx, recv_src_rank=made.src_rank, rank_prefix_matrix=dev["rpm"],
                            handle=made, lease=lease)

    def _handle(self, topk_idx, dev, delta, num_worst_tokens: int, num_experts: int, lay: dict, payload: int,
                stride: int):
        """(the TwoHopHandle of a counted dispatch that just ran, the temporaries
        a captured graph keeps): its copies of what the combine reads, made on
        the current stream right after the dispatch kernel, before a later
        call can overwrite them (the next dispatch's notify orders the peers'
        writes after this stream's work): the rows' sources and network
        slots from the pool slot ``lay``, the notify's verdict, and on the
        two-hop route the metadata of this rank's network rows (``payload``:
        where it starts in a row of ``stride`` bytes)."""
        import cupy
        R, k = self.R, int(topk_idx.shape[1])
        worst = num_worst_tokens > 0
        n = num_worst_tokens if worst else int(self._host[1])
        # Each row's source: the first source whose cumulative count to me passes the row (-1: padding).
        rows = cupy.arange(n, dtype=np.int64)
        upto = cupy.ascontiguousarray(dev["rpm"][:, self.me])  # rows from sources 0..s, cumulative
        first = cupy.searchsorted(upto, rows, side="right").astype(np.int32)
        src_rank = cupy.where(first < R, first, np.int32(-1))
        net_meta = None
        if not self.direct:  # the counted rows (the host has waited for the kernels), or the most there can be
            net = max(1, (self.N - 1) * self.max_tokens) if worst else int(dev["net_count"].get().sum())
            net_meta = self._net_meta(net, payload, stride, k)
        made = TwoHopHandle(owner=id(self), topk_idx=topk_idx, plan=dev, delta=delta, num_rows=n,
                            num_worst_tokens=num_worst_tokens, src_rank=src_rank, num_experts=num_experts,
                            recv_src_idx=self.pool.view(lay["src"], (n,), np.int32).copy(),
                            recv_slot=self.pool.view(lay["slot"], (n,), np.int64).copy(), net_meta=net_meta,
                            ok=self._state["ok"].copy(), route=self.route)
        return made, (rows, upto, first)

    def _net_meta(self, rows: int, payload: int, stride: int, num_topk: int):
        """A copy ([rows, meta_words] int64, on the current stream) of the
        metadata of this rank's first ``rows`` network rows: the words the
        combine's rail-peer step reads (two_hop_combine, step 2)."""
        from ..ipc import buffer_view
        offset, shape, strides = meta_block(rows, payload, stride, num_topk, self.K)
        view = buffer_view(self.net_rows, self.net_rows.data.ptr, self._net_bytes, offset, shape, np.int64, strides)
        return view.copy()  # always a copy (a view of one row counts as contiguous)

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, TwoHopHandle) or handle.owner != id(self):
            raise ValueError("handle must be a TwoHopHandle made by this TwoHopDispatch")

    def _order(self, kind: str, capturing: bool) -> None:
        """Enqueue what keeps this call (``kind``: "dispatch" or "combine")
        from racing the one before it on other ranks (class NOTES): a GPU
        barrier over every rank before a combine that may follow a combine.
        A call captured in a graph leaves the order unknown ("graph")."""
        if kind == "combine" and combine_needs_barrier(self._previous, capturing):
            self.barrier()
        self._previous = "graph" if capturing else kind

    def _launch(self, fn, args, wait: bool = True) -> None:
        """Launch ``fn`` on ``num_sms`` blocks (every block resident: the kernels
        wait on other ranks). ``wait``: wait for it, raise what it
        reported, and put its device time in ``last_kernel_us``."""
        import cupy
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn((self.num_sms,), (THREADS,), (args,))
        end.record()
        if not wait:
            return
        end.synchronize()
        self._check_errors()
        self.last_kernel_us = cupy.cuda.get_elapsed_time(start, end) * 1e3

    def combine(self, y, handle: TwoHopHandle, hop_ns=None, row_weights=None, topk_weights=None, kernel_ns=None):
        """Reduce the expert outputs of a dispatch's rows back to its tokens
        (collective). Any live handle of this object, any number of times,
        in any order (class NOTES).

        Arguments:
            y: cupy [n, H] uint16 BF16 bits, one row per row the dispatch
               received (its order); H <= hidden, a multiple of 128.
            handle: the dispatch's TwoHopHandle.
            hop_ns: cupy uint64 [4] or None: the hop metric, as dispatch's
               (TwoHopCombineArgs::hop_ns).
            kernel_ns: cupy int64 [2] or None: the combine kernel's stamps,
               as dispatch's (the rows' pass; the weights' pass has none).
            row_weights: cupy [n] float32 or None: row r counts as
               BF16(weight_r * y_r), scaled in float32 before it leaves
               (one more BF16 rounding than the combine within a node, which
               weights in its float32 sum: calc_diff 2.3e-6 from the exact
               weighted sum at 2 x 4 ranks, T = 256, H = 7168, BF16 partials).
            topk_weights: cupy [n, k] float32 or None (e.g. recv_topk_weights):
               combined too, in float32 all the way (a second pass of the
               same route over rows of k floats).

        Returns:
            cupy [T, H] uint16: per token, the FP32 sum over nodes in node order
            of the node's rows (own node: each rank's row in local rank order;
            other nodes: the rail peer's BF16 partial of its node's rows in
            local rank order), rounded to BF16. With topk_weights, the tuple
            (that, [T, k] float32 sums of the weights over the ranks).
        """
        import cupy

        from ..arrays import BF16, as_cupy, check
        self._usable()
        self._check_handle(handle)
        n, k = handle.num_rows, handle.num_topk
        y = check(as_cupy(y, "y"), "y", BF16, ndim=2)
        if y.shape[0] != n or y.shape[1] <= 0 or y.shape[1] % 128 or y.shape[1] > self.hidden:
            raise ValueError(f"y must be [{n}, H], one row per received row, H a multiple of 128 up to "
                             f"{self.hidden}; got {list(y.shape)}")
        hop_ns = _check_hop(hop_ns)
        kernel_ns = _check_kernel_ns(kernel_ns, "kernel_ns")
        row_weights = as_cupy(row_weights, "row_weights")
        if row_weights is not None:
            from ..moe import bf16_bits_to_f32, f32_to_bf16_bits
            row_weights = check(row_weights, "row_weights", np.float32, shape=(n,))
        topk_weights = as_cupy(topk_weights, "topk_weights")
        if topk_weights is not None:
            check(topk_weights, "topk_weights", np.float32, shape=(n, k))
        if row_weights is not None:  # on the current stream, before the combine reads the rows
            y = f32_to_bf16_bits(bf16_bits_to_f32(y) * row_weights[:, None])
        self._order("combine", cupy.cuda.get_current_stream().is_capturing())
        # Partial rows this rank makes as a rail peer, for the staging of each pass (the handle's network rows).
        rows_now = 0 if self.direct else int(handle.net_meta.shape[0])
        rows_pass = dict(direct_in=self._clay["direct"], gather=self._clay["gather"], counters=self.counter_ptrs,
                         **{name: self._state[name] for name in COMBINE_TARGETS}, net_in=self.cnet_in,
                         net_signal=self.cnet_signal, **self._rank.get("rows", {}))
        out = self._route_back(handle, y, self.combine_fn, hop_ns, rows_pass, rows_now, kernel_ns)
        if topk_weights is None:
            return out
        kp = -(-k // 4) * 4  # rows of whole int4 words of floats
        w_rows = cupy.zeros((n, kp), dtype=np.float32)
        w_rows[:, :k] = topk_weights
        weights_pass = dict(direct_in=self._clay["wdirect"], gather=self._clay["wgather"],
                            counters=self.wcounter_ptrs, **self._wtargets,
                            net_in=self.wnet_in, net_signal=self.wnet_signal, **self._rank.get("weights", {}))
        return out, self._route_back(handle, w_rows, self.combine_weights_fn, None, weights_pass, rows_now)[:, :k]

    def _route_back(self, h: TwoHopHandle, rows, fn, hop_ns, res: dict, rows_now: int, kernel_ns=None):
        """One combine kernel over ``rows`` ([n, W] of int4 words: BF16 rows, or
        float32 rows for the weights' pass) with the route of the dispatch of
        handle ``h`` and the pass's own resources ``res`` (pool regions,
        counters, targets, network buffer and signals) and ``rows_now``
        partial rows to stage; returns [T, W] of the same dtype. The pass's
        cumulative targets move by the dispatch's steps first. The rail
        peer's step reads the handle's copy of its network rows' metadata
        (rows of meta_words int64, from their first word)."""
        import cupy
        R, K, me = self.R, self.K, self.me
        x_int4 = rows.shape[1] * rows.dtype.itemsize // 16
        staging = cupy.empty((max(1, rows_now), x_int4 * 16), dtype=np.uint8)
        out = cupy.zeros((h.num_tokens, rows.shape[1]), dtype=rows.dtype)
        args = jit.pack(
            COMBINE_ARGS_DTYPE, y=rows.data.ptr, recv_src_rank=h.src_rank.data.ptr,
            recv_src_idx=h.recv_src_idx.data.ptr, recv_slot=h.recv_slot.data.ptr,
            pools=self.cpool.peer_ptrs.data.ptr, direct_in=res["direct_in"], gather=res["gather"],
            counters=res["counters"].data.ptr, targets=res["combine_total"].data.ptr,
            net_rows=jit.ptr(h.net_meta), row_stride=8 * meta_words(h.num_topk, K), meta_offset=0,
            net_count=h.plan["net_count"].data.ptr, staging=staging.data.ptr,
            net_in=res["net_in"].data.ptr, net_signal=res["net_signal"].data.ptr,
            net_target=res["combine_net_total"].data.ptr, send_head=h.plan["head"].data.ptr, direct=int(self.direct),
            rank_in=jit.ptr(res.get("rank_in")), rank_signal=jit.ptr(res.get("rank_signal")),
            rank_target=res["combine_rank_total"].data.ptr, rank_stage=jit.ptr(res.get("rank_stage")),
            out=out.data.ptr, notify_ok=h.ok.data.ptr, hop_ns=jit.ptr(hop_ns),
            kernel_time=jit.ptr(kernel_ns), num_recv=h.num_rows,
            num_tokens=h.num_tokens, max_tokens=self.max_tokens, x_int4=x_int4, num_topk=h.num_topk, num_ranks=R,
            ranks_per_node=K, rank=me, guard=self.group.guard("two_hop_combine"))
        # This dispatch's steps of the combine's cumulative targets (on the device, in stream order).
        sl, d = state_slices(R, K), h.delta  # delta: the state past its first two words
        for name in COMBINE_TARGETS:
            res[name][...] += d[sl[name].start - 2:sl[name].stop - 2]
        if cupy.cuda.get_current_stream().is_capturing():
            self._captured.append((rows, staging, out))
        self._launch(fn, args, wait=h.num_worst_tokens == 0)
        return out

    def destroy(self) -> None:
        """Collective: free the buffers and end NVSHMEM."""
        from .. import nvshmem as NV
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
        self.group.comm.Barrier()
        self._captured = []
        self.slots.invalidate_all()
        for buf in (self.pool, self.sync, self.cpool, self.csync, self.barrier):
            buf.destroy()
        extra = [self.direct_signal, self.direct_stage] if self.direct else []
        extra += [arr for res in self._rank.values() for arr in res.values()]
        for arr in (self.net_rows, self.net_signal, self.cnet_in, self.cnet_signal, self.wnet_in, self.wnet_signal,
                    self.row, self.matrix, self.row_signal, *extra):
            self._core.free_array(arr)
        if self._host_ptr:
            self._host = None
            cupy.cuda.runtime.freeHost(self._host_ptr)
            self._host_ptr = 0
        NV.finalize()
