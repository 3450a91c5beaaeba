"""The balance study's table: per trace and arm, from its records.

    python -m cupyep.lab.balance_table results/balance_study/study_8ranks_hot05.jsonl [...]

Each file holds the records of ``experiments/study_balance.py`` (one per
(trace, arm, step)); one table row per (file, arm): the max over mean
(row, expert) pairs per rank (median step, worst step), the layer's time per
step (median, min, max), the speed-up over ``none`` of the median step and
of all steps together (balancing included), and the medians of the slowest
rank's FFN, dispatch, combine and balancing, and the experts moved.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

COLUMNS = ("trace", "arm", "max/mean pairs: median (worst step)", "layer: median [min, max]",
           "speed-up: median / all steps", "straggler FFN", "dispatch", "combine", "balancing", "experts moved")


def rows_of(records: list) -> list[dict]:
    """One dict per arm of one file's records (in the order the arms ran):
    imbalance, layer_ms (median, min, max), speedup (median step, all
    steps; None without a "none" arm), the phases' medians in ms and the
    experts moved."""
    arms: dict = {}
    for r in records:
        arms.setdefault(r["arm"], []).append(r)
    base = arms.get("none")
    out = []
    for arm, rs in arms.items():
        layer = np.array([r["layer_us"] for r in rs]) / 1e3
        imb = np.array([r["imbalance"] for r in rs])

        def phase(key):
            return float(np.median([max(r["us"][key]) for r in rs])) / 1e3
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


def markdown(paths) -> str:
    """The table of every file in ``paths``, as Markdown."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for path in paths:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not records:
            raise ValueError(f"{path} holds no records")
        for i, row in enumerate(rows_of(records)):
            params = ", ".join(f"{k} {v}" for k, v in row["trace_params"].items())
            name = f"{row['trace']}, {params}" if params else row["trace"]
            s = row["speedup"]
            lines.append(
                f"| {name if i == 0 else ''} | {row['arm']} | {row['imbalance'][0]:.3f} ({row['imbalance'][1]:.3f}) | "
                f"{row['layer_ms'][0]:.1f} ms [{row['layer_ms'][1]:.1f}, {row['layer_ms'][2]:.1f}] | "
                f"{'-' if s is None else f'{s[0]:.2f} / {s[1]:.2f}'} | {row['ffn_ms']:.1f} ms | "
                f"{row['dispatch_ms']:.2f} | {row['combine_ms']:.2f} | {row['balance_ms']:.2f} | "
                f"{row['moved_experts']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.balance_table", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="records of experiments/study_balance.py (JSONL)")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        print(f"balance_table: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        print(markdown(args.files))
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"balance_table: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
