"""Tests of cupyep.lab.experiments (CPU only): grid expansion and keys, the study
registry, JSONL records, and sweeps on 2 ranks (and on 4 ranks as 2 emulated
nodes, ``ranks_per_node``) under the mpiexec next to sys.executable (pip's
mpich), through the API and the command line.
Launches see no GPU (CUDA_VISIBLE_DEVICES="")."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cupyep.lab import experiments
from cupyep.lab.experiments import Study, config_key, cpu_reference, expand, load, records, studies
from cupyep.lab.experiments.__main__ import parse_grid

REPO = Path(__file__).resolve().parents[1]
KNOBS = {"tokens": 1, "hidden": 2, "routing": "uniform", "routing_params": {}}
TINY = {"tokens": [4, 8], "hidden": 128, "experts": 16, "topk": 2}
LAUNCH_TIMEOUT_S = 60

# A study module for the fault tests; it is written to a temporary folder
# that the ranks import from (PYTHONPATH).
FAULTS_MODULE = '''
"""Study "sweep_faults": knob mode says how a configuration ends."""
import time

from cupyep.lab.experiments import Skip, Study, register


def run(group, config):
    mode = config["mode"]
    if mode == "hang":
        time.sleep(300)
    if mode == "skip":
        raise Skip("not on this machine")
    if mode == "value":
        raise ValueError("hidden 7 is not a multiple of 128")
    if mode == "memory":
        raise MemoryError("a symmetric buffer of 9 bytes per rank does not fit")
    if mode == "error":
        raise RuntimeError("the check failed")
    if mode == "rank1" and group.rank == 1:
        raise ZeroDivisionError("rank 1 only")
    return {"answer": 42 + config["n"], "rank": group.rank}


register(Study("sweep_faults", {"mode": "ok", "n": 0}, run))
'''


@pytest.fixture
def launch_env(monkeypatch):
    """The environment run() launches with: no GPU, no launcher variables."""
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUPYEP_RANKS_PER_NODE", "CUPYEP_LAUNCHED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PYTHONPATH", str(REPO))


@pytest.fixture
def faults_study(tmp_path, monkeypatch, launch_env):
    folder = tmp_path / "studies"
    folder.mkdir()
    (folder / "sweep_faults_study.py").write_text(FAULTS_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(REPO)]))
    return studies.get("sweep_faults", "sweep_faults_study")


# ------------------------------------------------------------------ grid ---

def test_grid_expands_first_knob_slowest_with_defaults():
    configs = expand({"hidden": [10, 20], "tokens": [3, 4, 5]}, KNOBS)
    assert [(c["hidden"], c["tokens"]) for c in configs] == [(10, 3), (10, 4), (10, 5), (20, 3), (20, 4), (20, 5)]
    assert all(list(c) == list(KNOBS) for c in configs)  # the study's knob order
    assert configs[0] == {"tokens": 3, "hidden": 10, "routing": "uniform", "routing_params": {}}


def test_grid_single_values_dicts_lists_and_duplicates():
    configs = expand({"tokens": 7, "routing_params": {"s": 0.5}}, KNOBS)
    assert configs == [{"tokens": 7, "hidden": 2, "routing": "uniform", "routing_params": {"s": 0.5}}]
    explicit = expand([{"tokens": 2}, {"hidden": np.int64(5)}, {"tokens": 2, "hidden": 2}], KNOBS)
    assert [(c["tokens"], c["hidden"]) for c in explicit] == [(2, 2), (1, 5)]  # the third equals the first
    assert type(explicit[1]["hidden"]) is int
    with pytest.raises(ValueError, match="empty"):
        expand({"tokens": []}, KNOBS)


def test_config_key_is_canonical_json():
    a = config_key({"b": 1, "a": [1, 2], "c": {"y": 1, "x": 2}})
    assert a == '{"a":[1,2],"b":1,"c":{"x":2,"y":1}}'
    assert a == config_key({"c": {"x": 2, "y": 1}, "a": (1, 2), "b": 1})
    assert config_key({"a": 1}) != config_key({"a": 1.0}) != config_key({"a": "1"})


def test_unknown_knob_names_it_and_the_allowed_ones():
    with pytest.raises(ValueError) as exc:
        expand({"tokens": [1], "hiden": [2]}, KNOBS)
    assert "'hiden'" in str(exc.value) and "['tokens', 'hidden', 'routing', 'routing_params']" in str(exc.value)
    with pytest.raises(ValueError, match="'toks'"):
        expand([{"tokens": 1}, {"toks": 1}], KNOBS)
    with pytest.raises(ValueError, match="'hiden'"):
        experiments.run("reference", {"hiden": 128}, progress=False)
    with pytest.raises(ValueError, match="unknown study 'nope'"):
        experiments.run("nope", {})


def test_cli_grid_values():
    assert parse_grid(["tokens=4,8", "scale=0.5", "routing=uniform,zipf"]) == {
        "tokens": [4, 8], "scale": [0.5], "routing": ["uniform", "zipf"]}
    assert parse_grid(['routing_params=[{"s": 0.5}, {}]', 'p={"a": 1}']) == {
        "routing_params": [{"s": 0.5}, {}], "p": [{"a": 1}]}
    assert parse_grid(["plain_launch=false,true", "x=null,True"]) == {
        "plain_launch": [False, True], "x": [None, True]}
    with pytest.raises(ValueError):
        parse_grid(["tokens"])


# --------------------------------------------------------------- records ---

def test_load_skips_a_truncated_last_line_and_append_repairs_it(tmp_path):
    path = tmp_path / "r.jsonl"
    assert load(path) == []
    records.append(path, {"key": "a"})
    records.append(path, {"key": "b"})
    with path.open("a") as f:
        f.write('{"key": "c", "status": "o')  # killed mid-write
    assert [r["key"] for r in load(path)] == ["a", "b"]
    records.append(path, {"key": "d"})
    assert [r["key"] for r in load(path)] == ["a", "b", "d"]
    path.write_text('{"key": "a"}\nnot json\n{"key": "b"}\n')
    with pytest.raises(ValueError, match="r.jsonl:2"):
        load(path)


# ------------------------------------------------------- reference study ---

def test_reference_study_checks_the_combine(monkeypatch):
    config = expand({"tokens": 6, "hidden": 128, "experts": 8, "topk": 2, "iters": 2}, cpu_reference.KNOBS)[0]
    group = SimpleNamespace(rank=0, world_size=2)
    metrics = cpu_reference.run(group, config)
    assert metrics["combine_max_abs_err"] < 1e-5 and metrics["recv_tokens"] > 0
    assert metrics["dispatch_us_p10"] <= metrics["dispatch_us_median"] <= metrics["dispatch_us_p99"]
    assert cpu_reference.run(SimpleNamespace(rank=1, world_size=2), config) == {}
    real = cpu_reference.reference.intranode_combine
    monkeypatch.setattr(cpu_reference.reference, "intranode_combine",
                        lambda *a, **k: [c + np.float32(1e-3) for c in real(*a, **k)])
    with pytest.raises(AssertionError, match="combine of rank 0"):
        cpu_reference.run(group, config)


def test_gpu_study_without_gpu_needs_a_fallback(tmp_path, monkeypatch):
    gpu = studies.register(Study("sweep_gpu_only", {"tokens": 1}, lambda group, config: {}, needs_gpu=True))
    monkeypatch.setattr(experiments, "_has_gpu", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        experiments.run(gpu, {"tokens": [1, 2]})
    committed = tmp_path / "committed.jsonl"
    for tokens, ranks in ((1, 2), (2, 2), (2, 8), (3, 2)):
        records.append(committed, {"study": gpu.name, "tokens": tokens, "ranks": ranks, "status": "ok",
                                   "key": config_key({"tokens": tokens})})
    got = experiments.run(gpu, {"tokens": [2, 1]}, fallback=committed)
    assert [(r["tokens"], r["ranks"]) for r in got] == [(2, 2), (1, 2)]


# ---------------------------------------------------- sweeps on 2 ranks ---

def test_resume_runs_only_new_configurations(tmp_path, launch_env):
    out = tmp_path / "sweep.jsonl"
    first = experiments.run("reference", TINY, ranks=2, out=out, progress=False, timeout=LAUNCH_TIMEOUT_S)
    assert [r["tokens"] for r in first] == [4, 8] and {r["status"] for r in first} == {"ok"}
    assert {r["ranks"] for r in first} == {2} and len({r["run_id"] for r in first}) == 1
    bigger = {**TINY, "tokens": [4, 8, 16]}
    second = experiments.run("reference", bigger, ranks=2, out=out, progress=False, timeout=LAUNCH_TIMEOUT_S)
    on_disk = load(out)
    assert len(on_disk) == 3 and [r["tokens"] for r in on_disk] == [4, 8, 16]
    assert [r["run_id"] for r in second[:2]] == [r["run_id"] for r in first]
    assert second[2]["run_id"] != first[0]["run_id"] and second[2]["index"] == 0
    experiments.run("reference", bigger, ranks=2, out=out, progress=False, timeout=LAUNCH_TIMEOUT_S)
    assert len(load(out)) == 3  # nothing left to run
    again = experiments.run("reference", {**TINY, "tokens": 4}, ranks=2, out=out, resume=False,
                            progress=False, timeout=LAUNCH_TIMEOUT_S)
    assert len(load(out)) == 4 and again[0]["run_id"] not in {r["run_id"] for r in on_disk}


def test_skip_value_error_and_errors_are_recorded_and_the_sweep_goes_on(tmp_path, faults_study):
    out = tmp_path / "faults.jsonl"
    modes = ["ok", "skip", "value", "error", "rank1", "ok", "memory"]
    grid = [{"mode": m, "n": i} for i, m in enumerate(modes)]
    recs = experiments.run(faults_study, grid, ranks=2, out=out, progress=False, timeout=LAUNCH_TIMEOUT_S)
    assert [r["status"] for r in recs] == ["ok", "skipped", "skipped", "error", "error", "ok", "skipped"]
    assert [r["index"] for r in recs] == list(range(7))
    assert recs[6]["reason"] == "MemoryError: a symmetric buffer of 9 bytes per rank does not fit"
    assert recs[0]["answer"] == 42 and recs[0]["rank"] == 0 and recs[5]["answer"] == 47
    assert recs[1]["reason"] == "Skip: not on this machine"
    assert recs[2]["reason"] == "ValueError: hidden 7 is not a multiple of 128"
    assert recs[3]["reason"] == "RuntimeError: the check failed"
    assert recs[4]["reason"] == "ZeroDivisionError: rank 1 only"
    assert all("answer" not in r for r in recs[1:5]) and all("reason" not in r for r in (recs[0], recs[5]))


def test_cli_end_to_end_on_two_ranks(tmp_path, launch_env):
    out = tmp_path / "cli.jsonl"
    cmd = [sys.executable, "-m", "cupyep.lab.experiments", "reference", "--ranks", "2", "--out", str(out),
           "--timeout", str(LAUNCH_TIMEOUT_S), "--no-progress",
           "--grid", "tokens=4,8", "hidden=128", "experts=16", "topk=2"]
    res = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                         timeout=2 * LAUNCH_TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok: 2" in res.stdout.splitlines()
    recs = load(out)
    assert [(r["tokens"], r["hidden"], r["experts"], r["topk"]) for r in recs] == [(4, 128, 16, 2), (8, 128, 16, 2)]
    for r in recs:
        assert r["status"] == "ok" and r["study"] == "reference" and r["ranks"] == 2
        assert r["combine_max_abs_err"] < 1e-5 and r["total_us_median"] > 0
        assert r["key"] == config_key({k: r[k] for k in cpu_reference.KNOBS})
        assert r["env"]["ranks"] == 2 and r["env"]["numpy"] == np.__version__ and "mpi4py" in r["env"]
    manifest = json.loads((tmp_path / "cli.manifest.json").read_text())
    entry = manifest["sweeps"][-1]
    assert manifest["study"] == "reference" and manifest["records"] == "cli.jsonl" and len(manifest["sweeps"]) == 1
    assert entry["ranks"] == 2 and entry["configurations"] == 2 and entry["launched"] == 2
    assert entry["grid"]["tokens"] == [4, 8] and "--grid" in entry["argv"]
    assert len(entry["cuda_src_sha256"]) == 64
    again = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                           timeout=2 * LAUNCH_TIMEOUT_S)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(json.loads((tmp_path / "cli.manifest.json").read_text())["sweeps"]) == 1  # resumed: nothing launched
    listing = subprocess.run([sys.executable, "-m", "cupyep.lab.experiments", "--list"], env=dict(os.environ),
                             capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "reference:" in listing.stdout and "    tokens = 128" in listing.stdout


def test_run_api_end_to_end_on_two_ranks(tmp_path, launch_env):
    grid = {**TINY, "experts": [16, 15], "routing": ["uniform", "zipf"]}
    recs = experiments.run("reference", grid, ranks=2, out=tmp_path / "api.jsonl", progress=True,
                           timeout=LAUNCH_TIMEOUT_S)
    assert len(recs) == 8
    for r in recs:
        if r["experts"] == 15:  # not divisible by 2 ranks: the library's ValueError
            assert r["status"] == "skipped" and "divisible" in r["reason"], r
        else:
            assert r["status"] == "ok" and r["recv_tokens"] > 0, r


def test_a_timed_out_sweep_keeps_the_finished_records(tmp_path, faults_study):
    out = tmp_path / "hang.jsonl"
    grid = [{"mode": "ok", "n": 1}, {"mode": "hang"}, {"mode": "ok", "n": 2}]
    with pytest.raises(experiments.SweepError, match="timed out"):
        experiments.run(faults_study, grid, ranks=2, out=out, progress=False, timeout=3)
    assert [(r["mode"], r["status"]) for r in load(out)] == [("ok", "ok")]


# ------------------------------------------------ emulated nodes (layouts) ---

def test_select_matches_the_layout_and_old_records_are_one_node():
    def rec(tokens, ranks, **extra):
        return {"study": "s", "tokens": tokens, "ranks": ranks, "key": config_key({"tokens": tokens}), **extra}
    old4 = rec(1, 4)  # written before the field existed: one node of 4
    new4 = rec(2, 4, ranks_per_node=4)
    split4 = rec(2, 4, ranks_per_node=2)
    old2 = rec(1, 2)
    recs = [old4, new4, split4, old2]
    keys = [config_key({"tokens": t}) for t in (1, 2)]
    k1, k2 = keys
    assert records.record_ranks_per_node(old4) == 4 and records.record_ranks_per_node(split4) == 2
    assert records.record_ranks_per_node(rec(1, 4, ranks_per_node=None)) == 4
    # ranks given, ranks_per_node None: one node only (split4 is not the latest of key 2 at 4 ranks)
    assert records.select(recs, "s", keys, 4) == {k1: old4, k2: new4}
    assert records.select(recs, "s", keys, 4, 4) == {k1: old4, k2: new4}
    assert records.select(recs, "s", keys, 4, 2) == {k2: split4}
    assert records.select(recs, "s", keys, 2) == {k1: old2}
    assert records.select(recs, "s", keys, 2, 1) == {}
    # ranks None: any rank count; ranks_per_node None too: any layout (the latest record wins)
    assert records.select(recs, "s", keys) == {k1: old2, k2: split4}
    assert records.select(recs, "s", keys, ranks_per_node=4) == {k1: old4, k2: new4}
    assert records.select(recs, "s", keys, ranks_per_node=2) == {k1: old2, k2: split4}
    assert records.select(recs, "other", keys, 4) == {}


def test_follower_and_fallback_match_the_layout(tmp_path, monkeypatch):
    path = tmp_path / "f.jsonl"
    keys = [config_key({"tokens": t}) for t in (1, 2)]
    one = experiments._Follower(path, "s", keys, 4, 4)
    two = experiments._Follower(path, "s", keys, 4, 2)
    for tokens, extra in ((1, {}), (2, {"ranks_per_node": 4}), (1, {"ranks_per_node": 2}), (2, {"ranks": 2})):
        records.append(path, {"study": "s", "tokens": tokens, "ranks": 4, "key": config_key({"tokens": tokens}),
                              **extra})
    assert one.new_records() == 2 and two.new_records() == 1 and two.last["ranks_per_node"] == 2

    gpu = studies.register(Study("sweep_gpu_layouts", {"tokens": 1}, lambda group, config: {}, needs_gpu=True))
    monkeypatch.setattr(experiments, "_has_gpu", lambda: False)
    committed = tmp_path / "committed.jsonl"
    for tokens, rpn, t in ((1, None, 10.0), (2, 8, 20.0), (1, 4, 11.0), (2, 4, 21.0)):
        records.append(committed, {"study": gpu.name, "tokens": tokens, "ranks": 8, "status": "ok", "t": t,
                                   "key": config_key({"tokens": tokens}),
                                   **({} if rpn is None else {"ranks_per_node": rpn})})
    grid = {"tokens": [1, 2]}
    assert [r["t"] for r in experiments.run(gpu, grid, ranks=8, fallback=committed)] == [10.0, 20.0]
    assert [r["t"] for r in experiments.run(gpu, grid, ranks=8, ranks_per_node=8, fallback=committed)] == [10.0, 20.0]
    assert [r["t"] for r in experiments.run(gpu, grid, ranks=8, ranks_per_node=4, fallback=committed)] == [11.0, 21.0]
    with pytest.warns(UserWarning, match=r"0 of the 2 configurations .* at 8 ranks \(2 per node\)"):
        assert experiments.run(gpu, grid, ranks=8, ranks_per_node=2, fallback=committed) == []


@pytest.mark.parametrize("bad", [0, -2, 3, "2", 2.0, True])
def test_bad_ranks_per_node_raises_before_launching(tmp_path, monkeypatch, bad):
    def launched(*args, **kwargs):
        raise AssertionError("launched")
    monkeypatch.setattr(experiments, "_launch", launched)
    monkeypatch.setattr(experiments.subprocess, "Popen", launched)
    out = tmp_path / "sub" / "bad.jsonl"
    with pytest.raises(ValueError, match="ranks_per_node"):
        experiments.run("reference", TINY, ranks=4, ranks_per_node=bad, out=out, progress=False)
    assert not out.parent.exists()  # nothing written either


def test_launch_command_passes_ranks_per_node():
    cmd = experiments._launch_command("spec.json", 4, 2, 60.0)
    assert cmd[1:] == ["-m", "cupyep.launcher.launch", "-n", "4", "--ranks-per-node", "2", "--timeout", "60",
                       "-m", "cupyep.lab.experiments.worker", "spec.json"]
    assert "--ranks-per-node" not in experiments._launch_command("spec.json", 4, None, 60.0)


def test_cli_passes_ranks_per_node_through(monkeypatch, capsys):
    from cupyep.lab.experiments import __main__ as cli
    args = cli.parser().parse_args(["reference", "--ranks", "4", "--ranks-per-node", "2"])
    assert (args.ranks, args.ranks_per_node) == (4, 2)
    assert cli.parser().parse_args(["reference"]).ranks_per_node is None
    calls = []

    def fake_run(study, grid, **kwargs):
        calls.append(kwargs)
        return [{"status": "ok", "key": "{}"}]
    monkeypatch.setattr(cli, "run", fake_run)
    assert cli.main(["reference", "--ranks", "4", "--ranks-per-node", "2", "--grid", "tokens=4"]) == 0
    assert cli.main(["reference", "--ranks", "4", "--grid", "tokens=4"]) == 0
    assert [(c["ranks"], c["ranks_per_node"]) for c in calls] == [(4, 2), (4, None)]
    monkeypatch.setattr(cli, "run", experiments.run)  # the real one refuses before launching
    assert cli.main(["reference", "--ranks", "4", "--ranks-per-node", "3", "--grid", "tokens=4"]) == 2
    assert "ranks_per_node" in capsys.readouterr().err


def test_a_sweep_on_two_emulated_nodes_records_the_layout(tmp_path, launch_env):
    out = tmp_path / "nodes.jsonl"
    recs = experiments.run("reference", {**TINY, "tokens": 4}, ranks=4, ranks_per_node=2, out=out,
                           progress=False, timeout=LAUNCH_TIMEOUT_S)
    assert len(recs) == 1 and recs[0]["status"] == "ok", recs
    for r in load(out):
        assert r["ranks"] == 4 and r["ranks_per_node"] == 2
        assert r["env"]["ranks"] == 4 and r["env"]["ranks_per_node"] == 2
    entry = json.loads((tmp_path / "nodes.manifest.json").read_text())["sweeps"][-1]
    assert entry["ranks"] == 4 and entry["ranks_per_node"] == 2


def test_resume_distinguishes_layouts(tmp_path, launch_env, monkeypatch):
    out = tmp_path / "layouts.jsonl"
    # one node: a CUPYEP_RANKS_PER_NODE of this process does not reach the ranks
    monkeypatch.setenv("CUPYEP_RANKS_PER_NODE", "2")
    one = experiments.run("reference", TINY, ranks=4, out=out, progress=False, timeout=LAUNCH_TIMEOUT_S)
    assert [(r["ranks"], r["ranks_per_node"], r["env"]["ranks_per_node"]) for r in one] == [(4, 4, 4)] * 2
    monkeypatch.delenv("CUPYEP_RANKS_PER_NODE")
    split = experiments.run("reference", TINY, ranks=4, ranks_per_node=2, out=out, progress=False,
                            timeout=LAUNCH_TIMEOUT_S)
    assert len(load(out)) == 4  # run again at the new layout, not skipped
    assert [r["ranks_per_node"] for r in split] == [2, 2] and {r["status"] for r in split} == {"ok"}
    assert {r["run_id"] for r in split}.isdisjoint(r["run_id"] for r in one)
    again = experiments.run("reference", TINY, ranks=4, ranks_per_node=2, out=out, progress=False,
                            timeout=LAUNCH_TIMEOUT_S)
    assert len(load(out)) == 4 and [r["run_id"] for r in again] == [r["run_id"] for r in split]
    whole = experiments.run("reference", TINY, ranks=4, ranks_per_node=4, out=out, progress=False,
                            timeout=LAUNCH_TIMEOUT_S)  # ranks_per_node == ranks: the one-node records
    assert len(load(out)) == 4 and [r["run_id"] for r in whole] == [r["run_id"] for r in one]
    assert len(json.loads((tmp_path / "layouts.manifest.json").read_text())["sweeps"]) == 2


@pytest.mark.parametrize("grid,match", [(["tokens=abc"], "knob 'tokens': 'abc' is not of type int"),
                                        (["routing=zipff"], "knob 'routing': 'zipff' is not one of"),
                                        (["topk=2.5"], "knob 'topk': 2.5 is not of type int")])
def test_a_typo_in_a_grid_value_is_bad_usage_before_anything_runs(monkeypatch, capsys, grid, match):
    """A grid value of the wrong type, or a routing that does not exist, is
    the caller's error (exit 2, nothing launched), not a skipped record."""
    from cupyep.lab.experiments import __main__ as cli
    launched = []
    monkeypatch.setattr(experiments, "_launch_command", lambda *a, **k: launched.append(a) or ["false"])
    assert cli.main(["reference", "--no-progress", "--grid", *grid]) == 2
    assert re.search(match, capsys.readouterr().err) and not launched
    with pytest.raises(ValueError, match="not of type bool"):
        experiments.grid.check_value("fused", "yes", True)
    experiments.grid.check_value("fused", 1, True)  # 0 / 1 stand for a bool
    experiments.grid.check_value("sleep_us", 400, 400.0)  # an int for a float


def test_the_command_line_passes_a_fallback_through(monkeypatch):
    from cupyep.lab.experiments import __main__ as cli
    calls = []
    monkeypatch.setattr(cli, "run", lambda study, grid, **kw: calls.append(kw) or [])
    assert cli.main(["normal", "--fallback", "results/sweeps/normal_knobs.jsonl"]) == 0
    assert calls[0]["fallback"] == "results/sweeps/normal_knobs.jsonl"
