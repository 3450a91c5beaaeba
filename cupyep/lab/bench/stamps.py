"""Summaries of the %globaltimer stamps kernels write while profiled.

All ranks of one GPU read the same %globaltimer, so stamps of different
ranks on one GPU can be compared (different GPUs' timers are not aligned):
how far apart the ranks' kernels started, and how long the call took once
the last rank had started.

Inputs are int64 nanoseconds gathered from every rank:

* ``kernel`` stamps: [R, n, 2], per rank and call the first block's start and
  the last block's end;
* ``trace`` stamps: [R, n, G, M], per rank, call, block and mark the time the
  block reached the mark (0 where a mark was not reached).
"""
from __future__ import annotations

import numpy as np


def one_timer(group) -> bool:
    """Every rank of ``group``'s world is on one GPU (ranks_per_gpu counts a
    host's ranks on one device), so all their stamps read one %globaltimer
    and compare across ranks (:func:`cross_rank`)."""
    return group.ranks_per_gpu == group.world_size


def new_kernel_stamps(n: int):
    """Device int64 [n, 2] for n profiled calls: column 0 starts at the int64
    maximum (the kernels atomicMin their start into it), column 1 at 0 (atomicMax end)."""
    import cupy
    st = cupy.empty((n, 2), dtype=np.int64)
    st[:, 0], st[:, 1] = np.iinfo(np.int64).max, 0
    return st


def kernel_seconds(kernel) -> np.ndarray:
    """Durations in seconds, end minus start, of [..., 2] kernel stamps (host array)."""
    k = np.asarray(kernel, dtype=np.int64)
    if k.shape[-1] != 2:
        raise ValueError(f"kernel stamps must end in a dimension of 2, got {k.shape}")
    return (k[..., 1] - k[..., 0]) * 1e-9


def _median_p99(a) -> dict:
    a = np.asarray(a, dtype=np.float64) * 1e-3
    return {"median_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99))}


def cross_rank(kernel) -> dict:
    """Per call over ranks, from [R, n, 2] kernel stamps:

    * ``skew``: last rank's start minus first rank's start;
    * ``span``: last rank's end minus first rank's start;
    * ``after_last_start``: last rank's end minus last rank's start (the
      call's own latency once every rank has launched).

    Returns {name: {"median_us", "p99_us"}}.
    """
    k = np.asarray(kernel, dtype=np.int64)
    if k.ndim != 3 or k.shape[2] != 2:
        raise ValueError(f"kernel stamps must be [R, n, 2], got {k.shape}")
    first, last, end = k[:, :, 0].min(0), k[:, :, 0].max(0), k[:, :, 1].max(0)
    return {"skew": _median_p99(last - first), "span": _median_p99(end - first),
            "after_last_start": _median_p99(end - last)}


def concurrent_ranks(kernel) -> dict:
    """How many ranks' kernels ran at once, from [R, n, 2] kernel stamps: per
    call, the mean over ranks of the number of ranks (itself included) whose
    kernel's [start, end] overlaps that rank's. On one GPU the ranks' kernels
    share its SMs and memory, so a call timed per rank is slower the more of
    them overlap. Returns {"median", "min", "max"} over calls.
    """
    k = np.asarray(kernel, dtype=np.int64)
    if k.ndim != 3 or k.shape[2] != 2:
        raise ValueError(f"kernel stamps must be [R, n, 2], got {k.shape}")
    start, end = k[:, :, 0], k[:, :, 1]                              # [R, n]
    overlaps = (start[:, None, :] <= end[None, :, :]) & (start[None, :, :] <= end[:, None, :])  # [R, R, n]
    per_call = overlaps.sum(axis=1).mean(axis=0).astype(np.float64)  # [n]
    return {"median": float(np.median(per_call)), "min": float(per_call.min()), "max": float(per_call.max())}


def trace_marks(trace, names) -> dict:
    """When the ranks reached each mark, from [R, n, G, M] trace stamps.

    Per call, a rank reaches mark m when its last block does; times count from
    the first rank's start (mark 0). Returns {name: {"first_rank_us",
    "last_rank_us"}}, medians over calls of the first and the last rank to
    reach the mark; marks no block reached are left out.
    """
    t = np.asarray(trace, dtype=np.int64)
    if t.ndim != 4 or t.shape[3] < len(names):
        raise ValueError(f"trace stamps must be [R, n, G, >= {len(names)}], got {t.shape}")
    starts = np.where(t[..., 0] > 0, t[..., 0], np.iinfo(np.int64).max)
    t0 = starts.min(axis=(0, 2))                              # [n]
    out = {}
    for m, name in enumerate(names):
        mark = t[..., m]                                      # [R, n, G]
        if not (mark > 0).any():
            continue
        reached = mark.max(axis=2)                            # [R, n]: the rank's last block
        reached = np.where(reached > 0, reached - t0[None, :], np.nan)
        out[name] = {"first_rank_us": float(np.nanmedian(np.nanmin(reached, axis=0))) * 1e-3,
                     "last_rank_us": float(np.nanmedian(np.nanmax(reached, axis=0))) * 1e-3}
    return out
