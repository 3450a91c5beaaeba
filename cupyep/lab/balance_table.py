"""The balance study's tables: per trace and arm, from its records.

    python -m cupyep.lab.balance_table results/balance_study/study_8ranks_run1.jsonl [...]
    python -m cupyep.lab.balance_table --over-runs results/balance_study/study_8ranks_run*.jsonl

Each file holds the records of one launch of ``experiments/study_balance.py``
(one per (trace, arm, step)). The default table has one row per (file,
trace, arm): the max over mean (row, expert) pairs per rank (median step,
worst step), the layer's time per step (median, min, max), the speed-up over
that trace's ``none`` of the median step and of all steps together
(balancing included), and the medians of the slowest rank's FFN, dispatch,
combine and balancing, and the experts moved.

``--over-runs`` treats the files as repeated runs and gives one row per
(trace, arm): the median over runs of each run's figures, with their
[min, max] over runs.

``--planner-bound`` gives, per file and trace, what the planner itself
reaches on each recorded step's own loads (cupyep.balance.rebalance_experts
with the records' physical slots, ranks and nodes): the max/mean load per
GPU of its plan under the records' expert groups (hierarchical across
nodes) and under one group (the global policy), medians over the steps,
beside the ``per_step`` arm's measured max/mean. It separates what a policy
allows from what the run achieved.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

COLUMNS = ("trace", "arm", "max/mean pairs: median (worst step)", "layer: median [min, max]",
           "speed-up: median / all steps", "straggler FFN", "dispatch", "combine", "balancing", "experts moved")


def _key(r) -> tuple:
    """A trace's identity in a record or a row of :func:`rows_of`."""
    return r["trace"], json.dumps(r["trace_params"], sort_keys=True)


def rows_of(records: list) -> list[dict]:
    """One dict per (trace, arm) of one file's records (in the order they
    ran): imbalance, layer_ms (median, min, max), speedup (median step, all
    steps, over the same trace's "none" arm; None without one), the phases'
    medians in ms and the experts moved."""
    arms: dict = {}
    for r in records:
        arms.setdefault((_key(r), r["arm"]), []).append(r)
    out = []
    for (key, arm), rs in arms.items():
        base = arms.get((key, "none"))
        layer = np.array([r["layer_us"] for r in rs]) / 1e3
        imb = np.array([r["imbalance"] for r in rs])

        def phase(name):
            return float(np.median([max(r["us"][name]) for r in rs])) / 1e3
        speedup = None
        if base:
            none = np.array([r["layer_us"] for r in base]) / 1e3
            speedup = (float(np.median(none) / np.median(layer)), float(none.sum() / layer.sum()))
        out.append({"trace": rs[0]["trace"], "trace_params": rs[0]["trace_params"], "arm": arm, "steps": len(rs),
                    "imbalance": (float(np.median(imb)), float(imb.max())),
                    "layer_ms": (float(np.median(layer)), float(layer.min()), float(layer.max())),
                    "speedup": speedup, "ffn_ms": phase("ffn"), "dispatch_ms": phase("dispatch"),
                    "combine_ms": phase("combine"), "balance_ms": phase("balance"),
                    "moved_experts": int(sum(r["moved_experts"] for r in rs))})
    return out


def _read(path) -> list:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _name(row) -> str:
    params = ", ".join(f"{k} {v}" for k, v in row["trace_params"].items())
    return f"{row['trace']}, {params}" if params else row["trace"]


RUN_COLUMNS = ("trace", "arm", "runs", "max/mean pairs: median step (worst step of any run)",
               "layer: median ms", "speed-up of the median step", "speed-up over all steps", "balancing ms",
               "experts moved per run")


def over_runs(paths) -> list[dict]:
    """One dict per (trace, arm) over the files in ``paths`` as repeated runs:
    "runs", and per figure the list of each run's value ("imbalance",
    "worst", "layer_ms", "speedup_median_step", "speedup_all_steps",
    "balance_ms", "moved_experts"). ValueError when a run lacks the "none"
    arm of a trace."""
    groups: dict = {}
    for path in paths:
        for row in rows_of(_read(path)):
            if row["speedup"] is None:
                raise ValueError(f"{path}: {_name(row)} has no 'none' arm to compare with")
            g = groups.setdefault((_key(row), row["arm"]), {"trace": _name(row), "arm": row["arm"], "runs": 0})
            g["runs"] += 1
            for key, value in (("imbalance", row["imbalance"][0]), ("worst", row["imbalance"][1]),
                               ("layer_ms", row["layer_ms"][0]), ("speedup_median_step", row["speedup"][0]),
                               ("speedup_all_steps", row["speedup"][1]), ("balance_ms", row["balance_ms"]),
                               ("moved_experts", row["moved_experts"])):
                g.setdefault(key, []).append(value)
    return list(groups.values())


