"""How far apart the ranks sharing a GPU start a kernel once a GPU barrier
has released them (``cuda_src/bench/skew.cu``), launched plainly or as a
programmatic dependent of the barrier (cupyep.driver).

Per call it gives int64 nanoseconds of %globaltimer: when this rank left the
barrier and when the kernel after it started; across ranks of one GPU
(stamps.cross_rank-style) the spread of each.
"""
from __future__ import annotations

import numpy as np

from ... import jit
from ...driver import launch

SKEW_SPEC = jit.KernelSpec(name="bench_skew", source="bench/skew.cu",
                           kernels=("cupyep::skew_barrier", "cupyep::skew_stamp"))


def kernel_specs() -> list[jit.KernelSpec]:
    return [SKEW_SPEC]


def barrier_then_stamp(bar, exit_ns, start_ns, grid: int, threads: int, smem: int, programmatic: bool,
                       event_between: bool = False) -> None:
    """Enqueue the barrier (``bar``: a GpuBarrier, whose region it uses), which
    writes its exit time into ``exit_ns`` (device int64 [1]), then a kernel of
    ``grid`` x ``threads`` with ``smem`` bytes of dynamic shared memory that
    stamps its start into ``start_ns`` (device int64 [1], preset to the int64
    maximum). With ``programmatic`` the barrier lets the kernel launch at once
    and the kernel waits for it on the GPU; ``event_between`` records a CUDA
    event between the two (as a timed call does)."""
    import cupy
    mod = jit.load(SKEW_SPEC, bar.group)
    launch(mod["cupyep::skew_barrier"], 1, 32, (bar.args(), np.uint64(exit_ns.data.ptr), np.int32(programmatic)))
    if event_between:
        cupy.cuda.Event().record()
    launch(mod["cupyep::skew_stamp"], grid, threads, (np.uint64(start_ns.data.ptr),), shared_mem=smem,
           programmatic=programmatic)

