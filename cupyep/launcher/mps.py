"""CUDA MPS (Multi-Process Service) helpers.

Ranks that share one GPU spin-wait on each other.  Without MPS, kernels of
different processes on one GPU are time-sliced, so a cross-process round trip
takes about 4.5 ms instead of about 4 us: protocols crawl or look hung.  These
helpers detect a running MPS control daemon and start/stop a private one.

Public API:
    mps_pipe_directory(env=None) -> str
    mps_is_running(env=None) -> bool
    mps_daemon(env=None)  (context manager yielding the env vars for clients)
    processes_with_env(name, value) -> [(pid, start time)]
    stop_processes(procs, grace, patience)
    MPSUnavailableError

This module imports nothing from CUDA and creates no CUDA context.
"""

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

__all__ = ["CONTROL_BINARY", "DEFAULT_PIPE_DIRECTORY", "MPSUnavailableError",
           "MPS_NEEDED_REASON", "mps_pipe_directory", "mps_is_running",
           "mps_daemon", "processes_with_env", "stop_processes"]

CONTROL_BINARY = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
PIPE_VAR = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VAR = "CUDA_MPS_LOG_DIRECTORY"
#: The MPS client cap on a rank's SMs (a percentage). The launcher never sets it: capped, kernels that wait
#: on other ranks' blocks can time out; ``--sm-share`` partitions only the compute (cupyep.sm_partition).
SM_CAP_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe dir while it runs

MPS_NEEDED_REASON = (
    "several ranks share one GPU and spin-wait on each other; without CUDA MPS "
    "the kernels of different processes are time-sliced and a cross-process "
    "round trip takes ~4.5 ms instead of ~4 us (runs crawl or look hung)")


class MPSUnavailableError(RuntimeError):
    """MPS is needed but cannot be started (no control binary, or it failed)."""


def mps_pipe_directory(env=None):
    """Return the pipe directory a CUDA client would use with this env.

    That is ``CUDA_MPS_PIPE_DIRECTORY`` when set (and non-empty), else the
    driver default ``/tmp/nvidia-mps``.
    """
    env = os.environ if env is None else env
    return env.get(PIPE_VAR) or DEFAULT_PIPE_DIRECTORY


def _socket_accepts(path, timeout=1.0):
    """True unless connecting to the unix socket ``path`` is refused."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False  # stale socket left by a daemon that exited
    except OSError:
        return True  # cannot tell (permissions, timeout): assume it runs
    finally:
        sock.close()
    return True


def _pid_file_alive(path):
    """True/False from the daemon's pid file, None when there is none."""
    try:
        with open(path) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def mps_is_running(env=None):
    """True when an MPS control daemon is reachable by clients using ``env``.

    Looks at the ``control`` endpoint in the pipe directory the clients would
    use (``CUDA_MPS_PIPE_DIRECTORY`` if set, else ``/tmp/nvidia-mps``).  The
    daemon leaves ``control`` (a unix socket) behind when it exits, so a
    socket must also accept a connection; for any other file type the
    daemon's pid file is checked when present.
    """
    pipe_dir = mps_pipe_directory(env)
    control = os.path.join(pipe_dir, "control")
    try:
        mode = os.stat(control).st_mode
    except OSError:
        return False
    if stat.S_ISSOCK(mode):
        return _socket_accepts(control)
    alive = _pid_file_alive(os.path.join(pipe_dir, PID_FILE))
    return True if alive is None else alive


def _wait_for(predicate, timeout, interval=0.02):
    """Poll ``predicate`` until true or ``timeout`` seconds pass; return it."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def proc_start_time(pid):
    """Start time of a live (non-zombie) ``pid`` from /proc, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields[19]


def processes_with_env(name, value):
    """(pid, start time) of the live processes, this one excepted, whose
    initial environment holds ``name=value`` (Linux /proc; processes of
    other users are unreadable and skipped)."""
    needle = f"{name}={value}".encode()
    me = os.getpid()
    out = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            start = proc_start_time(pid)
            if start is not None:
                out.append((pid, start))
    return out


