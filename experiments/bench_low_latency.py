"""Low-latency dispatch/combine benchmark.

    python -m cupyep.launcher -n 8 experiments/bench_low_latency.py --out results/low_latency.jsonl

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
``--partial`` adds the partial combine ("combine_partial", and its halves
"combine_partial_send_half" / "combine_partial_recv_half"): the dispatch
carries the weights and each expert rank returns one row per (token, expert
rank); its bytes to peers count those rows. It also adds that combine with
its partial rows in LogFMT-10 ("combine_partial_logfmt", and halves), and
``--logfmt`` the per-slot LogFMT-10 combine ("combine_logfmt").
The default combine pushes the rows ("combine"; "combine_pull": the expert
ranks copy them into their own buffers and the owners pull them); the
zero-copy combine pulls by default ("combine_zero_copy";
"combine_zero_copy_push"). Also the send and receive halves in hook mode,
the buffer bytes per rank, and efficiency = (2 x bytes moved between ranks
by all ranks, written into peers or, for pulling combines, read from them /
copy bandwidth measured in this run) / time. With ``--trace N``, N more calls of
each kind (the partial combine too, with ``--partial``) record when every
block reached each mark (kernels.TRACE_MARKS), summarised as when the first
and the last rank got there. ``--scatter-probe``
adds the bare row scatter (cupyep/lab/bench/scatter.py) over the same arrays.
``--num-blocks N [N ...]`` runs everything once per block count (a buffer
each); with several, rank 0 also times the copy kernel on R x N blocks
("copy_probe" records) and every record with an efficiency gets
"copy_same_sms_GBps" and "of_copy_same_sms", its fraction of that probe.

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

The rounds of calls, both boundaries and the records are
cupyep/lab/bench/low_latency.py's (``Session``), which the "low_latency" sweep
study also times with (``python -m cupyep.lab.experiments low_latency``).
"""
import argparse

import numpy as np

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.barrier import gpu_barrier
from cupyep.low_latency import ranks_of
from cupyep.lab.bench.copy import against_copy, copy_bandwidth, probe_on_rank0
from cupyep.lab.bench.low_latency import WARMUP, Session
from cupyep.lab.bench.report import JsonlWriter
from cupyep.lab.bench.scatter import pattern_rows, scatter
from cupyep.lab.bench.stamps import kernel_seconds, new_kernel_stamps, trace_marks
from cupyep.lab.bench.timing import FLUSH_MODES, Timing, gpu_sleep
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
    p.add_argument("--num-blocks", type=int, nargs="+", default=[None],
                   help="blocks per rank (default: the rank's share of the SMs); several values run everything "
                        "once per value, each record also against the copy kernel on as many SMs")
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
                   help="also time the bare scatter kernel (cupyep/lab/bench/scatter.py) moving the same rows between "
                        "the same arrays: BF16 dispatch rows into recv_x, combine rows into combine_recv")
    p.add_argument("--zero-copy", action="store_true",
                   help="also time zero-copy combines, pulling and pushing (combine(..., zero_copy=True, pull=...))")
    p.add_argument("--partial", action="store_true",
                   help="also time the partial combine (combine(..., partial=True) after a dispatch given the "
                        "weights: one row per (token, expert rank)) and its LogFMT-10 form, whole and in halves, "
                        "on both boundaries")
    p.add_argument("--logfmt", action="store_true", help="also time the per-slot LogFMT-10 combine "
                   "(combine(..., use_logfmt=True))")
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
    group = cupyep.init()
    out_all = JsonlWriter(args.out, group)
    me, R = ranks_of(group)  # the node's ranks, or across nodes (--ranks-per-node) every rank of the world
    copy_bw = group.comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    bar = gpu_barrier(group)  # lines up every rank a call involves, across nodes too
    H, warmup = args.hidden, WARMUP
    probe = {}
    if len(args.num_blocks) > 1:  # the copy kernel on R x N blocks, timed by rank 0 alone
        probe = probe_on_rank0(group, [R * n for n in args.num_blocks if n is not None], out_all)
    for num_blocks in args.num_blocks:
        buf = cupyep.LowLatencyBuffer(group, args.max_tokens, args.hidden, args.experts, num_blocks=num_blocks,
                                      num_waiters=args.num_waiters, num_threads=args.threads,
                                      programmatic_launch=False if args.plain_launch else None)
        out = _AgainstCopy(out_all, probe.get(R * buf.num_blocks), copy_bw)
        run_buffer(args, group, buf, bar, out, me, R, H, warmup, copy_bw)
        buf.synchronize()
        group.comm.Barrier()
        buf.destroy()
    bar.destroy()
    group.destroy()


