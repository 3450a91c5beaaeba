"""Where everything lives in a low-latency rank's symmetric buffer.

The buffer holds two identical sets. Signals alternate between them with
every call (each call clears the flags of the set the next call uses); the
data regions of each kind of call are chosen by :class:`CallSchedule`, which
reuses one copy until two calls of the same kind follow each other. One set,
with ``El = E / R`` local experts, ``M = max_tokens``
(num_max_dispatch_tokens_per_rank), ``C = capacity`` (rows of each (local
expert, source) region: ``M``, or fewer to fit a buffer the worst case does
not; see :func:`capacity_for`) and hidden ``H``::

    dispatch_count [El][R] int32      tokens source r sent to local expert e
    dispatch_flag  [R] int32          arrivals of source r's blocks: its dispatch rows are written
    combine_flag   [R] int32          arrivals of expert rank r's blocks: its combine rows are written
    recv_x         [El][R * C] messages of D bytes (see message_layout), sized for BF16
    combine_send   [El][R * C][H] BF16  zero-copy combine input
    combine_recv   [R][Kr][H] BF16      rows expert rank r returns to me
    remote_signal  [4][R] uint64      across nodes: NVSHMEM signals from each rank on another node
                                      (its counts, its dispatch messages, its combine rows, its combine start)
    stage          [M * max_topk] messages  across nodes: my messages to other nodes, staged for the
                                      puts; 0 bytes unless the layout is ``staged``

with ``Kr = min(M * min(max_topk, El), El * C)`` (a token sends at most
``min(max_topk, El)`` rows to one rank, and a rank's experts take at most
``C`` rows each from one source). Every region starts on a 128-byte boundary.

With ``C < M`` an expert can get more of one source's rows than its region
holds: the dispatch kernel then sends none past the region and reports a
DeviceCapacityError, and a validated dispatch refuses such a routing on every
rank before anything is launched (cupyep.low_latency.overflow chooses what
happens instead).

A dispatch message is one row with everything the receiver gets about it:
the payload (H bytes FP8 or 2H bytes BF16), for FP8 its H / 128 scales
(float32, or UE8M0 bytes) padded to 16 bytes, then a 16-byte tag (int32
source token, uint8 top-k slot). ``recv_x``, its scales and the handle's
source tags are strided views of these messages.

Both layouts keep the pages a call writes in a peer's buffer few: with
several ranks on one GPU, each rank reaches its peers through its own
mappings, and the number of distinct pages a call touches there costs as
much as its bytes. So a row's scales and tag travel inside the row instead
of in regions of their own, and the combine returns an expert rank's rows
for me packed into one range (in the order of my dispatch's rows to it,
``LowLatencyHandle.combine_pos``) instead of scattering them by token.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

ALIGN = 128
FIELDS = ("dispatch_count", "dispatch_flag", "combine_flag", "recv_x", "combine_send", "combine_recv",
          "remote_signal", "stage")
MAX_TOPK = 255  # a message's tag holds the top-k slot in one byte
TAG_BYTES = 16


class MessageLayout(NamedTuple):
    """Byte offsets within one dispatch message, and its size (``nbytes``)."""
    scales: int  # the FP8 scales (after the payload; equal to tag for BF16)
    tag: int     # int32 source token, then uint8 top-k slot
    nbytes: int


def message_layout(hidden: int, fp8: bool, ue8m0: bool = False) -> MessageLayout:
    """Where a dispatch message of this kind keeps its parts (mirrored by
    ``message_layout`` in cuda_src/low_latency/args.cuh)."""
    payload = hidden if fp8 else 2 * hidden
    scales = (((hidden // 128) * (1 if ue8m0 else 4) + 15) // 16 * 16) if fp8 else 0
    return MessageLayout(payload, payload + scales, payload + scales + TAG_BYTES)


def return_rows(max_tokens: int, max_topk: int, num_local_experts: int, capacity: int | None = None) -> int:
    """Rows of one expert rank's range in combine_recv: min(M * min(max_topk,
    El), El * C) (mirrored by ``return_rows`` in args.cuh)."""
    rows = max_tokens * min(max_topk, num_local_experts)
    return rows if capacity is None else min(rows, num_local_experts * capacity)


def capacity_for(capacity_factor: float, max_tokens: int, max_topk: int, num_experts: int) -> int:
    """Rows per (local expert, source) region for a capacity factor: the mean
    rows one source sends one expert at full load (max_tokens * max_topk /
    num_experts) times the factor, rounded up, at least 1 and at most
    max_tokens (the worst case: every token to one expert)."""
    if not (isinstance(capacity_factor, (int, float)) and not isinstance(capacity_factor, bool)
            and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be a number > 0, got {capacity_factor!r}")
    mean = max_tokens * max_topk / num_experts
    return int(max(1, min(max_tokens, -(-capacity_factor * mean // 1))))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SetLayout:
    """Byte offsets (from the buffer start) of one set's regions."""
    dispatch_count: int
    dispatch_flag: int
    combine_flag: int
    recv_x: int
    combine_send: int
    combine_recv: int
    remote_signal: int
    stage: int
    end: int


