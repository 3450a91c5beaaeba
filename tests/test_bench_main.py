"""CPU tests of the main job and its tools: the experiments' no-GPU guard,
gpu_tests without a GPU, the multi-run summary, and the main job's no-GPU
path writing a fresh run folder (its figures: tests/test_plotting.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupyep.launcher import gpu_tests
from cupyep.lab.bench import summary

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((REPO / "experiments").glob("*.py"))
# Scripts whose guard another change adds; checked once they call it.
GUARD_PENDING = {"bench_normal.py", "bench_low_latency.py"}


def _no_gpu_env():
    """This environment with every GPU hidden (CUDA_VISIBLE_DEVICES empty), so
    the no-GPU paths run on GPU machines too."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("script", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_without_gpu_prints_one_line_and_exits_2(script):
    if script.name in GUARD_PENDING and "require_gpu(" not in script.read_text():
        pytest.skip(f"{script.name} does not call cupyep.lab.bench.require_gpu yet")
    res = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_no_gpu_env(), capture_output=True,
                         text=True, timeout=120)
    out = (res.stdout + res.stderr).strip().splitlines()
    rel = f"experiments/{script.name}"
    assert res.returncode == 2, (res.returncode, out)
    assert out == [f"{rel} needs a CUDA GPU; none found (run python -m cupyep.lab.bench for the CPU reference run)"]


