"""Low-latency dispatch/combine benchmark.

    python -m cupyep.launch -n 8 experiments/bench_low_latency.py --out results/low_latency.jsonl

Shape: T tokens per rank (128, and 1), hidden 7168, top-8 of 256 experts with
some -1 slots, FP8 dispatch (plus BF16), BF16 combine. Calls alternate
dispatch, combine as in a decode loop, and every call is timed on its own
right after a GPU barrier that lines the ranks up (L2 flushed first, and a
GPU sleep ahead of it so that the host has queued the call before the GPU
reaches it), over --iters calls: median and p99 of the slowest rank. Two
clocks: ``event_*`` spans CUDA events around the barrier and the call, which
under MPS includes the time the launch waits to be scheduled; ``kernel_*``
spans the kernel itself (first block start to last block end, %globaltimer
stamps the kernels write), which is what a profiler such as Kineto reports.
The kernels are launched as programmatic dependents (unless --plain-launch),
so they are resident before the barrier ends and start counting when it does. When all ranks share one GPU (and so one
%globaltimer), the stamps also give the ranks' start skew and
``after_last_start``, the call's latency once the last rank has started.
The default combine pushes the rows ("combine"; "combine_pull": the expert
ranks copy them into their own buffers and the owners pull them); the
zero-copy combine pulls by default ("combine_zero_copy";
"combine_zero_copy_push"). Also the send and receive halves in hook mode,
the buffer bytes per rank, and efficiency = (2 x bytes moved between ranks
by all ranks, written into peers or, for pulling combines, read from them /
copy bandwidth measured in this run) / time. With ``--trace N``, N more calls of
each kind record when every block reached each mark (kernels.TRACE_MARKS),
summarised as when the first and the last rank got there. ``--scatter-probe``
adds the bare row scatter (cupyep/bench/scatter.py) over the same arrays.

``--timing both`` (the default; ``strict`` leaves it out) also times on DeepEP's own
boundary (its bench_kineto and test_low_latency): a GPU sleep (its large
GEMM) and a barrier ahead of a period, so that every host has queued its
calls before the GPU reaches them, then --deepep-iters calls back to back with no flush or barrier
between them, a warm-up period first; single calls as dispatch then combine;
hook mode as send half, a host-side gap (--host-gap-ms; DeepEP computes a
GEMM on the CPU there), receive half, for dispatch and then combine, so the
GPU is idle between the halves and L2 keeps what the send half wrote (a
host barrier after the gap stands for the CPU GEMM taking about as long on
every rank, so no receive half starts before every send half is out). Each
rank's kernel durations (stamps, as above); records carry "timing":
"deepep", the slowest rank's median as ``kernel_median_us`` and the mean
over ranks of each rank's median and mean (``kernel_rank_median_mean_us``,
``kernel_rank_mean_mean_us``: DeepEP averages each rank's calls).
"""
import argparse
import time

import numpy as np

