"""Command line of the sweep runner.

    python -m cupyep.lab.experiments STUDY [--ranks 2] [--ranks-per-node K] [--out results/sweeps/STUDY.jsonl]
        [--grid KNOB=V1,V2 ...] [--configs FILE.json] [--no-resume] [--timeout S] [--no-progress]
        [--fallback RESULTS.jsonl]
    python -m cupyep.lab.experiments --list

``--grid KNOB=VALUES``: comma-separated values, each read as an int, else a
float, else a string (``tokens=128,4096 routing=uniform,zipf``); VALUES
starting with ``[`` or ``{`` are JSON: a list of values or one dict
(``routing_params='[{"s": 0.5}, {"s": 1.5}]'``). Knobs not given take the
study's defaults. ``--configs FILE.json``: a JSON list of configuration
dicts instead of a grid. ``--ranks-per-node K``: emulate nodes of K ranks
on this host (the launcher's option; K divides ``--ranks``; default one
node); records of another layout are not resumed from. Ends with one line
per status (``ok``, ``skipped``, ``error``) and the output path; exit
status 0, 1 when a configuration's status is "error", 2 for bad usage or a
failed launch (a knob value of the wrong type or not among the knob's
choices is bad usage). ``--fallback RESULTS.jsonl``: on a machine without
a GPU, a GPU study reads its configurations' records from that file (a
committed results file) instead of running them.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

from . import DEFAULT_OUT, run
from .grid import parse_value
from .studies import all_studies, get


def parse_grid(items) -> dict:
    """``["tokens=4,8", "hidden=128"]`` -> ``{"tokens": [4, 8], "hidden": [128]}``."""
    grid = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--grid takes KNOB=VALUES, got {item!r}")
        if name in grid:
            raise ValueError(f"knob {name!r} given twice in --grid")
        if text.lstrip().startswith(("[", "{")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--grid {name}: not JSON: {exc}") from None
            grid[name] = value if isinstance(value, list) else [value]
        else:
            grid[name] = [parse_value(v) for v in text.split(",")]
    return grid


def list_studies() -> str:
    lines = []
    for st in all_studies():
        lines.append(f"{st.name}{' (needs a GPU)' if st.needs_gpu else ''}: {st.description}")
        lines += [f"    {name} = {json.dumps(default)}" for name, default in st.knobs.items()]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.experiments", description=__doc__.split("\n\n")[0])
    p.add_argument("study", nargs="?", help="registered study name (see --list)")
    p.add_argument("--list", action="store_true", help="print the studies and their knobs")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                   help="emulated nodes of K ranks (the launcher's --ranks-per-node; default: one node)")
    p.add_argument("--out", help=f"JSONL output (default {DEFAULT_OUT})")
    p.add_argument("--grid", nargs="+", action="extend", default=[], metavar="KNOB=VALUES")
    p.add_argument("--configs", metavar="FILE.json", help="a JSON list of configurations instead of --grid")
    p.add_argument("--no-resume", action="store_true", help="run configurations already in --out again")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole launch")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--fallback", metavar="RESULTS.jsonl",
                   help="without a GPU: read a GPU study's records from this file instead of running it")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        print(list_studies())
        return 0
    if not args.study:
        p.error("give a STUDY (or --list)")
    try:
        study = get(args.study)
        if args.configs and args.grid:
            raise ValueError("give --grid or --configs, not both")
        if args.configs:
            with open(args.configs) as f:
                grid = json.load(f)
        else:
            grid = parse_grid(args.grid)
        recs = run(study, grid, ranks=args.ranks, out=args.out, resume=not args.no_resume,
                   progress=not args.no_progress, timeout=args.timeout, ranks_per_node=args.ranks_per_node,
                   fallback=args.fallback)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"python -m cupyep.lab.experiments: error: {exc}", file=sys.stderr)
        return 2
    counts = collections.Counter(r["status"] for r in recs)
    for status in ("ok", "skipped", "error"):
        print(f"{status}: {counts.get(status, 0)}")
    for r in recs:
        if r["status"] != "ok":
            print(f"  {r['status']}: {r['key']}: {r.get('reason')}")
    print(f"records: {args.out or DEFAULT_OUT.format(study=study.name)}")
    return 1 if counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
