"""Low-latency dispatch/combine benchmark.

    python -m cupyep.launch -n 8 experiments/bench_low_latency.py --out results/low_latency.jsonl

Shape: T tokens per rank (128, and 1), hidden 7168, top-8 of 256 experts with
some -1 slots, FP8 dispatch (plus BF16), BF16 combine. Every call is timed on
its own between GPU barriers that line the ranks up (CUDA events, L2 flushed
first, and a GPU sleep ahead of it so that the host has queued the call
before the GPU reaches it), over --iters calls: median and p99 of the slowest
rank. Two clocks: ``event_*`` spans the CUDA events around the call, which
under MPS includes the time the launch waits to be scheduled; ``kernel_*``
spans the kernel itself (first block start to last block end, %globaltimer
stamps the kernels write), which is what a profiler such as Kineto reports. Also the send
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
from cupyep.bench.timing import Timing, flush_l2, gpu_sleep, time_fn
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
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    p.add_argument("--sleep-us", type=float, default=400.0,
                   help="GPU sleep before each timed call, so host launch cost is not timed (0: time it)")
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

    def slowest(t: Timing, prefix: str) -> dict:
        return {f"{prefix}_median_us": group.comm.allreduce(t.median_s, op=MPI.MAX) * 1e6,
                f"{prefix}_p99_us": group.comm.allreduce(t.p99_s, op=MPI.MAX) * 1e6, "n": t.n}

    stamps = cupy.empty((args.iters + 10, 2), dtype=np.int64)

    def stamped(call):
        """fn() for time_fn: call i gets row i of `stamps` for its kernel times."""
        stamps[:, 0] = np.iinfo(np.int64).max
        stamps[:, 1] = 0
        state = {"i": 0}

        def fn():
            call(stamps[state["i"]])
            state["i"] += 1
        return fn

    def kernel_timing(first: int = 10) -> Timing:
        s = stamps[first:].get()
        return Timing.from_samples((s[:, 1] - s[:, 0]) * 1e-9)

    for T in args.tokens:
        idx, w = global_routing(T, [T] * R, args.experts, args.topk)
        x = cupy.asarray(payload_bf16(me, np.arange(T), H))
        topk_idx, topk_w = cupy.asarray(idx[me]), cupy.asarray(w[me])
        pairs = int((idx[me] >= 0).sum())
        base = {"bench": "low_latency", "ranks": R, "tokens": T, "hidden": H, "topk": args.topk,
                "experts": args.experts, "max_tokens": args.max_tokens, "buffer_bytes": buf.num_bytes,
                "num_blocks": buf.num_blocks, "num_threads": buf.num_threads, "copy_GBps": copy_bw / 1e9,
                "l2_flush": not args.no_flush}

        def record(kind, event: Timing, kernel: Timing, bytes_to_peers):
            r = {**slowest(event, "event"), **slowest(kernel, "kernel")}
            total = group.comm.allreduce(bytes_to_peers)
            out.write({**base, "kind": kind, **r, "bytes_to_peers": total,
                       "efficiency": 2 * total / copy_bw / (r["kernel_median_us"] * 1e-6)})

        def timed(call):
            fn = stamped(call)
            ev = time_fn(fn, iters=args.iters, warmup=10, flush=not args.no_flush, before=bar,
                         hide_launch_us=args.sleep_us)
            return ev, kernel_timing()

        for use_fp8 in (True, False):
            row = (H + H // 128 * 4 + 4 + 1) if use_fp8 else (2 * H + 4 + 1)
            ev, kt = timed(lambda t: buf.dispatch(x, topk_idx, use_fp8=use_fp8, validate=False, kernel_time_ns=t))
            record("dispatch_fp8" if use_fp8 else "dispatch_bf16", ev, kt, pairs * row)
        res = buf.dispatch(x, topk_idx, use_fp8=False, validate=False)
        y = res.recv_x.copy()
        ev, kt = timed(lambda t: buf.combine(y, topk_idx, topk_w, res.handle, kernel_time_ns=t))
        record("combine", ev, kt, pairs * 2 * H)

        # Hook mode: the send half and the receive half, each timed alone.
        halves = {k: ([], cupy.empty((args.iters + 10, 2), dtype=np.int64)) for k in ("ds", "dr", "cs", "cr")}
        for _, st in halves.values():
            st[:, 0] = np.iinfo(np.int64).max
            st[:, 1] = 0
        for i in range(args.iters + 10):
            ev = [cupy.cuda.Event() for _ in range(8)]
            if not args.no_flush:
                flush_l2()
            gpu_sleep(args.sleep_us)
            bar()
            ev[0].record()
            r = buf.dispatch(x, topk_idx, use_fp8=True, validate=False, return_recv_hook=True,
                             kernel_time_ns=halves["ds"][1][i])
            ev[1].record()
            gpu_sleep(args.sleep_us)
            bar()
            ev[2].record()
            r.hook(kernel_time_ns=halves["dr"][1][i])
            ev[3].record()
            gpu_sleep(args.sleep_us)
            bar()
            ev[4].record()
            c = buf.combine(y, topk_idx, topk_w, r.handle, return_recv_hook=True, kernel_time_ns=halves["cs"][1][i])
            ev[5].record()
            gpu_sleep(args.sleep_us)
            bar()
            ev[6].record()
            c.hook(kernel_time_ns=halves["cr"][1][i])
            ev[7].record()
            ev[7].synchronize()
            if i >= 10:
                for (lst, _), (a, b) in zip(halves.values(), ((0, 1), (2, 3), (4, 5), (6, 7))):
                    lst.append(cupy.cuda.get_elapsed_time(ev[a], ev[b]) * 1e-3)
        row = H + H // 128 * 4 + 4 + 1
        for key, kind, nbytes in (("ds", "dispatch_fp8_send_half", pairs * row), ("dr", "dispatch_fp8_recv_half", 0),
                                  ("cs", "combine_send_half", pairs * 2 * H), ("cr", "combine_recv_half", 0)):
            lst, st = halves[key]
            s_ = st[10:].get()
            record(kind, Timing.from_samples(lst), Timing.from_samples((s_[:, 1] - s_[:, 0]) * 1e-9), nbytes)
    buf.synchronize()
    bar.destroy()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
