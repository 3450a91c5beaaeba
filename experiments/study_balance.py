"""Load balance under skew: the MoE layer's time per step with each balancing arm.

    python -m cupyep.launcher -n 8 --sm-share experiments/study_balance.py --out results/balance_study/study_8ranks.jsonl

With ``--sm-share`` each rank's experts run on a share of the SMs of its own
(cupyep.sm_partition), so the rank holding more (row, expert) pairs computes
longer, as on a GPU of its own, and every other rank waits for it in the
combine: the straggler.

For each trace (``--traces``: ``kind:key=value,...`` of cupyep.routing, each
step drawing new tokens, ``drift`` moving its hot set every ``period`` steps)
and each arm, one MoE layer (cupyep.moe.MoELayer on one Buffer; the
routing is given, not the router's) runs ``--warmup`` + ``--steps`` steps:

- ``none``: E experts, E / R per rank, no replicas;
- ``eplb``: P = E + ``--redundant`` * R physical slots, re-planned every
  ``--period`` steps from an exponential moving average of the past steps'
  loads (``--smoothing``; never the current step's), the experts moved while
  that step computes (start_migration before it, finish_migration after);
- ``migration``: cupyep.balance.OnlineBalancer on the same average, behind an
  imbalance alarm (``--alarm``), moving only when MigrationPolicy says it
  pays (its costs: the copy bandwidth measured here and the FFN time per pair
  measured in the warm-up), the move overlapped with the next step;
- ``per_step``: planned from the current step's own loads (each rank's
  counts on the GPU, exchanged) before the step runs, the move finished
  before its dispatch.

Every arm pays its balancing in its step time: counting and exchanging the
loads, planning, and the moves. One record per (trace, arm, step): the
logical loads, the (row, expert) pairs and rows each rank received, their
max over mean ("imbalance"), each rank's time in each phase ("us":
"balance" (before and after the layer), "map" (replica choice), "dispatch",
"ffn", "combine", "layer" (the whole step)), "layer_us" (the slowest rank's
step), the experts moved and their bytes. Rank 0 writes.
"""
import argparse
import faulthandler
import sys
import time

import numpy as np

import cupyep
from cupyep import moe, routing, sm_partition
from cupyep.balance import LayerBalancer, MigrationPolicy, physical_topk, rebalance_experts, received
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.copy import copy_bandwidth
from cupyep.lab.bench.report import JsonlWriter

ARMS = ("none", "eplb", "migration", "per_step")
MODE_OF_ARM = {"eplb": "eplb", "migration": "online", "per_step": "per_step"}  # cupyep.balance.LayerBalancer
DEFAULT_TRACES = ("hot_expert:hot_fraction=0.5", "zipf:s=1.2", "drift:s=1.2,period=4")
PHASES = ("route", "dispatch", "ffn", "combine", "end")


