"""The floor under a low-latency call on this machine, and what each part of
a one-token call's own work adds to it (cupyep.lab.bench.floor).

    python -m cupyep.launcher -n 8 experiments/probes/probe_ll_floor.py --out floor_8ranks_1.jsonl

Each kind is a grid that runs only the low-latency flag protocol (every
block arrives on every peer's flag, every block waits for every peer's),
timed as the low-latency benchmark times its calls (L2 flush, GPU sleep, the
GPU barrier, a programmatic launch; strict boundary, kernel clock of the
slowest rank), alone and after: dependent global loads, block barriers,
eight rows of 7 KiB stored to the peers from one block (a one-token FP8
dispatch's rows), or all three; or straight-line code of 16 or 64 KiB,
run once or twice: the first run fetches the code, the second finds it in
the instruction cache, so the difference is what a cold code path costs.
"""
import argparse

import cupyep
from cupyep.barrier import gpu_barrier
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.floor import Floor
from cupyep.lab.bench.low_latency import strict_record
from cupyep.lab.bench.report import JsonlWriter
from cupyep.lab.bench.stamps import one_timer
from cupyep.lab.bench.timing import FLUSH_MODES, timed_rounds

KINDS = {
    "protocol": {},
    "loads_4": {"loads": 4},
    "barriers_8": {"barriers": 8},
    "rows_8": {"rows": 8},
    "loads_barriers_rows": {"loads": 4, "barriers": 8, "rows": 8},
    "code_16k": {"code_kib": 16},
    "code_16k_twice": {"code_kib": 16, "passes": 2},
    "code_64k": {"code_kib": 64},
    "code_64k_twice": {"code_kib": 64, "passes": 2},
}


def main():
    require_gpu(__file__)
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/ll_floor.jsonl")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--grids", type=int, nargs="+", default=[16, 1], help="blocks per rank")
    p.add_argument("--threads", type=int, default=512)
    p.add_argument("--flush", choices=FLUSH_MODES, default="write")
    p.add_argument("--sleep-us", type=float, default=400.0)
    args = p.parse_args()
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    bar = gpu_barrier(group)
    floor = Floor(group)
    calls = [0]  # every rank launches the same calls in the same order: their flags agree

    for grid in args.grids:
        for kind, work in KINDS.items():
            def call(i, st, grid=grid, work=work):
                floor.call(calls[0], st, grid=grid, threads=args.threads, **work)
                calls[0] += 1

            (timed,) = timed_rounds([call], args.iters, 10, args.flush, args.sleep_us, before=bar)
            floor.check()
            base = {"bench": "ll_floor", "ranks": group.local_size, "grid": grid, "threads": args.threads,
                    "l2_flush": args.flush, "timing": "strict", **work}
            out.write(strict_record(group.comm, base, kind, timed, 0, None, one_timer(group)))
    floor.destroy()
    bar.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
