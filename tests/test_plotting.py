"""cupyep.plotting on synthetic records: fields and filters, units on the
axes, heatmap cells, crossover points, CDF marks, PNG + SVG output, the CLI."""
import json

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from cupyep import plotting as P  # noqa: E402


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
