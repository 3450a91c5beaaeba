"""What bounds the low-latency data movement: the same rows, moved by a bare
scatter kernel (cupyep/lab/bench/scatter.py), under each destination layout.

    python -m cupyep.launcher -n 8 experiments/probes/probe_scatter.py --out results/probe_scatter.jsonl
    python -m cupyep.launcher -n 1 experiments/probes/probe_scatter.py --virtual 8    # one process moves all 8 ranks' rows

Each of R processes plays V / R virtual ranks (default V = R): with -n 1
--virtual 8 one process and one address space move every row that 8 ranks
would, into the same number of distinct pages, which separates the cost of
the pages from the cost of many processes mapping them. ``--local`` sends
every row to the sender's own buffer (no peer mappings). Every call is timed
alone after an L2 flush and a GPU barrier, cycling through ``--sets``
destination regions (two, as the buffer's sets alternate, leave each call's
destination pages cold); records give the kernel time
(slowest rank's median), after_last_start (from the last rank's start to the
last end) and the bytes read plus written by all ranks per second over it.
"""
import argparse

import numpy as np

import cupyep
from cupyep.barrier import GpuBarrier
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.copy import copy_bandwidth
from cupyep.lab.bench.report import JsonlWriter
from cupyep.lab.bench.scatter import PATTERNS, pattern_rows, rows_needed, scatter
from cupyep.lab.bench.stamps import cross_rank, kernel_seconds
from cupyep.lab.bench.timing import FLUSH_MODES, timed_rounds
from cupyep.ipc import SymmetricBuffer
from cupyep.testing import global_routing


def main():
    require_gpu(__file__)
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/probe_scatter.jsonl")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--virtual", type=int, default=None, help="virtual ranks (a multiple of the processes)")
    p.add_argument("--blocks", type=int, nargs="+", default=[16], help="blocks per virtual rank")
    p.add_argument("--row-bytes", type=int, nargs="+", default=None, help="default: 2 x hidden")
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--flush", nargs="+", default=["write", "none"], choices=FLUSH_MODES)
    p.add_argument("--local", action="store_true", help="every row to the sender's own buffer")
    p.add_argument("--sets", type=int, nargs="+", default=[1],
                   help="destination regions the calls cycle through (2: like the buffer's two sets)")
    p.add_argument("--data", choices=("ones", "random"), default="random", help="source contents")
    p.add_argument("--iters", type=int, default=40)
    args = p.parse_args()
    import cupy
    from mpi4py import MPI
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.local_size, group.local_rank
    V = args.virtual or R
    if V % R:
        raise ValueError(f"--virtual {V} is not a multiple of {R} processes")
    per = V // R
    mine = range(me * per, (me + 1) * per)
    copy_bw = group.comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    idx, _ = global_routing(args.tokens, [args.tokens] * V, args.experts, args.topk)
    row_sizes = args.row_bytes or [2 * args.hidden]
    need = [rows_needed(pt, args.experts, V, args.max_tokens, args.topk) for pt in args.patterns]
    src_rows, dst_rows = max(n[0] for n in need), max(n[1] for n in need)
    big = max(row_sizes)
    region = per * dst_rows * big
    dst = SymmetricBuffer(group, max(args.sets) * region)
    n_src = per * src_rows * big // 16 * 4
    src = (cupy.ones(n_src, dtype=np.int32) if args.data == "ones"
           else cupy.random.default_rng(me).integers(0, 1 << 30, n_src, dtype=np.int32))
    bar = GpuBarrier(group)
    warmup = 5
    for pattern in args.patterns:
        parts = [pattern_rows(pattern, idx, v, args.experts, args.max_tokens) for v in mine]
        s_row = np.concatenate([a + (v - mine[0]) * src_rows for (a, _, _), v in zip(parts, mine)])
        d_virt = np.concatenate([b for _, b, _ in parts])
        d_row = np.concatenate([c for _, _, c in parts])
        d_peer = np.full_like(d_virt, me) if args.local else d_virt // per
        d_row = d_row + (d_virt % per) * dst_rows
        dev = [cupy.asarray(a) for a in (s_row.astype(np.int32), d_peer.astype(np.int32), d_row.astype(np.int64))]
        for row_bytes in row_sizes:
            for blocks in args.blocks:
                for flush, sets in ((f, n) for f in args.flush for n in args.sets):
                    def call(i, stamp, sets=sets, row_bytes=row_bytes, blocks=blocks):
                        scatter(dst.peer_ptrs.data.ptr, (i % sets) * region, src, *dev, row_bytes, stamp,
                                blocks * per, group)

                    ((_, st),) = timed_rounds([call], args.iters, warmup, flush, sleep_us=200, before=bar)
                    everyone = np.stack(group.comm.allgather(st))
                    kernel = group.comm.allreduce(float(np.median(kernel_seconds(st))) * 1e6, op=MPI.MAX)
                    moved = group.comm.allreduce(2 * len(s_row) * row_bytes)
                    cr = cross_rank(everyone)
                    after = cr["after_last_start"]["median_us"]
                    out.write({"bench": "probe_scatter", "pattern": pattern, "processes": R, "virtual_ranks": V,
                               "local": args.local, "row_bytes": row_bytes, "blocks_per_rank": blocks,
                               "flush": flush, "sets": sets, "data": args.data, "rows_per_rank": len(s_row) // per, "kernel_median_us": kernel,
                               **{f"{k}_median_us": v["median_us"] for k, v in cr.items()},
                               "GBps_after_last_start": moved / after * 1e-3, "copy_GBps": copy_bw / 1e9,
                               "of_copy": moved / (after * 1e-6) / copy_bw, "n": args.iters})
    cupy.cuda.get_current_stream().synchronize()
    bar.destroy()
    dst.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