def stop_processes(procs, grace=2.0, patience=0.0):
    """Wait up to ``patience`` s for ``procs`` ((pid, start time) pairs) to
    end by themselves, SIGTERM the rest, SIGKILL those alive ``grace`` s
    later.  A pid counts only while its start time matches (no reused pid
    is signalled)."""
    def alive():
        return [(p, t) for p, t in procs if proc_start_time(p) == t]

    for step, sig in ((patience, signal.SIGTERM), (grace, signal.SIGKILL)):
        _wait_for(lambda: not alive(), step)
        for pid, _ in alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _read_logs(log_dir, limit=2000):
    """Return the tail of the daemon's control.log, for error messages."""
    try:
        with open(os.path.join(log_dir, "control.log"), errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return ""


def _quit_daemon(control, child_env, pipe_dir, timeout):
    """Send ``quit`` to the daemon (synchronous: it stops its servers), then
    wait (bounded) until its pid file is gone, i.e. it has exited.  Any
    process still carrying the private ``CUDA_MPS_PIPE_DIRECTORY`` after
    that (a daemon or server that did not quit; clients are gone by now)
    gets ``timeout`` more seconds, then SIGTERM, then SIGKILL."""
    try:
        subprocess.run([control], input=b"quit\n", env=child_env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        pass
    _wait_for(lambda: not _pid_file_alive(os.path.join(pipe_dir, PID_FILE)),
              timeout)
    stop_processes(processes_with_env(PIPE_VAR, pipe_dir), grace=2.0,
                   patience=timeout)


@contextlib.contextmanager
def mps_daemon(env=None, start_timeout=10.0, stop_timeout=5.0):
    """Make sure an MPS control daemon runs for the body; yield client env vars.

    ``env`` is the environment the clients will run with (default
    ``os.environ``); it is also used to find ``nvidia-cuda-mps-control`` on
    its ``PATH``.  If a daemon is already reachable (see ``mps_is_running``) it
    is reused and left running; the yielded dict then holds
    ``CUDA_MPS_PIPE_DIRECTORY`` only if ``env`` sets it.  Otherwise a private
    daemon is started with ``nvidia-cuda-mps-control -d`` and both
    ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` in a fresh
    temporary directory (they are yielded: pass them to every client); on exit
    (normal or exception) it is stopped with ``echo quit |
    nvidia-cuda-mps-control`` (what still runs with that pipe directory
    ``stop_timeout`` seconds later is terminated, then killed) and the
    directory removed.  Every step of the stop is bounded in time.

    The daemon itself runs uncapped (``SM_CAP_VAR`` is removed from its
    environment); a cap is the clients' own.  Raises ``MPSUnavailableError`` when the
    control binary is missing or the daemon does not come up in
    ``start_timeout`` seconds.
    """
    env = dict(os.environ if env is None else env)
    if mps_is_running(env):
        yield {PIPE_VAR: env[PIPE_VAR]} if env.get(PIPE_VAR) else {}
        return
    control = shutil.which(CONTROL_BINARY, path=env.get("PATH", os.defpath))
    if control is None:
        raise MPSUnavailableError(
            f"CUDA MPS is needed but {CONTROL_BINARY} was not found on PATH: "
            f"{MPS_NEEDED_REASON}. Install it, start MPS yourself, or give one "
            "GPU per rank.")
    base = tempfile.gettempdir()
    if len(base) > 60 and os.path.isdir("/tmp"):
        base = "/tmp"  # unix socket paths are limited to ~107 bytes
    tmp = tempfile.mkdtemp(prefix="cupyep-mps-", dir=base)
    pipe_dir = os.path.join(tmp, "pipe")
    log_dir = os.path.join(tmp, "log")
    os.mkdir(pipe_dir)
    os.mkdir(log_dir)
    mps_env = {PIPE_VAR: pipe_dir, LOG_VAR: log_dir}
    child_env = {**env, **mps_env}
    child_env.pop(SM_CAP_VAR, None)
    out_path = os.path.join(tmp, "start.out")
    started = False
    try:
        # Output goes to a file, not a pipe: the forked daemon may keep
        # inherited descriptors open, which would block reading a pipe.
        with open(out_path, "wb") as out:
            try:
                res = subprocess.run([control, "-d"], env=child_env,
                                     stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     timeout=start_timeout, check=False)
            except subprocess.TimeoutExpired as exc:
                raise MPSUnavailableError(
                    f"{control} -d did not return in {start_timeout} s"
                ) from exc
        started = res.returncode == 0
        if not started:
            with open(out_path, errors="replace") as f:
                msg = f.read()[-2000:].strip()
            raise MPSUnavailableError(
                f"{control} -d failed with status {res.returncode}: {msg}")
        if not _wait_for(lambda: mps_is_running(child_env), start_timeout):
            raise MPSUnavailableError(
                f"MPS control daemon did not create {pipe_dir}/control within "
                f"{start_timeout} s. control.log: {_read_logs(log_dir)!r}")
        yield dict(mps_env)
    finally:
        if started or mps_is_running(child_env):
            _quit_daemon(control, child_env, pipe_dir, stop_timeout)
        shutil.rmtree(tmp, ignore_errors=True)
