"""The two-hop dispatch and combine across (emulated) nodes: time and traffic.

    python -m cupyep.launch -n 8 --ranks-per-node 4 experiments/bench_internode.py --out results/internode.jsonl

One record per kind of cupyep.bench.internode (a counted dispatch with its
notify pass across nodes, a cached dispatch, the combine) at this rank
layout, with that module's times and traffic. The first call's output is
checked against the one-node oracle (dispatch exactly, combine within
calc_diff 5e-6) before anything is timed. "hop_us": each hop's time from the
kernels' own stamps over 10 more, untimed calls
(cupyep.metrics.two_hop_metrics): the dispatch's network hop, its NVLink
forwarding and the whole kernel; the combine's in-node hop, network hop and
final reduction. The same measurement, as a sweep over knobs:
``python -m cupyep.experiments internode --ranks 8 --ranks-per-node 4``.
"""
import argparse

import numpy as np

import cupyep
from cupyep.bench import require_gpu
from cupyep.bench.report import JsonlWriter
from cupyep.testing import global_routing, payload_bf16


def main():
    require_gpu(__file__)
    import cupy

    from cupyep.bench.internode import KINDS, check_against_oracle, measure
    from cupyep.internode import TwoHopDispatch
    from cupyep.metrics import two_hop_metrics
    from cupyep.reference import internode as I
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/internode.jsonl")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--num-sms", type=int, default=0, help="blocks per rank (0: the rank's share of the SMs)")
    args = p.parse_args()
    group = cupyep.init()
    if group.num_nodes < 2:
        if group.rank == 0:
            print("bench_internode needs ranks on two or more nodes: launch with --ranks-per-node K (K < ranks)")
        raise SystemExit(2)
    R, me, K = group.world_size, group.rank, group.local_size
    T, H, E, k = args.tokens, args.hidden, args.experts, args.topk
    tokens = [T] * R
    idx, w = global_routing(0, tokens, E, k)
    x = cupy.asarray(payload_bf16(me, np.arange(T), H))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    hop = TwoHopDispatch(group, T, H, k, E, num_sms=args.num_sms)
    out = hop.dispatch(x, ids, ws)
    comb = hop.combine(out.recv_x.copy())  # identity experts: each token's row times the ranks it visited
    check_against_oracle(group, out, comb, idx, w, tokens, E, H)
    hops = two_hop_metrics(group, hop, x, ids, ws)  # untimed calls with the hop stamps (cupyep.metrics)
    traffic = I.two_hop_traffic(I.two_hop_routes(idx, E, R, K), K, H * 2)
    writer = JsonlWriter(args.out, group)
    handle = hop.dispatch(x, ids, ws).handle
    for kind in KINDS:
        rec = measure(group, hop, kind, x, ids, ws, handle, args.iters, traffic)
        writer.write({"bench": "internode", "kind": f"{kind}_two_hop", "ranks": R, "ranks_per_node": K,
                      "nodes": R // K, "tokens": T, "hidden": H, "topk": k, "experts": E, "num_sms": hop.num_sms,
                      **rec, "hop_us": hops["combine_hop_us" if kind == "combine_bf16" else "dispatch_hop_us"],
                      "checked": True, "version": "device notify"})
    hop.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
