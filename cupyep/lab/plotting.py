"""Figures of any results file: one call (or one command) per figure.

    python -m cupyep.lab.plotting FILE.jsonl knob --x tokens --y time_us --by kind --out fig
    python -m cupyep.lab.plotting FILE.jsonl heatmap --x dispatch_config.queue_depth \\
        --y dispatch_config.chunk_size --value time_us --where kind=dispatch_bf16 ranks=8 --out heat
    python -m cupyep.lab.plotting FILE.jsonl cdf --samples wait_us --by ranks --out waits
    python -m cupyep.lab.plotting FILE.jsonl crossover --x tokens --y time_us --by mode --out cross
    python -m cupyep.lab.plotting FILE.jsonl scatter --x rank_GBps --y calc_diff --by kind --out fp8
    python -m cupyep.lab.plotting RUN_DIR main      # RUN_DIR/normal.png, low_latency.png (+ .svg)
    python -m cupyep.lab.plotting RUN1 RUN2 RUN3 main --out DIR   # medians of the runs, bars min-max

Records are the JSON objects of a JSONL file (the benchmarks', the main
job's and the sweeps' all work). A field is named by its key, or by a dotted
path into nested objects (``dispatch_config.queue_depth``). ``where``
keeps the records whose fields equal the given values (a list: any of them).
Units come from the field names (a word ``us``, ``ms``, ``GBps``, ``bytes``
... after the first: ``time_us``, ``total_us_median``) and appear on the axes.

The functions return matplotlib Figures (no pyplot: notebooks and headless
runs alike); :func:`save` writes a figure as PNG and SVG.

- :func:`knob_figure`: a metric against any knob, one line per ``by`` value,
  with a p10-p90 band when the records carry ``p10_*``/``p90_*`` of it;
- :func:`heatmap_figure`: a metric over two knobs (queue depth x chunk
  size), the best cell outlined;
- :func:`cdf_figure`: the distribution of a list-valued field (signal-wait
  samples), one curve per ``by`` value, p50 and p99 marked;
- :func:`crossover_figure`: time against a knob for several modes, with the
  knob values where the fastest mode changes (:func:`crossovers`) marked;
- :func:`scatter_figure`: one metric against another (FP8 error against
  bandwidth; imbalance factor against straggler time);
- :func:`main_normal_figure` and :func:`main_low_latency_figure`: the main
  job's two figures of a run folder (``results/main/<UTC time>/``), which
  :func:`main_figures` saves there as ``normal`` and ``low_latency``; given
  several run folders, each bar is the median over the runs with an error
  bar from their min to their max.

The main job's normal-mode figure has GB/s per rank (received rows x row
bytes / time) per kind and rank count, the naive baseline's dispatch and
combine at the same tokens beside them (hatched, grey), and the copy roofline
per rank (a dashed line over each rank count's bars):

    copy roofline per rank = copy_GBps / (2 x ranks per GPU)

``copy_GBps`` is the copy kernel's bandwidth in read + write bytes per
second; receiving B bytes takes at least one pass that reads B and writes B,
and the ranks sharing a GPU share its bandwidth. So the line is the most a
rank can receive per second on a one-copy design; a two-copy design (the
normal mode's ring queues) meets half of it when every byte goes through HBM
twice. The low-latency figure has the kernel median (slowest rank) per kind
and rank count, one panel per token count (128 and 1), the naive baseline's
whole-call median beside it (hatched, grey), on a log scale. Both read only
the records timed on each bench's default boundary (strict; the naive
baseline's host-aligned one), sweep points left out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from .bench.summary import DEFAULT_TIMINGS, record_time_us
from .experiments.grid import parse_value

UNITS = {"us": "us", "ms": "ms", "s": "s", "GBps": "GB/s", "bytes": "bytes", "MiB": "MiB"}


def field(rec: dict, key: str):
    """``rec[key]``, or the value at a dotted path; None when absent."""
    if key in rec:
        return rec[key]
    cur = rec
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


NAMES = {"rank_GBps": "bandwidth per rank (GB/s)", "copy_GBps": "copy bandwidth (GB/s)",
         "efficiency": "efficiency (fraction of the copy roofline)", "calc_diff": "calc_diff (1 - similarity)"}


def label(key: str) -> str:
    """Axis label of a field: its last path part with the unit word taken out
    and put last (``time_us`` -> "time (us)", ``total_us_median`` -> "total
    median (us)")."""
    name = key.split(".")[-1]
    if name in NAMES:
        return NAMES[name]
    words = name.split("_")
    for i, w in enumerate(words):
        if i and w in UNITS:
            return f"{' '.join(words[:i] + words[i + 1:])} ({UNITS[w]})"
    return name.replace("_", " ")


def select(records, where: dict | None = None) -> list[dict]:
    """Records whose fields equal ``where``'s values (a list or tuple: any of them)."""
    out = []
    for r in records:
        ok = True
        for k, v in (where or {}).items():
            got = field(r, k)
            if isinstance(v, (list, tuple, set)):
                ok = got in v
            else:
                ok = got == v
            if not ok:
                break
        if ok:
            out.append(r)
    return out


def _require(records, *keys) -> None:
    if not records:
        raise ValueError("no records to plot (check the file and the where filter)")
    for k in keys:
        if k and not any(field(r, k) is not None for r in records):
            have = sorted({kk for r in records for kk in r})
            raise ValueError(f"no record has field {k!r}; fields: {have}")


def _groups(records, by):
    """[(label, records)] by the value of field ``by`` (one group when None), in first-seen order."""
    if by is None:
        return [(None, list(records))]
    groups: dict = {}
    for r in records:
        groups.setdefault(json.dumps(field(r, by), sort_keys=True, default=str), []).append(r)
    return [(f"{by.split('.')[-1]} = {json.loads(k)}", v) for k, v in groups.items()]


def _series(records, x, y):
    """Sorted (xs, ys) of records with both fields (the median where an x repeats)."""
    pts: dict = {}
    for r in records:
        xv, yv = field(r, x), field(r, y)
        if xv is not None and yv is not None:
            pts.setdefault(xv, []).append(float(yv))
    xs = sorted(pts)
    return xs, [float(np.median(pts[v])) for v in xs]


def _figure(width=7.0, height=4.2, ncols: int | None = None):
    """A Figure and its Axes; with ``ncols``, a list of that many side by side."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    if ncols is None:
        return fig, fig.subplots()
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _finish(ax, xlabel: str, ylabel: str, title: str, legend: bool = True, grid: str = "both") -> None:
    """Axis labels, grid (``grid``: "both", "x" or "y"), legend and title of a figure's axes."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis=grid)
    ax.set_axisbelow(True)
    if legend:
        ax.legend(fontsize="small")
    ax.set_title(title, fontsize="medium")


def _legend_beside(fig, axes) -> None:
    """One legend for all of ``axes``, to the right of them (each label once)."""
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), loc="outside right upper", fontsize="small")


