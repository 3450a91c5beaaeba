"""Tests of cupyep.launcher.calls (per-process call records) and of the launcher's
report when a rank dies, raises or hangs (CPU only, pip's mpich)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cupyep.launcher import calls
from cupyep.launcher.calls import CallRecord, Ending

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "mpi_scripts"


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in (calls.ENV_VAR, "CUDA_VISIBLE_DEVICES", "CUPYEP_RANKS_PER_NODE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def launch(args, tmp_path, timeout=120):
    """Run the launcher with TMPDIR in tmp_path; return (result, TMPDIR)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "cupyep.launcher.launch", *args], cwd=REPO, text=True,
                         capture_output=True, timeout=timeout, env=_env(TMPDIR=str(tmpdir)))
    return res, tmpdir


def report_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("cupyep.launcher: ")]


# ---------------------------------------------------------- the record ---

def test_traced_call_without_record_is_the_function():
    assert calls.ENV_VAR not in os.environ

    def f(a, b=1):
        return a + b

    assert calls.traced_call("Test.f")(f) is f


def test_record_in_a_process(tmp_path):
    code = textwrap.dedent("""
        import os, sys
        from cupyep.launcher import calls

        @calls.traced_call("Demo.outer")
        def outer(n, *, inner_too=False):
            "outer's doc"
            if inner_too:
                inner()
            return n

        @calls.traced_call("Demo.inner")
        def inner():
            rec = calls.read_record(calls._record[2])
            print("INSIDE", rec.current, rec.last, rec.counts["Demo.inner"], flush=True)

        @calls.traced_call("Demo.fails")
        def fails():
            raise KeyError("x")

        assert outer.__name__ == "outer" and outer.__doc__ == "outer's doc" and outer.__wrapped__
        assert [outer(i) for i in range(5)] == list(range(5))
        outer(5, inner_too=True)
        try:
            fails()
        except KeyError:
            pass
        rec = calls.read_record(calls._record[2])
        print("AFTER", rec.rank, rec.pid == os.getpid(), rec.state, rec.current, rec.last, rec.counts, flush=True)

        @calls.traced_call("Demo.sometimes")
        def sometimes(fail):
            if fail:
                raise ValueError("once")
        try:
            sometimes(True)
        except ValueError:
            pass
        print("RAISED", calls.read_record(calls._record[2]).where(), flush=True)
        sometimes(False)  # a later call of the kind returns: its last call did not raise
        print("RETURNED", calls.read_record(calls._record[2]).where(), flush=True)
        try:
            fails()
        except KeyError:
            pass
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=60,
                         env=_env(**{calls.ENV_VAR: str(tmp_path), "PMI_RANK": "5"}))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    # Inside a nested call: current is the inner one, last too.
    assert lines[0] == "INSIDE Demo.inner Demo.inner 1"
    assert lines[1] == ("AFTER 5 True 1 None Demo.fails "
                        "{'Demo.outer': 6, 'Demo.inner': 1, 'Demo.fails': 1}")
    assert lines[2] == "RAISED after Demo.sometimes raised (ValueError: once), call 1 of that kind"
    assert lines[3] == "RETURNED after Demo.sometimes, call 2 of that kind"
    (path,) = tmp_path.glob("*" + calls.SUFFIX)
    rec = calls.read_record(str(path))
    assert rec.state == calls.EXITED  # interpreter shutdown marked it
    assert rec.where() == "after Demo.fails raised (KeyError: 'x'), call 2 of that kind"
    assert not list(tmp_path.glob("*.tmp"))


def test_record_marks_uncaught_exception(tmp_path):
    code = ("from cupyep.launcher import calls\n"
            "f = calls.traced_call('Demo.f')(lambda: 1 / 0)\n"
            "f()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=60,
                         env=_env(**{calls.ENV_VAR: str(tmp_path)}))
    assert res.returncode == 1 and "ZeroDivisionError" in res.stderr
    (rec,) = calls.read_records(str(tmp_path))
    assert rec.state == calls.EXITED_AFTER_EXCEPTION
    assert rec.rank == -1 and rec.label == f"pid {rec.pid}"
    assert rec.counts == {"Demo.f": 1}


def test_forked_child_does_not_write_the_parent_record(tmp_path):
    code = textwrap.dedent("""
        import os
        from cupyep.launcher import calls
        f = calls.traced_call("Demo.f")(lambda: None)
        f()
        pid = os.fork()
        if pid == 0:
            for _ in range(10):
                f()
            os._exit(0)
        os.waitpid(pid, 0)
        print(calls.read_record(calls._record[2]).counts["Demo.f"])
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=60,
                         env=_env(**{calls.ENV_VAR: str(tmp_path)}))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["1"]


