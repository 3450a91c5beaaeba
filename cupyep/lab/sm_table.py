"""Build the measured SM-defaults table (cupyep.sm_defaults) from sweep records.

    python -m cupyep.launcher -n R experiments/bench_normal.py --transports direct \
        --kinds dispatch_bf16 dispatch_fp8 combine_bf16 --direct-sms 4 8 16 ... --timing strict --out sms_Rranks_N.jsonl
    python -m cupyep.launcher -n R experiments/bench_low_latency.py --tokens 128 1 --num-blocks 4 8 16 ... \
        --no-hook --out ll_sms_Rranks_N.jsonl
    python -m cupyep.lab.sm_table sms_*.jsonl ll_sms_*.jsonl --out table.json --markdown

Run each sweep at least three times: every point's time is the median of
the records that timed it. Point ``CUPYEP_SM_DEFAULTS`` at the written
table to make its choices the defaults on that machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..sm_defaults import TOLERANCE, build
from . import plotting


def markdown(table: list[dict]) -> str:
    """One row per entry: the swept counts with their times, and the choice."""
    lines = ["| route | kind | ranks | tokens | us at each count of blocks per rank | best | chosen (within 5 %) | runs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in table:
        times = {int(b): t for b, t in e["times_us"].items()}
        best = min(times, key=times.get)
        pts = ", ".join(f"{b}: {t:.1f}" for b, t in sorted(times.items()))
        lines.append(f"| {e['route']} | {e['kind']} | {e['ranks']} | {e['tokens']} | {pts} | {best} | "
                     f"**{e['blocks']}** | {e['runs']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", help="JSONL files of bench_normal / bench_low_latency sweeps")
    p.add_argument("--out", help="write the table (JSON) here")
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)
    records = [r for f in args.records for r in plotting.load(f)]
    table = build(records, args.tolerance)
    if not table:
        print("no strict-boundary sweep points with an explicit block count in these records", file=sys.stderr)
        return 1
    text = json.dumps(table, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(markdown(table) if args.markdown else text, end="" if not args.markdown else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
