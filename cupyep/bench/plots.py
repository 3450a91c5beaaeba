"""Every figure of the main job, drawn from its results files.

    python -m cupyep.bench.plots RUN_DIR        # writes RUN_DIR/normal.png, RUN_DIR/low_latency.png

- :func:`normal_figure`: normal mode, GB/s per rank (received rows x row
  bytes / time) per kind and rank count, the naive baseline's dispatch and
  combine at the same tokens beside them (hatched), and the copy roofline
  per rank (a line over each rank count's bars):

      copy roofline per rank = copy_GBps / (2 x ranks per GPU)

  ``copy_GBps`` is the copy kernel's bandwidth in read + write bytes per
  second; receiving B bytes takes at least one pass that reads B and writes
  B, and the ranks sharing a GPU share its bandwidth. So the line is the most
  a rank can receive per second on a one-copy design; a two-copy design (the
  normal mode's ring queues) meets half of it when every byte goes through
  HBM twice.
- :func:`low_latency_figure`: low-latency mode, kernel median (slowest
  rank) per kind and rank count, one panel per token count (128 and 1), the
  naive baseline's whole-call median beside it (hatched), log scale.

The functions return matplotlib Figures (no pyplot, so notebooks and
headless runs alike can call them); :func:`plot_run` saves them for a run.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .summary import DEFAULT_TIMINGS, load_jsonl, record_time_us

NORMAL_KINDS = ("dispatch_bf16", "dispatch_fp8", "dispatch_bf16_notify", "combine_bf16",
                "dispatch_bf16_direct", "dispatch_fp8_direct", "dispatch_bf16_notify_direct", "combine_bf16_direct",
                "dispatch_bf16_notify_unfused_direct", "combine_bf16_zero_copy_direct", "dispatch_bf16_expert_major",
                "dispatch_bf16_expert_major_direct")
LOW_LATENCY_KINDS = ("dispatch_fp8", "dispatch_bf16", "combine", "combine_pull", "combine_zero_copy",
                     "combine_zero_copy_push")
NAIVE_KINDS = ("dispatch", "combine")


def copy_roofline_per_rank(rec: dict) -> float | None:
    """GB/s per rank of one read + write pass: copy_GBps / (2 x ranks per GPU)."""
    if not rec.get("copy_GBps"):
        return None
    per_gpu = rec.get("env", {}).get("ranks_per_gpu") or rec.get("ranks", 1)
    return rec["copy_GBps"] / (2 * per_gpu)


def _by_ranks(records, kind, value) -> dict:
    """{ranks: value(rec)} of the last record of ``kind`` at each rank count."""
    return {r["ranks"]: value(r) for r in records if r.get("kind") == kind and value(r) is not None}


def _bars(ax, series, ranks, width=0.8):
    """Grouped bars: series is a list of (label, {ranks: value}, hatched); hatched
    ones (the naive baseline) are grey."""
    from matplotlib import colormaps
    w = width / max(1, len(series))
    greys = iter(("0.55", "0.8", "0.35", "0.95"))
    colours = colormaps["tab20"].colors  # distinct colours for up to 20 series (tab10 repeats after 10)
    for i, (label, vals, hatched) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * w for j in range(len(ranks))]
        style = dict(hatch="//", color=next(greys, "0.7"), edgecolor="black", linewidth=0.5) if hatched else \
            dict(color=colours[i % len(colours)])
        ax.bar(xs, [vals.get(n, 0) for n in ranks], w, label=label, **style)
    ax.set_xticks(range(len(ranks)), [f"{n} ranks" for n in ranks])
    return w


def _figure(ncols=1, width=7.5):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, 4.2), layout="constrained")
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _strict(records):
    return [r for r in records if r.get("timing") in DEFAULT_TIMINGS and not r.get("sweep")]


def normal_figure(records, naive=(), title: str | None = None):
    """Normal mode's GB/s per rank, with the naive baseline and the copy roofline.

    Arguments:
        records: normal-mode records (bench "normal"; sweep points ignored).
        naive: naive records (bench "naive"); those at the normal records' tokens are drawn.
        title: figure title (default from the records' GPU).

    Returns:
        matplotlib.figure.Figure.
    """
    recs = [r for r in _strict(records) if r.get("bench") == "normal" and r.get("rank_GBps") is not None]
    tokens = {r.get("tokens") for r in recs}
    naive = [r for r in _strict(naive) if r.get("bench") == "naive" and r.get("tokens") in tokens]
    ranks = sorted({r["ranks"] for r in recs} | {r["ranks"] for r in naive})
    kinds = [k for k in NORMAL_KINDS if any(r["kind"] == k for r in recs)]
    kinds += sorted({r["kind"] for r in recs} - set(kinds))
    gbps = lambda r: r["rank_GBps"]  # noqa: E731
    series = [(k, _by_ranks(recs, k, gbps), False) for k in kinds]
    series += [(f"naive {k}", _by_ranks(naive, k, gbps), True) for k in NAIVE_KINDS
               if any(r["kind"] == k for r in naive)]
    fig, (ax,) = _figure(width=10.5)
    _bars(ax, series, ranks)
    labelled = False
    for j, n in enumerate(ranks):
        roof = next((copy_roofline_per_rank(r) for r in reversed(recs)
                     if r["ranks"] == n and copy_roofline_per_rank(r)), None)
        if roof:
            ax.hlines(roof, j - 0.45, j + 0.45, colors="black", linestyles="--", linewidth=1,
                      label=None if labelled else "copy roofline per rank = copy GB/s / (2 x ranks per GPU)")
            labelled = True
    ax.set_ylabel("GB/s per rank (received bytes / time)")
    backend = next((r["backend"] for r in recs if r.get("backend")), None)
    gpu = next((r.get("env", {}).get("gpu") for r in recs if r.get("env", {}).get("gpu")), "GPU")
    tok = ", ".join(str(t) for t in sorted(tokens))
    ax.set_title(title or (f"{backend}: small size, not kernel speed" if backend else
                           f"cupyep normal mode, {gpu}, {tok} tokens per rank"), fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    return fig


def low_latency_figure(records, naive=(), tokens=(128, 1), title: str | None = None):
    """Low-latency kernel medians per kind and rank count, naive beside them.

    Arguments:
        records: low-latency records (bench "low_latency"; only those timed
            on the bench's default boundary).
        naive: naive records; those at the same tokens are drawn.
        tokens: token counts per rank, one panel each (those present).

    Returns:
        matplotlib.figure.Figure.
    """
    recs = [r for r in _strict(records) if r.get("bench") == "low_latency" and r.get("kernel_median_us")]
    naive = [r for r in _strict(naive) if r.get("bench") == "naive"]
    panels = [t for t in tokens if any(r.get("tokens") == t for r in recs + naive)]
    fig, axes = _figure(max(1, len(panels)), width=6.5)
    for ax, T in zip(axes, panels):
        here = [r for r in recs if r.get("tokens") == T]
        nv = [r for r in naive if r.get("tokens") == T]
        ranks = sorted({r["ranks"] for r in here + nv})
        kinds = [k for k in LOW_LATENCY_KINDS if any(r["kind"] == k for r in here)]
        series = [(k, _by_ranks(here, k, lambda r: r["kernel_median_us"]), False) for k in kinds]
        series += [(f"naive {k} (whole call)", _by_ranks(nv, k, record_time_us), True) for k in NAIVE_KINDS
                   if any(r["kind"] == k for r in nv)]
        _bars(ax, series, ranks)
        ax.set_yscale("log")
        ax.set_ylabel("median time, us (kernel; naive: whole call)")
        ax.set_title(f"{T} token{'s' if T != 1 else ''} per rank", fontsize=10)
        ax.legend(fontsize=7)
    gpu = next((r.get("env", {}).get("gpu") for r in recs if r.get("env", {}).get("gpu")), "GPU")
    fig.suptitle(title or f"cupyep low-latency mode, {gpu}", fontsize=11)
    return fig


def plot_run(run_dir, out_dir=None) -> list[Path]:
    """Draw every figure a run's files allow; returns the paths written.

    Reads ``normal.jsonl``, ``low_latency.jsonl`` and ``naive.jsonl`` in
    ``run_dir`` (any may be missing) and writes ``normal.png`` and
    ``low_latency.png`` into ``out_dir`` (default ``run_dir``).
    """
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir

    def read(name):
        p = run_dir / name
        return load_jsonl(p) if p.exists() else []
    normal, low_latency, naive = read("normal.jsonl"), read("low_latency.jsonl"), read("naive.jsonl")
    written = []
    for name, recs, draw in (("normal.png", normal, normal_figure), ("low_latency.png", low_latency,
                                                                     low_latency_figure)):
        if recs:
            path = out_dir / name
            draw(recs, naive).savefig(path, dpi=120)
            written.append(path)
    return written


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m cupyep.bench.plots RUN_DIR", file=sys.stderr)
        return 2
    paths = plot_run(args[0])
    print("wrote " + (", ".join(map(str, paths)) if paths else "nothing (no normal.jsonl or low_latency.jsonl)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