def test_gpu_tests_without_gpu_says_skipped_and_exits_2():
    res = subprocess.run([sys.executable, "-m", "cupyep.launcher.gpu_tests"], cwd=REPO, env=_no_gpu_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr  # nothing ran: not a pass
    assert res.stdout.strip() == gpu_tests.NO_GPU_MESSAGE
    assert res.stdout.startswith("skipped: no GPU") and "passed" not in res.stdout


def test_warm_without_gpu_says_skipped_and_exits_2():
    res = subprocess.run([sys.executable, "-m", "cupyep.jit", "--warm"], cwd=REPO, env=_no_gpu_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stdout.startswith("skipped: no GPU")


def test_gpu_tests_named_files_run_instead_of_the_suite(tmp_path, monkeypatch):
    suite = [str(REPO / "tests" / "gpu")]
    cmd = gpu_tests.pytest_command(4, ["-q"], suite, k="low_latency", timeout=60, ranks_per_node=2)
    assert cmd[cmd.index("-n") + 1] == "4" and cmd[cmd.index("--ranks-per-node") + 1] == "2"
    assert cmd[cmd.index("--timeout") + 1] == "60"
    assert cmd[-4:] == [suite[0], "-k", "low_latency", "-q"]  # the suite, then -k and the extra arguments
    named = ["tests/gpu/test_low_latency_gpu.py", "tests/gpu/test_direct_gpu.py::test_direct_fault_missing_rank_times_out_naming_it"]
    cmd = gpu_tests.pytest_command(2, [*named, "-q"], suite)
    assert suite[0] not in cmd and cmd[-3:] == [*named, "-q"]  # each named file once, the suite not beside them
    # A file named relative to another folder is passed absolute (pytest runs in the repository).
    (tmp_path / "test_x.py").write_text("")
    monkeypatch.chdir(tmp_path)
    cmd = gpu_tests.pytest_command(2, ["test_x.py::test_a"], suite)
    assert cmd[-1] == f"{tmp_path / 'test_x.py'}::test_a" and suite[0] not in cmd
    assert gpu_tests.named_test_path("-x") is None and gpu_tests.named_test_path("no_such_file.py") is None


def test_gpu_tests_verdicts():
    out = "x\n...s [100%]\n3 passed, 2 skipped, 1 deselected in 4.50s\n" * 2
    assert gpu_tests.pytest_counts(out) == {"passed": 3, "skipped": 2, "deselected": 1}
    assert gpu_tests.verdict(0, {"passed": 3, "skipped": 2}) == ("passed (3 passed, 2 skipped)", False)
    what, bad = gpu_tests.verdict(0, gpu_tests.pytest_counts("sss\n3 skipped in 0.10s\n"))
    assert bad and what.startswith("skipped") and "passed" not in what
    assert gpu_tests.verdict(5, {})[1]
    what, bad = gpu_tests.verdict(1, gpu_tests.pytest_counts("1 failed, 2 passed, 1 error in 3.00s"))
    assert bad and what == "FAILED (status 1; 1 failed, 2 passed, 1 error)"
    assert gpu_tests.pytest_counts("no summary here") == {}


# ------------------------------------------------------------ summary ---

def _write_run(path: Path, normal_us, naive_us, ll_us, copy_GBps=4000.0):
    """A synthetic run folder: normal, low-latency and naive records at 2 and 8 ranks."""
    path.mkdir(parents=True)
    env = {"gpu": "Test GPU", "ranks_per_gpu": None}
    with (path / "normal.jsonl").open("w") as f:
        for ranks in (2, 8):
            for kind, t in normal_us.items():
                f.write(json.dumps({"bench": "normal", "kind": kind, "ranks": ranks, "tokens": 4096, "time_us": t,
                                    "rank_GBps": 100.0 * 1000 / t, "copy_GBps": copy_GBps,
                                    "env": {**env, "ranks_per_gpu": ranks}}) + "\n")
            # a sweep point never counts
            f.write(json.dumps({"bench": "normal", "kind": "dispatch_bf16", "ranks": ranks, "tokens": 4096,
                                "time_us": 1.0, "rank_GBps": 1.0, "sweep": True}) + "\n")
    with (path / "naive.jsonl").open("w") as f:
        for ranks in (2, 8):
            for tokens, (d, c) in naive_us.items():
                for kind, t in (("dispatch", d), ("combine", c)):
                    f.write(json.dumps({"bench": "naive", "kind": kind, "ranks": ranks, "tokens": tokens,
                                        "time_us": t, "rank_GBps": 10.0, "timing": "host_aligned",
                                        "env": env}) + "\n")
    with (path / "low_latency.jsonl").open("w") as f:
        for ranks in (2, 8):
            for tokens, kinds in ll_us.items():
                for kind, t in kinds.items():
                    f.write(json.dumps({"bench": "low_latency", "kind": kind, "ranks": ranks, "tokens": tokens,
                                        "kernel_median_us": t, "event_median_us": t + 10,
                                        "bytes_to_peers": 8_000_000, "env": env}) + "\n")
                f.write(json.dumps({"bench": "low_latency", "kind": "dispatch_fp8", "timing": "deepep",
                                    "ranks": ranks, "tokens": tokens, "kernel_median_us": 5.0}) + "\n")
                f.write(json.dumps({"bench": "low_latency", "kind": "dispatch_fp8_trace", "ranks": ranks,
                                    "tokens": tokens, "marks": {}}) + "\n")
            f.write("{not json\n")  # a run cut short mid-line


@pytest.fixture
def three_runs(tmp_path):
    runs = []
    for i, scale in enumerate((1.0, 1.2, 0.9)):
        d = tmp_path / f"2024010{i}T000000Z"
        _write_run(d, {"dispatch_bf16": 1000 * scale, "combine_bf16": 2000 * scale},
                   {4096: (16000 * scale, 17000), 128: (2000, 800), 1: (1000, 400)},
                   {128: {"dispatch_fp8": 40 * scale, "combine": 50.0, "dispatch_fp8_send_half": 20.0},
                    1: {"dispatch_fp8": 10.0, "combine": 10.0}})
        runs.append(d)
    return runs


def test_summary_medians_spread_and_speedup(three_runs):
    rows = summary.summarize([summary.load_run(d) for d in three_runs])
    by = {(r.bench, r.kind, r.ranks, r.tokens): r for r in rows}
    r = by[("normal", "dispatch_bf16", 8, 4096)]
    assert (r.runs, r.median_us, r.min_us, r.max_us) == (3, 1000.0, 900.0, 1200.0)
    assert r.speedup == pytest.approx(16000 / 1000)      # naive dispatch medians 16000, 19200, 14400
    assert by[("normal", "combine_bf16", 2, 4096)].speedup == pytest.approx(17000 / 2000)
    assert by[("low_latency", "dispatch_fp8", 8, 128)].speedup == pytest.approx(2000 / 40)
    assert by[("low_latency", "combine", 2, 1)].speedup == pytest.approx(400 / 10)
    assert by[("low_latency", "dispatch_fp8_send_half", 8, 128)].speedup is None
    assert by[("low_latency", "dispatch_fp8 [deepep]", 8, 128)].median_us == 5.0
    assert by[("naive", "dispatch", 8, 4096)].speedup is None
    assert by[("low_latency", "dispatch_fp8", 8, 128)].rank_GBps == pytest.approx(8e6 / 8 / 40e-6 / 1e9)
    assert not any("trace" in r.kind for r in rows)
    assert [r.tokens for r in rows] == sorted((r.tokens for r in rows), reverse=True)


def test_summary_command_markdown(three_runs, capsys):
    assert summary.main([str(d) for d in three_runs] + ["--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| bench | kind | ranks | tokens | runs | median us | min-max us")
    assert set(lines[1].replace("|", "").split()) <= {"---", "---:"}
    row = next(line for line in lines if line.startswith("| normal | dispatch_bf16 | 8 | 4096 |"))
    assert [c.strip() for c in row.strip("|").split("|")][4:] == ["3", "1000.0", "900.0-1200.0", "100.0", "16.0x"]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_summary_command_text_and_errors(three_runs, tmp_path, capsys):
    assert summary.main([str(three_runs[0])]) == 0
    out = capsys.readouterr().out
    assert "dispatch_bf16" in out and "|" not in out
    (tmp_path / "empty").mkdir()
    assert summary.main([str(tmp_path / "empty")]) == 2
    assert summary.main([str(tmp_path / "missing")]) == 2
    (tmp_path / "README.md").write_text("# runs\n")
    (tmp_path / "figures").mkdir()
    capsys.readouterr()
    # results/main/* holds a README and figure folders beside the runs: they are skipped, with a note
    assert summary.main([str(tmp_path / "README.md"), str(tmp_path / "figures"), str(three_runs[0])]) == 0
    err = capsys.readouterr().err
    assert "skipped" in err and "README.md" in err and "figures" in err
    (three_runs[1] / "normal.jsonl").write_text("")
    for p in three_runs[1].glob("*.jsonl"):
        p.write_text("")
    assert summary.main([str(three_runs[1])]) == 1  # a run folder without timed records


# ------------------------------------------------------- main, no GPU ---

def test_main_without_gpu_writes_a_fresh_run_folder(tmp_path, monkeypatch, capsys):
    import cupyep.runtime
    from cupyep.lab.bench import main as bench_main
    monkeypatch.setattr(cupyep.runtime, "gpu_count", lambda: 0)
    dirs = []
    for _ in range(2):
        assert bench_main.main(["--out", str(tmp_path), "--ranks", "2"]) == 0
        dirs.append(sorted(set(tmp_path.iterdir()) - set(dirs))[0])
    out = capsys.readouterr().out
    assert dirs[0] != dirs[1] and all(d.parent == tmp_path for d in dirs)
    for d in dirs:
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["command"].endswith("-m cupyep.lab.bench --out " + str(tmp_path) + " --ranks 2")
        assert manifest["backend"] == "numpy-reference (no GPU)" and manifest["status"] == 0
        assert {"normal.jsonl", "normal.png", "normal.svg"} <= set(manifest["files"])
        assert "low_latency.png" not in manifest["files"]  # no low-latency records without a GPU
        assert "python" in manifest["environment"] and "git_commit" in manifest
        records = summary.load_jsonl(d / "normal.jsonl")
        assert [(r["kind"], r["ranks"]) for r in records] == [("dispatch_bf16", 2), ("combine_bf16", 2)]
        assert all(r["combine_check"] and r["backend"] == "numpy-reference (no GPU)" for r in records)
    assert "numpy-reference" in out and "median us" in out


@pytest.mark.parametrize("argv,match", [(["--ranks", "3"], "--ranks 3: the job's 256 experts"),
                                        (["--ranks", "0"], "--ranks 0"),
                                        (["--ranks-per-node", "0"], "--ranks-per-node must be >= 1")])
def test_main_refuses_a_bad_rank_count_before_writing_anything(tmp_path, capsys, argv, match):
    from cupyep.lab.bench import main as bench_main
    with pytest.raises(SystemExit) as info:
        bench_main.main(["--out", str(tmp_path / "runs"), *argv])
    assert info.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no half-written run folder


def test_main_says_that_ranks_per_node_needs_a_gpu(tmp_path, monkeypatch, capsys):
    import cupyep.runtime
    from cupyep.lab.bench import main as bench_main
    monkeypatch.setattr(cupyep.runtime, "gpu_count", lambda: 0)
    assert bench_main.main(["--out", str(tmp_path), "--ranks", "2", "--ranks-per-node", "2"]) == 0
    assert "--ranks-per-node needs a GPU" in capsys.readouterr().err


def test_gpu_test_shards_cover_every_file_once():
    files = [f"tests/gpu/test_{c}.py" for c in "fbdaec"]
    shards = [gpu_tests.shard_files(files, f"{i}/3") for i in (1, 2, 3)]
    assert sorted(f for sh in shards for f in sh) == sorted(files)
    assert shards[0] == ["tests/gpu/test_a.py", "tests/gpu/test_d.py"]
    for bad in ("0/2", "3/2", "x", "1-2"):
        with pytest.raises(ValueError, match="shard"):
            gpu_tests.shard_files(files, bad)


def test_the_job_times_both_routes_across_nodes_where_the_ranks_make_two_nodes():
    from cupyep.lab.bench import main as bench_main
    within = [r[0] for r in bench_main.planned_runs(8, None)]
    assert "bench_internode.py" not in within and within == [b[0] for b in bench_main.BENCHES]
    across = [r for r in bench_main.planned_runs(8, 4) if r[0] == "bench_internode.py"]
    assert [r[2] for r in across] == [("--route", "two_hop"), ("--route", "direct")]
    assert all(r[1] == "internode.jsonl" and r[3] == ("--ranks-per-node", "4") for r in across)
    assert not [r for r in bench_main.planned_runs(4, 4) if r[0] == "bench_internode.py"]  # one node of 4
    assert not [r for r in bench_main.planned_runs(6, 4) if r[0] == "bench_internode.py"]  # not whole nodes


def test_the_main_job_writes_outside_the_repository_by_default(tmp_path, monkeypatch):
    import cupyep.runtime
    from cupyep.lab.bench import main as bench_main
    monkeypatch.setattr(cupyep.runtime, "gpu_count", lambda: 0)
    monkeypatch.setenv("CUPYEP_RUNS", str(tmp_path / "runs"))
    assert bench_main.default_runs_dir() == tmp_path / "runs"
    monkeypatch.delenv("CUPYEP_RUNS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert bench_main.default_runs_dir() == tmp_path / "cache" / "cupyep" / "runs"
    assert bench_main.main(["--ranks", "2"]) == 0
    (run,) = (tmp_path / "cache" / "cupyep" / "runs").iterdir()
    assert (run / "manifest.json").is_file() and bench_main.ROOT not in run.parents


def test_a_run_is_promoted_into_the_results_once(tmp_path, monkeypatch, capsys):
    import cupyep.runtime
    from cupyep.lab.bench import main as bench_main
    from cupyep.lab.bench import promote
    monkeypatch.setattr(cupyep.runtime, "gpu_count", lambda: 0)
    assert bench_main.main(["--out", str(tmp_path / "runs"), "--ranks", "2"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    dest = tmp_path / "results" / "main"
    assert promote.main([str(run), "--to", str(dest)]) == 0
    files = json.loads((run / "manifest.json").read_text())["files"]
    assert sorted(p.name for p in (dest / run.name).iterdir()) == sorted(["manifest.json", *files])
    assert promote.main([str(run), "--to", str(dest)]) == 2  # not overwritten
    assert "exists already" in capsys.readouterr().err
    (tmp_path / "notarun").mkdir()
    assert promote.main([str(tmp_path / "notarun"), "--to", str(dest)]) == 2
    assert "not a run folder" in capsys.readouterr().err
