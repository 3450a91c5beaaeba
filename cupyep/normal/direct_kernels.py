"""The direct (one-copy) transport of normal mode: its pools, layouts,
argument structs and kernel specialisations (kernels: cuda_src/normal/direct.cu).

A sender writes each row straight into the receiver's output, so every
received byte crosses HBM once (the queue transport moves it twice: into a
ring, then out of it). The outputs live in IPC-registered pools, one per
rank and kind, sized from the buffer's declared sizes and exchanged once
(:class:`DirectPools`); a dispatch's ``recv_x`` and its other receive arrays
are views of one of the dispatch pool's ``num_in_flight`` slots, valid until
that slot goes to a later dispatch (cupyep.slots: reading them through the
result then raises StaleResultError).

Pools of every rank (the same sizes on every rank):

- sync: four [R] arrays of int64 counters (:data:`SYNC_STRIDE` bytes apart):
  dispatch ready / arrived, combine ready / arrived (see direct_args.cuh);
- dispatch: the receive arrays of a call, laid out by :func:`recv_layout`, in slots;
- combine: the partial rows an owner receives, laid out by :func:`combine_layout`;
- zero_copy: the caller's expert outputs of a zero-copy combine (which the
  owners read in place) and the pushed weights, laid out by
  :func:`zero_copy_layout` (its own pool, so a pushing combine never
  overwrites outputs written for a zero-copy one).

and ``state``, int64 [4 + 2R] private to the rank: the epochs and the
cumulative row counts the kernels wait on.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from .. import jit
from ..errors import GUARD_DTYPE
from .node_kernels import NOTIFY_ARGS_DTYPE
from ..ipc import SymmetricBuffer

u64, i64, i32 = np.uint64, np.int64, np.int32

SYNC_STRIDE = 64       # bytes between counters (kDirectSyncStride)
ALIGN = 256            # alignment of every array in a pool
THREADS = 512
MAX_SHARED_BYTES = 227 * 1024  # dynamic shared memory one block may have on sm_90
BULK_STAGE_BYTES = 7168  # the default bulk stage (half a BF16 row of 7168), where a block's stages fit
BULK_MAX_BLOCKS = 8      # by default, bulk copies only for calls of at most this many blocks per rank
STATE_HEADER = 9       # kStateHeader
ZERO_COPY_MAX_TOPK = 32  # top-k weights a zero-copy combine carries (its metadata stride is fixed)

SYNC_DTYPE = jit.struct_dtype([(n, i64) for n in (
    "dispatch_ready", "dispatch_arrived", "combine_ready", "combine_arrived", "combine_done")])
MAX_IN_PLACE_RANKS = 16  # kMaxInPlaceRanks: x_peers entries of an in-place combine
X_PEERS_DTYPE = jit.struct_dtype([(f"x{i}", u64) for i in range(MAX_IN_PLACE_RANKS)])
RECV_LAYOUT_DTYPE = jit.struct_dtype([(n, i64) for n in (
    "x", "x_scales", "topk_idx", "topk_weights", "src_idx", "x_bytes", "rows", "em_x", "em_x_scales", "em_src_row",
    "em_recv_row", "em_rows")])
EXPAND_DTYPE = jit.struct_dtype([("base", u64), ("pos", u64), ("meta", u64), ("num_experts", i32),
                                 ("hist_warps", i32), ("compute_pos", i32)])
DISPATCH_ARGS_DTYPE = jit.struct_dtype([
    ("pools", u64), ("syncs", u64), ("sync", SYNC_DTYPE), ("out", RECV_LAYOUT_DTYPE), ("x", u64),
    ("x_scales", u64), ("topk_idx", u64), ("topk_weights", u64), ("send_list", u64),
    ("send_channel_prefix", u64), ("rank_prefix_matrix", u64), ("recv_rank_offset", u64), ("state", u64),
    ("kernel_time", u64), ("src_copy", u64), ("expand", EXPAND_DTYPE), ("num_tokens", i32), ("num_scales", i32), ("num_topk", i32),
    ("num_local_experts", i32), ("num_channels", i32), ("capacity", i32), ("rank", i32), ("bulk_stage", i32),
    ("guard", GUARD_DTYPE)])
FUSED_ARGS_DTYPE = jit.struct_dtype([
    ("notify", NOTIFY_ARGS_DTYPE), ("dispatch", DISPATCH_ARGS_DTYPE), ("layout_guard", GUARD_DTYPE),
    ("host_status", u64)])
COMBINE_ARGS_DTYPE = jit.struct_dtype([
    ("pools", u64), ("syncs", u64), ("sync", SYNC_DTYPE), ("partial_x", i64), ("partial_meta", i64),
    ("zc_x", i64), ("rows", i64), ("meta_stride", i64), ("x", u64), ("row_weights", u64), ("recv_topk_weights", u64), ("rank_prefix_matrix", u64),
    ("recv_rank_offset", u64), ("send_head", u64), ("send_channel_prefix", u64), ("combined_x", u64),
    ("combined_topk_weights", u64), ("state", u64), ("kernel_time", u64), ("num_tokens", i32), ("x_int4", i32),
    ("num_topk", i32), ("num_channels", i32), ("rank", i32), ("bulk_stage", i32), ("in_place", i32),
    ("x_peers", X_PEERS_DTYPE), ("guard", GUARD_DTYPE)])


POSITIONS_KERNEL = "cupyep::normal::direct_expert_positions"
POSITIONS_THREADS = 512
HIST_INTS = 12288  # shared-memory ints the position pass's per-warp expert counts may use


def hist_warps(num_experts: int, num_threads: int = POSITIONS_THREADS) -> int:
    """Warps of the expert-major position pass (expand.cuh): one segment of
    the pairs each, their per-expert counts ([warps, E] ints) in shared memory."""
    return max(1, min(num_threads // 32, HIST_INTS // max(1, num_experts)))


@functools.cache  # a spec is built once per argument tuple (the host path looks it up every call)
def dispatch_spec(num_ranks: int, num_threads: int = THREADS) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"direct_dispatch_ranks_{num_ranks}_threads_{num_threads}",
                          source="normal/direct.cu",
                          kernels=(f"cupyep::normal::direct_dispatch<{num_ranks}, {num_threads}>",))


@functools.cache
def positions_spec() -> jit.KernelSpec:
    """The expert-major position pass of a dispatch that is not fused (one block of POSITIONS_THREADS)."""
    return jit.KernelSpec(name="direct_expert_positions", source="normal/direct_positions.cu",
                          kernels=(POSITIONS_KERNEL,))


@functools.cache
def fused_spec(num_ranks: int, num_threads: int = THREADS) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"direct_dispatch_fused_ranks_{num_ranks}_threads_{num_threads}",
                          source="normal/direct.cu",
                          kernels=(f"cupyep::normal::direct_dispatch_fused<{num_ranks}, {num_threads}>",))


COMBINE_WORDS = (1, 2, 4, 8)  # the combine's row words per lane and rank in flight that a config may ask for


def combine_words(num_ranks: int, words: int | None = None) -> int:
    """Row words (16 bytes) per lane and rank the direct combine's reduce
    keeps in flight before summing them: ``words``, or by default the most
    that stay in registers (:func:`max_combine_words`: 8 up to 2 ranks, 4 up
    to 4, 2 above). At 2 ranks 8 words moved the zero-copy combine from
    0.87 to 0.94 of the copy probe at 6 blocks, and matched 4 at 66
    (results/sm_economy)."""
    return words if words is not None else max_combine_words(num_ranks)


def max_combine_words(num_ranks: int) -> int:
    """The most row words per lane and rank (of COMBINE_WORDS) the combine
    may keep in flight at ``num_ranks`` ranks: words * ranks <= 16, so that
    they stay in registers (direct.cu's static_assert)."""
    return max(w for w in COMBINE_WORDS if w * num_ranks <= 16)


def combine_spec(num_ranks: int, num_threads: int = THREADS, words: int | None = None) -> jit.KernelSpec:
    """The direct combine with ``words`` row words in flight (None: the default; see :func:`combine_words`)."""
    return _combine_spec(num_ranks, num_threads, combine_words(num_ranks, words))


@functools.cache
def _combine_spec(num_ranks: int, num_threads: int, w: int) -> jit.KernelSpec:
    tag = "" if w == combine_words(num_ranks) else f"_words_{w}"
    return jit.KernelSpec(name=f"direct_combine_ranks_{num_ranks}_threads_{num_threads}{tag}",
                          source="normal/direct.cu",
                          kernels=(f"cupyep::normal::direct_combine<{num_ranks}, {num_threads}, {w}>",))


def kernel_specs() -> list[jit.KernelSpec]:
    """Specialisations the offline check compiles: 1 to 8 ranks, and the
    combine with the most row words in flight each rank count allows."""
    fewer = [combine_spec(r, THREADS, 4) for r in (1, 2)]  # below the default's 8 words: the fewer-register build
    return [s for r in range(1, 9) for s in (dispatch_spec(r), fused_spec(r), combine_spec(r))] + fewer + \
        [positions_spec()]


def notify_channels(num_ranks: int) -> int:
    """Token slices the notify pass of a direct dispatch splits the tokens
    into (it only shapes the send lists: one warp per (rank, slice))."""
    return max(1, 32 // num_ranks)


@dataclass(frozen=True)
class DirectConfig:
    """Knobs of the direct transport (identical on every rank of a call).

    Attributes:
        num_sms: blocks per rank (0: :func:`default_num_sms` of the call's shape).
        num_threads: threads per block (THREADS is the compiled default).
        fused: a dispatch that runs the notify pass does it, and the layout,
            inside the send kernel (one launch; the host waits only for the
            counts, while the rows are moving). The default: it saves about 340 us of the 1770 us dispatch at 8
            ranks, T = 4096 (results/direct/). False: layout, notify and send
            as three launches.
        bulk_stage_bytes: 0 moves the rows (the dispatch's, and the ones a
            pushing combine sends) by warp copies of 16-byte words; > 0 (a
            multiple of 16) by bulk asynchronous copies through two stages
            of this many bytes per warp in shared memory
            (cuda_src/common/bulk.cuh), 2 * bulk_stage_bytes * num_threads / 32
            bytes a block: more bytes in flight per SM than registers hold,
            so fewer SMs move the same rate (results/sm_economy). None, the
            default: bulk copies for a call of at most BULK_MAX_BLOCKS
            blocks per rank (0.88-0.98 of the copy probe where warp copies
            reach 0.82-0.91), warp copies above (with 12 or more blocks per
            rank at 2 ranks bulk copies were no faster and at times 1.5x
            slower); see :meth:`bulk_stage`.
        combine_words: row words (16 bytes) per lane and rank the combine's
            reduce loads before it sums them, one of COMBINE_WORDS with
            combine_words * ranks <= 16 (the loads stay in registers); more
            keeps more bytes in flight per SM. None: :func:`combine_words`.
        combine_in_place: how a combine whose x is the caller's own array
            (not ``get_combine_buffer``'s) reaches the owners. None, the
            default: in place when every rank's x can be mapped through
            CUDA IPC (cupyep.ipc_peers) and no CUDA graph is being captured:
            the owners read each expert rank's rows where its caller left
            them, one pass over the rows, and the kernel ends only after
            every owner has read this rank's x; else pushed. True: in place,
            ValueError where it cannot be. False: pushed, two passes (each
            expert rank copies its rows into the owners' partial rows, the
            owners reduce them), with no host collective in the call.
    """
    num_sms: int = 0
    num_threads: int = THREADS
    fused: bool = True
    bulk_stage_bytes: int | None = None
    combine_words: int | None = None
    combine_in_place: bool | None = None

    def validate(self) -> "DirectConfig":
        if self.num_sms < 0:
            raise ValueError(f"num_sms must be >= 0 (0: from the shape), got {self.num_sms}")
        if self.num_threads % 32 or not 32 <= self.num_threads <= 1024:
            raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {self.num_threads}")
        if self.bulk_stage_bytes is not None and (self.bulk_stage_bytes < 0 or self.bulk_stage_bytes % 16):
            raise ValueError(f"bulk_stage_bytes must be a multiple of 16 (0: warp copies; None: the default), got "
                             f"{self.bulk_stage_bytes}")
        if self.combine_words is not None and self.combine_words not in COMBINE_WORDS:
            raise ValueError(f"combine_words must be one of {COMBINE_WORDS} (None: the default), got "
                             f"{self.combine_words}")
        if self.bulk_shared_bytes() > MAX_SHARED_BYTES:
            raise ValueError(f"bulk_stage_bytes={self.bulk_stage_bytes} needs {self.bulk_shared_bytes()} bytes of "
                             f"shared memory a block at num_threads={self.num_threads} (2 stages per warp); a block "
                             f"has at most {MAX_SHARED_BYTES}: use bulk_stage_bytes <= "
                             f"{largest_bulk_stage(self.num_threads)}")
        return self

    def bulk_stage(self, num_blocks: int | None = None) -> int:
        """The bulk stage in bytes (0: warp copies) of a call on up to
        ``num_blocks`` blocks per rank (None: num_sms): bulk_stage_bytes, or
        by default BULK_STAGE_BYTES (less where a block's stages would not
        fit) when the call has at most BULK_MAX_BLOCKS blocks, else 0."""
        if self.bulk_stage_bytes is not None:
            return self.bulk_stage_bytes
        blocks = self.num_sms if num_blocks is None else num_blocks
        if not 0 < blocks <= BULK_MAX_BLOCKS:
            return 0
        return min(BULK_STAGE_BYTES, largest_bulk_stage(self.num_threads))

    def resolved(self, sm_budget: int) -> "DirectConfig":
        """This config with bulk_stage_bytes decided for a rank whose calls
        take at most ``sm_budget`` blocks when num_sms is 0."""
        if self.bulk_stage_bytes is not None:
            return self
        return replace(self, bulk_stage_bytes=self.bulk_stage(self.num_sms or sm_budget))

    def bulk_shared_bytes(self) -> int:
        """Dynamic shared memory the bulk stages of a block take (0 without them)."""
        return bulk_shared_bytes(self.bulk_stage(), self.num_threads)


def bulk_shared_bytes(stage_bytes: int, num_threads: int) -> int:
    """Dynamic shared memory of a block's bulk stages: two of ``stage_bytes`` per warp."""
    return 2 * stage_bytes * (num_threads // 32)


def largest_bulk_stage(num_threads: int) -> int:
    """The largest bulk stage (a multiple of 16 bytes) whose two stages per
    warp fit a block of ``num_threads`` in MAX_SHARED_BYTES."""
    return MAX_SHARED_BYTES // (2 * max(1, num_threads // 32)) // 16 * 16


def default_num_sms(sm_budget: int, num_rows: int, num_threads: int = THREADS) -> int:
    """Blocks for a direct call that moves ``num_rows`` rows: a warp per row
    in flight, so no more blocks than ceil(rows / warps per block), and no
    more than this rank's share of the GPU (``sm_budget``: its SMs divided by
    the ranks sharing it). A copy needs every warp the rank may have to keep
    enough bytes in flight for HBM, so the budget is the usual bound."""
    warps = num_threads // 32
    return max(1, min(int(sm_budget), math.ceil(max(num_rows, 1) / warps)))


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


@dataclass(frozen=True)
class RecvLayout:
    """Byte offsets of a dispatch's receive arrays in a dispatch pool (-1: absent)."""
    x: int
    x_scales: int
    topk_idx: int
    topk_weights: int
    src_idx: int
    x_bytes: int
    rows: int
    end: int
    em_x: int = -1
    em_x_scales: int = -1
    em_src_row: int = -1
    em_recv_row: int = -1
    em_rows: int = 0

    def at(self, base: int) -> "RecvLayout":
        """This layout with every array ``base`` bytes further into the pool (a slot's base)."""
        if not base:
            return self
        sh = lambda o: o + base if o >= 0 else o  # noqa: E731
        return RecvLayout(sh(self.x), sh(self.x_scales), sh(self.topk_idx), sh(self.topk_weights), sh(self.src_idx),
                          self.x_bytes, self.rows, self.end + base, sh(self.em_x), sh(self.em_x_scales),
                          sh(self.em_src_row), sh(self.em_recv_row), self.em_rows)

    @functools.lru_cache(maxsize=256)  # a slot's layout is packed once (every send packs it)
    def struct(self) -> np.void:
        return jit.pack(RECV_LAYOUT_DTYPE, x=self.x, x_scales=self.x_scales, topk_idx=self.topk_idx,
                        topk_weights=self.topk_weights, src_idx=self.src_idx, x_bytes=self.x_bytes, rows=self.rows,
                        em_x=self.em_x, em_x_scales=self.em_x_scales, em_src_row=self.em_src_row,
                        em_recv_row=self.em_recv_row, em_rows=self.em_rows)


def recv_layout(rows: int, x_bytes: int, num_scales: int, num_topk: int, with_idx: bool,
                with_weights: bool, expert_rows: int | None = None) -> RecvLayout:
    """Receive arrays for ``rows`` rows: x [rows, x_bytes], x_scales [rows,
    num_scales] float32, topk_idx [rows, k] int64, topk_weights [rows, k]
    float32, src_idx [rows] int32, each 256-byte aligned, in that order.

    Expert-major (``expert_rows`` M given): no rank-major x / x_scales; after
    src_idx come em_x [M, x_bytes], em_x_scales [M, num_scales] float32,
    em_src_row [M] int32 and em_recv_row [rows, k] int32."""
    if x_bytes <= 0 or x_bytes % 16:
        raise ValueError(f"row bytes must be a positive multiple of 16, got {x_bytes}")
    expand = expert_rows is not None
    off = 0
    x = -1 if expand else off
    off = _align(off + (0 if expand else rows * x_bytes))
    sc = off if num_scales and not expand else -1
    off = _align(off + (0 if expand else rows * num_scales * 4))
    idx = off if with_idx else -1
    off = _align(off + (rows * num_topk * 8 if with_idx else 0))
    w = off if with_weights else -1
    off = _align(off + (rows * num_topk * 4 if with_weights else 0))
    src = off
    off = _align(off + rows * 4)
    if not expand:
        return RecvLayout(x, sc, idx, w, src, int(x_bytes), int(rows), off)
    m = int(expert_rows)
    em_x = off
    off = _align(off + m * x_bytes)
    em_sc = off if num_scales else -1
    off = _align(off + m * num_scales * 4)
    em_src = off
    off = _align(off + m * 4)
    em_recv = off
    off = _align(off + rows * num_topk * 4)
    return RecvLayout(x, sc, idx, w, src, int(x_bytes), int(rows), off, em_x, em_sc, em_src, em_recv, m)


def rows_that_fit(nbytes: int, x_bytes: int, num_scales: int, num_topk: int, with_idx: bool,
                  with_weights: bool) -> int:
    """The most rows whose recv_layout fits ``nbytes``."""
    per_row = x_bytes + 4 * num_scales + (8 * num_topk if with_idx else 0) + (4 * num_topk if with_weights else 0) + 4
    rows = max(0, int(nbytes) // per_row)
    while rows and recv_layout(rows, x_bytes, num_scales, num_topk, with_idx, with_weights).end > nbytes:
        rows -= max(1, (recv_layout(rows, x_bytes, num_scales, num_topk, with_idx, with_weights).end - nbytes)
                    // per_row)
    return rows


def combine_layout(rows: int, hidden: int, num_topk: int) -> tuple[int, int, int]:
    """(partial_x, partial_meta, end) byte offsets of ``rows`` partial rows:
    BF16 [rows, hidden], then float32 [rows, 1 + k] (row weight, top-k weights)."""
    meta = _align(rows * hidden * 2)
    return 0, meta, _align(meta + rows * (1 + num_topk) * 4)


def zero_copy_layout(out_rows: int, hidden: int, meta_rows: int) -> tuple[int, int, int]:
    """(zc_x, partial_meta, end) byte offsets of a zero-copy combine: the
    caller's expert outputs, BF16 [out_rows, hidden], then float32 [meta_rows,
    1 + ZERO_COPY_MAX_TOPK] (each owner's pushed row and top-k weights)."""
    meta = _align(out_rows * hidden * 2)
    return 0, meta, _align(meta + meta_rows * (1 + ZERO_COPY_MAX_TOPK) * 4)


def combine_rows_that_fit(nbytes: int, hidden: int, num_topk: int) -> int:
    per_row = hidden * 2 + 4 * (1 + num_topk)
    rows = max(0, int(nbytes) // per_row)
    while rows and combine_layout(rows, hidden, num_topk)[2] > nbytes:
        rows -= 1
    return rows


def default_slot_bytes(num_ranks: int, sizes) -> int:
    """Bytes of one dispatch slot for the declared sizes (cupyep.sizes.DeclaredSizes):
    the larger of the rank-major worst case (every rank's max_tokens to this
    rank: R * max_tokens rows of BF16, FP8 or expert-major metadata) and an
    expert-major layout with twice the mean (row, expert) pairs a rank
    receives (2 * max_tokens * num_topk rows)."""
    rows = num_ranks * sizes.max_tokens
    H, k = sizes.hidden, sizes.num_topk
    rank_major = max(recv_layout(rows, 2 * H, 0, k, True, True).end,
                     recv_layout(rows, H, H // 128, k, True, True).end)
    expert_major = recv_layout(rows, 2 * H, 0, k, True, True, expert_rows=2 * sizes.max_tokens * k).end
    return _align(max(rank_major, expert_major))


def expert_rows_that_fit(nbytes: int, rows: int, x_bytes: int, num_scales: int, num_topk: int,
                         with_weights: bool) -> int:
    """The most expert-major rows M whose recv_layout(rows, ..., expert_rows=M) fits ``nbytes`` (0: none)."""
    shape = (x_bytes, num_scales, num_topk, True, with_weights)
    base = recv_layout(rows, *shape, expert_rows=0).end
    per_row = x_bytes + 4 * num_scales + 4
    m = max(0, (int(nbytes) - base) // per_row)
    while m and recv_layout(rows, *shape, expert_rows=m).end > nbytes:
        m -= 1
    return m


class DirectPools:
    """The direct transport's memory of one Buffer (collective, like the buffer).

    Sized when made, from the declared sizes (cupyep.sizes.DeclaredSizes) and
    never grown, so no result's memory is ever freed under it:

    - dispatch: ``num_in_flight`` slots of ``slot_bytes`` (default
      :func:`default_slot_bytes`), taken round-robin (cupyep.slots); a
      dispatch's receive arrays are views of its slot;
    - combine: the partial rows an owner receives, for R * max_tokens rows of
      the declared hidden size and top-k (one region: combines run in order
      on the communication stream, each behind its own handshake);
    - zero_copy: ``num_in_flight`` slots of the same shape, slot s holding the
      expert outputs of the dispatch in dispatch slot s.

    Each pool is allocated (collectively) by the first call that uses it.

    Attributes:
        sync: SymmetricBuffer of the counters.
        pools: {"dispatch", "combine", "zero_copy"}: SymmetricBuffer pools, or None before first use.
        slots: cupyep.slots.InFlightSlots of the dispatch (and zero-copy) slots.
        state: cupy int64 [4 + 2R], private.
    """

    def __init__(self, group, sizes, num_in_flight: int, slot_bytes: int | None = None):
        import cupy
        from ..slots import InFlightSlots
        self.group = group
        R = group.local_size
        self.num_ranks = R
        self.sizes = sizes
        self.max_rows = R * sizes.max_tokens  # the most rows a rank receives, and partial rows an owner gets back
        self.slot_bytes = _align(slot_bytes) if slot_bytes else default_slot_bytes(R, sizes)
        self.zero_copy_bytes = zero_copy_layout(self.max_rows, sizes.hidden, self.max_rows)[2]
        self.combine_bytes = combine_layout(self.max_rows, sizes.hidden, sizes.num_topk)[2]
        self.slots = InFlightSlots(num_in_flight, "direct transport's dispatch pool")
        self.sync = SymmetricBuffer(group, _align(5 * R * SYNC_STRIDE))
        self.sync_struct = jit.pack(SYNC_DTYPE, dispatch_ready=0, dispatch_arrived=R * SYNC_STRIDE,
                                    combine_ready=2 * R * SYNC_STRIDE, combine_arrived=3 * R * SYNC_STRIDE,
                                    combine_done=4 * R * SYNC_STRIDE)
        self.state = cupy.zeros(STATE_HEADER + 2 * R, dtype=np.int64)
        self.pools = {"dispatch": None, "combine": None, "zero_copy": None}
        self._layouts: dict = {}

    def pool(self, kind: str) -> SymmetricBuffer:
        """Collective at the first call that uses ``kind``: the pool, allocated
        at its fixed size (MemoryError naming the bytes when a rank lacks them)."""
        pool = self.pools[kind]
        if pool is not None:
            return pool
        import cupy
        size = {"dispatch": self.slots.num_in_flight * self.slot_bytes, "combine": self.combine_bytes,
                "zero_copy": self.slots.num_in_flight * self.zero_copy_bytes}[kind]
        if cupy.cuda.get_current_stream().is_capturing():
            raise ValueError(f"the direct transport's {kind} pool is allocated by the first call that uses it; "
                             f"run that call once outside graph capture first")
        free = cupy.cuda.runtime.memGetInfo()[0]
        oks = self.group.node_comm.allgather(free >= size)
        if not all(oks):
            short = [r for r, ok in enumerate(oks) if not ok]
            raise MemoryError(f"the direct transport's {kind} pool needs {size} bytes on every rank; node-local "
                              f"rank(s) {short} lack the free device memory (this rank: {free} bytes free); make "
                              f"the Buffer with smaller max_tokens, hidden, num_topk or num_in_flight")
        self.pools[kind] = SymmetricBuffer(self.group, size)
        return self.pools[kind]

    def recv_layout(self, shape: tuple, slot: int) -> RecvLayout:
        """The rank-major recv_layout of ``shape`` (x_bytes, num_scales, num_topk,
        with_idx, with_weights) in dispatch slot ``slot``: the most rows the slot holds."""
        key = ("dispatch", shape, slot)
        lay = self._layouts.get(key)
        if lay is None:
            base = self._layouts.get(key[:2])
            if base is None:
                base = self._layouts[key[:2]] = recv_layout(rows_that_fit(self.slot_bytes, *shape), *shape)
            lay = self._layouts[key] = base.at(slot * self.slot_bytes)
        return lay

    def expand_layout(self, shape: tuple, slot: int) -> RecvLayout:
        """The expert-major recv_layout of ``shape`` in dispatch slot ``slot``:
        R * max_tokens rows of metadata, and the most expert-major rows the rest
        of the slot holds (``em_rows``)."""
        key = ("expand", shape)
        if key not in self._layouts:
            x_bytes, ns, k, _, with_w = shape
            m = expert_rows_that_fit(self.slot_bytes, self.max_rows, x_bytes, ns, k, with_w)
            self._layouts[key] = recv_layout(self.max_rows, *shape, expert_rows=m)
        return self._layouts[key].at(slot * self.slot_bytes)

    def combine_layout(self, hidden: int, num_topk: int) -> tuple[int, int, int]:
        """(partial_x, partial_meta, rows) of the combine pool for this row shape; cached."""
        key = ("combine", hidden, num_topk)
        if key not in self._layouts:
            rows = combine_rows_that_fit(self.combine_bytes, hidden, num_topk)
            self._layouts[key] = (*combine_layout(rows, hidden, num_topk)[:2], rows)
        return self._layouts[key]

    def zero_copy_layout(self, hidden: int, slot: int) -> tuple[int, int, int]:
        """(zc_x, partial_meta, rows) of zero-copy slot ``slot`` for rows of ``hidden``."""
        zc_x, meta, _ = zero_copy_layout(self.max_rows, hidden, self.max_rows)
        base = slot * self.zero_copy_bytes
        return zc_x + base, meta + base, self.max_rows

    def destroy(self) -> None:
        """Collective: free every pool (every lease of its slots becomes stale)."""
        self.slots.invalidate_all()
        for kind, pool in self.pools.items():
            if pool is not None:
                pool.destroy()
                self.pools[kind] = None
        if self.sync is not None and self.sync.alive:
            self.sync.destroy()
        self.sync = None


# ------------------------------------------------------------------ launches
def send_args(pools: DirectPools, pool, lay: RecvLayout, offsets, x, x_scales, topk_idx, topk_weights,
              num_experts: int, capacity: int, rank: int, guard: np.void, pos=None, compute_pos: bool = False,
              pos_threads: int = POSITIONS_THREADS, bulk_stage: int = 0, kernel_time=None, src_copy: int = 0) -> np.void:
    """DirectDispatchArgs of a send into ``pool`` laid out as ``lay``, at the
    offsets of ``offsets`` (a handle, or the arrays a fused notify fills);
    ``capacity``: rows of the receive arrays (padding past the count);
    ``pos``: the [T, k] expert-major positions (expert-major layouts),
    which the fused kernel fills when ``compute_pos`` (with blocks of
    ``pos_threads`` threads; else the position kernel); ``bulk_stage``:
    DirectConfig.bulk_stage_bytes; ``kernel_time``: int64 [2] kernel stamps
    (common/ptx.cuh stamp_start / stamp_end) or None; ``src_copy``: the
    device address the kernel copies the received source indices to (the
    handle's own array, ``capacity`` rows in worst-token mode, else the
    received count), 0 for none."""
    T, H = x.shape
    k = topk_idx.shape[1] if topk_idx is not None else 0
    tables = offsets.expand
    base, meta = tables.ptrs() if tables is not None else (0, 0)
    expand = jit.pack(EXPAND_DTYPE, base=base, pos=jit.ptr(pos), meta=meta,
                      num_experts=num_experts, hist_warps=hist_warps(num_experts, pos_threads),
                      compute_pos=int(compute_pos))
    return jit.pack(
        DISPATCH_ARGS_DTYPE, pools=jit.ptr(pool.peer_ptrs), syncs=jit.ptr(pools.sync.peer_ptrs),
        sync=pools.sync_struct, out=lay.struct(), x=jit.ptr(x), x_scales=jit.ptr(x_scales),
        topk_idx=jit.ptr(topk_idx), topk_weights=jit.ptr(topk_weights), send_list=offsets.array_ptr("send_list"),
        send_channel_prefix=offsets.array_ptr("send_channel_prefix"),
        rank_prefix_matrix=offsets.array_ptr("rank_prefix_matrix"),
        recv_rank_offset=offsets.array_ptr("recv_rank_offset"),
        state=jit.ptr(pools.state), kernel_time=jit.ptr(kernel_time), src_copy=src_copy, expand=expand, num_tokens=T,
        num_scales=H // 128 if x_scales is not None else 0,
        num_topk=k, num_local_experts=num_experts // pools.num_ranks, num_channels=offsets.num_channels,
        capacity=capacity, rank=rank, bulk_stage=bulk_stage, guard=guard)


def launch_positions(args: np.void, num_experts: int) -> None:
    """The expert-major position pass (one block) of a send's ``args``."""
    jit.kernel(positions_spec())((1,), (POSITIONS_THREADS,), (args,),
                                 shared_mem=4 * hist_warps(num_experts) * num_experts)


_shared_limit: dict = {}  # kernel handle -> the dynamic shared memory it has been allowed


def with_shared(fn, shared_bytes: int):
    """``fn`` allowed ``shared_bytes`` of dynamic shared memory (the driver's
    limit is raised past the default 48 KiB, once per kernel and size)."""
    if shared_bytes > 48 * 1024 and _shared_limit.get(fn.kernel.ptr, 0) < shared_bytes:
        fn.max_dynamic_shared_size_bytes = shared_bytes
        _shared_limit[fn.kernel.ptr] = shared_bytes
    return fn


def launch_send(fn, num_blocks: int, num_threads: int, args: np.void, shared_bytes: int = 0) -> None:
    """The send of a direct dispatch (``fn``: dispatch_spec's kernel;
    ``shared_bytes``: DirectConfig.bulk_shared_bytes)."""
    with_shared(fn, shared_bytes)((num_blocks,), (num_threads,), (args,), shared_mem=shared_bytes)


def fused_shared_bytes(num_ranks: int, num_experts: int, num_channels: int, with_positions: bool,
                       num_threads: int, bulk_bytes: int) -> int:
    """Dynamic shared memory of the fused dispatch: its notify block's counts
    (or the position pass's histogram) and, after them in time, the bulk stages."""
    hist = hist_warps(num_experts, num_threads) * num_experts if with_positions else 0
    return max(4 * max(num_ranks * (num_channels + 1) + num_ranks + num_experts, hist), bulk_bytes)


def fused_args(notify: np.void, send: np.void, layout_guard: np.void, host_status: int) -> np.void:
    """FusedDispatchArgs: the notify pass's and the send's args; ``host_status``:
    the mapped word the kernel publishes its verdict in (0 in worst-token mode)."""
    return jit.pack(FUSED_ARGS_DTYPE, notify=notify, dispatch=send, layout_guard=layout_guard,
                    host_status=host_status)


#: What a fused dispatch's args hold the addresses of, per call (jit.ArgTemplate sources): the
#: notify pass's carved allocation, the inputs, the expert-major positions and the two metrics.
FUSED_SOURCES = ("base", "x", "x_scales", "topk_idx", "topk_weights", "pos", "kernel_time", "notify_time")


def launch_fused(fn, template: jit.ArgTemplate, num_blocks: int, num_threads: int, shared_bytes: int,
                 stream_ptr: int, addresses: tuple) -> None:
    """The fused dispatch (layout, notify and send in one launch): its args
    are ``template`` (packed by :func:`fused_args` once per call shape)
    patched with ``addresses``, in the order of FUSED_SOURCES (0 for none);
    ``shared_bytes``: :func:`fused_shared_bytes`, allowed to ``fn`` already."""
    template.launch(fn, num_blocks, num_threads, shared_bytes, stream_ptr, *addresses)


def launch_combine(fn, num_blocks: int, num_threads: int, pools: DirectPools, handle, x, row_weights, topk_weights,
                   combined, combined_w, zero_copy: bool, rank: int, guard: np.void, bulk_stage: int = 0,
                   kernel_time=None, x_peers: list | None = None) -> None:
    """The direct combine: each expert rank pushes its rows (zero-copy, or
    in place: only their weights) into the owners' partial rows, each owner
    reduces them in rank order into combined [T, H] (and combined_w [T, k]);
    ``bulk_stage``: the pushed rows' bulk stage (DirectConfig.bulk_stage; 0
    when no rows are pushed); ``kernel_time``: int64 [2] kernel stamps or
    None; ``x_peers``: in place, every rank's x as an address in this process
    ([R] ints, cupyep.ipc_peers.PeerArrays.exchange), else None."""
    T, H = combined.shape
    k = topk_weights.shape[1] if topk_weights is not None else 0
    if zero_copy:
        zc_x, partial_meta, fit = pools.zero_copy_layout(H, handle.lease.slot)
        pool, partial_x, meta_stride = pools.pools["zero_copy"], 0, 1 + ZERO_COPY_MAX_TOPK
    else:
        pool = pools.pool("combine")
        partial_x, partial_meta, fit = pools.combine_layout(H, k)
        zc_x, meta_stride = -1, 1 + k
    args = jit.pack(
        COMBINE_ARGS_DTYPE, pools=jit.ptr(pool.peer_ptrs), syncs=jit.ptr(pools.sync.peer_ptrs),
        sync=pools.sync_struct, partial_x=partial_x, partial_meta=partial_meta, zc_x=zc_x, rows=fit,
        meta_stride=meta_stride, x=jit.ptr(x), row_weights=jit.ptr(row_weights),
        recv_topk_weights=jit.ptr(topk_weights), rank_prefix_matrix=handle.array_ptr("rank_prefix_matrix"),
        recv_rank_offset=handle.array_ptr("recv_rank_offset"), send_head=handle.array_ptr("send_head"),
        send_channel_prefix=handle.array_ptr("send_channel_prefix"), combined_x=jit.ptr(combined),
        combined_topk_weights=jit.ptr(combined_w), state=jit.ptr(pools.state), kernel_time=jit.ptr(kernel_time),
        num_tokens=T, x_int4=H * 2 // 16,
        num_topk=k, num_channels=handle.num_channels, rank=rank, bulk_stage=bulk_stage, guard=guard,
        in_place=int(x_peers is not None), x_peers=x_peers_bytes(x_peers))
    smem = bulk_shared_bytes(bulk_stage, num_threads)
    with_shared(fn, smem)((num_blocks,), (num_threads,), (args,), shared_mem=smem)


def x_peers_bytes(x_peers: list | None) -> bytes:
    """The x_peers field of DirectCombineArgs: the [R] addresses, zero-padded
    to MAX_IN_PLACE_RANKS (zeros for None)."""
    if x_peers is None:
        return bytes(X_PEERS_DTYPE.itemsize)
    if len(x_peers) > MAX_IN_PLACE_RANKS:
        raise ValueError(f"an in-place combine reads at most {MAX_IN_PLACE_RANKS} ranks' x, got {len(x_peers)}")
    return np.array(list(x_peers) + [0] * (MAX_IN_PLACE_RANKS - len(x_peers)), dtype=np.uint64).tobytes()
