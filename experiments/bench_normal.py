"""Normal-mode dispatch/combine benchmark (and queue-depth x chunk sweep).

    python -m cupyep.launcher -n 8 experiments/bench_normal.py --out results/normal.jsonl [--sweep]

Shape: T tokens per rank (4096), hidden 7168, top-8 of 256 experts. Reports
per call: median time, per-rank GB/s as DeepEP counts it (received rows x
row bytes / time), and efficiency = (2 x bytes received by all ranks / copy
bandwidth measured in this run by the plain copy kernel) / time. Combine
counts the same bytes as BF16 dispatch.

Two timing boundaries (``--timing``), each record saying which in "timing":
"strict" times every call on its own after an L2 flush and a GPU barrier
that lines the ranks up, and reports the slowest rank's median; "deepep"
times as DeepEP's own benchmark does: one barrier, then calls back to back
with no flush or barrier between them, each rank's median of its own calls
("time_us" is then the slowest rank's, "rank_mean_us" the mean over ranks).
The sweep (``--sweep``) runs queue depth x chunk x threads x SMs for the
kinds in ``--sweep-kinds``.

Transports (``--transports``, default both): the queue transport's kinds as
above, the direct (one-copy) transport's as ``<kind>_direct`` with
"transport": "direct" and its DirectConfig, with the default blocks and each
of ``--direct-sms`` (SMs used against time); the queue transport's kinds
again with each of ``--queue-sms`` blocks per rank (Config.num_sms, for
dispatch and combine alike).

``python experiments/bench_normal.py --blocks-table FILE...`` (no GPU) prints
the swept direct points of repeated runs as a Markdown table: median and
[min, max] of the time and of the fraction of the copy probe.

The copy roofline at the same number of SMs: with ``--direct-sms`` or
``--queue-sms`` (or ``--copy-probe BLOCKS...``) rank 0 alone times the copy
kernel on R x S blocks for each S (R ranks of S blocks each), one
"copy_probe" record per block count, and each swept record gets
"copy_same_sms_GBps" and "of_copy_same_sms": its bytes (as "efficiency"
counts them) over that probe's bandwidth, divided by its time.
"""
import argparse
from dataclasses import replace

import numpy as np

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.barrier import GpuBarrier
from cupyep.lab.bench.copy import against_copy, copy_bandwidth, probe_on_rank0
from cupyep.lab.bench.normal import DIRECT_KINDS, KINDS, measure
from cupyep.lab.bench.report import JsonlWriter
from cupyep.fp8 import per_token_cast_to_fp8
from cupyep.normal import Config
from cupyep.normal.direct_kernels import MAX_SHARED_BYTES, DirectConfig, max_combine_words
from cupyep.testing import global_routing, payload_bf16


def blocks_table(paths) -> str:
    """The Markdown table of the swept direct points (``--direct-sms``) in
    ``paths`` (JSONL files of repeated runs of one command): per kind, bulk
    stage, combine words and blocks per rank, the median time over the files
    with [min, max] and the median fraction of the copy probe at the same SMs with [min, max],
    by the event clock and, where the records have it, the kernels' own (the
    span over every rank's kernel on one GPU, else the slowest rank's)."""
    import json
    import statistics
    from collections import defaultdict
    points = defaultdict(list)
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            if r.get("sweep") and r.get("transport") == "direct":
                c = r["dispatch_config"]
                bulk, words = c.get("bulk_stage_bytes"), c.get("combine_words")
                key = (r["ranks"], r["kind"], "default" if bulk is None else bulk,
                       "default" if words is None else words, c["num_sms"], c["num_threads"])
                points[key].append((r["time_us"], r["of_copy_same_sms"], r.get("kernel_span_us", r.get("kernel_us")),
                                    r.get("of_copy_same_sms_kernel")))
    lines = ["| ranks | kind | bulk stage | combine words | threads | blocks per rank | runs | "
             "event us: median [min, max] | of probe: median [min, max] | kernel span us: median [min, max] | "
             "of probe, kernel clock |",
             "|" + " --- |" * 11]

    def cell(values, digits):
        if any(v is None for v in values):
            return "-"
        return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"
    def order(item):  # ranks, kind, stage and words as text ("default" among numbers), then blocks and threads
        key = item[0]
        return tuple(map(str, key[:4])) + key[4:]
    for (R, kind, bulk, words, sms, threads), v in sorted(points.items(), key=order):
        t, f, kt, kf = (list(c) for c in zip(*v))
        lines.append(f"| {R} | {kind} | {bulk} | {words} | {threads} | {sms} | {len(v)} | {cell(t, 0)} | "
                     f"{cell(f, 3)} | {cell(kt, 0)} | {cell(kf, 3)} |")
    return "\n".join(lines)


