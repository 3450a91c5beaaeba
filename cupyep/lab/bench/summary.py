"""Tables over runs of the main job: median time, spread, speed-up over naive.

    python -m cupyep.lab.bench.summary RUN_DIR [RUN_DIR ...] [--markdown]

Each RUN_DIR is a folder the main job wrote (``results/main/<UTC time>/``);
every ``*.jsonl`` in it is read. Per (bench, kind, ranks, tokens) the table
gives the median over runs of each run's median time, the spread (min-max
over runs), per-rank GB/s (median over runs) and the speed-up over the naive
baseline of the same ranks and tokens (naive "dispatch" for dispatch kinds,
"combine" for combine kinds; whole calls only, not hook halves or ablations).

The time of a record (:func:`record_time_us`): ``time_us`` where present
(normal mode and naive: CUDA events around the whole call, slowest rank's
median; the naive calls on a host-aligned boundary, ``"timing":
"host_aligned"``), else ``kernel_median_us`` (low latency: the kernel itself, first
block start to last block end, slowest rank's median). Low-latency records
timed on another boundary (``"timing": "deepep"``) form kinds of their own,
``<kind> [deepep]``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BENCH_ORDER = ("normal", "low_latency", "naive")
# Each bench's default timing boundary: the kernels' strict one, and the
# naive baseline's host-aligned one (its calls synchronize with the host).
DEFAULT_TIMINGS = (None, "strict", "host_aligned")
NOT_WHOLE_CALLS = ("half", "ablate", "scatter", "cross", "trace")


def load_jsonl(path) -> list[dict]:
    """Records of one JSONL file; lines that do not parse (a run cut short
    mid-line) are skipped with a warning on stderr."""
    records = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path}:{i} is not JSON, skipped", file=sys.stderr)
    return records


def load_run(run_dir) -> list[dict]:
    """Every record of every ``*.jsonl`` in ``run_dir`` (file name order)."""
    return [r for p in sorted(Path(run_dir).glob("*.jsonl")) for r in load_jsonl(p)]


def record_time_us(rec: dict) -> float | None:
    """The time a record reports, in microseconds (see the module docstring), or None."""
    for key in ("time_us", "kernel_median_us"):
        if rec.get(key) is not None:
            return float(rec[key])
    return None


def record_rank_GBps(rec: dict) -> float | None:
    """Per-rank GB/s: ``rank_GBps`` (received rows x row bytes / time), else
    bytes moved between ranks (``bytes_to_peers``, all ranks) / ranks / time."""
    if rec.get("rank_GBps") is not None:
        return float(rec["rank_GBps"])
    t = record_time_us(rec)
    if rec.get("bytes_to_peers") and t and rec.get("ranks"):
        return rec["bytes_to_peers"] / rec["ranks"] / (t * 1e-6) / 1e9
    return None


def bench_label(rec: dict) -> str:
    """The bench name, with the backend when it is not the kernels."""
    b = str(rec.get("bench", "?"))
    return f"{b} [{rec['backend']}]" if rec.get("backend") else b


def kind_label(rec: dict) -> str:
    """The kind, with the timing boundary when it is not the bench's default."""
    k = str(rec.get("kind", "?"))
    timing = rec.get("timing")
    return f"{k} [{timing}]" if timing not in DEFAULT_TIMINGS else k


def naive_kind(kind: str) -> str | None:
    """The naive kind a whole-call kind compares with ("dispatch" / "combine"), or None."""
    base = kind.split(" [")[0]
    if any(w in base for w in NOT_WHOLE_CALLS):
        return None
    for k in ("dispatch", "combine"):
        if base.startswith(k):
            return k
    return None


def timed(records) -> list[dict]:
    """Records with a time, sweep points left out."""
    return [r for r in records if not r.get("sweep") and record_time_us(r) is not None]


@dataclass(frozen=True)
class Row:
    """One line of the table: times in microseconds, GB/s per rank."""
    bench: str
    kind: str
    ranks: int
    tokens: int
    runs: int
    median_us: float
    min_us: float
    max_us: float
    rank_GBps: float | None
    speedup: float | None


def _key(rec: dict) -> tuple:
    return bench_label(rec), kind_label(rec), int(rec.get("ranks", 0)), int(rec.get("tokens", 0))


