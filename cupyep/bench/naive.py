"""The naive baseline: dispatch and combine written with CuPy array ops,
mpi4py and CUDA IPC peer mappings, no custom kernels.

What a user writes without this library, kept correct and reasonably fast
so that the benchmarks' speed-ups are measured against something fair.
Every call has one host synchronisation point that the protocol needs (a
stream synchronize, then an MPI barrier: every rank's writes into its peers
are done); the work before it is queued behind the GPU's preceding work
(expert GEMMs in a model, the L2 flush and GPU barrier in the benchmark), so
its host cost overlaps, while everything after the barrier runs with the
GPU idle until the host has queued it. Both calls therefore do as much as
they can before the barrier and little after it.

Dispatch (rank ``me`` of ``R``, ``T`` tokens, BF16 rows of ``H`` columns):
  1. ``mask`` [R, T] bool from ``topk_idx`` with array ops (expert id //
     experts per rank; a -1 slot stays -1): each token goes once to every
     rank that owns any of its top-k experts (deduplicated per rank, as
     normal mode).
  2. The sent (destination, token) pairs ordered by destination, then token
     (``flatnonzero`` of ``mask``, whose size comes back to the host: a host
     sync), and the per-destination counts to the host.
  3. The rows gathered into a contiguous send buffer (as uint64 words, four
     columns per element), queued before the next step so that the GPU
     gathers while the host waits in MPI.
  4. The counts and ``T`` are allgathered over MPI: every rank holds the
     table ``[R, R + 1]`` (``C[s, d]`` tokens rank s sends to rank d, then
     ``T_s``), from which :class:`NaivePlan` (pure NumPy) derives every
     offset and size.
  5. One ``memcpyAsync`` per peer with rows (rows, and one for their int32
     source token indices) into the peer's dispatch staging of a
     :class:`cupyep.ipc.SymmetricBuffer`, at row ``sum(C[:me, d])``: a
     receiver's staging rows are thus ordered by source rank, then source
     token, the order of the NumPy reference. ``recv_src_rank`` (host
     values) goes to the device here too.
  6. Stream synchronize, then an MPI barrier (every sender's copies are done).
  7. The receiver copies its staging rows into ``recv_x`` and
     ``recv_src_idx`` (two copies).

Combine, the reverse, summed where the tokens live: each rank widens its
rows ``y`` to FP32 (one shift over all rows: the 16 BF16 bits become the
upper half of the word) and adds the rows that came from source ``s``
straight into ``s``'s combine region ``[T_s, H]`` float32, at the rows of
their source tokens (``recv_src_idx``), through the IPC mapping: one
``cupy.add.at`` per source with rows (float atomic adds, so the ranks'
GPUs must take each other's atomics natively: one GPU under MPS, or NVLink;
checked at construction). Stream synchronize, MPI barrier; each rank then
copies its region into a fresh ``combined_x`` [T, H] float32 (one
``memcpyAsync``): the unweighted sum over the ranks each token went to,
zeros for tokens sent nowhere. Summation order follows the atomics (not
deterministic), as with any scatter-add.

The staging buffer is allocated once and grown (collectively, from the
exchanged table, which every rank holds) when a call needs more received
rows (dispatch staging) or more tokens (combine regions). Reuse is
race-free without extra barriers:

- a dispatch writes into a peer only after the table's allgather, which
  each rank enters after a host sync of its stream (step 2), so the peer's
  copy-out of the previous dispatch is done;
- combines alternate between two regions (:class:`RegionSchedule`). A
  region must be zero when the peers start adding into it. Call ``k`` zeroes
  the rows that call ``k - 1`` used in the other region (``memsetAsync``,
  queued after call ``k - 1``'s copy-out and before call ``k``'s stream
  sync); the peers add into that region next in call ``k + 1``, after call
  ``k``'s barrier, which this rank enters only after that sync. The copy-out
  of call ``k`` follows call ``k``'s barrier, which every peer enters after
  syncing the stream that queued its adds.

All of this assumes that a rank's successive calls run in stream order; when
the current stream changes between calls, the previous call's stream is
synchronized first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ipc import ALIGNMENT, SymmetricBuffer

ROW_ALIGN = 256  # staging capacity (rows and tokens) grows in multiples of this


# ------------------------------------------------- array-module functions ---
# Written for NumPy and CuPy alike (``xp`` is either module), so the CPU tests
# run the same code as the GPU path.

def routing_mask(xp, topk_idx, num_experts: int, num_ranks: int, ranks=None):
    """Which ranks each token goes to.

    Arguments:
        xp: numpy or cupy.
        topk_idx: [T, k] int64, expert ids in [-1, num_experts).
        num_experts: E, divisible by num_ranks (rank r owns experts
            [r * E / R, (r + 1) * E / R)).
        num_ranks: R.
        ranks: None or an xp [R] int64 ``arange(R)`` to reuse.

    Returns:
        [R, T] bool: entry [d, t] is True when any of token t's experts lives
        on rank d (-1 slots // experts per rank stay -1: floor division).
    """
    rank_of = topk_idx // (num_experts // num_ranks)                      # [T, k], -1 for -1 slots
    if ranks is None:
        ranks = xp.arange(num_ranks, dtype=np.int64)
    return (rank_of[None, :, :] == ranks[:, None, None]).any(axis=2)


def send_order(xp, mask):
    """Source token of each sent row, by destination rank, then token.

    Arguments:
        xp: numpy or cupy.
        mask: [R, T] bool (:func:`routing_mask`).

    Returns:
        [N_send] int32, N_send = mask.sum(); on the GPU ``flatnonzero``
        synchronizes the host with the stream (its size).
    """
    T = mask.shape[1]
    pairs = xp.flatnonzero(mask)                                           # d * T + t, ascending
    return (pairs % T if T else pairs).astype(np.int32)


def gather_rows(xp, x, rows):
    """``x[rows]``, bit-exact, moved as uint64 words (four BF16 columns each).

    Arguments:
        xp: numpy or cupy.
        x: [T, H] uint16, C-contiguous, H a multiple of 4.
        rows: [n] int32 or int64 row indices in [0, T).

    Returns:
        [n, H] uint16.
    """
    return xp.take(x.view(np.uint64), rows, axis=0).view(np.uint16)


def widen_bf16(xp, bits):
    """BF16 bits -> float32 values: the 16 bits become the upper half of the word.

    Arguments:
        xp: numpy or cupy.
        bits: [..., H] uint16.

    Returns:
        [..., H] float32 (a new array).
    """
    return xp.left_shift(bits, 16, dtype=np.uint32).view(np.float32)


# ----------------------------------------------------------- host layout ---
@dataclass(frozen=True)
class NaivePlan:
    """Everything one rank's dispatch and combine need from the routing,
    computed on the host from the table every rank holds after the allgather.

    Attributes:
        rank: me, this rank's node-local index.
        counts: numpy [R, R] int64, entry [s, d] = tokens rank s sends to rank d.
        tokens: numpy [R] int64, T_s of every rank.
        send_copies: tuple of (d, first, num, at) for every destination d with
            rows: rows [first, first + num) of this rank's send buffer (sent
            rows in destination, then token order) go to rows
            [at, at + num) of d's dispatch staging (at = sum(C[:me, d])).
        recv_ranges: tuple of (s, first, num) for every source s with rows:
            received rows [first, first + num) came from s
            (first = sum(C[:s, me])).
        recv_rows: N, rows this rank receives (sum(C[:, me])).
        staging_rows: most rows any rank receives (dispatch staging capacity).
        staging_tokens: most tokens any rank has (combine region capacity).
    """
    rank: int
    counts: np.ndarray
    tokens: np.ndarray
    send_copies: tuple
    recv_ranges: tuple
    recv_rows: int
    staging_rows: int
    staging_tokens: int

    @staticmethod
    def build(table: np.ndarray, rank: int) -> "NaivePlan":
        """Arguments:
            table: numpy [R, R + 1] int64, row s = (C[s, 0], ..., C[s, R - 1], T_s),
                the same on every rank.
            rank: me, in [0, R).
        """
        table = np.asarray(table, dtype=np.int64)
        R = table.shape[0]
        if table.ndim != 2 or table.shape[1] != R + 1 or not 0 <= rank < R:
            raise ValueError(f"table must be [R, R + 1] and rank in [0, R), got {table.shape} and {rank}")
        if (table < 0).any():
            raise ValueError("table holds negative counts")
        C = np.ascontiguousarray(table[:, :R])
        tokens = np.ascontiguousarray(table[:, R])
        me = int(rank)
        into = np.cumsum(C, axis=0) - C                          # [s, d]: rows from sources < s into d
        send_first = np.cumsum(C[me]) - C[me]
        send_copies = tuple((d, int(send_first[d]), int(C[me, d]), int(into[me, d]))
                            for d in range(R) if C[me, d])
        recv_first = into[:, me]
        recv_ranges = tuple((s, int(recv_first[s]), int(C[s, me])) for s in range(R) if C[s, me])
        recv = C.sum(axis=0)
        return NaivePlan(rank=me, counts=C, tokens=tokens, send_copies=send_copies, recv_ranges=recv_ranges,
                         recv_rows=int(recv[me]), staging_rows=int(recv.max(initial=0)),
                         staging_tokens=int(tokens.max(initial=0)))

    @property
    def num_ranks(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_tokens(self) -> int:
        """T of this rank."""
        return int(self.tokens[self.rank])

    @property
    def rank_prefix_matrix(self) -> np.ndarray:
        """numpy [R, R] int32, cumulative sum of ``counts`` over sources
        (entry [i, j] = tokens sources 0..i sent to rank j)."""
        return np.cumsum(self.counts, axis=0).astype(np.int32)

    @property
    def recv_src_rank(self) -> np.ndarray:
        """numpy [N] int32, source rank of each received row."""
        return np.repeat(np.arange(self.num_ranks, dtype=np.int32), self.counts[:, self.rank])


class RegionSchedule:
    """Host bookkeeping of the two alternating combine regions of one rank.

    Every rank calls :meth:`next` once per combine (all ranks the same number
    of times, so they agree on the region), zeroes the bytes it names, and
    calls :meth:`used` after its copy-out. Invariant: when ``next`` returns
    region r, r is all zero (zeroed by the call before, or never used), so
    peers may add into it once they pass the previous call's barrier.
    """

    def __init__(self):
        self.calls = 0
        self.dirty = [0, 0]   # bytes at the start of each region written since it was last zeroed

    def next(self) -> tuple[int, int, int]:
        """(region of this call, the other region, bytes at the start of the
        other region to zero now); the zeroing counts as done."""
        region = self.calls % 2
        other = 1 - region
        self.calls += 1
        nbytes, self.dirty[other] = self.dirty[other], 0
        return region, other, nbytes

    def used(self, region: int, nbytes: int) -> None:
        """The peers wrote (at most) the first ``nbytes`` bytes of ``region``."""
        self.dirty[region] = max(self.dirty[region], int(nbytes))

    def reset(self) -> None:
        """A fresh (zeroed) buffer: nothing dirty; the parity stays."""
        self.dirty = [0, 0]


# ------------------------------------------------------------- handles ---
@dataclass(frozen=True)
class NaiveHandle:
    """What a naive combine needs from its dispatch.

    Attributes:
        plan: NaivePlan of the dispatch.
        recv_src_idx: cupy [N] int32, source token of each received row (the
            dispatch result's array, shared: do not write into it).
    """
    plan: NaivePlan
    recv_src_idx: object

    @property
    def counts(self) -> np.ndarray:
        """numpy [R, R] int64, entry [s, d] = tokens rank s sent to rank d."""
        return self.plan.counts

    @property
    def rank_prefix_matrix(self) -> np.ndarray:
        """numpy [R, R] int32, cumulative sum of ``counts`` over sources."""
        return self.plan.rank_prefix_matrix

    @property
    def num_tokens(self) -> int:
        """T, tokens of this rank's dispatch."""
        return self.plan.num_tokens


@dataclass(frozen=True)
class NaiveDispatchResult:
    """Output of :meth:`NaiveBuffer.dispatch`.

    Attributes:
        recv_x: cupy [N, H] uint16 (BF16 bits), received rows ordered by
            source rank, then source token.
        recv_src_idx: cupy [N] int32, source token index of each row.
        recv_src_rank: cupy [N] int32, source rank of each row.
        handle: NaiveHandle for the combine.
    """
    recv_x: object
    recv_src_idx: object
    recv_src_rank: object
    handle: NaiveHandle


def check_peer_atomics(devices, native_atomics) -> None:
    """The combine adds into peers' memory with float atomics, so every two
    local ranks' GPUs must take each other's atomics natively (always on one
    GPU and over NVLink). ``devices``: each local rank's CUDA device (the same
    list on every rank); ``native_atomics(device, peer)``: the link attribute
    (cupyep.driver.peer_native_atomics). RuntimeError otherwise."""
    pairs = sorted({(a, b) for a in set(devices) for b in set(devices) if a != b and not native_atomics(a, b)})
    if pairs:
        raise RuntimeError(f"NaiveBuffer's combine needs native atomics between the ranks' GPUs; these (GPU, "
                           f"peer GPU) pairs have none: {pairs}. Put the ranks on one GPU (MPS) or on "
                           "NVLink-connected GPUs")


class NaiveBuffer:
    """Naive dispatch/combine of BF16 rows within one node.

    Collective over ``group.node_comm``: every rank constructs it and calls
    the same methods in the same order. Use as a context manager or call
    :meth:`destroy`.

    Arguments:
        group: the rank group (one node).
        hidden: H, columns of every row (a multiple of 8).
        num_max_rows: dispatch staging rows to allocate up front (default 0:
            allocate at the first dispatch, grow when a dispatch needs more).
        num_max_tokens: tokens per rank the combine regions hold up front
            (default 0: likewise).
    """

    def __init__(self, group, hidden: int, num_max_rows: int = 0, num_max_tokens: int = 0):
        group.require_gpu("NaiveBuffer")
        if group.num_nodes != 1:
            raise ValueError(f"NaiveBuffer works within one node, the group spans {group.num_nodes}")
        if hidden <= 0 or hidden % 8:
            raise ValueError(f"hidden must be a positive multiple of 8, got {hidden}")
        from ..driver import peer_native_atomics
        check_peer_atomics(group.node_comm.allgather(group.device_id), peer_native_atomics)
        self.group = group
        self.hidden = int(hidden)
        self.row_bytes = 2 * self.hidden
        self.buffer: SymmetricBuffer | None = None
        self.num_max_rows = 0
        self.num_max_tokens = 0
        self.offsets = self._offsets(0, 0)
        self._regions = RegionSchedule()
        self._views: dict = {}
        self._last_stream = None
        import cupy
        self._ranks = cupy.arange(group.local_size, dtype=np.int64)
        if num_max_rows > 0 or num_max_tokens > 0:
            self._grow(num_max_rows, num_max_tokens)

    # ------------------------------------------------------------ layout ---
    def _offsets(self, rows: int, tokens: int) -> dict:
        """Byte offsets of the regions for ``rows`` staging rows and ``tokens`` tokens."""
        idx = rows * self.row_bytes
        region = tokens * self.hidden * 4
        c0 = -(-(idx + rows * 4) // ALIGNMENT) * ALIGNMENT
        return {"dispatch_x": 0, "dispatch_idx": idx, "combine": (c0, c0 + region), "end": c0 + 2 * region}

    def _grow(self, rows: int, tokens: int) -> None:
        """Collective: reallocate the staging buffer for at least ``rows`` rows and ``tokens`` tokens."""
        rows = -(-max(int(rows), self.num_max_rows) // ROW_ALIGN) * ROW_ALIGN
        tokens = -(-max(int(tokens), self.num_max_tokens) // ROW_ALIGN) * ROW_ALIGN
        self._release()
        self.buffer = SymmetricBuffer(self.group, self._offsets(rows, tokens)["end"])
        self.num_max_rows, self.num_max_tokens = rows, tokens
        self.offsets = self._offsets(rows, tokens)
        self._regions.reset()   # SymmetricBuffer zeroes its memory

    def _release(self) -> None:
        self._views = {}
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None

    def _staging(self, offset: int, shape, dtype=np.uint16):
        """cupy view of this rank's staging buffer at byte ``offset`` (an empty
        array when ``shape`` holds no element)."""
        import cupy
        if 0 in shape:
            return cupy.empty(shape, dtype=dtype)
        return self.buffer.view(offset, shape, dtype)

    def _peer_region(self, region: int, peer: int, tokens: int):
        """cupy [tokens, H] float32 view of ``peer``'s combine region (cached
        until the buffer is reallocated)."""
        key = (region, peer, tokens)
        view = self._views.get(key)
        if view is None:
            view = self.buffer.view(self.offsets["combine"][region], (tokens, self.hidden), np.float32, peer=peer)
            self._views[key] = view
        return view

    def _copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        import cupy
        if nbytes:
            cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

    def _settle(self, stream) -> None:
        """Keep the calls in stream order: synchronize the previous call's
        stream when this call runs on another one."""
        last = self._last_stream
        if last is not None and last.ptr != stream.ptr:
            last.synchronize()
        self._last_stream = stream

    # ---------------------------------------------------------- dispatch ---
    def dispatch(self, x, topk_idx, num_experts: int) -> NaiveDispatchResult:
        """Send each token's row once to every rank owning any of its experts.

        Arguments:
            x: cupy [T, H] uint16, BF16 bits.
            topk_idx: cupy [T, k] int64, expert ids in [-1, num_experts); rank
                r owns experts [r * E / R, (r + 1) * E / R).
            num_experts: E, divisible by the number of ranks R.

        Returns:
            NaiveDispatchResult (recv_x [N, H] uint16, recv_src_idx and
            recv_src_rank [N] int32, handle).
        """
        import cupy
        g = self.group
        R, me = g.local_size, g.local_rank
        if x.ndim != 2 or x.shape[1] != self.hidden or x.dtype != np.uint16:
            raise ValueError(f"x must be [T, {self.hidden}] uint16 (BF16 bits), got {x.shape} {x.dtype}")
        if topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.dtype != np.int64:
            raise ValueError(f"topk_idx must be [{x.shape[0]}, k] int64, got {topk_idx.shape} {topk_idx.dtype}")
        if num_experts <= 0 or num_experts % R:
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the ranks ({R})")
        T = int(x.shape[0])
        stream = cupy.cuda.get_current_stream()
        self._settle(stream)
        x = cupy.ascontiguousarray(x)
        if x.data.ptr % 8:       # gather_rows moves uint64 words
            x = x.copy()

        # 1-2. Where each token goes, the send order (host sync inside) and the counts.
        mask = routing_mask(cupy, topk_idx, num_experts, R, self._ranks)  # [R, T]
        counts = mask.sum(axis=1)
        send_token = send_order(cupy, mask)                                  # [N_send] int32
        row = np.empty(R + 1, dtype=np.int64)
        row[:R] = counts.get()
        row[R] = T
        # 3. The send buffer, gathered on the GPU while the host is in the allgather.
        send_x = gather_rows(cupy, x, send_token)
        # 4. Every rank's counts and T on every host.
        table = np.empty((R, R + 1), dtype=np.int64)
        g.node_comm.Allgather(row, table)
        plan = NaivePlan.build(table, me)
        if plan.staging_rows > self.num_max_rows or plan.staging_tokens > self.num_max_tokens:
            self._grow(plan.staging_rows, plan.staging_tokens)

        # 5-6. One copy per peer with rows (rows and source indices), then everyone's copies are done.
        if plan.send_copies:
            peers, off, rb = self.buffer.peer_ptr_list, self.offsets, self.row_bytes
            for d, first, num, at in plan.send_copies:
                self._copy(peers[d] + off["dispatch_x"] + at * rb, send_x.data.ptr + first * rb, num * rb, stream)
                self._copy(peers[d] + off["dispatch_idx"] + at * 4, send_token.data.ptr + first * 4, num * 4,
                           stream)
        recv_src_rank = cupy.asarray(plan.recv_src_rank)
        stream.synchronize()
        g.node_comm.Barrier()

        # 7. Own staging rows, already in (source rank, source token) order.
        N = plan.recv_rows
        recv_x = self._staging(self.offsets["dispatch_x"], (N, self.hidden)).copy()
        recv_src_idx = self._staging(self.offsets["dispatch_idx"], (N,), np.int32).copy()
        return NaiveDispatchResult(recv_x=recv_x, recv_src_idx=recv_src_idx, recv_src_rank=recv_src_rank,
                                   handle=NaiveHandle(plan=plan, recv_src_idx=recv_src_idx))

    # ----------------------------------------------------------- combine ---
    def combine(self, y, handle: NaiveHandle):
        """Send each received row back to its source rank and sum there.

        Arguments:
            y: cupy [N, H] uint16 (BF16 bits), one row per received row of the
                dispatch that made ``handle``, in its order.
            handle: NaiveHandle of that dispatch.

        Returns:
            cupy [T, H] float32: for each of this rank's tokens, the sum of
            the rows that came back for it (zeros for tokens sent nowhere).
        """
        import cupy
        g = self.group
        plan = handle.plan
        N, T, H = plan.recv_rows, plan.num_tokens, self.hidden
        if y.ndim != 2 or y.shape != (N, H) or y.dtype != np.uint16:
            raise ValueError(f"y must be [{N}, {H}] uint16 (BF16 bits), got {y.shape} {y.dtype}")
        if plan.staging_tokens > self.num_max_tokens:
            raise ValueError(f"the handle needs combine regions of {plan.staging_tokens} tokens, the buffer "
                             f"holds {self.num_max_tokens}")
        stream = cupy.cuda.get_current_stream()
        self._settle(stream)
        region, other, dirty = self._regions.next()
        if dirty:
            # The rows the previous combine used: peers add into them next call, after this call's barrier.
            cupy.cuda.runtime.memsetAsync(self.buffer.ptr + self.offsets["combine"][other], 0, dirty, stream.ptr)

        # Rows from source s go straight into s's region, at their source tokens.
        if plan.recv_ranges:
            values = widen_bf16(cupy, cupy.ascontiguousarray(y))
            src_idx = handle.recv_src_idx
            for s, first, num in plan.recv_ranges:
                cupy.add.at(self._peer_region(region, s, int(plan.tokens[s])), src_idx[first:first + num],
                            values[first:first + num])
        stream.synchronize()
        g.node_comm.Barrier()

        combined_x = cupy.empty((T, H), dtype=np.float32)
        if T:
            self._copy(combined_x.data.ptr, self.buffer.ptr + self.offsets["combine"][region], T * H * 4, stream)
            self._regions.used(region, T * H * 4)
        return combined_x

    # ---------------------------------------------------------- lifetime ---
    def destroy(self) -> None:
        """Collective: free the staging buffer."""
        if self.buffer is not None:
            self._release()
            self.num_max_rows = self.num_max_tokens = 0
            self.offsets = self._offsets(0, 0)
            self._regions.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def naive_records(group, buf: NaiveBuffer, barrier, x, topk_idx, num_experts: int, iters: int,
                  copy_bw: float) -> list[dict]:
    """Time the naive dispatch and combine (cupyep.bench.timing.time_fn, L2
    flushed, ``barrier`` lining the ranks up inside the events) and return one
    record per kind, in the keys of the other benchmarks: ``time_us`` (median
    of the slowest rank), ``event_median_us``/``event_p99_us``, ``rank_GBps``
    (received rows x row bytes / time, averaged over ranks; the combine counts
    the same bytes), ``efficiency`` (2 x bytes received by all ranks / copy
    bandwidth / time), ``staging_rows``/``staging_tokens`` (the buffer's
    capacities).

    Arguments:
        group: the rank group; buf: NaiveBuffer; barrier: a callable
            enqueuing a GPU barrier (cupyep.barrier.GpuBarrier).
        x: cupy [T, H] uint16; topk_idx: cupy [T, k] int64.
        num_experts: E; iters: timed calls per kind; copy_bw: bytes/s of the
            copy kernel (read + write), the same on every rank.
    """
    from mpi4py import MPI

    from .timing import time_fn
    R = group.local_size
    first = buf.dispatch(x, topk_idx, num_experts)
    y = first.recv_x
    recv_bytes = int(y.shape[0]) * buf.row_bytes
    total = group.comm.allreduce(recv_bytes)
    T, k = int(x.shape[0]), int(topk_idx.shape[1])
    records = []
    for kind, fn in (("dispatch", lambda: buf.dispatch(x, topk_idx, num_experts)),
                     ("combine", lambda: buf.combine(y, first.handle))):
        t = time_fn(fn, iters=iters, warmup=3, before=barrier)
        t_max = group.comm.allreduce(t.median_s, op=MPI.MAX)
        records.append({
            "bench": "naive", "kind": kind, "ranks": R, "tokens": T, "hidden": buf.hidden, "topk": k,
            "experts": num_experts, "time_us": t_max * 1e6, "event_median_us": t_max * 1e6,
            "event_p99_us": group.comm.allreduce(t.p99_s, op=MPI.MAX) * 1e6, "n": t.n,
            "rank_GBps": group.comm.allreduce(recv_bytes / t.median_s) / R / 1e9,
            "efficiency": 2 * total / copy_bw / t_max, "copy_GBps": copy_bw / 1e9,
            "staging_rows": buf.num_max_rows, "staging_tokens": buf.num_max_tokens})
    return records
