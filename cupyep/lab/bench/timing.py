"""Timing with CUDA events: warm-up, optional L2 flush between runs, many runs.

With ``hide_launch_us`` a sleep kernel runs before each timed call, so the
host has queued the call before the GPU reaches it and the events measure GPU
time only (what matters for calls of a few microseconds, whose host-side
launch cost would otherwise be counted).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ... import jit

SLEEP_SPEC = jit.KernelSpec(name="bench_sleep", source="bench/sleep.cu", kernels=("cupyep::gpu_sleep",))


def kernel_specs() -> list[jit.KernelSpec]:
    return [SLEEP_SPEC]


def gpu_sleep(us: float) -> None:
    """Enqueue a kernel that keeps the current stream busy for ``us`` microseconds."""
    jit.kernel(SLEEP_SPEC)((1,), (32,), (np.uint64(int(us * 1000)),))


@dataclass(frozen=True)
class Timing:
    """Per-call times in seconds over ``n`` runs."""
    median_s: float
    mean_s: float
    p99_s: float
    min_s: float
    max_s: float
    n: int
    p10_s: float = float("nan")
    p90_s: float = float("nan")

    def as_us(self) -> dict:
        return {k.replace("_s", "_us"): (v * 1e6 if k != "n" else v) for k, v in asdict(self).items()}

    @staticmethod
    def from_samples(samples_s) -> "Timing":
        a = np.asarray(samples_s, dtype=np.float64)
        return Timing(float(np.median(a)), float(a.mean()), float(np.percentile(a, 99)), float(a.min()),
                      float(a.max()), int(a.size), float(np.percentile(a, 10)), float(np.percentile(a, 90)))


_flush_buf = None


FLUSH_MODES = ("write", "read", "pages", "none")
PAGE_BYTES = 2 << 20


def flush_l2(nbytes: int = 256 << 20, mode: str = "write") -> None:
    """Evict L2 so the next run starts cold, by touching a buffer larger than L2.

    ``mode``: "write" overwrites it (L2 is left full of dirty lines, as after
    a kernel that wrote much); "read" sums it (L2 is left full of clean lines,
    as after a weight-streaming GEMM); "pages" touches one word in each 2 MB
    page of a buffer 16 times larger (evicts address translations, hardly any
    data); "none" does nothing.
    """
    import cupy
    global _flush_buf
    if mode not in FLUSH_MODES:
        raise ValueError(f"flush mode must be one of {FLUSH_MODES}, got {mode!r}")
    if mode == "none":
        return
    size = nbytes * 16 if mode == "pages" else nbytes
    if _flush_buf is None or _flush_buf.nbytes < size:
        _flush_buf = None
        _flush_buf = cupy.zeros(size, dtype=np.uint8)
    if mode == "pages":
        _flush_buf[:size].view(np.int32)[::PAGE_BYTES // 4] += 1
    elif mode == "write":
        _flush_buf[:nbytes].fill(0)
    else:
        _flush_buf[:nbytes].view(np.int64).sum()


def time_fn(fn, iters: int = 50, warmup: int = 5, flush: bool = True, before=None,
            hide_launch_us: float = 0.0) -> Timing:
    """Time ``fn()`` (which enqueues GPU work on the current stream).

    ``before()`` runs before each call (e.g. a barrier that lines all ranks
    up) and, as in :func:`timed_rounds`, inside the events: an event recorded
    between it and the call would hold the call's launch back. With ``flush``
    the L2 is flushed before each call as well; with ``hide_launch_us`` a sleep
    kernel of that length precedes ``before()``.
    """
    import cupy
    for _ in range(warmup):
        if before:
            before()
        fn()
    cupy.cuda.get_current_stream().synchronize()
    starts = [cupy.cuda.Event() for _ in range(iters)]
    ends = [cupy.cuda.Event() for _ in range(iters)]
    for i in range(iters):
        if flush:
            flush_l2()
        if hide_launch_us:
            gpu_sleep(hide_launch_us)
        starts[i].record()
        if before:
            before()
        fn()
        ends[i].record()
    ends[-1].synchronize()
    return Timing.from_samples([cupy.cuda.get_elapsed_time(s, e) * 1e-3 for s, e in zip(starts, ends)])


def host_median_us(fn, iters: int) -> float:
    """The median host time of ``iters`` calls of ``fn()``, in microseconds
    rounded to 0.01 (nothing waits for GPU work ``fn`` enqueues)."""
    import time
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1e6, 2)


def time_host_synchronous(fn, comm, iters: int = 50, warmup: int = 3, flush: bool = True) -> tuple:
    """Time ``fn()``, a call that synchronizes with the host itself (the naive
    baseline: MPI exchanges and stream syncs inside the call).

    Before each call: the L2 flush, a stream sync, then an MPI barrier on
    ``comm``, so every rank starts the call at the same moment with its flush
    done (a GPU barrier inside the events would charge each rank for the
    other ranks' flushes, which run concurrently under MPS). CUDA events
    span the call and a host clock spans the call plus a final stream sync.

    Returns (event Timing, wall Timing).
    """
    import time

    import cupy
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    events, walls = [], []
    for _ in range(iters):
        if flush:
            flush_l2()
        stream.synchronize()
        comm.Barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        walls.append(time.perf_counter() - t0)
        events.append(cupy.cuda.get_elapsed_time(start, end) * 1e-3)
    return Timing.from_samples(events), Timing.from_samples(walls)


def timed_rounds(calls, iters: int, warmup: int = 10, flush: str = "write", sleep_us: float = 400.0,
                 before=None) -> list:
    """Run ``warmup + iters`` rounds of ``calls``, each call on its own: an L2
    flush (``flush``: a FLUSH_MODES mode), a GPU sleep of ``sleep_us`` (so the
    host has queued the call before the GPU reaches it), ``before()`` (e.g. a
    GPU barrier lining all ranks up), then ``call(i, stamp_row)``, where
    ``stamp_row`` is that call's int64 [2] kernel-stamp row
    (stamps.new_kernel_stamps) for the kernel to fill. CUDA events span
    ``before()`` and the call: an event recorded between them would hold the
    call's launch back (under MPS by about 15 us at 8 ranks, and it defeats
    programmatic launch; results/archive/launch_skew.jsonl).

    Returns, per call, (event Timing, host int64 [iters, 2] kernel stamps),
    warm-up rounds dropped.
    """
    import cupy
    from .stamps import new_kernel_stamps
    stamps = [new_kernel_stamps(warmup + iters) for _ in calls]
    times = [[] for _ in calls]
    for i in range(warmup + iters):
        evs = []
        for call, st in zip(calls, stamps):
            flush_l2(mode=flush)
            if sleep_us:
                gpu_sleep(sleep_us)
            e = (cupy.cuda.Event(), cupy.cuda.Event())
            e[0].record()
            if before:
                before()
            call(i, st[i])
            e[1].record()
            evs.append(e)
        evs[-1][1].synchronize()
        if i >= warmup:
            for lst, (a, b) in zip(times, evs):
                lst.append(cupy.cuda.get_elapsed_time(a, b) * 1e-3)
    return [(Timing.from_samples(t), st[warmup:].get()) for t, st in zip(times, stamps)]
