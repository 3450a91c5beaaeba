"""Tests of cupyep.launcher.launch and cupyep.launcher.mps (CPU only; real launches use the
mpiexec next to sys.executable, fake nvidia-cuda-mps-control scripts)."""

import json
import re
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cupyep.launcher import launch, lines, mps
from cupyep.launcher.launch import MPICH, OPENMPI, build_command

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "mpi_scripts"
DEFAULT_MPS_RUNNING = os.path.exists("/tmp/nvidia-mps/control")

FAKE_MPS = """#!/bin/sh
# Fake nvidia-cuda-mps-control: logs its args, env and stdin to $FAKE_MPS_LOG.
printf 'argv:%s pipe:%s log:%s atp:%s\\n' "$*" "$CUDA_MPS_PIPE_DIRECTORY" \\
    "$CUDA_MPS_LOG_DIRECTORY" "${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-unset}" \\
    >> "$FAKE_MPS_LOG"
if [ "$1" = "-d" ]; then
    [ -z "$FAKE_MPS_START_DELAY" ] || sleep "$FAKE_MPS_START_DELAY"
    [ -n "$FAKE_MPS_NO_PIPE" ] || mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
    if [ -n "$FAKE_MPS_STUBBORN" ]; then  # a server that never quits
        sleep 300 < /dev/null > /dev/null 2>&1 &
        echo $! > "$FAKE_MPS_LOG.server"
    fi
    exit 0
fi
sed 's/^/stdin:/' >> "$FAKE_MPS_LOG"
[ -n "$FAKE_MPS_STUBBORN" ] || rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


# ------------------------------------------------------------- helpers ---

def _clean_env(**extra):
    env = dict(os.environ)
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_VISIBLE_DEVICES",
                 "CUPYEP_RANKS_PER_NODE", "CUPYEP_LAUNCHED"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def run_launcher(args, env=None, timeout=120):
    """Run ``python -m cupyep.launcher args``; return (CompletedProcess, s)."""
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "cupyep.launcher.launch", *args],
                         cwd=REPO, env=env or _clean_env(), text=True,
                         capture_output=True, timeout=timeout)
    return res, time.monotonic() - start


def _pid_alive(pid):
    """True for a live, non-zombie process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _wait_pids(directory, count, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = sorted(directory.glob("*.pid"))
        if len(pids) == count:
            return [int(p.read_text()) for p in pids]
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start: {list(directory.iterdir())}")


def _assert_all_dead(pids, timeout=5):
    deadline = time.monotonic() + timeout
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_pid_alive(p) for p in pids), pids


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """Put a fake nvidia-cuda-mps-control first on PATH; return its log."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    tool = bindir / mps.CONTROL_BINARY
    tool.write_text(FAKE_MPS)
    tool.chmod(0o755)
    log = tmp_path / "mps.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIRECTORY",
                        str(tmp_path / "no-default-mps"))
    return log


# --------------------------------------------------------- pure logic ---

def test_detect_flavour():
    assert launch.detect_flavour("mpirun (Open MPI) 4.1.6\n") == OPENMPI
    assert launch.detect_flavour("mpiexec (OpenRTE) 4.0.3") == OPENMPI
    assert launch.detect_flavour("https://www.open-mpi.org/") == OPENMPI
    assert launch.detect_flavour("HYDRA build details:\n Version: 4") == MPICH
    assert launch.detect_flavour("Intel(R) MPI Library for Linux") == MPICH
    with pytest.raises(launch.LaunchError):
        launch.detect_flavour("something else")


def test_real_mpiexec_flavour():
    exe = launch.find_mpiexec()
    assert launch.mpiexec_flavour(exe) in (OPENMPI, MPICH)


def test_build_command_openmpi():
    env = {"CUPYEP_LAUNCHED": "1", "NCCL_NVLS_ENABLE": "0"}
    before = dict(env)
    cmd = build_command(OPENMPI, "/x/mpiexec", 4, ["s.py", "-n", "7"], env,
                        is_root=False, num_slots=8)
    assert env == before  # pure
    assert cmd[:3] == ["/x/mpiexec", "-n", "4"]
    assert "--oversubscribe" not in cmd and "--allow-run-as-root" not in cmd
    assert "-genv" not in cmd
    i = cmd.index(sys.executable)
    assert cmd[3:i] == ["-x", "CUPYEP_LAUNCHED", "-x", "NCCL_NVLS_ENABLE"]
    assert cmd[i:] == [sys.executable, "-c", lines.RANK_BOOT, "s.py", "-n", "7"]


def test_build_command_openmpi_oversubscribe_and_root():
    cmd = build_command(OPENMPI, "mpiexec", 8, ["-m", "pkg.mod", "a"],
                        {"A": "1"}, is_root=True, num_slots=2)
    assert "--oversubscribe" in cmd and "--allow-run-as-root" in cmd
    assert cmd[-5:] == ["-c", lines.RANK_BOOT, "-m", "pkg.mod", "a"]
    assert "--oversubscribe" not in build_command(
        OPENMPI, "mpiexec", 2, ["s.py"], {}, False, 2)
    env = launch.mpiexec_env(OPENMPI, {"A": "1"}, True, base_env={"B": "2"})
    assert env == {"A": "1", "B": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert launch.mpiexec_env(OPENMPI, {"A": "1"}, False, {}) == {"A": "1"}


def test_build_command_mpich():
    env = {"CUPYEP_RANKS_PER_NODE": "2", "CUPYEP_LAUNCHED": "1"}
    cmd = build_command(MPICH, "mpiexec", 16, ["-m", "pkg.mod", "--x"], env,
                        is_root=True, num_slots=2)
    assert cmd[:3] == ["mpiexec", "-n", "16"]
    assert cmd[3:9] == ["-genv", "CUPYEP_LAUNCHED", "1",
                        "-genv", "CUPYEP_RANKS_PER_NODE", "2"]
    assert cmd[9:] == [sys.executable, "-c", lines.RANK_BOOT, "-m", "pkg.mod", "--x"]
    assert not {"--oversubscribe", "--allow-run-as-root", "-x"} & set(cmd)
    assert launch.mpiexec_env(MPICH, env, True, {}) == env  # no OMPI vars


def test_rank_env():
    env = launch.rank_env()
    assert env == {"CUPYEP_LAUNCHED": "1", "NVSHMEM_DISABLE_NVLS": "1",
                   "NCCL_NVLS_ENABLE": "0"}
    env = launch.rank_env(4, {"CUDA_MPS_PIPE_DIRECTORY": "/p"})
    assert env["CUPYEP_RANKS_PER_NODE"] == "4"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/p"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_rank_env_asks_for_sm_partitions():
    assert launch.rank_env(None, {}, None, True)["CUPYEP_SM_SHARE"] == "1"
    assert "CUPYEP_SM_SHARE" not in launch.rank_env(None, {}, None, False)


def test_validate_ranks_per_node():
    launch.validate_ranks_per_node(8, None)
    launch.validate_ranks_per_node(8, 4)
    launch.validate_ranks_per_node(8, 8)
    for n, k in ((8, 3), (8, 0), (8, 16), (0, None)):
        with pytest.raises(launch.LaunchError):
            launch.validate_ranks_per_node(n, k)


def test_count_visible_devices():
    cvd = launch.count_visible_devices
    assert cvd("0,1,2") == 3
    assert cvd(" 0 , 1 ") == 2
    assert cvd("") == 0
    assert cvd("-1") == 0
    assert cvd("0,-1,1") == 1
    assert cvd("GPU-1234,MIG-abcd") == 2


def test_gpu_count():
    def smi():
        return 8

    assert launch.gpu_count(3, {"CUDA_VISIBLE_DEVICES": "0"}, smi) == 3
    assert launch.gpu_count(None, {"CUDA_VISIBLE_DEVICES": "0,1"}, smi) == 2
    assert launch.gpu_count(None, {"CUDA_VISIBLE_DEVICES": ""}, smi) == 0
    assert launch.gpu_count(None, {}, smi) == 8
    assert launch.gpu_count(None, {}, lambda: None) == 0


def test_nvidia_smi_gpu_count(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
                   "echo '  MIG 1g.18gb Device 0: (UUID: MIG-b)'\n"
                   "echo 'GPU 1: NVIDIA H200 (UUID: GPU-c)'\n")
    smi.chmod(0o755)
    assert launch.nvidia_smi_gpu_count({"PATH": str(tmp_path)}) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert launch.nvidia_smi_gpu_count({"PATH": str(empty)}) is None


def test_ranks_per_gpu_and_mps_needed():
    assert launch.ranks_per_gpu(4, 1) == 4
    assert launch.ranks_per_gpu(4, 2) == 2
    assert launch.ranks_per_gpu(5, 2) == 3
    assert launch.ranks_per_gpu(2, 8) == 1
    assert launch.ranks_per_gpu(4, 0) == 0
    assert launch.mps_needed(2) and launch.mps_needed(4)
    assert not launch.mps_needed(1)
    assert not launch.mps_needed(0)
    assert not launch.mps_needed(4, no_mps=True)


def test_find_mpiexec(tmp_path):
    beside = tmp_path / "venv"
    beside.mkdir()
    exe = beside / "mpiexec"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    onpath = tmp_path / "onpath"
    onpath.mkdir()
    other = onpath / "mpiexec"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    env = {"PATH": str(onpath)}
    assert launch.find_mpiexec(None, env, str(beside / "python")) == str(exe)
    nowhere = str(tmp_path / "none" / "python")
    assert launch.find_mpiexec(None, env, nowhere) == str(other)
    assert launch.find_mpiexec(str(exe), env, nowhere) == str(exe)
    with pytest.raises(launch.LaunchError, match="no mpiexec"):
        launch.find_mpiexec(None, {"PATH": str(tmp_path)}, nowhere)
    with pytest.raises(launch.LaunchError):
        launch.find_mpiexec(str(tmp_path / "missing"), env, nowhere)


def test_parse_args_split():
    opts, prog = launch.parse_args(
        ["-n", "4", "--timeout", "5", "-m", "pkg.mod", "-n", "--no-mps"])
    assert (opts.num_ranks, opts.timeout, opts.no_mps) == (4, 5.0, False)
    assert prog == ["-m", "pkg.mod", "-n", "--no-mps"]
    opts, prog = launch.parse_args(
        ["-n", "2", "--no-mps", "--gpus=1", "s.py", "--gpus", "3"])
    assert (opts.no_mps, opts.gpus, prog) == (True, 1, ["s.py", "--gpus", "3"])
    opts, prog = launch.parse_args(["-n", "2", "--", "-weird.py"])
    assert prog == ["-weird.py"]
    assert launch.main(["-n", "2"]) == 2  # no program
    assert launch.default_num_slots() >= 1


# ---------------------------------------------------------------- MPS ---

def test_mps_is_running(tmp_path, monkeypatch):
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIRECTORY", str(tmp_path / "d"))
    assert not mps.mps_is_running({})
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "control").touch()  # no pid file: trust it
    assert mps.mps_is_running({})
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "e")}
    assert not mps.mps_is_running(env)
    (tmp_path / "e").mkdir()
    os.mkfifo(tmp_path / "e" / "control")
    assert mps.mps_is_running(env)
    pid_file = tmp_path / "e" / mps.PID_FILE
    pid_file.write_text(str(os.getpid()))
    assert mps.mps_is_running(env)
    dead = subprocess.Popen(["true"])
    dead.wait()
    pid_file.write_text(str(dead.pid))
    assert not mps.mps_is_running(env)


def test_mps_is_running_socket(tmp_path):
    """The real daemon's control is a unix socket, left behind on exit."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "control"))
    server.listen(4)
    try:
        assert mps.mps_is_running(env)
    finally:
        server.close()
    assert (tmp_path / "control").exists()
    assert not mps.mps_is_running(env)  # stale socket: nobody listens


