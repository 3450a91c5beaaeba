"""Replicated experts against a skewed routing: how evenly the ranks are
loaded and how long the dispatch and combine take, without a placement and
with each replica rule.

    python -m cupyep.launcher -n 8 experiments/bench_balance.py --out results/balance/balance_8ranks.jsonl

Every rank builds the same seeded routing (``--routing hot_expert``: a
fraction of every rank's slots on one expert, or ``zipf``), plans one
placement from the routing's expert counts (cupyep.balance.rebalance_experts,
``--extra`` replicas per rank beyond E, the global policy), and maps its
tokens' slots to physical experts with each rule (cupyep.balance.physical_topk).
Per case ("rule": "none" is the identity placement) the record gives, from
the routing alone: the (row, expert) pairs each rank receives, max over mean
("pairs_max_over_mean", the experts' compute), the rows each rank receives,
max over mean ("rows_max_over_mean", the bytes it takes in), and the
fraction of rows that leave their rank ("remote_rows"); and, measured on
each transport, the notified dispatch and the combine of its rows on the
strict boundary (cupyep.lab.bench.normal.measure: slowest rank's median).
"""
import argparse

import numpy as np

import cupyep
from cupyep import routing

from cupyep.balance import Placement, physical_topk, rebalance_experts, received, report
from cupyep.barrier import GpuBarrier
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.copy import copy_bandwidth
from cupyep.lab.bench.normal import measure
from cupyep.lab.bench.report import JsonlWriter
from cupyep.normal.direct_kernels import DirectConfig
from cupyep.testing import payload_bf16

RULES = ("none", "round_robin", "nearest")


def loads(idx_by_rank, num_experts: int, num_ranks: int) -> dict:
    """What each rank receives under physical routing ``idx_by_rank`` (lists
    of [T, k] int64 over num_experts physical experts, -1 empty)."""
    pairs, sent = received(idx_by_rank, num_experts, num_ranks)  # sent[s, d]: rows source s sends rank d
    rows = sent.sum(axis=0)
    total = int(sent.sum())
    remote = total - int(np.trace(sent))
    return {"pairs_max_over_mean": round(float(pairs.max() / pairs.mean()), 4),
            "rows_max_over_mean": round(float(rows.max() / rows.mean()), 4),
            "remote_rows": round(remote / max(total, 1), 4), "pairs_per_rank": pairs.astype(int).tolist(),
            "rows_per_rank": rows.astype(int).tolist()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/balance/balance.jsonl")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--routing", choices=["hot_expert", "zipf"], default="hot_expert")
    p.add_argument("--hot-fraction", type=float, default=0.3)
    p.add_argument("--zipf-s", type=float, default=1.2)
    p.add_argument("--extra", type=int, default=4, help="replicas per rank beyond E / R")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--transports", nargs="+", default=["queue", "direct"], choices=["queue", "direct"])
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    args = p.parse_args()
    require_gpu(__file__)
    import cupy
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.world_size, group.rank
    E, P = args.experts, args.experts + args.extra * R
    params = {"hot_fraction": args.hot_fraction, "hot_expert": 0} if args.routing == "hot_expert" else \
        {"s": args.zipf_s}
    idx, w = routing.make(args.routing, 0, [args.tokens] * R, E, args.topk, **params)
    counts = np.bincount(np.concatenate([i.ravel() for i in idx]).clip(-1) + 1, minlength=E + 1)[1:]
    plan = rebalance_experts(counts[None].astype(np.float64), P, 1, group.num_nodes, R, policy="global")
    placements = {"none": Placement.identity(1, E, R, group.num_nodes), "round_robin": plan.layer(0),
                  "nearest": plan.layer(0)}
    copy_bw = group.comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    x = cupy.asarray(payload_bf16(me, np.arange(args.tokens), args.hidden))
    buf = cupyep.Buffer(group, max_tokens=args.tokens, hidden=args.hidden, num_topk=args.topk)
    bar = GpuBarrier(group)
    planned = report(counts[None], plan)
    for rule in args.rules:
        pl = placements[rule]
        phys = idx if rule == "none" else [physical_topk(i, pl, r, rule) for r, i in enumerate(idx)]
        num_experts = E if rule == "none" else P
        base = {"bench": "balance", "rule": rule, "routing": args.routing, "routing_params": params, "ranks": R,
                "tokens": args.tokens, "hidden": args.hidden, "experts": E, "physical_experts": num_experts,
                "topk": args.topk, "planned": planned["after"] if rule != "none" else planned["before"],
                **loads(phys, num_experts, R)}
        topk_idx, topk_w = cupy.asarray(phys[me]), cupy.asarray(w[me])
        for transport in args.transports:
            dcfg = DirectConfig() if transport == "direct" else buf.default_dispatch_config()
            ccfg = None if transport == "direct" else buf.default_combine_config()
            for kind in ("dispatch_bf16_notify", "combine_bf16"):
                rec = measure(group, buf, bar, kind, x, None, topk_idx, topk_w, num_experts, dcfg, ccfg, transport,
                              "strict", args.iters, copy_bw)
                out.write({**base, "kind": kind, "transport": transport, "time_us": rec["time_us"],
                           "p10_us": rec["p10_us"], "p90_us": rec["p90_us"]})
    bar.destroy()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