def parse_trace(text: str) -> tuple[str, dict]:
    """``"kind:key=value,..."`` -> (kind, params) for cupyep.routing.make."""
    kind, _, rest = text.partition(":")
    if kind not in routing.KINDS:
        raise argparse.ArgumentTypeError(f"unknown routing kind {kind!r}; expected one of {routing.KINDS}")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"trace parameter {item!r} is not key=value")
        params[key] = int(value) if key in ("period", "hot_expert") else float(value)
    return kind, params


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/balance_study/study.jsonl")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--redundant", type=int, default=2, help="extra physical slots per rank (eplb, migration, "
                                                            "per_step)")
    p.add_argument("--traces", nargs="+", type=parse_trace, default=[parse_trace(t) for t in DEFAULT_TRACES])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--period", type=int, default=4, help="eplb: steps between plans")
    p.add_argument("--smoothing", type=float, default=0.5, help="weight of the newest step in the load average")
    p.add_argument("--alarm", type=float, default=1.1, help="migration: re-plan above this max/mean")
    p.add_argument("--groups", type=int, default=1,
                   help="expert groups for the planner: a multiple of the nodes gives the hierarchical policy")
    p.add_argument("--tolerance", type=float, default=1.05,
                   help="per_step: keep the placement while it holds the step's loads within this max/mean")
    p.add_argument("--horizon", type=int, default=8, help="migration: steps a new placement is expected to serve")
    p.add_argument("--transport", choices=["queue", "direct"], default="direct")
    p.add_argument("--comm-sms", type=int, default=0,
                   help="SMs of each rank's communication kernels (Buffer(num_sms=); 0: its share of the GPU). "
                        "With --sm-share a few keep other ranks' spinning blocks off the compute partitions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=60.0, help="every bounded wait's budget (cupyep.init)")
    p.add_argument("--stack-after", type=float, default=45.0,
                   help="print every rank's Python stack when a step takes longer than this (s)")
    args = p.parse_args()
    require_gpu(__file__)
    import cupy
    group = cupyep.init(timeout_s=args.timeout_s)
    out = JsonlWriter(args.out, group)
    R, me, nodes = group.world_size, group.rank, group.num_nodes
    T, H, F, E, k = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    P = E + args.redundant * R
    weights = moe.MoEWeights.random(args.seed, hidden=H, ffn=F, num_experts=E)
    expert_bytes = 2 * H * F * 4
    rng = np.random.default_rng([args.seed, me])
    x = moe.f32_to_bf16_bits(cupy.asarray(rng.standard_normal((T, H), dtype=np.float32)))
    copy_GBps = group.comm.bcast(copy_bandwidth(1 << 30) / 2e9 / group.ranks_per_gpu if me == 0 else 0.0)
    buf = cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=k, num_sms=args.comm_sms)
    compute = sm_partition.compute_stream(group)
    compute_sms = sm_partition.partition_stream(group)[1] if compute is not None else group.num_sms
    for kind, params in args.traces:
        us_per_pair = 0.0
        for arm_name in args.arms:
            initial = None if arm_name == "none" else \
                rebalance_experts(np.ones((1, E)), P, args.groups, nodes, R).layer(0)
            layer = moe.MoELayer(buf, weights, k, transport=args.transport, placement=initial, compute_stream=compute)
            bal = None if arm_name in ("none", "migration") else LayerBalancer(
                layer, MODE_OF_ARM[arm_name], period=args.period, smoothing=args.smoothing,
                tolerance=args.tolerance, num_groups=args.groups)
            for step in range(args.warmup + args.steps):
                idx_all, w_all = routing.make(kind, args.seed, [T] * R, E, k, step=step, **params)
                topk_idx, topk_w = cupy.asarray(idx_all[me]), cupy.asarray(w_all[me])
                if arm_name == "migration" and step == args.warmup:
                    us_per_pair = group.comm.bcast(us_per_pair)  # rank 0's, from this arm's warm-up
                    policy = MigrationPolicy(expert_bytes, copy_GBps, us_per_pair, args.horizon, overlap=1.0)
                    bal = LayerBalancer(layer, "online", smoothing=args.smoothing, policy=policy, alarm=args.alarm,
                                        num_groups=args.groups)
                faulthandler.dump_traceback_later(args.stack_after, file=sys.stderr)
                cupy.cuda.get_current_stream().synchronize()
                group.comm.Barrier()
                t0, done = cupy.cuda.Event(), cupy.cuda.Event()
                t0.record()
                host0 = time.perf_counter()
                did = bal.before(topk_idx) if bal is not None else {"planned": False, "moved_experts": 0,
                                                                     "pulled": [0] * R}
                placement = layer.placement  # the one this step's forward routes by
                events = {}
                layer.forward(x, topk_idx, topk_w, events=events)
                after = bal.after(topk_idx) if bal is not None else {"alarm": False}
                done.record()
                done.synchronize()
                host_us = (time.perf_counter() - host0) * 1e6
                ms = cupy.cuda.get_elapsed_time
                us = {"balance": (ms(t0, events["route"]) + ms(events["end"], done)) * 1e3,
                      "map": ms(events["route"], events["dispatch"]) * 1e3,
                      "dispatch": ms(events["dispatch"], events["ffn"]) * 1e3,
                      "ffn": ms(events["ffn"], events["combine"]) * 1e3,
                      "combine": ms(events["combine"], events["end"]) * 1e3,
                      "layer": ms(t0, done) * 1e3, "host": host_us}
                faulthandler.cancel_dump_traceback_later()
                per_rank = group.comm.gather(us, root=0)
                if me != 0:
                    continue
                phys = idx_all if placement is None else \
                    [physical_topk(i, placement, r, layer.rule) for r, i in enumerate(idx_all)]
                pairs, rows = received(phys, layer.num_experts, R)
                pairs, rows = pairs.tolist(), rows.sum(axis=0).tolist()
                ffn = np.array([u["ffn"] for u in per_rank])
                if step < args.warmup:  # the FFN's time per pair, for the migration arm's policy
                    us_per_pair = float(np.median(ffn / np.maximum(pairs, 1)))
                if step < args.warmup:
                    continue
                loads = np.bincount(np.concatenate([i.ravel() for i in idx_all]) + 1, minlength=E + 1)[1:]
                out.write({"study": "balance", "trace": kind, "trace_params": params, "arm": arm_name,
                           "step": step, "layer": 0, "ranks": R, "ranks_per_node": group.local_size,
                           "nodes": nodes, "tokens": T, "hidden": H, "ffn": F, "experts": E,
                           "physical_experts": layer.num_experts, "topk": k, "transport": args.transport,
                           "logical_loads": loads.tolist(), "pairs_per_rank": pairs, "rows_per_rank": rows,
                           "imbalance": round(max(pairs) / (sum(pairs) / R), 4),
                           "us": {key: [round(u[key], 1) for u in per_rank] for key in us},
                           "layer_us": round(max(u["layer"] for u in per_rank), 1),
                           "moved_experts": did["moved_experts"], "moved_bytes": did["moved_experts"] * expert_bytes,
                           "planned": did["planned"] or after["alarm"],
                           "moved_bytes_per_rank": [n * expert_bytes for n in did["pulled"]],
                           "expert_bytes": expert_bytes, "sm_share": compute is not None, "compute_sms": compute_sms,
                           "comm_sms": buf.sm_budget,
                           "copy_GBps": round(copy_GBps, 1), "us_per_pair": us_per_pair,
                           "tolerance": args.tolerance if arm_name == "per_step" else None,
                           "groups": args.groups, "policy": None if placement is None else placement.policy})
            layer.destroy()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