def main():
    import sys
    if sys.argv[1:2] == ["--blocks-table"]:  # no GPU needed
        print(blocks_table(sys.argv[2:]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/normal.jsonl")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="also sweep queue depth x chunk size")
    p.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[512, 768])
    p.add_argument("--sms", type=int, nargs="+", default=[None],
                   help="num_sms values to sweep (default: the config's own)")
    p.add_argument("--sweep-kinds", nargs="+", default=["dispatch_bf16", "combine_bf16"],
                   choices=["dispatch_bf16", "dispatch_fp8", "combine_bf16"])
    p.add_argument("--timing", choices=["strict", "deepep", "both"], default="both")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS + DIRECT_KINDS,
                   help="kinds timed with the default configs")
    p.add_argument("--l2", type=int, nargs="+", default=None,
                   help="L2 modes (Config.l2_hints) to run; default: the configs' own")
    p.add_argument("--transports", nargs="+", default=["queue", "direct"], choices=["queue", "direct"])
    p.add_argument("--direct-sms", type=int, nargs="*", default=[],
                   help="blocks per rank of the direct transport to time besides its default")
    p.add_argument("--direct-bulk", type=int, nargs="+", default=[None],
                   help="DirectConfig.bulk_stage_bytes of the --direct-sms points (0: warp copies; > 0: bulk "
                        "copies through two stages of this many bytes per warp; default: the config's own); each "
                        "value sweeps every point")
    p.add_argument("--direct-words", type=int, nargs="+", default=[None],
                   help="DirectConfig.combine_words of the --direct-sms points (row words per lane and rank the "
                        "combine's reduce keeps in flight; default: the config's own); each value sweeps every "
                        "point (a value past 16 / ranks is left out)")
    p.add_argument("--direct-threads", type=int, nargs="+", default=[DirectConfig.num_threads],
                   help="DirectConfig.num_threads of the --direct-sms points; each value sweeps every point (a "
                        "(threads, bulk) pair whose stages exceed a block's shared memory is left out)")
    p.add_argument("--queue-sms", type=int, nargs="*", default=[],
                   help="blocks per rank (Config.num_sms, even) of the queue transport to time besides its default, "
                        "each against the copy kernel on as many SMs")
    p.add_argument("--copy-probe", type=int, nargs="*", default=[],
                   help="also time the copy kernel on these numbers of blocks (besides R x each --direct-sms and "
                        "--queue-sms)")
    args = p.parse_args()
    require_gpu(__file__)
    import cupy
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.local_size, group.local_rank
    copy_bw = copy_bandwidth(2 << 30) if me == 0 else 0.0
    copy_bw = group.comm.bcast(copy_bw)

    idx, w = global_routing(0, [args.tokens] * R, args.experts, args.topk)
    x = cupy.asarray(payload_bf16(me, np.arange(args.tokens), args.hidden))
    x_fp8 = per_token_cast_to_fp8(x)
    topk_idx, topk_w = cupy.asarray(idx[me]), cupy.asarray(w[me])
    most = Config(num_sms=max([48] + [m for m in args.sms if m]), queue_depth=max(args.depths))
    buf_bytes = cupyep.Buffer.size_hint(R, args.hidden, args.topk, most, most)
    buf = cupyep.Buffer(group, buf_bytes, max_tokens=args.tokens, hidden=args.hidden, num_topk=args.topk)
    bar = GpuBarrier(group)

    def run(kind, dcfg, ccfg, timing="strict", transport="queue"):
        return measure(group, buf, bar, kind, x, x_fp8, topk_idx, topk_w, args.experts, dcfg, ccfg, transport,
                       timing, args.iters, copy_bw)

    dcfg0, ccfg0 = buf.default_dispatch_config(), buf.default_combine_config()
    fcfg0 = buf.default_dispatch_config(fp8=True)
    def with_l2(cfg, l2):
        return cfg if l2 is None else replace(cfg, l2_hints=l2)

    timings = ("strict", "deepep") if args.timing == "both" else (args.timing,)
    queue_kinds = [k for k in args.kinds if k not in DIRECT_KINDS]
    # The default kinds, then the direct transport's own (zero-copy combine, unfused dispatches).
    extra = list(DIRECT_KINDS) if args.kinds == list(KINDS) else []
    direct_kinds = args.kinds + [k for k in extra if k not in args.kinds]
    if "queue" in args.transports:
        for l2 in args.l2 or [None]:
            dcfg, fcfg, ccfg = with_l2(dcfg0, l2), with_l2(fcfg0, l2), with_l2(ccfg0, l2)
            for timing in timings:
                for kind in queue_kinds:
                    out.write(run(kind, fcfg if kind == "dispatch_fp8" else dcfg, ccfg, timing))
        swept = [m for m in args.queue_sms if 2 <= m <= buf.sm_budget and m % 2 == 0]
        probe = probe_on_rank0(group, [R * m for m in swept], out)
        for sms in swept:
            for kind in queue_kinds:
                d = replace(fcfg0 if kind == "dispatch_fp8" else dcfg0, num_sms=sms)
                out.write(against_copy({**run(kind, d, replace(ccfg0, num_sms=sms), "strict"), "sweep": True},
                                       probe[R * sms], copy_bw))
    if "direct" in args.transports:
        for timing in timings:
            for kind in direct_kinds:
                out.write(run(kind, DirectConfig(), None, timing, "direct"))
        swept = [m for m in args.direct_sms if m <= buf.sm_budget]  # more would not all be resident
        probe = probe_on_rank0(group, [R * m for m in swept] + args.copy_probe, out)
        for threads, bulk, words in ((t, b, w) for t in args.direct_threads for b in args.direct_bulk
                                     for w in args.direct_words):
            cfg0 = DirectConfig(num_threads=threads, bulk_stage_bytes=bulk, combine_words=words)
            if cfg0.bulk_shared_bytes() > MAX_SHARED_BYTES or (words is not None and words > max_combine_words(R)):
                continue
            for sms in swept:
                for kind in direct_kinds:
                    if not kind.startswith("combine") and words != args.direct_words[0]:
                        continue  # the dispatch does not read combine_words: timed once per point
                    cfg = replace(cfg0, num_sms=sms)
                    out.write(against_copy({**run(kind, cfg, None, "strict", "direct"), "sweep": True},
                                           probe[R * sms], copy_bw))
    if args.sweep:
        for threads, l2 in ((t, l2) for t in args.threads for l2 in (args.l2 or [None])):
            dcfg, fcfg, ccfg = with_l2(dcfg0, l2), with_l2(fcfg0, l2), with_l2(ccfg0, l2)
            warps = threads // 32
            for sms, depth, chunk in ((m, d, c) for m in args.sms for d in args.depths for c in args.chunks):
                if chunk > depth or (sms is not None and sms > buf.sm_budget):
                    continue
                sm = {} if sms is None else {"num_sms": sms}
                for kind in args.sweep_kinds:
                    if kind.startswith("dispatch"):
                        d = replace(fcfg if kind == "dispatch_fp8" else dcfg, queue_depth=depth, chunk_size=chunk,
                                    num_threads=threads, **sm)
                        out.write({**run(kind, d, ccfg), "sweep": True})
                    elif depth >= warps + chunk:
                        c = replace(ccfg, queue_depth=depth, chunk_size=chunk, num_threads=threads, **sm)
                        out.write({**run(kind, dcfg, c), "sweep": True})
    bar.destroy()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
