"""cupyep.lab.plotting on synthetic records: fields and filters, units on the
axes, heatmap cells, crossover points, CDF marks, PNG + SVG output, the CLI,
and the main job's figures of a synthetic run folder."""
import json

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from cupyep.lab import plotting as P  # noqa: E402


def _sweep():
    recs = []
    for depth in (8, 16, 32):
        for chunk in (2, 4):
            for ranks in (2, 8):
                t = 1000.0 / depth + 10 * chunk + ranks
                recs.append({"bench": "normal", "kind": "dispatch_bf16", "ranks": ranks, "time_us": t,
                             "p10_time_us": t - 1, "p90_time_us": t + 1,
                             "dispatch_config": {"queue_depth": depth, "chunk_size": chunk}})
    return recs


def test_field_label_and_select():
    r = {"a": 1, "cfg": {"depth": 8}, "x.y": 3}
    assert P.field(r, "a") == 1 and P.field(r, "cfg.depth") == 8 and P.field(r, "x.y") == 3
    assert P.field(r, "cfg.nothing") is None and P.field(r, "b") is None
    assert P.label("time_us") == "time (us)" and P.label("rank_GBps") == "bandwidth per rank (GB/s)"
    assert P.label("kernel_median_us") == "kernel median (us)" and P.label("wait_bytes") == "wait (bytes)"
    assert P.label("total_us_median") == "total median (us)" and P.label("us") == "us"
    assert P._band_keys("total_us_median") == ("total_us_p10", "total_us_p90")
    assert P._band_keys("median_us") == ("p10_us", "p90_us")
    assert P.label("dispatch_config.queue_depth") == "queue depth"
    recs = _sweep()
    assert len(P.select(recs, {"ranks": 8})) == 6
    assert len(P.select(recs, {"ranks": [2, 8], "dispatch_config.chunk_size": 4})) == 6
    assert P.select(recs, {"ranks": 3}) == []


def test_knob_figure_has_units_lines_and_bands(tmp_path):
    fig = P.knob_figure(_sweep(), "dispatch_config.queue_depth", "time_us", by="ranks",
                        where={"dispatch_config.chunk_size": 2})
    ax = fig.axes[0]
    assert ax.get_xlabel() == "queue depth" and ax.get_ylabel() == "time (us)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ranks = 2", "ranks = 8"]
    xs, ys = ax.lines[0].get_data()
    assert list(xs) == [8, 16, 32] and np.allclose(ys, [1000 / 8 + 22, 1000 / 16 + 22, 1000 / 32 + 22])
    assert len(ax.collections) == 2  # a p10-p90 band per line
    paths = P.save(fig, tmp_path / "sub" / "knob")
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size > 1000 for p in paths)


def test_heatmap_cells_are_the_medians_and_the_best_is_outlined():
    recs = _sweep() + [{"ranks": 8, "time_us": 1e9, "dispatch_config": {"queue_depth": 8, "chunk_size": 2}}]
    sel = P.select(recs, {"ranks": 8})
    grid = P.heatmap_values(sel, "dispatch_config.queue_depth", "dispatch_config.chunk_size", "time_us",
                            [8, 16, 32, 64], [2, 4])
    assert grid.shape == (2, 4) and np.isnan(grid[:, 3]).all()
    assert grid[1, 2] == pytest.approx(1000 / 32 + 40 + 8)
    assert grid[0, 0] == pytest.approx(np.median([1000 / 8 + 28, 1e9]))
    fig = P.heatmap_figure(sel, "dispatch_config.queue_depth", "dispatch_config.chunk_size", where={"ranks": 8})
    ax = fig.axes[0]
    best = [p for p in ax.patches][0]
    assert best.get_xy() == (2 - 0.5, 0 - 0.5)  # depth 32, chunk 2: the least time
    assert ax.get_xlabel() == "queue depth" and ax.get_ylabel() == "chunk size"


