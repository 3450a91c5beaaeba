"""Low-latency dispatch/combine benchmark.

    python -m cupyep.launch -n 8 experiments/bench_low_latency.py --out results/low_latency.jsonl

Shape: T tokens per rank (128, and 1), hidden 7168, top-8 of 256 experts with
some -1 slots, FP8 dispatch (plus BF16), BF16 combine. Every call is timed on
its own between GPU barriers that line the ranks up (CUDA events, L2 flushed
first), over --iters calls: median and p99 of the slowest rank. Also the send
and receive halves in hook mode, the buffer bytes per rank, and efficiency =
(2 x bytes written to peers by all ranks / copy bandwidth measured in this
run) / time.
"""
import argparse

import numpy as np

import cupyep
from cupyep.barrier import GpuBarrier
from cupyep.bench.copy import copy_bandwidth
from cupyep.bench.report import JsonlWriter
from cupyep.bench.timing import Timing, flush_l2, time_fn
from cupyep.testing import global_routing, payload_bf16


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/low_latency.jsonl")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--threads", type=int, default=512)
    args = p.parse_args()
    import cupy
    from mpi4py import MPI
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.local_size, group.local_rank
    copy_bw = group.comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    buf = cupyep.LowLatencyBuffer(group, args.max_tokens, args.hidden, args.experts, num_blocks=args.num_blocks,
                                  num_threads=args.threads)
    bar = GpuBarrier(group)
    H = args.hidden

    def slowest(t: Timing) -> dict:
        return {"median_us": group.comm.allreduce(t.median_s, op=MPI.MAX) * 1e6,
                "p99_us": group.comm.allreduce(t.p99_s, op=MPI.MAX) * 1e6, "n": t.n}

    for T in args.tokens:
        idx, w = global_routing(T, [T] * R, args.experts, args.topk)
        x = cupy.asarray(payload_bf16(me, np.arange(T), H))
        topk_idx, topk_w = cupy.asarray(idx[me]), cupy.asarray(w[me])
        pairs = int((idx[me] >= 0).sum())
        base = {"bench": "low_latency", "ranks": R, "tokens": T, "hidden": H, "topk": args.topk,
                "experts": args.experts, "max_tokens": args.max_tokens, "buffer_bytes": buf.num_bytes,
                "num_blocks": buf.num_blocks, "num_threads": buf.num_threads, "copy_GBps": copy_bw / 1e9}

        def record(kind, timing, bytes_to_peers, **extra):
            r = slowest(timing)
            total = group.comm.allreduce(bytes_to_peers)
            out.write({**base, "kind": kind, **r, "bytes_to_peers": total,
                       "efficiency": 2 * total / copy_bw / (r["median_us"] * 1e-6), **extra})

        for use_fp8 in (True, False):
            row = (H + H // 128 * 4 + 4) if use_fp8 else (2 * H + 4)
            fn = lambda: buf.dispatch(x, topk_idx, use_fp8=use_fp8, validate=False)
            record("dispatch_fp8" if use_fp8 else "dispatch_bf16",
                   time_fn(fn, iters=args.iters, warmup=10, before=bar), pairs * row)
        res = buf.dispatch(x, topk_idx, use_fp8=False, validate=False)
        y = res.recv_x.copy()
        fn = lambda: buf.combine(y, topk_idx, topk_w, res.handle)
        record("combine", time_fn(fn, iters=args.iters, warmup=10, before=bar), pairs * 2 * H)

        # Hook mode: the send half and the receive half, each timed alone.
        send_d, recv_d, send_c, recv_c = [], [], [], []
        for i in range(args.iters + 10):
            ev = [cupy.cuda.Event() for _ in range(8)]
            flush_l2()
            bar()
            ev[0].record()
            r = buf.dispatch(x, topk_idx, use_fp8=True, validate=False, return_recv_hook=True)
            ev[1].record()
            bar()
            ev[2].record()
            r.hook()
            ev[3].record()
            bar()
            ev[4].record()
            c = buf.combine(y, topk_idx, topk_w, r.handle, return_recv_hook=True)
            ev[5].record()
            bar()
            ev[6].record()
            c.hook()
            ev[7].record()
            ev[7].synchronize()
            if i >= 10:
                for lst, (a, b) in zip((send_d, recv_d, send_c, recv_c), ((0, 1), (2, 3), (4, 5), (6, 7))):
                    lst.append(cupy.cuda.get_elapsed_time(ev[a], ev[b]) * 1e-3)
        row = H + H // 128 * 4 + 4
        record("dispatch_fp8_send_half", Timing.from_samples(send_d), pairs * row)
        record("dispatch_fp8_recv_half", Timing.from_samples(recv_d), 0)
        record("combine_send_half", Timing.from_samples(send_c), pairs * 2 * H)
        record("combine_recv_half", Timing.from_samples(recv_c), 0)
    buf.synchronize()
    bar.destroy()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