def summarize(runs) -> list[Row]:
    """Rows over runs.

    Arguments:
        runs: list over runs of that run's records (list of dicts).

    Returns:
        list of Row, sorted by tokens (largest first), bench, kind (dispatch
        kinds first, then combine kinds), ranks.
    """
    per_key: dict[tuple, list[tuple[float, float | None]]] = {}
    for records in runs:
        groups: dict[tuple, list[dict]] = {}
        for r in timed(records):
            groups.setdefault(_key(r), []).append(r)
        for key, recs in groups.items():
            gbps = [g for g in map(record_rank_GBps, recs) if g is not None]
            per_key.setdefault(key, []).append(
                (float(np.median([record_time_us(r) for r in recs])), float(np.median(gbps)) if gbps else None))
    medians = {k: float(np.median([t for t, _ in v])) for k, v in per_key.items()}
    rows = []
    for key, vals in per_key.items():
        bench, kind, ranks, tokens = key
        times = [t for t, _ in vals]
        gbps = [g for _, g in vals if g is not None]
        speedup = None
        nk = naive_kind(kind)
        if bench != "naive" and nk and ("naive", nk, ranks, tokens) in medians:
            speedup = medians[("naive", nk, ranks, tokens)] / medians[key]
        rows.append(Row(bench, kind, ranks, tokens, len(vals), medians[key], min(times), max(times),
                        float(np.median(gbps)) if gbps else None, speedup))

    def order(row):
        b = row.bench.split(" [")[0]
        family = next((i for i, f in enumerate(("dispatch", "combine")) if row.kind.startswith(f)), 2)
        return (-row.tokens, BENCH_ORDER.index(b) if b in BENCH_ORDER else len(BENCH_ORDER), row.bench,
                family, row.kind, row.ranks)
    return sorted(rows, key=order)


def _us(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1e4 else f"{v:.0f}"


COLUMNS = {
    "bench": ("bench", lambda r: r.bench),
    "kind": ("kind", lambda r: r.kind),
    "ranks": ("ranks", lambda r: str(r.ranks)),
    "tokens": ("tokens", lambda r: str(r.tokens)),
    "runs": ("runs", lambda r: str(r.runs)),
    "median_us": ("median us", lambda r: _us(r.median_us)),
    "spread_us": ("min-max us", lambda r: f"{_us(r.min_us)}-{_us(r.max_us)}"),
    "rank_GBps": ("GB/s per rank", lambda r: "-" if r.rank_GBps is None else f"{r.rank_GBps:.1f}"),
    "speedup": ("vs naive", lambda r: "-" if r.speedup is None else f"{r.speedup:.1f}x"),
}
SUMMARY_COLUMNS = ("bench", "kind", "ranks", "tokens", "runs", "median_us", "spread_us", "rank_GBps", "speedup")
RUN_COLUMNS = ("bench", "kind", "ranks", "tokens", "median_us", "rank_GBps", "speedup")


def format_table(rows, columns=SUMMARY_COLUMNS, markdown: bool = False) -> str:
    """The rows as aligned text, or as a Markdown table."""
    heads = [COLUMNS[c][0] for c in columns]
    cells = [[COLUMNS[c][1](r) for c in columns] for r in rows]
    numeric = [c not in ("bench", "kind") for c in columns]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |",
                 "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]

    def line(vals):
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, numeric)).rstrip()
    return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(row) for row in cells])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.bench.summary", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", help="folders written by the main job (results/main/<UTC time>/); "
                   "other paths (a README, a folder of figures) are skipped with a note")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table (for the README)")
    args = p.parse_args(argv)
    runs = []
    for d in args.run_dirs:
        if not Path(d).is_dir() or not ((Path(d) / "manifest.json").is_file() or any(Path(d).glob("*.jsonl"))):
            print(f"skipped {d}: not a run folder of the main job (no manifest.json, no records)", file=sys.stderr)
            continue
        runs.append(load_run(d))
    if not runs:
        print(f"none of {' '.join(args.run_dirs)} is a run folder of the main job", file=sys.stderr)
        return 2
    rows = summarize(runs)
    if not rows:
        print(f"no timed records in {' '.join(args.run_dirs)}", file=sys.stderr)
        return 1
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
