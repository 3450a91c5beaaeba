"""cupyep.lab.balance_table on the committed balance study (CPU)."""
import json
from pathlib import Path

import pytest

from cupyep.lab import balance_table

STUDY = Path(__file__).resolve().parents[1] / "results" / "balance_study"
RUNS = [STUDY / f"study_8ranks_run{i}.jsonl" for i in (1, 2, 3)]
RUNS_2X4 = [STUDY / f"study_2x4_run{i}.jsonl" for i in (1, 2, 3)]


def test_the_balance_study_readme_tables_are_what_their_commands_print():
    """results/balance_study/README.md shows python -m cupyep.lab.balance_table's output on its records:
    the medians over the three runs, and the phases of run 1."""
    readme = (STUDY / "README.md").read_text()
    assert balance_table.markdown_over_runs(RUNS) in readme
    assert balance_table.markdown(RUNS[:1]) in readme
    assert balance_table.markdown_over_runs(RUNS_2X4) in readme
    assert balance_table.markdown(RUNS_2X4[:1]) in readme
    assert balance_table.markdown_planner_bound([RUNS_2X4[0], RUNS[0]]) in readme
    assert balance_table.main([str(STUDY / "no_such.jsonl")]) == 2


def test_rows_keep_the_traces_of_one_file_apart(tmp_path):
    """A file holding several traces compares each arm with its own trace's none arm."""
    def rec(trace, arm, layer_us):
        return {"trace": trace, "trace_params": {}, "arm": arm, "imbalance": 1.0, "layer_us": layer_us,
                "moved_experts": 0, "us": {k: [1.0] for k in ("ffn", "dispatch", "combine", "balance")}}
    path = tmp_path / "two.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [rec("a", "none", 40.0), rec("a", "eplb", 20.0),
                                                        rec("b", "none", 90.0), rec("b", "eplb", 30.0)]))
    rows = {(r["trace"], r["arm"]): r["speedup"][0] for r in balance_table.rows_of(balance_table._read(path))}
    assert rows == {("a", "none"): 1.0, ("a", "eplb"): 2.0, ("b", "none"): 1.0, ("b", "eplb"): 3.0}
    runs = balance_table.over_runs([path, path])
    assert [(g["trace"], g["arm"], g["runs"], g["speedup_median_step"]) for g in runs] == [
        ("a", "none", 2, [1.0, 1.0]), ("a", "eplb", 2, [2.0, 2.0]), ("b", "none", 2, [1.0, 1.0]),
        ("b", "eplb", 2, [3.0, 3.0])]
    lone = tmp_path / "lone.jsonl"
    lone.write_text(json.dumps(rec("c", "eplb", 10.0)))
    with pytest.raises(ValueError, match="no 'none' arm"):
        balance_table.over_runs([lone])


def test_the_planner_bound_is_the_planner_s_on_each_step_s_loads():
    """Across 2 nodes with 8 groups the hierarchical plan leaves more max/mean than the global one on a
    hot expert; the measured per_step max/mean is never below what its own policy plans."""
    rows = {b["trace"]: b for b in balance_table.planner_bound(RUNS_2X4[0])}
    hot = rows["hot_expert, hot_fraction 0.8"]
    assert (hot["groups"], hot["nodes"], hot["policy"]) == (8, 2, "hierarchical")
    assert hot["planned_global"] < hot["planned_groups"] <= hot["measured"]
    one = balance_table.planner_bound(RUNS[0])
    assert all(b["planned_groups"] == b["planned_global"] for b in one)  # one node, one group: the same plan
