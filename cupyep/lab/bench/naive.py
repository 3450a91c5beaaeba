"""The naive baseline: dispatch and combine written with CuPy array ops,
mpi4py and one ``cudaMemcpyAsync`` per peer, no custom kernels.

What a user writes without this library, kept correct and reasonably fast
so that the benchmarks' speed-ups are measured against something fair:

Dispatch (rank ``me`` of ``R``, ``T`` tokens, BF16 rows of ``H`` columns):
  1. ``is_token_in_rank`` [T, R] from ``topk_idx`` with array ops; each
     token goes once to every rank that owns any of its top-k experts
     (deduplicated per rank, as normal mode).
  2. The per-destination counts go to the host and are allgathered over
     MPI: every rank knows the whole count matrix ``C[s, d]``.
  3. The sent (token, destination) pairs are ordered by destination, then
     token (``flatnonzero`` of the transposed mask), and the rows gathered
     into a contiguous send buffer.
  4. One ``memcpyAsync`` per peer (rows, and one for their int32 source
     token indices) into the peer's staging region of a
     :class:`cupyep.ipc.SymmetricBuffer`, at row ``sum(C[:me, d])``:
     a receiver's staging rows are thus ordered by source rank, then source
     token, the order of the NumPy reference.
  5. Stream synchronize, then an MPI barrier (every sender's copies are done).
  6. The receiver copies its staging rows into ``recv_x``.

Combine, the reverse: each rank copies its rows from source ``s`` (one
``memcpyAsync`` per peer) into ``s``'s combine staging at row
``sum(C[s, :me])``, so an owner's staging rows are in its own send order
(destination, then token); stream synchronize, MPI barrier; the owner
widens them to FP32 and adds them into ``combined_x`` [T, H] at their
source tokens (``cupy.add.at``): the unweighted sum over the ranks each
token went to.

The staging buffer is allocated once and grown (collectively, from the
exchanged counts, which every rank knows) when a call needs more rows.
Reuse is race-free without extra barriers: a dispatch writes into a peer
only after the counts' allgather, which each rank enters after a host sync
of its stream, so the peer's previous copy-out is done; combines alternate
between two staging regions, and a combine writes into the region of the
combine two calls back only after the barrier of the call in between,
which each rank passes after a stream sync that followed its add.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ipc import ALIGNMENT, SymmetricBuffer

ROW_ALIGN = 256  # staging capacity grows in multiples of this many rows


@dataclass(frozen=True)
class NaiveHandle:
    """What a naive combine needs from its dispatch.

    Attributes:
        send_token: cupy [N_send] int64, source token of each sent row, in
            send order (destination rank, then token).
        counts: numpy [R, R] int64, entry [s, d] = tokens rank s sent to rank d.
        rank_prefix_matrix: numpy [R, R] int32, cumulative sum of ``counts``
            over sources (entry [i, j] = tokens sources 0..i sent to rank j).
        num_tokens: T, tokens of this rank's dispatch.
    """
    send_token: object
    counts: np.ndarray
    rank_prefix_matrix: np.ndarray
    num_tokens: int


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


class NaiveBuffer:
    """Naive dispatch/combine of BF16 rows within one node.

    Collective over ``group.node_comm``: every rank calls the same methods in
    the same order. Use as a context manager or call :meth:`destroy`.

    Arguments:
        group: the rank group (one node).
        hidden: H, columns of every row.
        num_max_rows: staging rows to allocate up front (default 0: allocate
            at the first dispatch, grow when a dispatch needs more).
    """

    def __init__(self, group, hidden: int, num_max_rows: int = 0):
        group.require_gpu("NaiveBuffer")
        if group.num_nodes != 1:
            raise ValueError(f"NaiveBuffer works within one node, the group spans {group.num_nodes}")
        if hidden <= 0 or hidden % 8:
            raise ValueError(f"hidden must be a positive multiple of 8, got {hidden}")
        self.group = group
        self.hidden = int(hidden)
        self.row_bytes = 2 * self.hidden
        self.buffer: SymmetricBuffer | None = None
        self.num_max_rows = 0
        self.offsets = self._offsets(0)
        self._combine_calls = 0
        if num_max_rows > 0:
            self._grow(num_max_rows)

    # ------------------------------------------------------------ layout ---
    def _offsets(self, rows: int) -> dict:
        """Byte offsets of the regions for a capacity of ``rows`` rows."""
        x_bytes = rows * self.row_bytes
        idx = x_bytes
        c0 = -(-(idx + rows * 4) // ALIGNMENT) * ALIGNMENT
        return {"dispatch_x": 0, "dispatch_idx": idx, "combine": (c0, c0 + x_bytes), "end": c0 + 2 * x_bytes}

    def _grow(self, rows: int) -> None:
        """Collective: reallocate the staging buffer for at least ``rows`` rows."""
        rows = -(-int(rows) // ROW_ALIGN) * ROW_ALIGN
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None
        self.buffer = SymmetricBuffer(self.group, self._offsets(rows)["end"])
        self.num_max_rows = rows
        self.offsets = self._offsets(rows)

    def _staging(self, offset: int, shape, dtype=np.uint16):
        """cupy view of this rank's staging buffer at byte ``offset`` (an empty
        array when ``shape`` holds no element)."""
        import cupy
        if 0 in shape:
            return cupy.empty(shape, dtype=dtype)
        return self.buffer.view(offset, shape, dtype)

    def _copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        import cupy
        if nbytes:
            cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

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

        # 1-2. Which ranks each token goes to; the count matrix on every host.
        rank_of = cupy.where(topk_idx >= 0, topk_idx // (num_experts // R), -1)
        is_token_in_rank = (rank_of[:, :, None] == cupy.arange(R)[None, None, :]).any(axis=1)  # [T, R]
        counts = np.ascontiguousarray(is_token_in_rank.sum(axis=0).get(), dtype=np.int64)
        C = np.empty((R, R), dtype=np.int64)
        g.node_comm.Allgather(counts, C)

        # 3. Send order: by destination, then token.
        pairs = cupy.flatnonzero(is_token_in_rank.T)             # dst * T + token, ascending
        send_token = pairs % T if T else pairs
        send_x = cupy.take(x, send_token, axis=0)
        send_idx = send_token.astype(np.int32)

        need = max(int(C.sum(axis=0).max()), int(C.sum(axis=1).max()))
        if need > self.num_max_rows:
            self._grow(need)

        # 4-5. One copy per peer (rows and source indices), then everyone's copies are done.
        into = np.cumsum(C, axis=0) - C                           # [s, d]: rows from sources < s into d
        send_off = np.cumsum(C[me]) - C[me]
        if need:
            peers, off = self.buffer.peer_ptr_list, self.offsets
            for d in range(R):
                n = int(C[me, d])
                self._copy(peers[d] + off["dispatch_x"] + int(into[me, d]) * self.row_bytes,
                           send_x.data.ptr + int(send_off[d]) * self.row_bytes, n * self.row_bytes, stream)
                self._copy(peers[d] + off["dispatch_idx"] + int(into[me, d]) * 4,
                           send_idx.data.ptr + int(send_off[d]) * 4, n * 4, stream)
        stream.synchronize()
        g.node_comm.Barrier()

        # 6. Own staging rows, already in (source rank, source token) order.
        N = int(C[:, me].sum())
        off = self.offsets
        recv_x = self._staging(off["dispatch_x"], (N, self.hidden)).copy()
        recv_src_idx = self._staging(off["dispatch_idx"], (N,), np.int32).copy()
        recv_src_rank = cupy.asarray(np.repeat(np.arange(R, dtype=np.int32), C[:, me]))
        handle = NaiveHandle(send_token=send_token, counts=C,
                             rank_prefix_matrix=np.cumsum(C, axis=0).astype(np.int32), num_tokens=T)
        return NaiveDispatchResult(recv_x=recv_x, recv_src_idx=recv_src_idx, recv_src_rank=recv_src_rank,
                                   handle=handle)

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
        R, me = g.local_size, g.local_rank
        C = handle.counts
        N = int(C[:, me].sum())
        if y.ndim != 2 or y.shape != (N, self.hidden) or y.dtype != np.uint16:
            raise ValueError(f"y must be [{N}, {self.hidden}] uint16 (BF16 bits), got {y.shape} {y.dtype}")
        need = max(int(C.sum(axis=0).max()), int(C.sum(axis=1).max()))
        if need > self.num_max_rows:
            raise ValueError(f"the handle needs {need} staging rows, the buffer holds {self.num_max_rows}")
        stream = cupy.cuda.get_current_stream()
        region = self._combine_calls % 2
        self._combine_calls += 1
        y = cupy.ascontiguousarray(y)

        # Rows from source s sit at [sum(C[:s, me]), ...) here and go to s's staging at
        # row sum(C[s, :me]): s's send order (destination, then token).
        recv_off = np.cumsum(C[:, me]) - C[:, me]
        back_to = np.cumsum(C, axis=1) - C                        # [s, d]: rows s sent to ranks < d
        if need:
            peers, base = self.buffer.peer_ptr_list, self.offsets["combine"][region]
            for s in range(R):
                self._copy(peers[s] + base + int(back_to[s, me]) * self.row_bytes,
                           y.data.ptr + int(recv_off[s]) * self.row_bytes, int(C[s, me]) * self.row_bytes, stream)
        stream.synchronize()
        g.node_comm.Barrier()

        combined_x = cupy.zeros((handle.num_tokens, self.hidden), dtype=np.float32)
        n_back = int(C[me].sum())
        if n_back:
            rows = self._staging(self.offsets["combine"][region], (n_back, self.hidden))
            # BF16 bits -> FP32: the 16 bits become the upper half of the word.
            values = cupy.left_shift(rows, 16, dtype=np.uint32).view(np.float32)
            cupy.add.at(combined_x, handle.send_token, values)
        return combined_x

    # ---------------------------------------------------------- lifetime ---
    def destroy(self) -> None:
        """Collective: free the staging buffer."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None
            self.num_max_rows = 0
            self.offsets = self._offsets(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def naive_records(group, buf: NaiveBuffer, x, topk_idx, num_experts: int, iters: int,
                  copy_bw: float) -> list[dict]:
    """Time the naive dispatch and combine and return one record per kind, in
    the keys of the other benchmarks: ``time_us`` (median of the slowest
    rank), ``event_median_us``/``event_p99_us``, ``wall_median_us`` (host
    clock to the results on the stream), ``rank_GBps`` (received rows x row
    bytes / time, averaged over ranks; the combine counts the same bytes),
    ``efficiency`` (2 x bytes received by all ranks / copy bandwidth / time).

    The calls synchronize with the host, so they are timed on a host-aligned
    boundary (cupyep.lab.bench.timing.time_host_synchronous): L2 flushed, then an
    MPI barrier, before each call; ``"timing": "host_aligned"``.

    Arguments:
        group: the rank group; buf: NaiveBuffer.
        x: cupy [T, H] uint16; topk_idx: cupy [T, k] int64.
        num_experts: E; iters: timed calls per kind; copy_bw: bytes/s of the
            copy kernel (read + write), the same on every rank.
    """
    from mpi4py import MPI

    from .timing import time_host_synchronous
    R = group.local_size
    first = buf.dispatch(x, topk_idx, num_experts)
    y = first.recv_x
    recv_bytes = int(y.shape[0]) * buf.row_bytes
    total = group.comm.allreduce(recv_bytes)
    T, k = int(x.shape[0]), int(topk_idx.shape[1])
    records = []
    for kind, fn in (("dispatch", lambda: buf.dispatch(x, topk_idx, num_experts)),
                     ("combine", lambda: buf.combine(y, first.handle))):
        t, wall = time_host_synchronous(fn, group.node_comm, iters=iters, warmup=3)
        t_max = group.comm.allreduce(t.median_s, op=MPI.MAX)
        records.append({
            "bench": "naive", "kind": kind, "ranks": R, "tokens": T, "hidden": buf.hidden, "topk": k,
            "experts": num_experts, "time_us": t_max * 1e6, "event_median_us": t_max * 1e6,
            "event_p99_us": group.comm.allreduce(t.p99_s, op=MPI.MAX) * 1e6, "n": t.n,
            "wall_median_us": group.comm.allreduce(wall.median_s, op=MPI.MAX) * 1e6, "timing": "host_aligned",
            "rank_GBps": group.comm.allreduce(recv_bytes / t.median_s) / R / 1e9,
            "efficiency": 2 * total / copy_bw / t_max, "copy_GBps": copy_bw / 1e9,
            "staging_rows": buf.num_max_rows})
    return records