class _AgainstCopy:
    """A JSONL writer that adds, to each record with an "efficiency", the copy
    kernel's rate on as many SMs as the buffer's blocks and the record's
    fraction of it ("copy_same_sms_GBps", "of_copy_same_sms"), when known."""

    def __init__(self, out, same, copy_bw):
        self.out, self.same, self.copy_bw = out, same, copy_bw

    def write(self, rec):
        self.out.write(against_copy(rec, self.same, self.copy_bw) if rec.get("efficiency") is not None else rec)


def run_buffer(args, group, buf, bar, out, me, R, H, warmup, copy_bw):
    """Every timed call of the benchmark on one buffer (its block count)."""
    import cupy
    for T in args.tokens:
        idx, w = global_routing(T, [T] * R, args.experts, args.topk)
        x = cupy.asarray(payload_bf16(me, np.arange(T), H))
        topk_idx, topk_w = cupy.asarray(idx[me]), cupy.asarray(w[me])
        # The calls of this shape and their timing (cupyep.lab.bench.low_latency); building it
        # dispatches once for the identity expert outputs s.y.
        s = Session(group, buf, bar, x, topk_idx, topk_w, copy_bw, flush=args.flush, sleep_us=args.sleep_us,
                    warmup=warmup)
        pairs, fp8_row = s.pairs, s.rows["fp8"]
        steps, d_fp8, combine, y = s.steps, s.dispatch(True), s.combine, s.y

        def record(kind, timed, bytes_to_peers):
            out.write(s.record(kind, timed, bytes_to_peers))

        # Calls alternate dispatch, combine as in a decode loop (each timed on its own), so each
        # kind writes the data copy it wrote last time (layout.CallSchedule).
        # "combine" is the default, pushing combine; "combine_pull" copies, then the owners pull.
        for name in ("fp8", "bf16", "pull"):
            for rec in s.records(name, "strict", args.iters):
                out.write(rec)

        if args.partial:
            # The partial combine: the expert side sums each token's rows, one row per expert rank returns.
            for name in ("partial", "partial_logfmt") + (() if args.no_hook else ("hook_partial",
                                                                                  "hook_partial_logfmt")):
                for rec in s.records(name, "strict", args.iters):
                    out.write(rec)

        if args.logfmt:
            for rec in s.records("logfmt", "strict", args.iters):
                out.write(rec)

        if args.zero_copy:
            # Zero-copy combines, the owners pulling the rows (default) or the expert ranks pushing them.
            for name in ("zero_copy", "zero_copy_push"):
                for rec in s.records(name, "strict", args.iters):
                    out.write(rec)

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
            names = ("fp8",) + (() if args.no_hook else ("hook",))
            names += (("partial", "partial_logfmt") + (() if args.no_hook else ("hook_partial", "hook_partial_logfmt"))
                      if args.partial else ())
            for name in names:
                for rec in s.records(name, "deepep", args.deepep_iters, args.host_gap_ms):
                    out.write(rec)

        if not args.no_hook:
            # Hook mode: the send half and the receive half, each timed alone.
            for rec in s.records("hook", "strict", args.iters):
                out.write(rec)

        if args.trace:
            G = buf.num_blocks
            traces = {k: cupy.zeros((warmup + args.trace, G, NUM_TRACE_SLOTS), dtype=np.int64)
                      for k in ("dispatch_fp8", "combine") +
                      (("combine_partial", "combine_partial_logfmt") if args.partial else ())}
            steps([lambda i, st: d_fp8(i, st, trace=traces["dispatch_fp8"][i]),
                   lambda i, st: combine(i, st, trace=traces["combine"][i])], args.trace)
            if args.partial:  # the partial combine, after a dispatch given the weights
                for kind, more in (("combine_partial", {}), ("combine_partial_logfmt", {"use_logfmt": True})):
                    steps([lambda i, st: d_fp8(i, st, topk_weights=s.topk_weights),
                           lambda i, st, kind=kind, more=more: combine(i, st, partial=True, trace=traces[kind][i],
                                                                       **more)], args.trace)
            for kind, tr in traces.items():
                everyone = np.stack(group.comm.allgather(tr[warmup:].get()))  # [R, n, G, M]
                out.write({**s.base, "kind": f"{kind}_trace", "n": args.trace,
                           "marks": trace_marks(everyone, TRACE_MARKS)})



if __name__ == "__main__":
    main()