def test_crossovers_are_where_the_fastest_changes():
    series = {"ll": ([1, 128, 4096], [10.0, 50.0, 5000.0]), "normal": ([1, 128, 4096], [100.0, 60.0, 2000.0])}
    (x, a, b), = P.crossovers(series)
    assert (a, b) == ("ll", "normal")
    # The lines cross between 128 and 4096 where 50 + f*4950 = 60 + f*1940, f = 10/3010, in log x.
    f = 10 / 3010
    assert x == pytest.approx(np.exp(np.log(128) + f * (np.log(4096) - np.log(128))))
    assert P.crossovers({"a": ([1, 2], [1, 1.5]), "b": ([1, 2], [2, 3])}) == []
    assert P.crossovers({"a": ([1], [1])}) == []
    recs = [{"mode": m, "tokens": t, "time_us": y} for m, (ts, ys) in series.items() for t, y in zip(ts, ys)]
    fig = P.crossover_figure(recs, "tokens", "time_us", "mode")
    assert len([ln for ln in fig.axes[0].lines if ln.get_linestyle() == ":"]) == 1


def test_cdf_marks_p50_and_p99():
    recs = [{"ranks": 8, "wait_us": list(range(1, 101))}, {"ranks": 8, "wait_us": list(range(101, 201))},
            {"ranks": 2, "wait_us": [5.0] * 10}]
    fig = P.cdf_figure(recs, "wait_us", by="ranks", threshold=100)
    ax = fig.axes[0]
    marks = [ln for ln in ax.lines if ln.get_marker() == "o"]
    assert len(marks) == 4  # p50 and p99 of each of two curves
    p50_8 = marks[0].get_data()[0][0]
    assert p50_8 == pytest.approx(np.quantile(np.arange(1, 201), 0.5))
    assert any("n = 200" in t.get_text() for t in ax.get_legend().get_texts())


def test_scatter_and_errors():
    recs = [{"kind": k, "rank_GBps": g, "calc_diff": d} for k, g, d in
            (("bf16", 100, 1e-7), ("fp8", 180, 4e-4), ("fp8", 170, 3e-4))]
    fig = P.scatter_figure(recs, "rank_GBps", "calc_diff", by="kind", logy=True)
    assert fig.axes[0].get_yscale() == "log" and len(fig.axes[0].collections) == 2
    with pytest.raises(ValueError, match="no record has field 'nope'"):
        P.scatter_figure(recs, "rank_GBps", "nope")
    with pytest.raises(ValueError, match="no records"):
        P.knob_figure(recs, "rank_GBps", "calc_diff", where={"kind": "int4"})