def markdown_over_runs(paths) -> str:
    """The table of :func:`over_runs`, as Markdown: medians over runs with
    their [min, max]."""
    def spread(v, fmt):
        return f"{fmt.format(np.median(v))} [{fmt.format(min(v))}, {fmt.format(max(v))}]"
    lines = ["| " + " | ".join(RUN_COLUMNS) + " |", "|" + " --- |" * len(RUN_COLUMNS)]
    last = None
    for g in over_runs(paths):
        lines.append(f"| {g['trace'] if g['trace'] != last else ''} | {g['arm']} | {g['runs']} | "
                     f"{np.median(g['imbalance']):.3f} ({max(g['worst']):.3f}) | {spread(g['layer_ms'], '{:.1f}')} | "
                     f"{spread(g['speedup_median_step'], '{:.2f}')} | {spread(g['speedup_all_steps'], '{:.2f}')} | "
                     f"{spread(g['balance_ms'], '{:.2f}')} | {', '.join(str(m) for m in g['moved_experts'])} |")
        last = g["trace"]
    return "\n".join(lines)


def markdown(paths) -> str:
    """The table of every file in ``paths``, as Markdown (a row per file,
    trace and arm)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for path in paths:
        last = None
        for row in rows_of(_read(path)):
            name = _name(row)
            s = row["speedup"]
            lines.append(
                f"| {name if name != last else ''} | {row['arm']} | {row['imbalance'][0]:.3f} ({row['imbalance'][1]:.3f}) | "
                f"{row['layer_ms'][0]:.1f} ms [{row['layer_ms'][1]:.1f}, {row['layer_ms'][2]:.1f}] | "
                f"{'-' if s is None else f'{s[0]:.2f} / {s[1]:.2f}'} | {row['ffn_ms']:.1f} ms | "
                f"{row['dispatch_ms']:.2f} | {row['combine_ms']:.2f} | {row['balance_ms']:.2f} | "
                f"{row['moved_experts']} |")
            last = name
    return "\n".join(lines)


BOUND_COLUMNS = ("file", "trace", "policy of the records", "planned max/mean: records' groups", "planned max/mean: global",
                 "per_step measured")


def planner_bound(path) -> list[dict]:
    """Per trace of one file: the medians over the ``per_step`` arm's steps
    of the planner's max/mean GPU load on that step's logical loads, with
    the records' groups and with one group, and of the measured max/mean."""
    from ..balance import rebalance_experts
    by_trace: dict = {}
    for r in _read(path):
        if r["arm"] == "per_step":
            by_trace.setdefault(_key(r), []).append(r)
    out = []
    for rs in by_trace.values():
        r0 = rs[0]
        nodes, groups = r0.get("nodes", 1), r0.get("groups", 1) or 1

        def planned(num_groups):
            vals = []
            for r in rs:
                loads = np.asarray(r["logical_loads"], dtype=np.float64)[None]
                g = np.asarray(rebalance_experts(loads, r["physical_experts"], num_groups, nodes,
                                                 r["ranks"]).gpu_loads(loads))[0]
                vals.append(g.max() / g.mean())
            return float(np.median(vals))
        out.append({"trace": _name({"trace": r0["trace"], "trace_params": r0["trace_params"]}),
                    "policy": r0.get("policy"), "groups": groups, "nodes": nodes,
                    "planned_groups": planned(groups), "planned_global": planned(1),
                    "measured": float(np.median([r["imbalance"] for r in rs]))})
    return out


def markdown_planner_bound(paths) -> str:
    """The table of :func:`planner_bound` for every file, as Markdown."""
    lines = ["| " + " | ".join(BOUND_COLUMNS) + " |", "|" + " --- |" * len(BOUND_COLUMNS)]
    for path in paths:
        for b in planner_bound(path):
            lines.append(f"| {Path(path).name} | {b['trace']} | {b['policy']} ({b['groups']} groups, {b['nodes']} nodes) | "
                         f"{b['planned_groups']:.3f} | {b['planned_global']:.3f} | {b['measured']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.balance_table", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="records of experiments/study_balance.py (JSONL)")
    p.add_argument("--over-runs", action="store_true",
                   help="the files are repeated runs: medians over runs with their [min, max]")
    p.add_argument("--planner-bound", action="store_true",
                   help="per file and trace: the planner's max/mean on the per_step arm's loads, with the "
                        "records' groups and globally, beside the measured one")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        print(f"balance_table: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        if args.planner_bound:
            print(markdown_planner_bound(args.files))
        else:
            print(markdown_over_runs(args.files) if args.over_runs else markdown(args.files))
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"balance_table: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
