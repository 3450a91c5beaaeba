"""The naive baseline's dispatch/combine benchmark (cupyep/lab/bench/naive.py).

    python -m cupyep.launcher -n 8 experiments/bench_naive.py --out results/naive.jsonl

What a user writes without custom kernels: counts exchanged over MPI, rows
sorted by destination with CuPy, one cudaMemcpyAsync per peer into a
preallocated IPC staging buffer, stream sync + MPI barrier, then the
receiver's copy (dispatch) or the owner's FP32 scatter-add (combine).
Shapes: T tokens per rank (4096, 128 and 1), hidden 7168, top-8 of 256
experts, BF16 rows. Per call: median and p99 of the slowest rank (CUDA
events; before each call the L2 flushed, the stream synchronized and an MPI
barrier: the calls are host-synchronous, and a GPU barrier inside the events
would charge each rank for the other ranks' concurrent flushes), the host
wall time,
per-rank GB/s as the normal-mode benchmark counts it (received rows x row
bytes / time; combine counts the same bytes) and efficiency against the
copy bandwidth measured in this run. Records: "bench": "naive", "kind":
"dispatch" / "combine".
"""
import argparse

import numpy as np

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.copy import copy_bandwidth
from cupyep.lab.bench.naive import NaiveBuffer, naive_records
from cupyep.lab.bench.report import JsonlWriter
from cupyep.testing import global_routing, payload_bf16


def main():
    require_gpu(__file__)
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/naive.jsonl")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 128, 1])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    import cupy
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.local_size, group.local_rank
    copy_bw = group.comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    buf = NaiveBuffer(group, args.hidden)
    for T in args.tokens:
        # The same routing as the normal (seed 0 at T = 4096) and low-latency (seed T) benchmarks.
        idx, _ = global_routing(0 if T == 4096 else T, [T] * R, args.experts, args.topk)
        x = cupy.asarray(payload_bf16(me, np.arange(T), args.hidden))
        topk_idx = cupy.asarray(idx[me])
        for rec in naive_records(group, buf, x, topk_idx, args.experts, args.iters, copy_bw):
            out.write(rec)
    cupy.cuda.get_current_stream().synchronize()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