def test_cli_writes_png_and_svg_and_reports_bad_fields(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _sweep()) + "\n{truncated")
    assert len(P.load(path)) == len(_sweep())
    out = tmp_path / "heat"
    assert P.main([str(path), "heatmap", "--x", "dispatch_config.queue_depth", "--y", "dispatch_config.chunk_size",
                   "--where", "ranks=8", "--out", str(out)]) == 0
    assert (tmp_path / "heat.png").exists() and (tmp_path / "heat.svg").exists()
    assert P.main([str(path), "knob", "--x", "dispatch_config.queue_depth", "--by", "ranks",
                   "--where", "dispatch_config.chunk_size=2,4", "--out", str(tmp_path / "k")]) == 0
    assert P.main([str(path), "scatter", "--x", "time_us", "--y", "missing", "--out", str(tmp_path / "s")]) == 2
    assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        P.main([str(path), "heatmap", "--x", "dispatch_config.queue_depth", "--out", str(tmp_path / "h")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:  # a missing file is a usage error, not a traceback
        P.main([str(tmp_path / "nope.jsonl"), "knob", "--x", "tokens", "--out", str(tmp_path / "n")])
    assert info.value.code == 2 and "no such results file" in capsys.readouterr().err


# ------------------------------------------------------ the main job's figures ---

def _main_run(path, low_latency=True):
    """A synthetic main-job run folder: normal, naive and low-latency records at
    2 and 8 ranks, plus records every figure must leave out (a sweep point,
    another timing boundary, a kind the figure does not draw)."""
    path.mkdir(parents=True)
    env = {"gpu": "Test GPU"}
    normal = []
    for ranks in (2, 8):
        for kind, gbps in (("combine_bf16", 200.0), ("dispatch_bf16", 100.0 * ranks)):
            normal.append({"bench": "normal", "kind": kind, "ranks": ranks, "tokens": 4096, "timing": "strict",
                           "time_us": 1e5 / gbps, "rank_GBps": gbps, "copy_GBps": 4000.0,
                           "env": {**env, "ranks_per_gpu": ranks}})
        normal.append({"bench": "normal", "kind": "dispatch_bf16", "ranks": ranks, "tokens": 4096,
                       "time_us": 1.0, "rank_GBps": 9999.0, "sweep": True})
        normal.append({"bench": "normal", "kind": "dispatch_bf16", "ranks": ranks, "tokens": 4096,
                       "timing": "deepep", "time_us": 1.0, "rank_GBps": 8888.0})
    naive = [{"bench": "naive", "kind": kind, "ranks": ranks, "tokens": tokens, "timing": "host_aligned",
              "time_us": t * ranks, "rank_GBps": 10.0 * ranks, "env": env}
             for ranks in (2, 8) for tokens in (4096, 128, 1) for kind, t in (("dispatch", 1000.0), ("combine", 500.0))]
    ll = [{"bench": "low_latency", "kind": kind, "ranks": ranks, "tokens": tokens, "timing": "strict",
           "kernel_median_us": t * ranks * (2 if tokens == 128 else 1), "env": env}
          for ranks in (2, 8) for tokens in (128, 1)
          for kind, t in (("dispatch_fp8", 10.0), ("combine", 20.0), ("dispatch_fp8_send_half", 5.0))]
    ll.append({"bench": "low_latency", "kind": "dispatch_fp8", "ranks": 2, "tokens": 128, "timing": "deepep",
               "kernel_median_us": 1.0})
    files = {"normal.jsonl": normal, "naive.jsonl": naive}
    if low_latency:
        files["low_latency.jsonl"] = ll
    for name, recs in files.items():
        (path / name).write_text("".join(json.dumps(r) + "\n" for r in recs) + "{cut short")
    return path


def _bars_of(ax):
    """{legend label: ([bar heights], hatched)} of a bar chart."""
    from matplotlib.container import BarContainer
    return {c.get_label(): ([b.get_height() for b in c], bool(c[0].get_hatch())) for c in ax.containers
            if isinstance(c, BarContainer)}


def test_main_normal_figure_bars_naive_and_roofline(tmp_path):
    fig = P.main_normal_figure(_main_run(tmp_path / "run"))
    ax, = fig.axes
    assert ax.get_xlabel() == "ranks" and ax.get_ylabel() == "received bytes per rank / time (GB/s)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "8"] and list(ax.get_xticks()) == [0, 1]
    assert ax.get_title() == "cupyep normal mode, Test GPU, 4096 tokens per rank"
    # kinds in the figure's order, then the naive baseline (hatched); sweep and deepep records left out
    assert _bars_of(ax) == {"dispatch_bf16": ([200.0, 800.0], False), "combine_bf16": ([200.0, 200.0], False),
                            "naive dispatch": ([20.0, 80.0], True), "naive combine": ([20.0, 80.0], True)}
    roof = [c for c in ax.collections if c.get_label() == P.ROOFLINE_LABEL]
    assert len(roof) == 1  # labelled once
    levels = sorted(seg[0][1] for c in ax.collections for seg in c.get_segments())
    assert levels == [4000.0 / 16, 4000.0 / 4]  # copy GB/s / (2 x ranks per GPU) at 8 and 2 ranks
    legend, = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        P.ROOFLINE_LABEL, "dispatch_bf16", "combine_bf16", "naive dispatch", "naive combine"]
    assert P.copy_roofline_per_rank({"copy_GBps": 4000.0, "ranks": 8, "env": {"ranks_per_gpu": 8}}) == 250.0
    assert P.copy_roofline_per_rank({"copy_GBps": 4000.0, "ranks": 8}) == 250.0
    assert P.copy_roofline_per_rank({"ranks": 2}) is None


def test_main_low_latency_figure_panels_log_scale_and_naive(tmp_path):
    fig = P.main_low_latency_figure(_main_run(tmp_path / "run"))
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["128 tokens per rank", "1 token per rank"]
    assert fig.get_suptitle() == "cupyep low-latency mode, Test GPU"
    for ax, scale in zip(axes, (2, 1)):
        assert ax.get_yscale() == "log" and ax.get_xlabel() == "ranks"
        assert ax.get_ylabel() == "median time (us): kernel; naive: whole call"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "8"]
        # the send half is no kind of this figure; the deepep-boundary record is left out
        assert _bars_of(ax) == {"dispatch_fp8": ([20.0 * scale, 80.0 * scale], False),
                                "combine": ([40.0 * scale, 160.0 * scale], False),
                                "naive dispatch (whole call)": ([2000.0, 8000.0], True),
                                "naive combine (whole call)": ([1000.0, 4000.0], True)}
        # ticks written as plain numbers, not only powers of ten
        assert "20" in [t.get_text() for t in ax.get_yticklabels()]
    # the same kind has the same colour in both panels
    colours = [{c.get_label(): c[0].get_facecolor() for c in ax.containers} for ax in axes]
    assert colours[0] == colours[1]
    legend, = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "dispatch_fp8", "combine", "naive dispatch (whole call)", "naive combine (whole call)"]