def test_read_record_rejects_other_files(tmp_path):
    (tmp_path / "junk.calls").write_bytes(b"\0" * calls.RECORD_BYTES)
    (tmp_path / "short.calls").write_bytes(b"x")
    assert calls.read_record(str(tmp_path / "junk.calls")) is None
    assert calls.read_record(str(tmp_path / "short.calls")) is None
    assert calls.read_record(str(tmp_path / "missing.calls")) is None
    assert calls.read_records(str(tmp_path)) == []
    assert calls.read_records(str(tmp_path / "nowhere")) == []


def _rec(pid, rank, state=calls.RUNNING, current=None, last=None, **counts):
    return CallRecord(pid, rank, state, current, last, counts)


def test_first_end_and_report_wording():
    killed = _rec(11, 1, current="B.combine", last="B.combine", **{"B.combine": 12})
    victims = [_rec(10, 0, last="B.combine", **{"B.combine": 12}),
               _rec(12, 2, current="B.dispatch", last="B.dispatch", **{"B.dispatch": 13})]
    ends = [Ending(0, 11, 9), Ending(1, 10, 9), Ending(2, 12, 9)]
    assert calls.first_end([*victims, killed], ends) == (killed, ends[0])
    # A rank that raised, or left through sys.exit, comes first even when
    # the launcher's kills reached others before it.
    raised = _rec(12, 2, state=calls.EXITED_AFTER_EXCEPTION, last="B.dispatch", **{"B.dispatch": 13})
    assert calls.first_end([killed, raised], ends)[0] is raised
    exited = _rec(12, 2, state=calls.EXITED)
    assert calls.first_end([killed, exited], ends)[0] is exited
    assert calls.first_end([killed], []) is None
    assert calls.describe_status(9) == "signal 9, SIGKILL"
    assert calls.describe_status(3 << 8) == "exit status 3"
    assert calls.describe_status(None) == ""
    assert killed.where() == "during B.combine, call 12 of that kind"
    assert victims[0].where() == "after B.combine, call 12 of that kind"
    assert _rec(1, 0).where() == "before any traced call"
    lines = calls.where_report([*victims, killed, _rec(13, 3, current="B.combine", **{"B.combine": 12}),
                                _rec(99, -1)], skip_pid=10)
    assert lines == ["ranks 1, 3: during B.combine, call 12 of that kind",
                     "rank 2: during B.dispatch, call 13 of that kind",
                     "pid 99: before any traced call"]
    assert calls._rank_list([0, 1, 2, 4, 6, 7]) == "0-2, 4, 6-7"


# ------------------------------------------------- under the launcher ---

@pytest.mark.parametrize("between", [False, True])
def test_launcher_names_the_rank_that_died(tmp_path, between):
    count = 300
    args = ["-n", "4", "--gpus", "0", "--timeout", "60", str(SCRIPTS / "faults_kill.py"), "1", str(count)]
    res, tmpdir = launch(args + (["between"] if between else []), tmp_path)
    assert res.returncode not in (0, 124), res.stderr
    lines = report_lines(res.stderr)
    where = "after" if between else "during"
    died = [line for line in lines if " died" in line]
    assert len(died) == 1, res.stderr
    assert died[0].startswith("cupyep.launcher: rank 1 (pid "), died[0]
    assert died[0].endswith(f"{where} FaultProbe.step, call {count} of that kind"), died[0]
    others = next(line for line in lines if "the others then:" in line)
    assert "rank 1:" not in others and "FaultProbe.step" in others
    assert list(tmpdir.iterdir()) == []  # the record directory is gone


def test_launcher_names_the_rank_that_raised(tmp_path):
    res, tmpdir = launch(["-n", "4", "--gpus", "0", "--timeout", "60", str(SCRIPTS / "faults_raise.py"), "7"],
                         tmp_path)
    assert res.returncode not in (0, 124), res.stderr
    assert "rank 2 fails on purpose" in res.stderr
    (line,) = [line for line in report_lines(res.stderr) if "uncaught exception" in line]
    assert line.startswith("cupyep.launcher: rank 2 (pid ")
    assert line.endswith("after FaultProbe.step, call 7 of that kind")
    assert list(tmpdir.iterdir()) == []


def test_launcher_timeout_says_where_ranks_were(tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    res, tmpdir = launch(["-n", "3", "--gpus", "0", "--timeout", "8", str(SCRIPTS / "faults_sleep.py"),
                          str(piddir)], tmp_path)
    assert res.returncode == 124, res.stderr
    assert ("cupyep.launcher: at the timeout, the ranks were: ranks 0-2: during FaultProbe.wait, "
            "call 1 of that kind") in report_lines(res.stderr)
    assert list(tmpdir.iterdir()) == []


def test_launcher_success_prints_no_report(tmp_path):
    res, tmpdir = launch(["-n", "2", "--gpus", "0", "--timeout", "60", "-c",
                          "from cupyep.launcher.calls import traced_call; traced_call('X.y')(print)('ok')"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok", "ok"]
    assert len(report_lines(res.stderr)) == 1  # the summary line only
    assert list(tmpdir.iterdir()) == []