def _log_if_wide(ax, xs, axis="x"):
    vals = [v for v in xs if isinstance(v, (int, float)) and v > 0]
    if len(vals) > 1 and max(vals) / min(vals) >= 64:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2 if axis == "x" else 10)


def knob_figure(records, x: str, y: str = "time_us", by: str | None = None, where: dict | None = None,
                title: str | None = None):
    """``y`` against knob ``x``, one line per value of ``by``; a p10-p90 band
    where the records carry ``p10_<name>`` and ``p90_<name>`` (or
    ``<stem>p10_us``-style keys next to ``median_us``)."""
    recs = select(records, where)
    _require(recs, x, y, by)
    fig, ax = _figure()
    name = y.split(".")[-1]
    lo_key, hi_key = _band_keys(name)
    for lab, group in _groups(recs, by):
        xs, ys = _series(group, x, y)
        line, = ax.plot(xs, ys, marker="o", label=lab)
        if lo_key and all(field(r, lo_key) is not None and field(r, hi_key) is not None for r in group):
            _, lo = _series(group, x, lo_key)
            _, hi = _series(group, x, hi_key)
            ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color(), linewidth=0)
    _log_if_wide(ax, [field(r, x) for r in recs])
    _finish(ax, label(x), label(y), title or f"{label(y)} against {x.split('.')[-1]}", legend=by is not None)
    return fig