def test_mps_daemon_start_and_quit(fake_mps):
    with mps.mps_daemon() as env:
        assert set(env) == {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}
        pipe, logdir = env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]
        assert os.path.isdir(logdir)
        assert os.path.exists(os.path.join(pipe, "control"))
        assert mps.mps_is_running(env)
        lines = fake_mps.read_text().splitlines()
        assert lines == [f"argv:-d pipe:{pipe} log:{logdir} atp:unset"]
    lines = fake_mps.read_text().splitlines()
    assert lines[1] == f"argv: pipe:{pipe} log:{logdir} atp:unset"
    assert lines[2:] == ["stdin:quit"]
    assert not os.path.exists(os.path.dirname(pipe))  # temp dir removed
    assert not mps.mps_is_running(env)


def test_mps_daemon_cleanup_when_body_raises(fake_mps):
    with pytest.raises(ZeroDivisionError):
        with mps.mps_daemon(dict(os.environ)) as env:
            pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
            1 / 0
    assert "stdin:quit" in fake_mps.read_text().splitlines()
    assert not os.path.exists(os.path.dirname(pipe))


def test_mps_daemon_stops_what_does_not_quit(fake_mps, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_STUBBORN", "1")
    with mps.mps_daemon(stop_timeout=0.5) as env:
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        server = int(Path(str(fake_mps) + ".server").read_text())
        assert _pid_alive(server)
        assert [p for p, _ in mps.processes_with_env(
            "CUDA_MPS_PIPE_DIRECTORY", pipe)] == [server]
    assert "stdin:quit" in fake_mps.read_text().splitlines()
    _assert_all_dead([server])
    assert not os.path.exists(os.path.dirname(pipe))


def test_mps_daemon_reuses_running(fake_mps, tmp_path):
    pipe = tmp_path / "existing"
    pipe.mkdir()
    (pipe / "control").touch()
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    with mps.mps_daemon(env) as got:
        assert got == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    assert fake_mps.read_text() == ""  # neither started nor stopped
    assert (pipe / "control").exists()


def test_mps_daemon_missing_binary(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": str(empty),
           "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "nothing")}
    with pytest.raises(mps.MPSUnavailableError, match="time-sliced"):
        with mps.mps_daemon(env):
            pass


def test_mps_daemon_no_pipe_times_out(fake_mps, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_NO_PIPE", "1")
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("cupyep-mps-*"))
    with pytest.raises(mps.MPSUnavailableError, match="did not create"):
        with mps.mps_daemon(start_timeout=0.3):
            pass
    after = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("cupyep-mps-*"))
    assert after <= before


# --------------------------------------------------------- real launches ---

def test_launch_allreduce():
    res, _ = run_launcher(["-n", "4", "--gpus", "0", "--timeout", "60",
                           str(SCRIPTS / "launch_allreduce.py")])
    assert res.returncode == 0, res.stderr
    assert "allreduce ok size=4 sum=10" in res.stdout
    assert "cupyep.launcher: 4 ranks" in res.stderr


def test_launch_rank_raises():
    res, elapsed = run_launcher(["-n", "4", "--gpus", "0", "--timeout", "60",
                                 str(SCRIPTS / "launch_raise.py")])
    assert res.returncode not in (0, 124), res.stderr
    assert "timeout" not in res.stderr
    assert "rank 2 fails on purpose" in res.stderr
    assert elapsed < 30


def test_launch_rank_sys_exit():
    res, elapsed = run_launcher(["-n", "4", "--gpus", "0", "--timeout", "60",
                                 str(SCRIPTS / "launch_exit.py")])
    assert res.returncode not in (0, 124), res.stderr
    assert elapsed < 30


def test_launch_env_reaches_every_rank():
    res, _ = run_launcher(["-n", "4", "--ranks-per-node", "2", "--gpus", "0",
                           str(SCRIPTS / "launch_env.py")])
    assert res.returncode == 0, res.stderr
    line = next(l for l in res.stdout.splitlines() if l.startswith("ENV "))
    ranks = json.loads(line[4:])
    assert len(ranks) == 4
    for seen in ranks:
        assert seen["CUPYEP_RANKS_PER_NODE"] == "2"
        assert seen["CUPYEP_LAUNCHED"] == "1"
        assert seen["NVSHMEM_DISABLE_NVLS"] == "1"
        assert seen["NCCL_NVLS_ENABLE"] == "0"
        assert seen["CUDA_MPS_PIPE_DIRECTORY"] is None
        assert seen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] is None


