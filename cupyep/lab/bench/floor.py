"""The floor under a low-latency call (``cuda_src/bench/floor.cu``): a grid
that runs only the low-latency kernels' flag protocol (every block arrives on
every peer's flag with a release add, the waiting blocks acquire every
peer's), optionally after some of a call's own work before its arrival:
dependent global loads, block barriers, rows stored to the peers, or
straight-line code run once (fetched) or more (cached).

:class:`Floor` holds the flags (a SymmetricBuffer of the node's ranks) and
launches calls the way the low-latency buffer does (programmatic dependent
launch), filling a kernel-stamp row as every timed call does.
"""
from __future__ import annotations

import numpy as np

from ... import jit
from ...driver import launch

FLOOR_SPEC = jit.KernelSpec(name="bench_floor", source="bench/floor.cu", kernels=("cupyep::ll_floor",))
ROWS_OFFSET = 4096  # floor.cu: rows are stored this far past the flags


def kernel_specs() -> list[jit.KernelSpec]:
    return [FLOOR_SPEC]


class Floor:
    """Flags for ``group``'s node ranks and room for ``max_rows`` rows of
    ``row_bytes``; ``call(i, stamp_row, ...)`` launches call i (calls must be
    numbered 0, 1, ... on every rank, each rank launching each)."""

    def __init__(self, group, max_rows: int = 8, row_bytes: int = 7168, timeout_s: float = 10.0):
        import cupy
        from ...ipc import SymmetricBuffer
        self.R, self.rank = group.local_size, group.local_rank
        self.buffer = SymmetricBuffer(group, ROWS_OFFSET + max_rows * row_bytes)
        self.buffer.view(0, (ROWS_OFFSET // 4,), np.int32).fill(0)
        self.chain = cupy.zeros(64, dtype=np.int32)  # chain[i] = 0: every load reads the same word
        self.error = cupy.zeros(1, dtype=np.int32)
        self.room, self.timeout_ns = max_rows * row_bytes, int(timeout_s * 1e9)
        self.module = jit.load(FLOOR_SPEC, group)
        cupy.cuda.get_current_stream().synchronize()
        group.comm.Barrier()

    def call(self, i: int, stamp_row, *, grid: int = 16, threads: int = 512, waiters: int | None = None,
             loads: int = 0, barriers: int = 0, rows: int = 0, row_bytes: int = 7168, code_kib: int = 0,
             passes: int = 1) -> None:
        """Launch call ``i`` (int): ``grid`` x ``threads``, the first ``waiters``
        blocks (default all) waiting; ``loads`` dependent loads, ``barriers``
        block barriers and (block 0) ``rows`` rows of ``row_bytes`` to peer
        ``row % R`` before the arrival; ``code_kib`` (0, 16 or 64) KiB of
        straight-line code run ``passes`` times (the first fetches it, the
        others find it cached). ``stamp_row``: device int64 [2]."""
        if code_kib not in (0, 16, 64) or passes < 1:
            raise ValueError(f"code_kib must be 0, 16 or 64 and passes >= 1, got {code_kib}, {passes}")
        if rows < 0 or row_bytes % 16 or rows * row_bytes > self.room:
            raise ValueError(f"{rows} rows of {row_bytes} bytes (a multiple of 16) do not fit the {self.room} "
                             "bytes this Floor holds")
        launch(self.module["cupyep::ll_floor"], grid, threads,
               (np.uint64(self.buffer.peer_ptrs.data.ptr), np.int64(0), np.uint64(stamp_row.data.ptr),
                np.uint64(self.chain.data.ptr), np.int64(i), np.int32(self.rank), np.int32(self.R),
                np.int32(grid if waiters is None else waiters), np.int32(loads), np.int32(barriers),
                np.int32(rows), np.int32(row_bytes), np.int32(code_kib), np.int32(passes), np.int64(self.timeout_ns),
                np.uint64(self.error.data.ptr)),
               programmatic=True)

    def check(self) -> None:
        """Raises RuntimeError if a wait ran out of time (naming the peer)."""
        err = int(self.error.get()[0])
        if err:
            raise RuntimeError(f"ll_floor: rank {self.rank} timed out waiting for rank {err - 1}'s flag")

    def destroy(self) -> None:
        self.buffer.destroy()