import cupyep
from cupyep.bench import require_gpu
from cupyep.barrier import GpuBarrier
from cupyep.bench.copy import copy_bandwidth
from cupyep.bench.report import JsonlWriter
from cupyep.bench.scatter import pattern_rows, scatter
from cupyep.bench.stamps import cross_rank, kernel_seconds, new_kernel_stamps, trace_marks
from cupyep.bench.timing import FLUSH_MODES, Timing, gpu_sleep, timed_rounds
from cupyep.low_latency import kernels as K
from cupyep.low_latency.kernels import NUM_TRACE_SLOTS, TRACE_MARKS
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
    p.add_argument("--num-waiters", type=int, default=None)
    p.add_argument("--threads", type=int, default=512)
    p.add_argument("--flush", choices=FLUSH_MODES, default="write",
                   help="how L2 is flushed before each timed call (timing.flush_l2)")
    p.add_argument("--back-to-back", action="store_true",
                   help="also time dispatch/combine pairs issued back to back, with no flush or barrier between calls")
    p.add_argument("--no-hook", action="store_true", help="skip the hook-mode halves")
    p.add_argument("--ablate", nargs="+", default=[], choices=sorted(K.ABLATIONS),
                   help="also time dispatch/combine in decode order with each of these parts of the work "
                        "skipped (LowLatencyBuffer.ablate; profiling only, results are wrong)")
    p.add_argument("--scatter-probe", action="store_true",
                   help="also time the bare scatter kernel (cupyep/bench/scatter.py) moving the same rows between "
                        "the same arrays: BF16 dispatch rows into recv_x, combine rows into combine_recv")
    p.add_argument("--zero-copy", action="store_true",
                   help="also time zero-copy combines, pulling and pushing (combine(..., zero_copy=True, pull=...))")
    p.add_argument("--plain-launch", action="store_true",
                   help="launch the kernels plainly (LowLatencyBuffer(programmatic_launch=False)); by default "
                        "they are programmatic dependents where the GPU supports it, resident while the GPU "
                        "barrier ahead of each timed call runs, so kernel_* counts from the barrier's end")
    p.add_argument("--trace", type=int, default=0, help="calls of each kind to trace per block and mark")
    p.add_argument("--timing", choices=("strict", "both"), default="both",
                   help="strict: each call on its own after a flush and a barrier (slowest rank); "
                        "both: also on DeepEP's boundary, calls back to back (see the module docstring)")
    p.add_argument("--deepep-iters", type=int, default=30, help="calls per period on DeepEP's boundary")
    p.add_argument("--host-gap-ms", type=float, default=2.0,
                   help="host-side gap between a hook call's send and receive halves on DeepEP's boundary")
    p.add_argument("--sleep-us", type=float, default=400.0,
                   help="GPU sleep before each timed call, so host launch cost is not timed (0: time it)")
    args = p.parse_args()
    require_gpu(__file__)
    import cupy
    from mpi4py import MPI
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.local_size, group.local_rank
    copy_bw = group.comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    buf = cupyep.LowLatencyBuffer(group, args.max_tokens, args.hidden, args.experts, num_blocks=args.num_blocks,
                                  num_waiters=args.num_waiters, num_threads=args.threads,
                                  programmatic_launch=False if args.plain_launch else None)
    bar = GpuBarrier(group)
    H, warmup = args.hidden, 10

    def steps(calls, iters):
        """Each call (call(i, stamp_row)) on its own, lined up across ranks by the GPU barrier."""
        return timed_rounds(calls, iters, warmup, args.flush, args.sleep_us, before=bar)

    for T in args.tokens:
        idx, w = global_routing(T, [T] * R, args.experts, args.topk)
        x = cupy.asarray(payload_bf16(me, np.arange(T), H))
        topk_idx, topk_w = cupy.asarray(idx[me]), cupy.asarray(w[me])
        pairs = int((idx[me] >= 0).sum())
        base = {"bench": "low_latency", "ranks": R, "tokens": T, "hidden": H, "topk": args.topk,
                "experts": args.experts, "max_tokens": args.max_tokens, "buffer_bytes": buf.num_bytes,
                "num_blocks": buf.num_blocks, "num_waiters": buf.num_waiters, "num_threads": buf.num_threads, "copy_GBps": copy_bw / 1e9,
                "l2_flush": args.flush, "programmatic_launch": buf.programmatic_launch, "timing": "strict"}
        fp8_row, bf16_row = H + H // 128 * 4 + 4 + 1, 2 * H + 4 + 1

        def record(kind, timed, bytes_to_peers):
            event, stamps = timed
            everyone = np.stack(group.comm.allgather(stamps))          # [R, iters, 2]
            kernel = Timing.from_samples(kernel_seconds(stamps))
            r = {f"{c}_{q}_us": group.comm.allreduce(getattr(t, f"{q}_s"), op=MPI.MAX) * 1e6
                 for c, t in (("event", event), ("kernel", kernel)) for q in ("median", "p99")}
            if group.ranks_per_gpu == R:  # %globaltimer is per GPU: cross-rank stamps only on one GPU
                for name, v in cross_rank(everyone).items():
                    r.update({f"{name}_{q}": x_ for q, x_ in v.items()})
            total = group.comm.allreduce(bytes_to_peers)
            out.write({**base, "kind": kind, **r, "n": event.n, "bytes_to_peers": total,
                       "efficiency": 2 * total / copy_bw / (r["kernel_median_us"] * 1e-6)})

        pending = {}

        def dispatch(use_fp8):
            def call(i, st, **more):
                pending["d"] = buf.dispatch(x, topk_idx, use_fp8=use_fp8, validate=False, kernel_time_ns=st, **more)
            return call

        def combine(i, st, **kw):
            return buf.combine(y, topk_idx, topk_w, pending["d"].handle, kernel_time_ns=st, **kw)

        d_fp8 = dispatch(True)

        # Identity expert outputs in the dispatch's row layout (the same for FP8 and BF16).
        y = buf.dispatch(x, topk_idx, use_fp8=False, validate=False).recv_x.copy()
        # Calls alternate dispatch, combine as in a decode loop (each timed on its own), so each
        # kind writes the data copy it wrote last time (layout.CallSchedule).
        # "combine" is the default, pushing combine; "combine_pull" copies, then the owners pull.
        for use_fp8 in (True, False):
            timed_d, timed_c = steps([dispatch(use_fp8), combine], args.iters)
            record("dispatch_fp8" if use_fp8 else "dispatch_bf16", timed_d, pairs * (fp8_row if use_fp8 else bf16_row))
            if use_fp8:
                record("combine", timed_c, pairs * 2 * H)
        timed_d, timed_c = steps([d_fp8, lambda i, st: combine(i, st, pull=True)], args.iters)
        record("combine_pull", timed_c, pairs * 2 * H)

        if args.zero_copy:
            # Zero-copy combines, the owners pulling the rows (default) or the expert ranks pushing them. In
            # decode order every combine uses one data copy, so its buffer is filled once.
            d0 = buf.dispatch(x, topk_idx, use_fp8=True, validate=False)
            buf.get_next_combine_buffer(d0.handle)[...] = y
            for pull in (True, False):
                def zc(i, st, pull=pull):
                    return buf.combine(None, topk_idx, topk_w, pending["d"].handle, zero_copy=True, pull=pull,
                                       kernel_time_ns=st)
                timed_d, timed_c = steps([d_fp8, zc], args.iters)
                record("combine_zero_copy" if pull else "combine_zero_copy_push", timed_c, pairs * 2 * H)

        for name in args.ablate:
            # The same calls with one part of the work skipped: what that part costs.
            buf.ablate = K.ablation_bits([name])
            timed_d, timed_c = steps([d_fp8, combine], args.iters)
            buf.ablate = 0
            record(f"dispatch_fp8_ablate_{name}", timed_d, pairs * fp8_row)
            # The combine skips rows itself under "rows"; otherwise it runs whole, after the lighter dispatch.
            record(f"combine_ablate_{name}" if name == "rows" else f"combine_after_ablate_{name}", timed_c,
                   pairs * 2 * H)

        if args.scatter_probe:
            # The data movement alone, from the same arrays into this buffer: what the kernels
            # would take if rows were all they moved. Combine rows also into the two copies in
            # turn, as calls of one kind back to back would.
            s0, s1 = buf.layout.sets
            cases = (("scatter_dispatch_rows_bf16", "dispatch_expert_major", x, (s0.recv_x,)),
                     ("scatter_combine_rows", "combine_slot_token", y, (s0.combine_recv,)),
                     ("scatter_combine_rows_both_copies", "combine_slot_token", y, (s0.combine_recv, s1.combine_recv)))
            for kind, pattern, src, offsets in cases:
                rows = [cupy.asarray(a) for a in pattern_rows(pattern, idx, me, args.experts, args.max_tokens)]

                def probe(i, st, rows=rows, src=src, offsets=offsets):
                    scatter(buf.buffer.peer_ptrs.data.ptr, offsets[i % len(offsets)], src, *rows, 2 * H, st,
                            buf.num_blocks, group)

                (timed,) = steps([probe], args.iters)
                record(kind, timed, int(rows[0].size) * 2 * H)
            # Decode order with the bare scatter: FP8-sized dispatch rows, then BF16 combine
            # rows, in turn, for the current layouts and for layouts that touch fewer pages;
            # then the current layouts plus, one at a time, what the kernels do besides rows
            # (per-row source/slot tags into recv_src / recv_slot, the kernels' dynamic
            # shared memory).
            d_smem = K.dispatch_smem(T, buf.num_blocks, args.topk, args.experts).bytes
            c_smem = K.combine_smem(args.experts)
            rows_total = buf.num_local_experts * buf.layout.slots
            pairs_ = (("current", "dispatch_expert_major", "combine_slot_token", False, False),
                      ("source_major", "dispatch_source_major", "combine_slot_token", False, False),
                      ("slot_major", "dispatch_slot_major", "combine_slot_token", False, False),
                      ("packed", "dispatch_packed", "combine_packed_src", False, False),
                      ("current_tags", "dispatch_expert_major", "combine_slot_token", True, False),
                      ("current_smem", "dispatch_expert_major", "combine_slot_token", False, True),
                      ("current_tags_smem", "dispatch_expert_major", "combine_slot_token", True, True))
            for name, dpat, cpat, tags, smem in pairs_:
                rows_d = [cupy.asarray(a) for a in pattern_rows(dpat, idx, me, args.experts, args.max_tokens)]
                rows_c = [cupy.asarray(a) for a in pattern_rows(cpat, idx, me, args.experts, args.max_tokens)]
                meta = dict(meta_offset=s0.combine_send, meta_rows=rows_total) if tags else {}  # a region the probes leave free

                def probe_d(i, st, rows=rows_d, meta=meta, sm=d_smem if smem else 0):
                    scatter(buf.buffer.peer_ptrs.data.ptr, s0.recv_x, x, *rows, H, st, buf.num_blocks, group,
                            smem_bytes=sm, **meta)

                def probe_c(i, st, rows=rows_c, sm=c_smem if smem else 0):
                    scatter(buf.buffer.peer_ptrs.data.ptr, s0.combine_recv, y, *rows, 2 * H, st, buf.num_blocks,
                            group, smem_bytes=sm)

                t_d, t_c = steps([probe_d, probe_c], args.iters)
                record(f"scatter_in_turn_{name}_dispatch_fp8_rows", t_d, int(rows_d[0].size) * H)
                record(f"scatter_in_turn_{name}_combine_rows", t_c, int(rows_c[0].size) * 2 * H)
                if name == "current":
                    # Each kernel in turn with the other kind's bare rows: whether a kernel's
                    # extra time is its own or comes from what the call before it left.
                    t_d, t_c = steps([d_fp8, probe_c], args.iters)
                    record("cross_dispatch_fp8_kernel", t_d, pairs * fp8_row)
                    record("cross_combine_rows_after_kernel", t_c, int(rows_c[0].size) * 2 * H)
                    t_d, t_c = steps([probe_d, combine], args.iters)
                    record("cross_dispatch_fp8_rows_before_kernel", t_d, int(rows_d[0].size) * H)
                    record("cross_combine_kernel_after_rows", t_c, pairs * 2 * H)

        if args.back_to_back:
            # Steady state: pairs of calls queued behind one sleep and barrier per round of
            # 20, so the GPU runs them back to back as a decode loop would.
            rounds, per = max(1, args.iters // 20), 20
            st_d, st_c = new_kernel_stamps(rounds * per), new_kernel_stamps(rounds * per)
            for r_ in range(rounds + 1):  # round 0 warms up
                gpu_sleep(args.sleep_us * 10)
                bar()
                for i in range(per):
                    row = (r_ - 1) * per + i
                    d = buf.dispatch(x, topk_idx, use_fp8=True, validate=False,
                                     kernel_time_ns=st_d[row] if r_ else None)
                    buf.combine(y, topk_idx, topk_w, d.handle, kernel_time_ns=st_c[row] if r_ else None)
            buf.synchronize()
            for kind, st, nbytes in (("dispatch_fp8_back_to_back", st_d, pairs * fp8_row),
                                     ("combine_back_to_back", st_c, pairs * 2 * H)):
                s_ = st.get()
                record(kind, (Timing.from_samples(kernel_seconds(s_)), s_), nbytes)

        if args.timing == "both":
            # DeepEP's boundary: a barrier per period, then calls back to back, each rank's own times.
            n, gap = args.deepep_iters, args.host_gap_ms * 1e-3

            def record_deepep(kind, st, nbytes):
                dur = kernel_seconds(st.get())
                meds = group.comm.allgather(float(np.median(dur)))
                means = group.comm.allgather(float(np.mean(dur)))
                total = group.comm.allreduce(nbytes)
                out.write({**base, "kind": kind, "timing": "deepep", "n": n, "host_gap_ms": args.host_gap_ms,
                           "kernel_median_us": max(meds) * 1e6, "kernel_rank_median_mean_us": np.mean(meds) * 1e6,
                           "kernel_rank_mean_mean_us": np.mean(means) * 1e6,
                           "kernel_rank_medians_us": [m * 1e6 for m in meds], "bytes_to_peers": total,
                           "efficiency": 2 * total / copy_bw / max(meds)})

            def period(body, names):
                stamps = {k: new_kernel_stamps(n) for k in names}
                for live in (False, True):  # a warm-up period, then the recorded one
                    # bench_kineto's large GEMM and all-reduce: the GPU is busy while every host
                    # queues its calls, then the ranks start together.
                    buf.synchronize()
                    group.comm.Barrier()
                    gpu_sleep(args.sleep_us * n)
                    bar()
                    for i in range(n):
                        body(lambda k: stamps[k][i] if live else None)
                buf.synchronize()
                return stamps

            def single(st):
                d = buf.dispatch(x, topk_idx, use_fp8=True, validate=False, kernel_time_ns=st("d"))
                buf.combine(y, topk_idx, topk_w, d.handle, kernel_time_ns=st("c"))

            def gap_then_align():
                # The work between the halves (DeepEP: a GEMM on the CPU, about as long on every
                # rank): every send half is out before any rank starts its receive half.
                time.sleep(gap)
                group.comm.Barrier()

            def hooked(st):
                d = buf.dispatch(x, topk_idx, use_fp8=True, validate=False, return_recv_hook=True,
                                 kernel_time_ns=st("ds"))
                gap_then_align()
                d.hook(kernel_time_ns=st("dr"))
                c = buf.combine(y, topk_idx, topk_w, d.handle, return_recv_hook=True, kernel_time_ns=st("cs"))
                gap_then_align()
                c.hook(kernel_time_ns=st("cr"))

            st = period(single, ("d", "c"))
            record_deepep("dispatch_fp8", st["d"], pairs * fp8_row)
            record_deepep("combine", st["c"], pairs * 2 * H)
            if not args.no_hook:
                st = period(hooked, ("ds", "dr", "cs", "cr"))
                for key, kind, nbytes in (("ds", "dispatch_fp8_send_half", pairs * fp8_row),
                                          ("dr", "dispatch_fp8_recv_half", 0),
                                          ("cs", "combine_send_half", pairs * 2 * H), ("cr", "combine_recv_half", 0)):
                    record_deepep(kind, st[key], nbytes)

        if not args.no_hook:
            # Hook mode: the send half and the receive half, each timed alone.
            def cs(i, st):
                pending["c"] = combine(i, st, return_recv_hook=True)

            halves = steps([lambda i, st: d_fp8(i, st, return_recv_hook=True),
                            lambda i, st: pending["d"].hook(kernel_time_ns=st),
                            cs, lambda i, st: pending["c"].hook(kernel_time_ns=st)], args.iters)
            for kind, timed, nbytes in zip(("dispatch_fp8_send_half", "dispatch_fp8_recv_half",
                                            "combine_send_half", "combine_recv_half"), halves,
                                           (pairs * fp8_row, 0, pairs * 2 * H, 0)):
                record(kind, timed, nbytes)

        if args.trace:
            G = buf.num_blocks
            traces = {k: cupy.zeros((warmup + args.trace, G, NUM_TRACE_SLOTS), dtype=np.int64)
                      for k in ("dispatch_fp8", "combine")}
            steps([lambda i, st: d_fp8(i, st, trace=traces["dispatch_fp8"][i]),
                   lambda i, st: combine(i, st, trace=traces["combine"][i])], args.trace)
            for kind, tr in traces.items():
                everyone = np.stack(group.comm.allgather(tr[warmup:].get()))  # [R, n, G, M]
                out.write({**base, "kind": f"{kind}_trace", "n": args.trace,
                           "marks": trace_marks(everyone, TRACE_MARKS)})
    buf.synchronize()
    bar.destroy()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
