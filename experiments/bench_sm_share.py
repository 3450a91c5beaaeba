"""Does a rank's work set its time when ranks share one GPU? Rows against
time per rank, with and without each rank's compute on a share of the SMs of
its own (cupyep.sm_partition).

    python -m cupyep.launcher -n 8 --sm-share experiments/bench_sm_share.py --out results/sm_share/sm_share.jsonl
    python -m cupyep.launcher -n 8 experiments/bench_sm_share.py --out results/sm_share/sm_share.jsonl

Rank r gets ``rows * (1 + r / (R - 1))`` rows (1x to 2x), like ranks that
receive skewed shares of the experts' (row, expert) pairs. All ranks start
together (a host barrier after a device sync) and each times, with events
on its compute stream (its SM partition under ``--sm-share``, else the
current stream), the two kinds of work a rank does per received row:

- ``copy``: moving its rows (``[rows, H]`` BF16 read and written), which is
  bound by the HBM that every rank on the GPU shares;
- ``ffn``: the expert FFN ``silu(x @ w1) @ w2`` in float32 over its rows
  (``[rows, H] x [H, F]``, then ``[rows, F] x [F, H]``), bound by the SMs.

Per kind, rank 0 writes one record: each rank's rows and median time over
``--iters``, the SMs its compute runs on (its partition's, else the GPU's), and the least-squares slope of time
against rows with ``time_ratio`` (the 2x rank's time over the 1x rank's):
about 2.0 is what ranks on GPUs of their own would show.
"""
import argparse

import numpy as np

import cupyep
from cupyep import sm_partition
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import JsonlWriter


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/sm_share/sm_share.jsonl")
    p.add_argument("--rows", type=int, default=16384, help="the lightest rank's rows")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    require_gpu(__file__)
    import cupy
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    stream = sm_partition.compute_stream(group)
    sms = sm_partition.partition_stream(group)[1] if stream is not None else group.num_sms
    stream = stream or cupy.cuda.get_current_stream()
    R, me = group.world_size, group.rank
    rows = int(args.rows * (1 + me / max(1, R - 1)))
    rng = np.random.default_rng(me)
    src = cupy.asarray(rng.integers(0, 1 << 14, (rows, args.hidden), dtype=np.uint16))
    dst = cupy.empty_like(src)
    x = cupy.asarray(rng.standard_normal((rows, args.hidden), dtype=np.float32))
    w1 = cupy.asarray(rng.standard_normal((args.hidden, args.ffn), dtype=np.float32)) * 0.02
    w2 = cupy.asarray(rng.standard_normal((args.ffn, args.hidden), dtype=np.float32)) * 0.02

    def ffn():
        h = x @ w1
        h /= 1 + cupy.exp(-h)
        return h @ w2

    def copy():
        dst[...] = src

    for kind, fn in (("copy", copy), ("ffn", ffn)):
        times = []
        for it in range(args.iters + 2):
            stream.synchronize()
            group.comm.Barrier()
            with stream:
                start = stream.record()
                fn()
                end = stream.record()
            end.synchronize()
            if it >= 2:
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        mine = {"rows": rows, "us": float(np.median(times)), "spread_us": [float(np.min(times)), float(np.max(times))]}
        per_rank = group.comm.gather(mine, root=0)
        if me == 0:
            r = np.array([m["rows"] for m in per_rank], dtype=float)
            t = np.array([m["us"] for m in per_rank])
            slope, intercept = np.polyfit(r, t, 1) if R > 1 else (float("nan"), float("nan"))
            out.write({"bench": "sm_share", "kind": kind, "ranks": R, "sm_share": sm_partition.requested(),
                       "sms": sms, "hidden": args.hidden, "ffn": args.ffn,
                       "rows": r.astype(int).tolist(), "us": [round(v, 1) for v in t],
                       "spread_us": [[round(a, 1), round(b, 1)] for a, b in (m["spread_us"] for m in per_rank)],
                       "us_per_krow": round(float(slope) * 1e3, 2), "intercept_us": round(float(intercept), 1),
                       "time_ratio": round(float(t[-1] / t[0]), 3) if R > 1 else None,
                       "rows_ratio": round(float(r[-1] / r[0]), 3) if R > 1 else None})
    group.destroy()


if __name__ == "__main__":
    main()
