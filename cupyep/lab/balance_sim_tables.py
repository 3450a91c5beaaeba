"""The balance simulator's tables, from its output.

    python -m cupyep.lab.balance_sim_tables results/balance_sim/sim.jsonl

Reads the JSONL that ``python -m cupyep.lab.balance_sim`` writes and prints,
as Markdown: the fitted cost model, the validation against the measured
runs, one table per trace of the arms at every simulated rank count, and
the break-even points of the sweeps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ARMS = ("none", "eplb", "migration", "per_step")


def _ms(us) -> str:
    return f"{us / 1e3:,.1f}"


def _size(nbytes, always) -> str:
    if always:
        return "always"
    if nbytes is None:
        return "never"
    return f"{nbytes / 2 ** 20:,.0f} MiB"


def cost_model(model: dict) -> str:
    """The fitted terms of a "cost_model" record."""
    e = model.get("fit_error") or {}
    arms = [a for a in ARMS if a in model["overhead_us"]]
    lines = ["| term | fitted | standard error |", "| --- | ---: | ---: |",
             f"| FFN a + b pairs | a = {model['ffn_us']:.0f} us, b = {model['ffn_us_per_pair']:.4f} us/pair | "
             f"{e.get('ffn_us', 0):.0f} us, {e.get('ffn_us_per_pair', 0):.4f} |",
             f"| dispatch c + d rows | c = {model['dispatch_us']:.0f} us, d = {model['dispatch_us_per_row']:.4f} us/row | "
             f"{e.get('dispatch_us', 0):.0f} us, {e.get('dispatch_us_per_row', 0):.4f} |",
             f"| combine c' + d' rows | c' = {model['combine_us']:.0f} us, d' = {model['combine_us_per_row']:.4f} "
             f"us/row | {e.get('combine_us', 0):.0f} us, {e.get('combine_us_per_row', 0):.4f} |",
             "| per-step overhead | " + ", ".join(f"{a} {model['overhead_us'][a]:.0f}" for a in arms) + " us | "
             + ", ".join(f"{(e.get('overhead_us') or {}).get(a, 0):.0f}" for a in arms) + " |",
             f"| a plan | {model['plan_us']:.0f} us at E = {model['plan_experts']} | {e.get('plan_us', 0):.0f} |",
             f"| a move | {model['copy_GBps']:.1f} GB/s for the busiest rank's bytes | {e.get('copy_GBps', 0):.1f} |",
             "| replica choice (map) | " + ", ".join(f"{a} {model['map_us'][a]:.0f}" for a in arms) + " us | "
             + ", ".join(f"{(e.get('map_us') or {}).get(a, 0):.0f}" for a in arms) + " |",
             f"| first-move setup | {model['setup_us'] / 1e3:.1f} ms once per layer | {e.get('setup_us', 0) / 1e3:.1f} ms |",
             f"| rest | {model['other_us']:.0f} us | {e.get('other_us', 0):.0f} |"]
    return "\n".join(lines)


def validation(records: list) -> str:
    """The "validation" records: per arm, the relative errors in percent."""
    lines = ["| arm | steps | median, every step | worst, every step | median, no first move | "
             "worst, no first move |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for v in sorted(records, key=lambda v: ARMS.index(v["arm"])):
        lines.append(f"| {v['arm']} | {v['points']} | {100 * v['median_rel_err']:.1f} % | "
                     f"{100 * v['worst_rel_err']:.1f} % | {100 * v['median_rel_err_steady']:.1f} % | "
                     f"{100 * v['worst_rel_err_steady']:.1f} % |")
    return "\n".join(lines)


def summary(records: list) -> str:
    """One table per trace of the "summary" records (their order)."""
    out, traces = [], []
    for r in records:
        key = (r["trace"], json.dumps(r["trace_params"], sort_keys=True))
        if key not in traces:
            traces.append(key)
    for trace, params in traces:
        rows = [r for r in records if (r["trace"], json.dumps(r["trace_params"], sort_keys=True)) == (trace, params)]
        name = ",".join(f"{k}={v}" for k, v in json.loads(params).items())
        out += [f"**`{trace}:{name}`**", "",
                "| ranks | arm | max/mean | layer ms | straggler ms | balancing ms/step | plans/step | "
                "busiest rank moves/step | speed-up vs none | break-even expert size |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(rows, key=lambda r: (r["ranks"], ARMS.index(r["arm"]))):
            out.append(f"| {r['ranks']} | {r['arm']} | {r['imbalance_mean']:.3f} | {_ms(r['layer_us_mean'])} | "
                       f"{_ms(r['straggler_us_mean'])} | {r['balance_us_mean'] / 1e3:.2f} | "
                       f"{r['plans_per_step']:.2f} | {r['busiest_moved_mean']:.1f} | {r['speedup_vs_none']:.2f} | "
                       f"{'-' if r['arm'] == 'none' else _size(r['break_even_expert_bytes'], r['always_pays'])} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def break_even(records: list) -> str:
    """The "break_even" records: where each swept arm's saving over none
    changes sign."""
    lines = ["| swept | trace | ranks | arm | break-even | crossings | pays at the lowest / highest value |",
             "| --- | --- | ---: | --- | ---: | --- | --- |"]
    for b in records:
        unit = (lambda v: f"{v / 2 ** 20:,.1f} MiB") if b["param"] == "expert_bytes" else (lambda v: f"{v:.1f}")
        value = "-" if b["value"] is None else unit(b["value"])
        lines.append(f"| {b['param']} | {b['trace']} | {b['ranks']} | {b['arm']} | {value} | "
                     f"{', '.join(unit(c) for c in b['crossings']) or '-'} | "
                     f"{'yes' if b['pays_at_lowest'] else 'no'} / {'yes' if b['pays_at_highest'] else 'no'} |")
    return "\n".join(lines)


def markdown(path) -> str:
    """Every table of the simulator's output at ``path``, separated by a
    blank line: cost model, validation, the traces, the break-even points."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    kinds = {k: [r for r in records if r.get("kind") == k] for k in ("cost_model", "validation", "summary",
                                                                      "break_even")}
    parts = []
    if kinds["cost_model"]:
        parts.append(cost_model(kinds["cost_model"][0]))
    if kinds["validation"]:
        parts.append(validation(kinds["validation"]))
    if kinds["summary"]:
        parts.append(summary(kinds["summary"]))
    if kinds["break_even"]:
        parts.append(break_even(kinds["break_even"]))
    if not parts:
        raise ValueError(f"{path} holds no records of the balance simulator")
    return "\n\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.balance_sim_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="the output of python -m cupyep.lab.balance_sim (JSONL)")
    args = p.parse_args(argv)
    if not Path(args.file).is_file():
        print(f"balance_sim_tables: no such file: {args.file}", file=sys.stderr)
        return 2
    try:
        print(markdown(args.file))
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"balance_sim_tables: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