def _band_keys(name: str):
    """The p10/p90 keys that go with metric ``name`` (median_us -> p10_us, p90_us)."""
    if name.startswith("median_"):
        unit = name[len("median"):]
        return f"p10{unit}", f"p90{unit}"
    if name.endswith("_median"):
        stem = name[:-len("median")]
        return f"{stem}p10", f"{stem}p90"
    return f"p10_{name}", f"p90_{name}"


def heatmap_figure(records, x: str, y: str, value: str = "time_us", where: dict | None = None,
                   lower_is_better: bool = True, title: str | None = None):
    """``value`` over knobs ``x`` (columns) and ``y`` (rows), each cell
    annotated, the best one outlined; cells no record has are left blank."""
    recs = select(records, where)
    _require(recs, x, y, value)
    xs = sorted({field(r, x) for r in recs if field(r, x) is not None})
    ys = sorted({field(r, y) for r in recs if field(r, y) is not None})
    grid = heatmap_values(recs, x, y, value, xs, ys)
    fig, ax = _figure(width=1.2 * len(xs) + 3, height=0.8 * len(ys) + 2)
    m = np.ma.masked_invalid(grid)
    im = ax.imshow(m, cmap="viridis_r" if lower_is_better else "viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    lo, hi = (float(np.nanmin(grid)), float(np.nanmax(grid))) if np.isfinite(grid).any() else (0.0, 1.0)
    for i in range(len(ys)):
        for j in range(len(xs)):
            if not math.isnan(grid[i, j]):
                f = (grid[i, j] - lo) / (hi - lo) if hi > lo else 0.0
                light = f < 0.5 if lower_is_better else f > 0.5  # the colormap's light end
                ax.text(j, i, f"{grid[i, j]:.4g}", ha="center", va="center", fontsize="x-small",
                        color="black" if light else "white")
    if np.isfinite(grid).any():
        best = np.nanargmin(grid) if lower_is_better else np.nanargmax(grid)
        i, j = np.unravel_index(best, grid.shape)
        from matplotlib.patches import Rectangle
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    fig.colorbar(im, ax=ax, label=label(value))
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    ax.set_title(title or f"{label(value)}, best outlined", fontsize="medium")
    return fig


def heatmap_values(records, x, y, value, xs, ys) -> np.ndarray:
    """[len(ys), len(xs)] float64: the median ``value`` of the records at
    each (y, x), NaN where there is none."""
    grid = np.full((len(ys), len(xs)), np.nan)
    cells: dict = {}
    for r in records:
        xv, yv, v = field(r, x), field(r, y), field(r, value)
        if xv in xs and yv in ys and v is not None:
            cells.setdefault((ys.index(yv), xs.index(xv)), []).append(float(v))
    for (i, j), vals in cells.items():
        grid[i, j] = float(np.median(vals))
    return grid


def cdf_figure(records, samples: str, by: str | None = None, where: dict | None = None,
               threshold: float | None = None, title: str | None = None):
    """Empirical CDF of the list-valued field ``samples`` (e.g. signal waits
    in us), pooled per value of ``by``; p50 and p99 marked on each curve, and
    ``threshold`` (e.g. the 100 us p99 budget) as a vertical line."""
    recs = select(records, where)
    _require(recs, samples, by)
    fig, ax = _figure()
    for lab, group in _groups(recs, by):
        vals = np.sort(np.concatenate([np.asarray(field(r, samples) or [], dtype=np.float64) for r in group]))
        if not vals.size:
            continue
        ps = np.arange(1, vals.size + 1) / vals.size
        line, = ax.step(vals, ps, where="post", label=f"{lab}, n = {vals.size}" if lab else f"n = {vals.size}")
        for q in (0.5, 0.99):
            v = float(np.quantile(vals, q))
            ax.plot([v], [q], marker="o", color=line.get_color())
            ax.annotate(f"p{int(q * 100)} {v:.3g}", (v, q), textcoords="offset points", xytext=(4, -10),
                        fontsize="x-small", color=line.get_color())
    if threshold is not None:
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"{threshold:g}")
    ax.set_ylim(0, 1.02)
    _finish(ax, label(samples), "fraction of samples", title or f"distribution of {samples.split('.')[-1]}")
    return fig