def test_launch_bad_ranks_per_node():
    res, _ = run_launcher(["-n", "4", "--ranks-per-node", "3",
                           str(SCRIPTS / "launch_env.py")])
    assert res.returncode == 2
    assert "divide" in res.stderr


def test_launch_missing_script():
    res, _ = run_launcher(["-n", "2", "no_such_script.py"])
    assert res.returncode == 2 and "not found" in res.stderr


def test_launch_timeout_kills_ranks(tmp_path):
    res, elapsed = run_launcher(["-n", "2", "--gpus", "0", "--timeout", "1.5",
                                 str(SCRIPTS / "launch_hang.py"),
                                 str(tmp_path)])
    assert res.returncode == 124, res.stderr
    assert "timeout" in res.stderr
    assert elapsed < 20
    _assert_all_dead([int(p.read_text()) for p in tmp_path.glob("*.pid")])


def test_the_ranks_lines_arrive_whole(tmp_path):
    """Four ranks write 3000 lines each as fast as they can, and an
    unfinished last line: every line reaches the launcher's stdout whole
    (mpiexec alone joined 4-10 of them here), each rank's lines in order,
    its stderr on stderr."""
    res, _ = run_launcher(["-n", "4", "--gpus", "0", str(SCRIPTS / "launch_lines.py"), "3000"])
    assert res.returncode == 0, res.stderr
    got = res.stdout.splitlines()
    pattern = re.compile(r"<(\d):(\d{5}):x{120}>")
    whole = [pattern.fullmatch(line) for line in got]
    assert all(whole), [line[:40] for line, m in zip(got, whole) if not m][:3]
    for r in range(4):
        mine = [int(m.group(2)) for m in whole if m and m.group(1) == str(r)]
        assert mine == list(range(3000)), r
    assert sorted(l for l in res.stderr.splitlines() if l.startswith("tail ")) == [f"tail {r}" for r in range(4)]


