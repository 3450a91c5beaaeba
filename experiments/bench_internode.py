"""The two-hop dispatch and combine across (emulated) nodes: time and traffic.

    python -m cupyep.launcher -n 8 --ranks-per-node 4 experiments/bench_internode.py --out results/internode.jsonl

One record per kind of cupyep.lab.bench.internode and repeat (--repeats, 3 by
default: the kinds' measurements interleaved, for a median and spread) (a counted dispatch with its
notify pass across nodes, a cached dispatch, the combine) at this rank
layout, with that module's times and traffic. The first call's output is
checked against the one-node oracle (dispatch exactly, combine within
calc_diff 5e-6) before anything is timed. "hop_us": each hop's time from the
kernels' own stamps over 10 more, untimed calls
(cupyep.lab.metrics.two_hop_metrics): the dispatch's network hop, its NVLink
forwarding and the whole kernel; the combine's in-node hop, network hop and
final reduction. The same measurement, as a sweep over knobs:
``python -m cupyep.lab.experiments internode --ranks 8 --ranks-per-node 4``.
"""
import argparse

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import JsonlWriter
from cupyep.testing import global_routing


def main():
    require_gpu(__file__)
    from cupyep.barrier import gpu_barrier
    from cupyep.lab.bench.internode import KINDS, hop_times_of, measure, prepare
    from cupyep.normal.internode_kernels import TwoHopDispatch
    from cupyep.lab.metrics import two_hop_metrics
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/internode.jsonl")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements of every kind, interleaved (one record each, field 'repeat')")
    p.add_argument("--num-sms", type=int, default=0, help="blocks per rank (0: the rank's share of the SMs)")
    p.add_argument("--route", default="two_hop", choices=("two_hop", "direct"),
                   help="two_hop: node dedup and forwarding; direct: every row straight to its final row")
    p.add_argument("--rdma-chunk", type=int, default=1, help="rows a warp sends to one node with one put")
    p.add_argument("--nvlink-chunk", type=int, default=1, help="network rows a warp of the rail peer forwards")
    args = p.parse_args()
    group = cupyep.init()
    if group.num_nodes < 2:
        if group.rank == 0:
            print("bench_internode needs ranks on two or more nodes: launch with --ranks-per-node K (K < ranks)")
        raise SystemExit(2)
    R, K = group.world_size, group.local_size
    T, H, E, k = args.tokens, args.hidden, args.experts, args.topk
    idx, w = global_routing(0, [T] * R, E, k)
    hop = TwoHopDispatch(group, T, H, k, E, num_sms=args.num_sms, rdma_chunk=args.rdma_chunk,
                         nvlink_chunk=args.nvlink_chunk, route=args.route)
    x, ids, ws, traffic, handle = prepare(group, hop, idx, w)  # checked against the oracle first
    hops = two_hop_metrics(group, hop, x, ids, ws)  # untimed calls with the hop stamps (cupyep.lab.metrics)
    writer = JsonlWriter(args.out, group)
    barrier = gpu_barrier(group)  # each timed call lined up across every rank (cupyep.lab.bench.internode)
    for repeat in range(args.repeats):
        for kind in KINDS:
            rec = measure(group, hop, kind, x, ids, ws, handle, args.iters, traffic, before=barrier)
            writer.write({"bench": "internode", "kind": f"{kind}_{args.route}", "ranks": R, "ranks_per_node": K,
                          "nodes": R // K, "tokens": T, "hidden": H, "topk": k, "experts": E,
                          "num_sms": hop.num_sms, "route": args.route, "rdma_chunk": hop.rdma_chunk,
                          "nvlink_chunk": hop.nvlink_chunk,
                          "repeat": repeat, **rec, "hop_us": hop_times_of(hops, kind),
                          "checked": True, "version": "device notify"})
    barrier.destroy()
    hop.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