@dataclass(frozen=True)
class LowLatencyLayout:
    """The two sets of a buffer for these sizes.

    Attributes:
        num_ranks, num_experts, max_tokens, hidden, max_topk: what the buffer was built for.
        capacity: rows of each (local expert, source) region (<= max_tokens).
        sets: (SetLayout, SetLayout).
        nbytes: total bytes per rank.
    """
    num_ranks: int
    num_experts: int
    max_tokens: int
    hidden: int
    max_topk: int
    capacity: int
    sets: tuple
    nbytes: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def slots(self) -> int:
        """Rows per local expert: R * capacity."""
        return self.num_ranks * self.capacity


def _int(name: str, value, what: str = "an integer") -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


def check_sizes(num_ranks: int, max_tokens: int, hidden: int, num_experts: int, max_topk: int = 16) -> None:
    """ValueError for sizes no low-latency buffer can hold (integers, NumPy ones included)."""
    num_ranks, hidden, num_experts = _int("num_ranks", num_ranks), _int("hidden", hidden), _int("num_experts", num_experts)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if _int("num_max_dispatch_tokens_per_rank", max_tokens, "a positive int") < 1:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, got {max_tokens!r}")
    if not 1 <= _int("max_topk", max_topk, f"an int in [1, {MAX_TOPK}]") <= MAX_TOPK:
        raise ValueError(f"max_topk must be an int in [1, {MAX_TOPK}], got {max_topk!r}")
    if hidden <= 0 or hidden % 128:
        raise ValueError(f"hidden size must be a positive multiple of 128, got {hidden}")
    if num_experts < num_ranks or num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of the {num_ranks} ranks")


def check_capacity(capacity, max_tokens: int) -> int:
    """``capacity`` (None: ``max_tokens``) as an int in [1, max_tokens]; ValueError otherwise."""
    if capacity is None:
        return operator.index(max_tokens)
    c = _int("capacity", capacity, f"an int in [1, {max_tokens}]")
    if not 1 <= c <= max_tokens:
        raise ValueError(f"capacity must be an int in [1, num_max_dispatch_tokens_per_rank={max_tokens}], got {c}")
    return c


def low_latency_layout(num_ranks: int, max_tokens: int, hidden: int, num_experts: int,
                       max_topk: int = 16, staged: bool = False, capacity: int | None = None) -> LowLatencyLayout:
    """Layout of a buffer for ``num_ranks`` ranks, ``max_tokens`` tokens per
    rank and call, hidden size ``hidden``, ``num_experts`` experts and top-k
    up to ``max_topk``; ``staged``: with the staging region of the buffer
    across nodes; ``capacity``: rows per (local expert, source) region
    (default max_tokens, the worst case)."""
    check_sizes(num_ranks, max_tokens, hidden, num_experts, max_topk)
    R, E, M, H = (operator.index(v) for v in (num_ranks, num_experts, max_tokens, hidden))
    max_topk = operator.index(max_topk)
    C = check_capacity(capacity, M)
    El = E // R
    rows = El * R * C
    sizes = {
        "dispatch_count": 4 * El * R,
        "dispatch_flag": 4 * R,
        "combine_flag": 4 * R,
        "recv_x": rows * message_layout(H, False).nbytes,
        "combine_send": rows * 2 * H,
        "combine_recv": R * return_rows(M, max_topk, El, C) * 2 * H,
        "remote_signal": 4 * R * 8,
        "stage": M * max_topk * message_layout(H, False).nbytes if staged else 0,
    }
    sets = []
    offset = 0
    for _ in range(2):
        offs = {}
        for name in FIELDS:
            offs[name] = offset
            offset = _align(offset + sizes[name])
        sets.append(SetLayout(**offs, end=offset))
    return LowLatencyLayout(R, E, M, H, max_topk, C, tuple(sets), offset)