def crossovers(series: dict) -> list[tuple[float, str, str]]:
    """Where the fastest of several series changes.

    Arguments:
        series: {name: (xs, ys)}, each xs ascending; compared on the xs all
            series share.

    Returns:
        [(x, faster_before, faster_after)]: x is where the two lines cross,
        interpolated linearly (in log x when every x is positive) between the
        shared points that bracket the change.
    """
    shared = sorted(set.intersection(*(set(xs) for xs, _ in series.values()))) if series else []
    if len(shared) < 2:
        return []
    vals = {n: dict(zip(xs, ys)) for n, (xs, ys) in series.items()}
    best = [min(vals, key=lambda n: vals[n][x]) for x in shared]
    logx = all(x > 0 for x in shared)
    out = []
    for i in range(1, len(shared)):
        a, b = best[i - 1], best[i]
        if a == b:
            continue
        x0, x1 = shared[i - 1], shared[i]
        d0 = vals[a][x0] - vals[b][x0]  # < 0: a faster at x0
        d1 = vals[a][x1] - vals[b][x1]  # > 0: b faster at x1
        f = d0 / (d0 - d1) if d0 != d1 else 0.5
        if logx:
            x = math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0)))
        else:
            x = x0 + f * (x1 - x0)
        out.append((x, a, b))
    return out


def crossover_figure(records, x: str = "tokens", y: str = "time_us", by: str = "mode", where: dict | None = None,
                     title: str | None = None):
    """``y`` against ``x`` for each value of ``by`` (the modes), the points
    where the fastest mode changes marked and labelled."""
    recs = select(records, where)
    _require(recs, x, y, by)
    fig, ax = _figure()
    series = {}
    for lab, group in _groups(recs, by):
        xs, ys = _series(group, x, y)
        series[lab] = (xs, ys)
        ax.plot(xs, ys, marker="o", label=lab)
    for xc, a, b in crossovers(series):
        ax.axvline(xc, color="0.4", linestyle=":", linewidth=1)
        ax.annotate(f"{x.split('.')[-1]} = {xc:.3g}", (xc, ax.get_ylim()[1]), rotation=90, va="top", ha="right",
                    fontsize="x-small")
    _log_if_wide(ax, [field(r, x) for r in recs])
    _log_if_wide(ax, [field(r, y) for r in recs], axis="y")
    _finish(ax, label(x), label(y), title or f"fastest {by.split('.')[-1]} against {x.split('.')[-1]}")
    return fig


def scatter_figure(records, x: str, y: str, by: str | None = None, where: dict | None = None,
                   logy: bool = False, title: str | None = None):
    """``y`` against ``x``, a point per record, coloured by ``by`` (FP8 error
    against GB/s; imbalance factor against straggler time)."""
    recs = select(records, where)
    _require(recs, x, y, by)
    fig, ax = _figure()
    for lab, group in _groups(recs, by):
        pts = [(field(r, x), field(r, y)) for r in group if field(r, x) is not None and field(r, y) is not None]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=lab, s=18)
    if logy:
        ax.set_yscale("log")
    _finish(ax, label(x), label(y), title or f"{y.split('.')[-1]} against {x.split('.')[-1]}", legend=by is not None)
    return fig


