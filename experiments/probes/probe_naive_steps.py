"""Where the naive baseline's time goes at small T: host time of each step of
:meth:`cupyep.lab.bench.naive.NaiveBuffer.combine` and ``dispatch``.

    python -m cupyep.launcher -n 8 experiments/probes/probe_naive_steps.py --out results/naive_steps.jsonl

Per T and kind, ``--iters`` calls; each call starts after a host MPI barrier.
The steps of the combine are replayed here with a ``perf_counter`` stamp
after each (no extra synchronisation: a step's host time is what the host
spends issuing it, and the two waits, ``sync`` and ``barrier``, absorb the
GPU's time and the other ranks'). The whole calls are also timed unchanged,
host-side (``wall``) and with the benchmark's own ``time_fn`` (``event``,
L2 flushed, GPU barrier before each call), so the sum of the steps can be
checked against them. One record per (T, kind, rank group statistic):
medians over calls of each step, max over ranks, in microseconds.
"""
import argparse
import time

import numpy as np

import cupyep
from cupyep.barrier import GpuBarrier
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import JsonlWriter
from cupyep.lab.bench.timing import time_fn
from cupyep.lab.bench.naive import NaiveBuffer
from cupyep.testing import global_routing, payload_bf16


def combine_steps(buf, y, handle):
    """NaiveBuffer.combine with a perf_counter stamp after each step; returns
    (combined_x, {step: seconds})."""
    import cupy
    t = [time.perf_counter()]
    names = []

    def mark(name):
        t.append(time.perf_counter())
        names.append(name)

    g = buf.group
    R, me = g.local_size, g.local_rank
    C = handle.counts
    stream = cupy.cuda.get_current_stream()
    region = buf._combine_calls % 2
    buf._combine_calls += 1
    y = cupy.ascontiguousarray(y)
    recv_off = np.cumsum(C[:, me]) - C[:, me]
    back_to = np.cumsum(C, axis=1) - C
    mark("prep")
    peers, base = buf.buffer.peer_ptr_list, buf.offsets["combine"][region]
    for s in range(R):
        buf._copy(peers[s] + base + int(back_to[s, me]) * buf.row_bytes,
                  y.data.ptr + int(recv_off[s]) * buf.row_bytes, int(C[s, me]) * buf.row_bytes, stream)
    mark("copies")
    stream.synchronize()
    mark("sync")
    g.node_comm.Barrier()
    mark("barrier")
    combined_x = cupy.zeros((handle.num_tokens, buf.hidden), dtype=np.float32)
    mark("zeros")
    n_back = int(C[me].sum())
    rows = buf._staging(buf.offsets["combine"][region], (n_back, buf.hidden))
    values = cupy.left_shift(rows, 16, dtype=np.uint32).view(np.float32)
    mark("widen")
    cupy.add.at(combined_x, handle.send_token, values)
    mark("add_at")
    stream.synchronize()
    mark("final_sync")
    return combined_x, {n: t[i + 1] - t[i] for i, n in enumerate(names)}


def main():
    require_gpu(__file__)
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/naive_steps.jsonl")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    import cupy
    from mpi4py import MPI
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.local_size, group.local_rank
    bar = GpuBarrier(group)
    buf = NaiveBuffer(group, args.hidden)
    comm = group.node_comm
    stream = cupy.cuda.get_current_stream()
    for T in args.tokens:
        idx, _ = global_routing(T, [T] * R, args.experts, args.topk)
        x = cupy.asarray(payload_bf16(me, np.arange(T), args.hidden))
        topk_idx = cupy.asarray(idx[me])
        d = buf.dispatch(x, topk_idx, args.experts)
        y, h = d.recv_x, d.handle
        ref = buf.combine(y, h)
        steps, walls = [], {"combine": [], "dispatch": []}
        for i in range(args.iters + 5):
            comm.Barrier()
            cx, st = combine_steps(buf, y, h)
            if i >= 5:
                steps.append(st)
        assert bool(cupy.array_equal(cx, ref)), "replayed combine differs from NaiveBuffer.combine"
        for kind, fn in (("combine", lambda: buf.combine(y, h)),
                         ("dispatch", lambda: buf.dispatch(x, topk_idx, args.experts))):
            for i in range(args.iters + 5):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                stream.synchronize()
                if i >= 5:
                    walls[kind].append(time.perf_counter() - t0)
        rec = {"bench": "naive_steps", "ranks": R, "tokens": T, "hidden": args.hidden, "iters": args.iters}
        for name in steps[0]:
            med = float(np.median([s[name] for s in steps])) * 1e6
            rec[f"combine_{name}_us"] = comm.allreduce(med, op=MPI.MAX)
        rec["combine_steps_sum_us"] = comm.allreduce(
            float(np.median([sum(s.values()) for s in steps])) * 1e6, op=MPI.MAX)
        for kind in walls:
            rec[f"{kind}_wall_us"] = comm.allreduce(float(np.median(walls[kind])) * 1e6, op=MPI.MAX)
            t = time_fn((lambda: buf.combine(y, h)) if kind == "combine"
                        else (lambda: buf.dispatch(x, topk_idx, args.experts)),
                        iters=args.iters, warmup=3, before=bar)
            rec[f"{kind}_event_us"] = comm.allreduce(t.median_s * 1e6, op=MPI.MAX)
            t = time_fn((lambda: buf.combine(y, h)) if kind == "combine"
                        else (lambda: buf.dispatch(x, topk_idx, args.experts)),
                        iters=args.iters, warmup=3, before=bar, flush=False)
            rec[f"{kind}_event_noflush_us"] = comm.allreduce(t.median_s * 1e6, op=MPI.MAX)
        out.write(rec)
    stream.synchronize()
    buf.destroy()
    bar.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