def test_main_figures_and_command_write_png_and_svg(tmp_path, capsys):
    run = _main_run(tmp_path / "run")
    paths = P.main_figures(run, tmp_path / "out")
    assert [p.name for p in paths] == ["normal.png", "normal.svg", "low_latency.png", "low_latency.svg"]
    assert all(p.parent == tmp_path / "out" and p.stat().st_size > 1000 for p in paths)
    assert P.main([str(run), "main"]) == 0  # into the run folder
    assert sorted(p.name for p in run.iterdir() if p.suffix in (".png", ".svg")) == [
        "low_latency.png", "low_latency.svg", "normal.png", "normal.svg"]
    assert f"wrote {run / 'normal.png'}" in capsys.readouterr().out
    only_normal = _main_run(tmp_path / "only_normal", low_latency=False)
    assert [p.name for p in P.main_figures(only_normal)] == ["normal.png", "normal.svg"]
    (tmp_path / "empty").mkdir()
    assert P.main_figures(tmp_path / "empty") == []
    assert P.main([str(tmp_path / "empty"), "main"]) == 2
    assert "no normal.jsonl or low_latency.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        P.main([str(run / "normal.jsonl"), "main"])  # a file, not a run folder
    with pytest.raises(SystemExit):
        P.main([str(run / "normal.jsonl"), "knob", "--x", "ranks"])  # the other figures still need --out


def test_main_figures_over_several_runs_are_medians_with_min_max(tmp_path, capsys):
    """Several run folders: each bar is the median over the runs, with an
    error bar from the runs' min to their max; the title says how many."""
    runs = []
    for i, scale in enumerate((1.0, 3.0, 2.0)):
        run = _main_run(tmp_path / f"run{i}")
        for name in ("normal.jsonl", "low_latency.jsonl"):
            recs = P.load(run / name)
            for r in recs:
                for key in ("rank_GBps", "kernel_median_us"):
                    if key in r:
                        r[key] *= scale
            (run / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
        runs.append(run)
    fig = P.main_normal_figure(runs)
    ax, = fig.axes
    assert ax.get_title() == "cupyep normal mode, Test GPU, 4096 tokens per rank; median of 3 runs, bars min-max"
    bars = _bars_of(ax)
    assert bars["dispatch_bf16"] == ([400.0, 1600.0], False)  # the median of x1, x3, x2
    assert bars["naive dispatch"] == ([20.0, 80.0], True)  # the same in every run: no spread
    # the error bars: one set per series with a spread, from the min to the max of the runs
    segments = [seg for c in ax.collections if c.get_label() != P.ROOFLINE_LABEL for seg in c.get_segments()
                if len(seg) == 2 and seg[0][0] == seg[1][0]]
    spans = sorted((round(float(seg[0][1]), 6), round(float(seg[1][1]), 6)) for seg in segments)
    assert (200.0, 600.0) in spans and (800.0, 2400.0) in spans  # dispatch_bf16 at 2 and 8 ranks
    ll = P.main_low_latency_figure(runs)
    assert ll.get_suptitle() == "cupyep low-latency mode, Test GPU; median of 3 runs, bars min-max"
    assert _bars_of(ll.axes[0])["dispatch_fp8"] == ([80.0, 320.0], False)  # 40 and 160 us, x2 (the median)
    with pytest.raises(ValueError, match="out_dir"):
        P.main_figures(runs)
    paths = P.main_figures(runs, tmp_path / "out")
    assert [p.name for p in paths] == ["normal.png", "normal.svg", "low_latency.png", "low_latency.svg"]
    with pytest.raises(SystemExit):
        P.main([*map(str, runs), "main"])  # several folders need --out
    assert P.main([*map(str, runs), "main", "--out", str(tmp_path / "cli")]) == 0
    assert f"wrote {tmp_path / 'cli' / 'normal.png'}" in capsys.readouterr().out