# ------------------------------------------------------ the main job's figures ---

MAIN_NORMAL_KINDS = ("dispatch_bf16", "dispatch_fp8", "dispatch_bf16_notify", "combine_bf16",
                     "dispatch_bf16_direct", "dispatch_fp8_direct", "dispatch_bf16_notify_direct",
                     "combine_bf16_direct", "dispatch_bf16_notify_unfused_direct", "combine_bf16_zero_copy_direct",
                     "dispatch_bf16_expert_major", "dispatch_bf16_expert_major_direct")
MAIN_LOW_LATENCY_KINDS = ("dispatch_fp8", "dispatch_bf16", "combine", "combine_pull", "combine_zero_copy",
                          "combine_zero_copy_push")
MAIN_NAIVE_KINDS = ("dispatch", "combine")
ROOFLINE_LABEL = "copy roofline per rank = copy GB/s / (2 x ranks per GPU)"


def copy_roofline_per_rank(rec: dict) -> float | None:
    """GB/s per rank of one read + write pass: copy_GBps / (2 x ranks per GPU)."""
    if not rec.get("copy_GBps"):
        return None
    per_gpu = rec.get("env", {}).get("ranks_per_gpu") or rec.get("ranks", 1)
    return rec["copy_GBps"] / (2 * per_gpu)


def _default_timing(records, bench: str) -> list[dict]:
    """Records of ``bench`` timed on its default boundary, sweep points left out."""
    return [r for r in records if r.get("bench") == bench and r.get("timing") in DEFAULT_TIMINGS
            and not r.get("sweep")]


def _by_ranks(runs, kind, value) -> dict:
    """{ranks: [value(rec) of each run]}: per run (a list of records), the
    last record of ``kind`` at each rank count."""
    out: dict = {}
    for records in runs:
        last = {r["ranks"]: value(r) for r in records if r.get("kind") == kind and value(r) is not None}
        for n, v in last.items():
            out.setdefault(n, []).append(v)
    return out


def _bars(ax, series, ranks, order, width=0.8) -> None:
    """Grouped bars, a group per rank count (x ticks at the counts only).

    ``series``: [(label, {ranks: [value of each run]}, hatched)]: a bar is
    the median over the runs, with a min-max error bar where there are
    several; ``order``: every label of the figure, so that a label has the
    same colour in every panel. Hatched series (the naive baseline) are grey."""
    from matplotlib import colormaps
    greys = ("0.55", "0.8", "0.35", "0.95")
    plain = [lab for lab, hatched in order if not hatched]
    # tab10 up to 10 series; tab20 (light and dark pairs) beyond, where tab10 would repeat
    colours = colormaps["tab10" if len(plain) <= 10 else "tab20"].colors
    hatched_labels = [lab for lab, hatched in order if hatched]
    w = width / max(1, len(series))
    for i, (lab, vals, hatched) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * w for j in range(len(ranks))]
        if hatched:
            style = dict(hatch="//", color=greys[hatched_labels.index(lab) % len(greys)], edgecolor="black",
                         linewidth=0.5)
        else:
            style = dict(color=colours[plain.index(lab) % len(colours)])
        runs = [vals.get(n, []) for n in ranks]
        heights = [float(np.median(v)) if v else 0.0 for v in runs]
        ax.bar(xs, heights, w, label=lab, **style)
        spread = [(x, h, min(v), max(v)) for x, h, v in zip(xs, heights, runs) if len(v) > 1]
        if spread:
            x, h, lo, hi = (list(c) for c in zip(*spread))
            ax.errorbar(x, h, yerr=[np.subtract(h, lo), np.subtract(hi, h)], fmt="none", ecolor="black",
                        elinewidth=0.8, capsize=1.5)
    ax.set_xticks(range(len(ranks)), [str(n) for n in ranks])
    ax.set_xlim(-0.5, len(ranks) - 0.5)