def test_dry_run_runs_nothing():
    res, _ = run_launcher(["-n", "3", "--ranks-per-node", "3", "--gpus", "0",
                           "--dry-run", "-m", "no_such_module", "x"])
    assert res.returncode == 0, res.stderr
    assert "CUPYEP_RANKS_PER_NODE=3" in res.stdout
    assert "NVSHMEM_DISABLE_NVLS=1" in res.stdout
    assert res.stdout.rstrip().endswith("-m no_such_module x")
    assert "from mpi4py.run import main" in res.stdout


def test_sm_share_partitions_every_gpu_that_ranks_share():
    res, _ = run_launcher(["-n", "4", "--gpus", "1", "--sm-share", "--dry-run",
                           "-m", "no_such_module"], _clean_env())
    assert res.returncode == 0, res.stderr
    assert "CUPYEP_SM_SHARE=1" in res.stdout
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in res.stdout
    assert "each rank's compute on its own share of the SMs" in res.stderr
    res, _ = run_launcher(["-n", "2", "--gpus", "2", "--sm-share", "--dry-run",
                           "-m", "no_such_module"], _clean_env())
    assert res.returncode == 0 and "nothing to partition" in res.stderr
    assert "CUPYEP_SM_SHARE" not in res.stdout


@pytest.mark.parametrize("args,env,message", [
    (["--gpus", "0"], {}, "none was found"),
    (["--gpus", "1", "--no-mps"], {}, "needs MPS"),
    (["--gpus", "1"], {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, "overrides the partitions")])
def test_sm_share_refuses_what_it_cannot_partition(args, env, message):
    res, _ = run_launcher(["-n", "2", "--sm-share", *args, "--dry-run", "-m", "m"], _clean_env(**env))
    assert res.returncode == 2 and message in res.stderr


@pytest.mark.skipif(DEFAULT_MPS_RUNNING, reason="a default MPS daemon runs")
def test_launch_starts_and_stops_mps(fake_mps):
    res, _ = run_launcher(["-n", "2", "--gpus", "1", "--timeout", "60",
                           str(SCRIPTS / "launch_env.py")], _clean_env())
    assert res.returncode == 0, res.stderr
    assert "2 ranks/GPU, MPS started" in res.stderr
    ranks = json.loads(next(l for l in res.stdout.splitlines()
                            if l.startswith("ENV "))[4:])
    pipe = ranks[0]["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe and all(r["CUDA_MPS_PIPE_DIRECTORY"] == pipe for r in ranks)
    assert all(r["CUDA_MPS_LOG_DIRECTORY"] for r in ranks)
    lines = fake_mps.read_text().splitlines()
    assert lines[0].startswith(f"argv:-d pipe:{pipe} ")
    assert lines[-1] == "stdin:quit"
    assert not os.path.exists(pipe)
    # --no-mps: nothing started
    fake_mps.write_text("")
    res, _ = run_launcher(["-n", "2", "--gpus", "1", "--no-mps",
                           str(SCRIPTS / "launch_env.py")], _clean_env())
    assert res.returncode == 0 and "disabled" in res.stderr
    assert fake_mps.read_text() == ""


def test_launch_mps_missing_is_an_error(tmp_path):
    env = _clean_env(CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "nothing"))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"
    if any(os.path.exists(os.path.join(d, mps.CONTROL_BINARY))
           for d in env["PATH"].split(os.pathsep)):
        pytest.skip("a real nvidia-cuda-mps-control is installed")
    res, _ = run_launcher(["-n", "2", "--gpus", "1",
                           str(SCRIPTS / "launch_env.py")], env)
    assert res.returncode == 2
    assert "time-sliced" in res.stderr


@pytest.mark.skipif(DEFAULT_MPS_RUNNING, reason="a default MPS daemon runs")
def test_sigterm_stops_ranks_and_mps(fake_mps, tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cupyep.launcher.launch", "-n", "2", "--gpus", "1",
         str(SCRIPTS / "launch_hang.py"), str(piddir)],
        cwd=REPO, env=_clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        pids = _wait_pids(piddir, 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    _assert_all_dead(pids)
    assert fake_mps.read_text().splitlines()[-1] == "stdin:quit"


def test_fake_openmpi_command_and_status(tmp_path):
    out = tmp_path / "seen.json"
    fake = tmp_path / "mpiexec"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "if sys.argv[1:] == ['--version']:\n"
        "    print('mpirun (Open MPI) 4.1.6'); sys.exit(0)\n"
        "names = ['CUPYEP_LAUNCHED', 'OMPI_ALLOW_RUN_AS_ROOT',\n"
        "         'OMPI_ALLOW_RUN_AS_ROOT_CONFIRM', 'NCCL_NVLS_ENABLE']\n"
        "json.dump({'argv': sys.argv[1:],\n"
        "           'env': {n: os.environ.get(n) for n in names}},\n"
        f"          open({str(out)!r}, 'w'))\n"
        "sys.exit(7)\n")
    fake.chmod(0o755)
    res, _ = run_launcher(["-n", "64", "--gpus", "0", "--mpiexec", str(fake),
                           str(SCRIPTS / "launch_env.py")])
    assert res.returncode == 7, res.stderr
    seen = json.loads(out.read_text())
    argv = seen["argv"]
    assert argv[:2] == ["-n", "64"] and "--oversubscribe" in argv
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert exported[:3] == ["CUPYEP_CALLS_DIR", "CUPYEP_IO_DIR", "CUPYEP_LAUNCHED"]
    assert argv[-4:] == [sys.executable, "-c", lines.RANK_BOOT,
                         str(SCRIPTS / "launch_env.py")]
    assert seen["env"]["CUPYEP_LAUNCHED"] == "1"
    assert seen["env"]["NCCL_NVLS_ENABLE"] == "0"
    root = os.geteuid() == 0
    assert (seen["env"]["OMPI_ALLOW_RUN_AS_ROOT"] == "1") == root
    assert (seen["env"]["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1") == root


def _processes_with(marker):
    """Pids of live processes whose command line contains ``marker``."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline and _pid_alive(pid):
            found.append(pid)
    return found


@pytest.mark.skipif(DEFAULT_MPS_RUNNING, reason="a default MPS daemon runs")
def test_ctrl_c_leaves_no_rank_daemon_or_temp_dir(fake_mps, tmp_path):
    """SIGINT to the launcher's process group, as a terminal's Ctrl-C sends
    it, while 8 ranks sleep (sharing one GPU: MPS started, here the fake)."""
    marker = f"ctrl-c-{os.getpid()}-{time.monotonic_ns()}"
    piddir = tmp_path / marker
    piddir.mkdir()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cupyep.launcher.launch", "-n", "8", "--gpus", "1",
         str(SCRIPTS / "faults_sleep.py"), str(piddir)],
        cwd=REPO, env=_clean_env(TMPDIR=str(tmpdir)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = _wait_pids(piddir, 8, timeout=60)
        assert len(_processes_with(marker)) >= 8
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGINT, err
    _assert_all_dead(pids)
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == [], err
    # The launcher said where the ranks were when it was interrupted (in
    # FaultProbe.wait, which KeyboardInterrupt ended).
    assert (f"cupyep.launcher: at signal {int(signal.SIGINT)}, the ranks were: ranks 0-7: "
            "after FaultProbe.wait raised (KeyboardInterrupt), call 1 of that kind (exited)") in err.splitlines()
    # MPS was stopped and every temporary directory removed.
    log = fake_mps.read_text().splitlines()
    pipe = log[0].split(" pipe:")[1].split(" log:")[0]
    assert log[-1] == "stdin:quit"
    assert not os.path.exists(os.path.dirname(pipe))
    assert list(tmpdir.iterdir()) == []


@pytest.mark.skipif(DEFAULT_MPS_RUNNING, reason="a default MPS daemon runs")
def test_ctrl_c_while_mps_starts_stops_it(fake_mps, tmp_path, monkeypatch):
    """A SIGINT while the daemon starts is held back until it is up; then the
    launcher stops it and removes its directories without running mpiexec."""
    monkeypatch.setenv("FAKE_MPS_START_DELAY", "1")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cupyep.launcher.launch", "-n", "2", "--gpus", "1",
         str(SCRIPTS / "launch_env.py")],
        cwd=REPO, env=_clean_env(TMPDIR=str(tmpdir)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "argv:-d" not in fake_mps.read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "interrupted by signal 2" in err and "ranks via" not in err
    assert "ENV " not in out
    log = fake_mps.read_text().splitlines()
    pipe = log[0].split(" pipe:")[1].split(" log:")[0]
    assert log[-1] == "stdin:quit"
    assert not os.path.exists(os.path.dirname(pipe))
    assert list(tmpdir.iterdir()) == []


def test_ctrl_c_kills_ranks_that_ignore_it(tmp_path):
    """Ranks ignoring SIGINT and SIGTERM: INTERRUPT_GRACE_S after the
    forwarded SIGINT the launcher kills them all."""
    marker = f"ignore-{os.getpid()}-{time.monotonic_ns()}"
    piddir = tmp_path / marker
    piddir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cupyep.launcher.launch", "-n", "4", "--gpus", "0",
         str(SCRIPTS / "launch_ignore_signals.py"), str(piddir)],
        cwd=REPO, env=_clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = _wait_pids(piddir, 4, timeout=60)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=launch.INTERRUPT_GRACE_S + 25)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "killing all ranks" in err
    _assert_all_dead(pids)
    assert _processes_with(marker) == []
