"""How far apart the ranks sharing a GPU start a kernel once a GPU barrier has
released them, and whether programmatic dependent launch closes the gap.

    python -m cupyep.launcher -n 8 experiments/probes/probe_launch_skew.py --out results/launch_skew.jsonl

Each call: a GPU sleep (so the host has queued everything), the barrier
(stamping when this rank left it), then a kernel stamping when its first
block started, launched plainly or as a programmatic dependent of the
barrier (cupyep.lab.bench.skew). Per kernel shape and launch kind, medians and
p99 over calls of: the spread of the ranks' barrier exits, the spread of
their kernel starts, and the last start after the last exit.
"""
import argparse

import numpy as np

import cupyep
from cupyep.barrier import GpuBarrier
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import JsonlWriter
from cupyep.lab.bench.skew import barrier_then_stamp
from cupyep.lab.bench.timing import gpu_sleep


def main():
    require_gpu(__file__)
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/launch_skew.jsonl")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--sleep-us", type=float, default=400.0)
    args = p.parse_args()
    import cupy
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    bar = GpuBarrier(group)
    shapes = ((1, 32, 0), (16, 512, 4096), (16, 1024, 32768))
    for grid, threads, smem in shapes:
        for programmatic, event_between in ((False, False), (True, False), (True, True)):
            n = args.iters + 10
            exits = cupy.zeros((n, 1), dtype=np.int64)
            starts = cupy.full((n, 1), np.iinfo(np.int64).max, dtype=np.int64)
            for i in range(n):
                gpu_sleep(args.sleep_us)
                barrier_then_stamp(bar, exits[i], starts[i], grid, threads, smem, programmatic, event_between)
            cupy.cuda.get_current_stream().synchronize()
            e = np.stack(group.comm.allgather(exits[10:, 0].get()))    # [R, iters]
            s = np.stack(group.comm.allgather(starts[10:, 0].get()))
            stats = {"exit_spread": e.max(0) - e.min(0), "start_spread": s.max(0) - s.min(0),
                     "last_start_after_last_exit": s.max(0) - e.max(0),
                     "start_after_own_exit": (s - e).reshape(-1)}
            r = {f"{k}_{q}_us": float(f(v)) * 1e-3 for k, v in stats.items()
                 for q, f in (("median", np.median), ("p99", lambda a: np.percentile(a, 99)))}
            out.write({"bench": "launch_skew", "ranks": group.local_size, "grid": grid, "threads": threads,
                       "smem": smem, "programmatic": programmatic,
                       "event_between": event_between, "n": args.iters, **r})


if __name__ == "__main__":
    main()