def size_hint(num_ranks: int, max_tokens: int, hidden: int, num_experts: int, max_topk: int = 16,
              staged: bool = False, capacity: int | None = None) -> int:
    """Bytes per rank of a LowLatencyBuffer for these sizes (``staged``: across
    nodes; ``capacity``: rows per (expert, source) region)."""
    return low_latency_layout(num_ranks, max_tokens, hidden, num_experts, max_topk, staged, capacity).nbytes


FLAG_FIELDS = ("dispatch_count", "dispatch_flag", "combine_flag", "remote_signal")
# The staged messages follow the dispatch's data copy: a copy is written again only once every peer has
# received what it held (the argument of CallSchedule), so a put has always read it by then.
DATA_FIELDS = {"dispatch": ("recv_x", "stage"),
               "combine": ("combine_send", "combine_recv")}


class CallSchedule:
    """Which set's signals and which copy of the data each call uses.

    Signals (``FLAG_FIELDS``) alternate with every call, so each call can clear
    the next call's flags. Each kind of call (dispatch, combine) keeps writing
    the same one of its two data copies and switches to the other only when two
    calls of that kind follow each other, so back-to-back calls of one kind
    never overwrite rows a peer may still be reading. In a decode loop
    (dispatch, combine, dispatch, ...) this is the same as alternating the sets
    per call. It is safe: a peer's next dispatch into my rows starts only after
    that peer saw my flags of the combine in between, which my stream issued
    after I used the rows. The schedule also records which call last wrote each
    copy, so a combine can reject a handle whose rows a later dispatch has
    overwritten (:meth:`holds`).

    All ranks make the same calls in the same order, so they agree on every
    choice. ``take`` returns (signal set, data copy, call number).
    """

    def __init__(self):
        self.calls = 0
        self.last_kind = None
        self.region = {"dispatch": 0, "combine": 0}
        self.writer = {}  # (kind, copy) -> number of the call that last wrote it

    def peek(self, kind: str) -> int:
        """Data copy the next call of ``kind`` will use."""
        if kind not in DATA_FIELDS:
            raise ValueError(f"call kind must be one of {tuple(DATA_FIELDS)}, got {kind!r}")
        r = self.region[kind]
        return r ^ 1 if self.last_kind == kind else r

    def take(self, kind: str) -> tuple[int, int, int]:
        region = self.peek(kind)
        signal_set = self.calls % 2
        self.calls += 1
        self.region[kind] = region
        self.last_kind = kind
        self.writer[(kind, region)] = self.calls
        return signal_set, region, self.calls

    def holds(self, kind: str, region: int, call: int) -> bool:
        """True while copy ``region`` of ``kind`` still holds the data of call ``call``."""
        return self.writer.get((kind, region)) == call


def call_offsets(layout: LowLatencyLayout, signal_set: int, dispatch_region: int, combine_region: int) -> SetLayout:
    """A SetLayout whose signals come from set ``signal_set`` and whose data
    come from the sets a CallSchedule chose for each kind."""
    import dataclasses
    sets = layout.sets
    fields = {n: getattr(sets[dispatch_region], n) for n in DATA_FIELDS["dispatch"]}
    fields.update({n: getattr(sets[combine_region], n) for n in DATA_FIELDS["combine"]})
    return dataclasses.replace(sets[signal_set], **fields)