def _log_y_plain(ax) -> None:
    """Log y axis with ticks at 1, 2 and 5 times the powers of ten, written
    as plain numbers (20, 50, 100 rather than only 10^2 and 10^3)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _gpu(records) -> str:
    return next((r["env"]["gpu"] for r in records if (r.get("env") or {}).get("gpu")), "GPU")


def _run_dirs(run_dir) -> list[Path]:
    """One run folder or several (a list)."""
    return [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(d) for d in run_dir]


def _run_files(run_dir, name, bench) -> list[list[dict]]:
    """Per run folder, the default-timing records of its ``name`` (none where absent)."""
    return [_default_timing(load(d / name) if (d / name).exists() else [], bench) for d in _run_dirs(run_dir)]


def _runs_note(runs) -> str:
    n = sum(1 for recs in runs if recs)
    return f"; median of {n} runs, bars min-max" if n > 1 else ""


def main_normal_figure(run_dir, title: str | None = None):
    """The main job's normal-mode figure of a run folder: GB/s per rank of
    each kind at each rank count (``normal.jsonl``), the naive baseline's
    dispatch and combine at the same tokens beside them (``naive.jsonl``,
    hatched) and the copy roofline per rank over each rank count's bars.

    Arguments:
        run_dir: a folder the main job wrote (``results/main/<UTC time>/``),
            or a list of such folders: each bar is then the median over the
            runs with their min-max, and the roofline the runs' median.
        title: figure title (default: the GPU and the tokens per rank, or the
            backend when the run was not on the kernels).

    Returns:
        matplotlib.figure.Figure.

    Raises:
        ValueError: no normal-mode record with ``rank_GBps`` in the folders.
    """
    runs = [[r for r in recs if r.get("rank_GBps") is not None]
            for recs in _run_files(run_dir, "normal.jsonl", "normal")]
    recs = [r for rs in runs for r in rs]
    if not recs:
        raise ValueError(f"no normal-mode records with rank_GBps in {run_dir}")
    tokens = {r.get("tokens") for r in recs}
    naive_runs = [[r for r in rs if r.get("tokens") in tokens] for rs in _run_files(run_dir, "naive.jsonl", "naive")]
    naive = [r for rs in naive_runs for r in rs]
    ranks = sorted({r["ranks"] for r in recs} | {r["ranks"] for r in naive})
    kinds = [k for k in MAIN_NORMAL_KINDS if any(r["kind"] == k for r in recs)]
    kinds += sorted({r["kind"] for r in recs} - set(kinds))

    def gbps(r):
        return r.get("rank_GBps")
    series = [(k, _by_ranks(runs, k, gbps), False) for k in kinds]
    series += [(f"naive {k}", _by_ranks(naive_runs, k, gbps), True) for k in MAIN_NAIVE_KINDS
               if any(r["kind"] == k for r in naive)]
    fig, ax = _figure(width=11.0, height=4.8)
    _bars(ax, series, ranks, [(lab, hatched) for lab, _, hatched in series])
    labelled = False
    for j, n in enumerate(ranks):
        roofs = [next((copy_roofline_per_rank(r) for r in reversed(rs) if r["ranks"] == n and copy_roofline_per_rank(r)),
                      None) for rs in runs]
        roofs = [v for v in roofs if v]
        roof = float(np.median(roofs)) if roofs else None
        if roof:
            ax.hlines(roof, j - 0.45, j + 0.45, colors="black", linestyles="--", linewidth=1.2,
                      label=None if labelled else ROOFLINE_LABEL)
            labelled = True
    backend = next((r["backend"] for r in recs if r.get("backend")), None)
    tok = ", ".join(str(t) for t in sorted(tokens))
    _finish(ax, "ranks", "received bytes per rank / time (GB/s)",
            title or (f"{backend}: small size, not kernel speed" if backend else
                      f"cupyep normal mode, {_gpu(recs)}, {tok} tokens per rank{_runs_note(runs)}"),
            legend=False, grid="y")
    _legend_beside(fig, [ax])
    return fig


def main_low_latency_figure(run_dir, tokens=(128, 1), title: str | None = None):
    """The main job's low-latency figure of a run folder: the kernel median
    (slowest rank) of each kind at each rank count (``low_latency.jsonl``),
    one panel per token count, the naive baseline's whole-call median beside
    it (``naive.jsonl``, hatched), log scale.

    Arguments:
        run_dir: a folder the main job wrote, or a list of them (each bar the
            median over the runs, with their min-max).
        tokens: token counts per rank, a panel each (those present).
        title: figure title (default: the GPU).

    Returns:
        matplotlib.figure.Figure.

    Raises:
        ValueError: no low-latency record with ``kernel_median_us`` at ``tokens``.
    """
    runs = [[r for r in rs if r.get("kernel_median_us")]
            for rs in _run_files(run_dir, "low_latency.jsonl", "low_latency")]
    naive_runs = _run_files(run_dir, "naive.jsonl", "naive")
    recs = [r for rs in runs for r in rs]
    naive = [r for rs in naive_runs for r in rs]
    panels = [t for t in tokens if any(r.get("tokens") == t for r in recs + naive)]
    if not recs or not panels:
        raise ValueError(f"no low-latency records with kernel_median_us at {tokens} tokens in {run_dir}")
    kinds = [k for k in MAIN_LOW_LATENCY_KINDS if any(r["kind"] == k for r in recs)]
    naive_kinds = [k for k in MAIN_NAIVE_KINDS if any(r["kind"] == k and r.get("tokens") in panels for r in naive)]
    order = [(k, False) for k in kinds] + [(f"naive {k} (whole call)", True) for k in naive_kinds]
    fig, axes = _figure(width=6.0 * len(panels) + 2.5, height=4.5, ncols=len(panels))
    for ax, T in zip(axes, panels):
        at_T = [[r for r in rs if r.get("tokens") == T] for rs in runs]  # per run
        nv_T = [[r for r in rs if r.get("tokens") == T] for rs in naive_runs]
        here, nv = [r for rs in at_T for r in rs], [r for rs in nv_T for r in rs]
        ranks = sorted({r["ranks"] for r in here + nv})
        series = [(k, _by_ranks(at_T, k, lambda r: r["kernel_median_us"]), False) for k in kinds
                  if any(r["kind"] == k for r in here)]
        series += [(f"naive {k} (whole call)", _by_ranks(nv_T, k, record_time_us), True) for k in naive_kinds
                   if any(r["kind"] == k for r in nv)]
        _bars(ax, series, ranks, order)
        _log_y_plain(ax)
        _finish(ax, "ranks", "median time (us): kernel; naive: whole call",
                f"{T} token{'s' if T != 1 else ''} per rank", legend=False, grid="y")
    fig.suptitle(title or f"cupyep low-latency mode, {_gpu(recs)}{_runs_note(runs)}", fontsize="large")
    _legend_beside(fig, axes)
    return fig


def main_figures(run_dir, out_dir=None) -> list[Path]:
    """Save the main job's figures of ``run_dir`` (a run folder, or a list of
    them: medians over the runs with their min-max) that its files allow:
    ``normal.png``/``.svg`` (from ``normal.jsonl``) and
    ``low_latency.png``/``.svg`` (from ``low_latency.jsonl``), with the naive
    baseline of ``naive.jsonl``, into ``out_dir`` (default the run folder;
    required for several). Returns the paths written (none when the folders
    have neither file)."""
    dirs = _run_dirs(run_dir)
    if out_dir is None and len(dirs) > 1:
        raise ValueError("several run folders need an out_dir for their figures")
    out_dir = Path(out_dir) if out_dir else dirs[0]
    written = []
    for stem, draw in (("normal", main_normal_figure), ("low_latency", main_low_latency_figure)):
        try:
            fig = draw(run_dir)
        except ValueError:
            continue
        written += save(fig, out_dir / stem)
    return written


def save(fig, stem) -> list[Path]:
    """Write ``fig`` to ``stem``.png and ``stem``.svg; returns the paths."""
    stem = Path(stem)
    if stem.suffix in (".png", ".svg"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    return paths


def load(path) -> list[dict]:
    """The records of a JSONL file (a truncated or malformed line is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def _where(items) -> dict:
    out = {}
    for it in items or []:
        if "=" not in it:
            raise SystemExit(f"--where takes key=value (comma-separated for any of several), got {it!r}")
        k, v = it.split("=", 1)
        vals = [parse_value(s) for s in v.split(",")]
        out[k] = vals if len(vals) > 1 else vals[0]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.plotting", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="+",
                   help="JSONL results file (main: a folder the main job wrote, or several with --out: "
                        "medians over the runs)")
    p.add_argument("figure", choices=("knob", "heatmap", "cdf", "crossover", "scatter", "main"),
                   help="main: the main job's normal-mode and low-latency figures of a run folder")
    p.add_argument("--x")
    p.add_argument("--y")
    p.add_argument("--value", default="time_us", help="heatmap: the metric in the cells")
    p.add_argument("--samples", help="cdf: the list-valued field")
    p.add_argument("--threshold", type=float, help="cdf: a vertical line at this value")
    p.add_argument("--by")
    p.add_argument("--where", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--logy", action="store_true", help="scatter: log y axis")
    p.add_argument("--higher-is-better", action="store_true", help="heatmap: outline the largest value")
    p.add_argument("--title")
    p.add_argument("--out", help="output path without extension (.png and .svg are written); "
                                 "main: the folder (default the run folder)")
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    if args.figure == "main":
        bad = [f for f in args.file if not Path(f).is_dir()]
        if bad:
            p.error(f"the main figures need run folders, got {bad[0]}")
        if len(args.file) > 1 and not args.out:
            p.error("several run folders need --out (the folder for their figures)")
        paths = main_figures(args.file, args.out)
        if not paths:
            print(f"cupyep.lab.plotting: no normal.jsonl or low_latency.jsonl records to plot in {' '.join(args.file)}",
                  file=sys.stderr)
            return 2
        for path in paths:
            print(f"wrote {path}")
        return 0
    if args.out is None:
        p.error(f"the {args.figure} figure needs --out")
    needs = {"knob": ("x",), "heatmap": ("x", "y"), "cdf": ("samples",), "crossover": (), "scatter": ("x", "y")}
    missing = [f"--{n}" for n in needs[args.figure] if getattr(args, n) is None]
    if missing:
        p.error(f"the {args.figure} figure needs {' and '.join(missing)}")
    if len(args.file) > 1:
        p.error(f"the {args.figure} figure reads one JSONL file, got {len(args.file)}")
    if not Path(args.file[0]).is_file():
        p.error(f"no such results file: {args.file[0]}")
    try:
        recs = load(args.file[0])
    except (OSError, ValueError) as exc:
        print(f"cupyep.lab.plotting: cannot read {args.file[0]}: {exc}", file=sys.stderr)
        return 2
    where = _where(args.where)
    try:
        if args.figure == "knob":
            fig = knob_figure(recs, args.x, args.y or "time_us", args.by, where, args.title)
        elif args.figure == "heatmap":
            fig = heatmap_figure(recs, args.x, args.y, args.value, where, not args.higher_is_better, args.title)
        elif args.figure == "cdf":
            fig = cdf_figure(recs, args.samples, args.by, where, args.threshold, args.title)
        elif args.figure == "crossover":
            fig = crossover_figure(recs, args.x or "tokens", args.y or "time_us", args.by or "mode", where, args.title)
        else:
            fig = scatter_figure(recs, args.x, args.y, args.by, where, args.logy, args.title)
    except (ValueError, TypeError) as exc:
        print(f"cupyep.lab.plotting: {exc}", file=sys.stderr)
        return 2
    for path in save(fig, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
