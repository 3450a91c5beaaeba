"""Rank launcher for cupyep: ``python -m cupyep.launcher`` / ``cupyep-launch``.

Usage::

    python -m cupyep.launcher -n N [--ranks-per-node K] [--gpus G]
        [--timeout SECONDS] [--mpiexec PATH] [--no-mps] [--sm-share] [--dry-run]
        (-m module | -c code | script.py) [args...]

Runs ``mpiexec -n N python -c RANK_BOOT <program>`` (mpi4py's runner, which
aborts the whole job when any rank raises, after pointing the rank's output
at the launcher, which writes it a whole line at a time:
``cupyep.launcher.lines``) on this host, with ``CUPYEP_LAUNCHED=1``,
``CUPYEP_RANKS_PER_NODE=K`` (when given), ``NVSHMEM_DISABLE_NVLS=1`` and
``NCCL_NVLS_ENABLE=0`` in every rank's environment.  When several ranks share
a GPU it reuses or starts a CUDA MPS daemon (see ``cupyep.launcher.mps``).
With ``--sm-share`` every rank sharing a GPU gets ``CUPYEP_SM_SHARE=1``:
its compute (``cupyep.sm_partition.compute_stream``, the MoE layer's experts)
then runs on a partition of the SMs of its own, so that it scales with the
rank's own work as on a GPU of its own, while the communication kernels keep
the whole GPU.

Every rank also gets ``CUPYEP_CALLS_DIR``, a private temporary directory in
which each rank keeps its call record (``cupyep.launcher.calls``).  When the job
fails, the launcher names the rank that ended first, how (signal or exit
status, when it saw it) and the traced call it was in, e.g. ``rank 3 (pid
4242) died (signal 9, SIGKILL) during LowLatencyBuffer.combine, call 1234 of
that kind``, then where the other ranks were; on a timeout or an interrupt
it says where every rank was.

SIGINT, SIGTERM and SIGHUP (forwarded as SIGTERM) go to mpiexec's process
group; a second one, or mpiexec still running ``INTERRUPT_GRACE_S`` seconds
later, kills every rank.  However the job ends, processes still carrying
this launch's ``CUPYEP_CALLS_DIR`` (ranks that outlived mpiexec, their
children) are stopped, then the MPS daemon the launcher started, then its
temporary directories are removed.

Exit status: mpiexec's status; 124 on ``--timeout``; 128+signal when
interrupted; 2 for launcher errors (bad arguments, no mpiexec, MPS needed but
unavailable).  Nothing here imports CUDA or CuPy.
"""

import argparse
import contextlib
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from . import calls
from . import lines

from . import mps
from ..sm_partition import ENV_VAR as SM_SHARE_VAR

__all__ = ["OPENMPI", "MPICH", "SAFETY_ENV", "LaunchError", "find_mpiexec",
           "detect_flavour", "mpiexec_flavour", "build_command",
           "mpiexec_env", "rank_env", "validate_ranks_per_node",
           "count_visible_devices", "gpu_count", "ranks_per_gpu",
           "mps_needed", "default_num_slots", "run_mpiexec", "main"]

OPENMPI = "openmpi"
MPICH = "mpich"
SAFETY_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}
OMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1",
                 "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
TIMEOUT_STATUS = 124
ERROR_STATUS = 2
PREFIX = "cupyep.launcher"
# Seconds mpiexec has to end after a forwarded signal before all is killed.
INTERRUPT_GRACE_S = 5.0
# Seconds between checks while mpiexec runs.
POLL_S = 0.05


class LaunchError(RuntimeError):
    """A launcher-side problem (reported to the user, exit status 2)."""


# ---------------------------------------------------------------- mpiexec ---

def find_mpiexec(explicit=None, env=None, python=None):
    """Return the mpiexec to use: ``explicit``, else ``mpiexec`` next to
    ``python`` (default ``sys.executable``; pip's ``mpich`` installs it
    there), else ``mpiexec`` on ``env['PATH']``.  Raises ``LaunchError``."""
    env = os.environ if env is None else env
    if explicit:
        path = shutil.which(explicit, path=env.get("PATH", os.defpath))
        if path is None:
            raise LaunchError(f"--mpiexec {explicit!r} is not an executable")
        return path
    beside = os.path.join(os.path.dirname(python or sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    path = shutil.which("mpiexec", path=env.get("PATH", os.defpath))
    if path is None:
        raise LaunchError(
            "no mpiexec found (looked next to the Python interpreter and on "
            "PATH); install an MPI (e.g. `pip install mpich`, or Open MPI) or "
            "pass --mpiexec PATH")
    return path


def detect_flavour(version_text):
    """Return ``OPENMPI`` or ``MPICH`` from ``mpiexec --version`` output."""
    low = version_text.lower()
    if any(k in low for k in ("open mpi", "openrte", "open-mpi")):
        return OPENMPI
    if any(k in low for k in ("hydra", "mpich", "intel")):
        return MPICH
    raise LaunchError("unknown MPI flavour; `mpiexec --version` said: "
                      + version_text.strip()[:300])


def mpiexec_flavour(mpiexec, timeout=20.0):
    """Run ``mpiexec --version`` and return its flavour (not cached)."""
    try:
        res = subprocess.run([mpiexec, "--version"], capture_output=True,
                             stdin=subprocess.DEVNULL, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {mpiexec} --version: {exc}") from exc
    return detect_flavour((res.stdout + res.stderr).decode(errors="replace"))


def default_num_slots():
    """Slots Open MPI assumes by default: physical cores we may run on.

    Counts distinct (package, core) pairs of the CPUs in our affinity mask,
    falling back to ``os.cpu_count()``.  Erring low only adds a harmless
    ``--oversubscribe``.
    """
    try:
        cores = set()
        for cpu in os.sched_getaffinity(0):
            topo = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
            with open(topo + "physical_package_id") as f1, \
                    open(topo + "core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        if cores:
            return min(len(cores), os.cpu_count() or len(cores))
    except (OSError, AttributeError):
        pass
    return os.cpu_count() or 1


def build_command(flavour, mpiexec, num_ranks, program_argv, env, is_root,
                  num_slots):
    """Return the mpiexec command line (pure; runs and mutates nothing).

    ``program_argv`` is ``[script, args...]`` or ``['-m', module, args...]``
    (or ``['-c', code, ...]``); every rank runs ``sys.executable -c
    lines.RANK_BOOT <program_argv>``: mpi4py's runner, as ``python -m
    mpi4py``, with its output to the launcher's line forwarder.  ``env`` holds the variables every rank must get.
    Open MPI: ``-x NAME`` per variable (they must also be in mpiexec's own
    environment: see ``mpiexec_env``), ``--oversubscribe`` when
    ``num_ranks > num_slots``, ``--allow-run-as-root`` when ``is_root``.
    MPICH/Hydra: ``-genv NAME VALUE`` per variable (oversubscription is
    implicit, root needs nothing).
    """
    cmd = [mpiexec, "-n", str(int(num_ranks))]
    if flavour == OPENMPI:
        if is_root:
            cmd.append("--allow-run-as-root")
        if num_ranks > num_slots:
            cmd.append("--oversubscribe")
        for name in sorted(env):
            cmd += ["-x", name]
    elif flavour == MPICH:
        for name in sorted(env):
            cmd += ["-genv", name, str(env[name])]
    else:
        raise LaunchError(f"unknown MPI flavour {flavour!r}")
    return cmd + [sys.executable, "-c", lines.RANK_BOOT, *program_argv]


def mpiexec_env(flavour, env, is_root, base_env=None):
    """Return the environment to run mpiexec with: ``base_env`` (default
    ``os.environ``) plus the rank variables ``env``, plus, for Open MPI run as
    root, ``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``.
    """
    out = dict(os.environ if base_env is None else base_env)
    out.update({k: str(v) for k, v in env.items()})
    if flavour == OPENMPI and is_root:
        out.update(OMPI_ROOT_ENV)
    return out


def rank_env(ranks_per_node=None, mps_env=None, calls_dir=None, sm_share=False, io_dir=None):
    """Variables every rank gets: CUPYEP_LAUNCHED=1, the NVLS safety
    variables, CUPYEP_RANKS_PER_NODE when given, the MPS variables,
    CUPYEP_CALLS_DIR when given, CUPYEP_SM_SHARE=1 with ``sm_share`` and
    CUPYEP_IO_DIR (the line forwarder's FIFOs) when given."""
    env = {"CUPYEP_LAUNCHED": "1", **SAFETY_ENV}
    if ranks_per_node:
        env["CUPYEP_RANKS_PER_NODE"] = str(int(ranks_per_node))
    env.update(mps_env or {})
    if calls_dir:
        env[calls.ENV_VAR] = str(calls_dir)
    if sm_share:
        env[SM_SHARE_VAR] = "1"
    if io_dir:
        env[lines.ENV_VAR] = str(io_dir)
    return env


def validate_ranks_per_node(num_ranks, ranks_per_node):
    """Raise ``LaunchError`` unless N >= 1 and K (if given) divides N."""
    if num_ranks < 1:
        raise LaunchError(f"-n must be >= 1, got {num_ranks}")
    if ranks_per_node is None:
        return
    if ranks_per_node < 1 or num_ranks % ranks_per_node:
        raise LaunchError(f"--ranks-per-node {ranks_per_node} must be >= 1 "
                          f"and divide the number of ranks {num_ranks}")


# ------------------------------------------------------------------- GPUs ---

def count_visible_devices(value):
    """Number of devices CUDA sees for a CUDA_VISIBLE_DEVICES value.

    Entries are indices or GPU-/MIG- UUIDs; like CUDA, counting stops at the
    first invalid entry (so ``""`` and ``"-1"`` give 0).
    """
    count = 0
    for item in value.split(","):
        item = item.strip()
        if item.isdigit() or item.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return count


def nvidia_smi_gpu_count(env=None, timeout=10.0):
    """GPUs listed by ``nvidia-smi -L`` (lines starting with "GPU"), or None
    when nvidia-smi is missing or fails."""
    env = os.environ if env is None else env
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if smi is None:
        return None
    try:
        res = subprocess.run([smi, "-L"], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return sum(1 for line in res.stdout.splitlines()
               if line.startswith("GPU"))


def gpu_count(gpus=None, env=None, smi=nvidia_smi_gpu_count):
    """GPUs available to the ranks: ``gpus`` if given, else the count from
    CUDA_VISIBLE_DEVICES if set, else ``smi()`` (nvidia-smi -L), else 0."""
    env = os.environ if env is None else env
    if gpus is not None:
        return int(gpus)
    if "CUDA_VISIBLE_DEVICES" in env:
        return count_visible_devices(env["CUDA_VISIBLE_DEVICES"])
    return smi() or 0


def ranks_per_gpu(num_ranks, num_gpus):
    """Ranks sharing the busiest GPU: ceil(N / G), or 0 when G == 0.

    All N ranks run on this host, also when CUPYEP_RANKS_PER_NODE emulates
    several nodes, so they all share these G GPUs.
    """
    if num_gpus <= 0:
        return 0
    return math.ceil(num_ranks / num_gpus)


def mps_needed(per_gpu, no_mps=False):
    """True when more than one rank shares a GPU and MPS is not disabled."""
    return per_gpu > 1 and not no_mps


# ---------------------------------------------------------------- running ---

class _Interrupted(Exception):
    """SIGINT/SIGTERM arrived while no mpiexec was running."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _descendants(root):
    """(pid, start time) of all descendants of ``root`` (Linux /proc)."""
    children = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append((pid, mps.proc_start_time(pid)))
            todo.append(pid)
    return out


def _reap_tree(tree, grace):
    """Wait up to ``grace`` s for the processes in ``tree`` to end, then
    SIGKILL the survivors (a pid counts only if its start time matches)."""
    deadline = time.monotonic() + grace
    while True:
        alive = [(p, t) for p, t in tree
                 if t is not None and mps.proc_start_time(p) == t]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for pid, _ in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _signal_group(pid, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _kill_tree(proc, grace=3.0, tree=None):
    """Stop mpiexec's process group and every rank under it.

    Hydra and Open MPI put ranks in their own sessions, out of mpiexec's
    process group, so descendants still alive ``grace`` seconds after the
    SIGTERM to the group get SIGKILL.
    """
    tree = _descendants(proc.pid) if tree is None else tree
    deadline = time.monotonic() + grace
    _signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    _signal_group(proc.pid, signal.SIGKILL)
    _reap_tree(tree, max(0.0, deadline - time.monotonic()))
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


def stop_marked(name, value, grace=2.0):
    """Stop the processes whose initial environment holds ``name=value``
    (``mps.processes_with_env``): SIGTERM, then SIGKILL for those alive
    ``grace`` s later.  Returns how many there were."""
    procs = mps.processes_with_env(name, value)
    mps.stop_processes(procs, grace)
    return len(procs)


# Signals the launcher handles, and what it forwards to mpiexec for each.
FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
             signal.SIGHUP: signal.SIGTERM}


class _SignalForwarder:
    """SIGINT/SIGTERM/SIGHUP handler: forwards to mpiexec's process group
    while it runs (SIGHUP as SIGTERM; a repeated signal SIGKILLs the whole
    tree); raises ``_Interrupted`` before it starts so that cleanup (e.g. MPS
    stop) runs; ignores signals after it ended (cleanup is running).  Inside
    ``deferred()`` a signal is only noted and handled when the block ends,
    so that starting MPS or mpiexec is never cut in half."""

    def __init__(self):
        self.proc = None
        self.finished = False
        self.signum = None
        self.signal_time = None
        self.count = 0
        self.tree = []
        self._deferring = False
        self._pending = None

    def __call__(self, signum, frame):
        if self._deferring:
            if self._pending is None:
                self._pending = signum
            return
        self._handle(signum)

    def _handle(self, signum):
        self.signum = signum
        proc = self.proc
        if proc is not None and proc.returncode is None:
            self.count += 1
            if self.count == 1:
                self.signal_time = time.monotonic()
                self.tree = _descendants(proc.pid)
                _signal_group(proc.pid, FORWARDED.get(signum, signum))
            else:
                # no waiting in a handler: SIGKILL the group and the ranks
                _signal_group(proc.pid, signal.SIGKILL)
                _reap_tree(self.tree + _descendants(proc.pid), 0.0)
        elif not self.finished:
            self.finished = True  # raise once; let the cleanup run
            raise _Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self):
        """Hold signals back for the body; handle the first one after it."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            pending, self._pending = self._pending, None
            if pending is not None:
                self._handle(pending)

    @contextlib.contextmanager
    def installed(self):
        """Install as handler of the FORWARDED signals for the body, then
        restore the previous handlers."""
        old = {s: signal.signal(s, self) for s in FORWARDED}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def run_mpiexec(cmd, env, timeout=None, forwarder=None):
    """Run ``cmd`` in its own process group; return its exit status.

    Returns 124 (after killing everything) when ``timeout`` seconds pass,
    128+N when mpiexec was killed by, or forwarded, signal N.  ``forwarder``
    (a ``_SignalForwarder`` already installed) forwards SIGINT/SIGTERM/SIGHUP
    to the group; if mpiexec has not ended ``INTERRUPT_GRACE_S`` seconds
    after the first, its group and every rank get SIGKILL.
    """
    fwd = forwarder or _SignalForwarder()
    with fwd.deferred():  # a signal now is forwarded once fwd.proc is set
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        fwd.proc = proc
    start = time.monotonic()
    try:
        while True:
            try:
                proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if timeout is not None and now - start >= timeout:
                print(f"{PREFIX}: timeout: still running after {timeout:g} s; "
                      "killing all ranks", file=sys.stderr, flush=True)
                _kill_tree(proc)
                return TIMEOUT_STATUS
            if (fwd.signal_time is not None
                    and now - fwd.signal_time >= INTERRUPT_GRACE_S):
                print(f"{PREFIX}: mpiexec still running {INTERRUPT_GRACE_S:g} s"
                      " after the signal; killing all ranks", file=sys.stderr,
                      flush=True)
                _signal_group(proc.pid, signal.SIGKILL)
                _reap_tree(fwd.tree + _descendants(proc.pid), 0.0)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=INTERRUPT_GRACE_S)
                break
    finally:
        fwd.finished = True
        if proc.returncode is None:  # unexpected exception while waiting
            _kill_tree(proc, grace=1.0)
    if fwd.signum is not None:
        # mpiexec may exit before its ranks: give them a moment, then kill.
        _reap_tree(fwd.tree, INTERRUPT_GRACE_S)
        return 128 + fwd.signum
    rc = proc.returncode
    return 128 - rc if rc < 0 else rc


# ------------------------------------------------------------------- main ---

_VALUE_OPTIONS = {"-n", "--ranks-per-node", "--gpus", "--timeout",
                  "--mpiexec"}


def _split_argv(argv):
    """Split ``argv`` into launcher options and the program part, which starts
    at ``-m``/``-c``, after ``--``, or at the first non-option word."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg in ("-m", "-c") or not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        i += 2 if arg in _VALUE_OPTIONS else 1
    return argv, []


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m cupyep.launcher", allow_abbrev=False,
        usage="%(prog)s -n N [options] (-m module | -c code | script.py) "
              "[args...]",
        description="Launch N mpi4py ranks of a cupyep program on this host "
                    "(starts CUDA MPS when ranks share a GPU).")
    p.add_argument("-n", type=int, required=True, dest="num_ranks",
                   metavar="N", help="number of ranks")
    p.add_argument("--ranks-per-node", type=int, metavar="K",
                   help="emulated ranks per node (exported as "
                        "CUPYEP_RANKS_PER_NODE; must divide N)")
    p.add_argument("--gpus", type=int, metavar="G",
                   help="GPUs to assume (default: CUDA_VISIBLE_DEVICES, "
                        "else nvidia-smi -L, else 0)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="kill all ranks and exit 124 after this long")
    p.add_argument("--mpiexec", metavar="PATH", help="mpiexec to use")
    p.add_argument("--no-mps", action="store_true",
                   help="never start CUDA MPS, even when ranks share a GPU")
    p.add_argument("--sm-share", action="store_true",
                   help="give each rank sharing a GPU a partition of the SMs "
                        "of its own for its compute (CUPYEP_SM_SHARE=1; "
                        "cupyep.sm_partition): it then scales with the rank's "
                        "own work, as on a GPU of its own")
    p.add_argument("--dry-run", action="store_true",
                   help="print the command and environment, run nothing")
    return p


def parse_args(argv):
    """Return ``(options, program_argv)``; exits (SystemExit) on bad usage."""
    own, program = _split_argv(list(argv))
    parser = _parser()
    opts = parser.parse_args(own)
    if not program:
        parser.error("no program given (script.py, -m module or -c code)")
    if program[0] in ("-m", "-c") and len(program) < 2:
        parser.error(f"{program[0]} needs an argument")
    if opts.timeout is not None and opts.timeout <= 0:
        parser.error("--timeout must be > 0")
    if opts.gpus is not None and opts.gpus < 0:
        parser.error("--gpus must be >= 0")
    return opts, program


def _mps_plan(need, env):
    """('started'|'reused'|..., env vars for ranks or placeholders)."""
    if not need:
        return None, {}
    if mps.mps_is_running(env):
        pipe = env.get(mps.PIPE_VAR)
        return "reused", ({mps.PIPE_VAR: pipe} if pipe else {})
    return "started", {mps.PIPE_VAR: "<private temp dir>/pipe",
                       mps.LOG_VAR: "<private temp dir>/log"}


def _summary(n, flavour, mpiexec, gpus, per_gpu, mps_state, no_mps, k, sm_share=False):
    if gpus == 0:
        mps_txt = "no GPU detected, MPS not needed"
    elif mps_state:
        mps_txt = f"MPS {mps_state}"
    elif per_gpu > 1 and no_mps:
        mps_txt = "MPS disabled by --no-mps"
    else:
        mps_txt = "MPS not needed"
    nodes = f" ({k} per node)" if k else ""
    cap = ", each rank's compute on its own share of the SMs" if sm_share else ""
    return (f"{PREFIX}: {n} ranks{nodes} via {flavour} ({mpiexec}), "
            f"{gpus} GPU(s), {per_gpu} ranks/GPU, {mps_txt}{cap}")


def _sm_share(opts, gpus, per_gpu):
    """Whether the ranks get SM partitions (--sm-share, ranks sharing a
    GPU); LaunchError where they cannot."""
    if not opts.sm_share:
        return False
    if gpus == 0:
        raise LaunchError("--sm-share partitions the SMs of a GPU, and none was found")
    if per_gpu > 1 and opts.no_mps:
        raise LaunchError("--sm-share partitions a GPU among ranks that run "
                          "together: it needs MPS (drop --no-mps)")
    if mps.SM_CAP_VAR in os.environ:
        raise LaunchError(f"--sm-share: {mps.SM_CAP_VAR} is set, and an MPS "
                          "cap overrides the partitions; unset it")
    if per_gpu <= 1:
        print(f"{PREFIX}: --sm-share: every rank has a GPU of its own; "
              "nothing to partition", file=sys.stderr)
        return False
    return True


def _error(msg):
    print(f"{PREFIX}: error: {msg}", file=sys.stderr, flush=True)
    return ERROR_STATUS


def main(argv=None):
    """Entry point of ``python -m cupyep.launcher`` / ``cupyep-launch``;
    returns the exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        opts, program = parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else ERROR_STATUS
    n, k = opts.num_ranks, opts.ranks_per_node
    try:
        validate_ranks_per_node(n, k)
        if program[0] not in ("-m", "-c") and not os.path.isfile(program[0]):
            raise LaunchError(f"script not found: {program[0]}")
        mpiexec = find_mpiexec(opts.mpiexec)
        flavour = mpiexec_flavour(mpiexec)
    except LaunchError as exc:
        return _error(exc)
    gpus = gpu_count(opts.gpus)
    per_gpu = ranks_per_gpu(n, gpus)
    need = mps_needed(per_gpu, opts.no_mps)
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    slots = default_num_slots()
    mps_state, mps_env = _mps_plan(need, os.environ)
    try:
        sm_share = _sm_share(opts, gpus, per_gpu)
    except LaunchError as exc:
        return _error(exc)
    if mps.SM_CAP_VAR in os.environ:
        print(f"{PREFIX}: warning: {mps.SM_CAP_VAR} is set; every rank is capped "
              "at it, and kernels whose blocks wait on other ranks can then "
              "time out (seen with 8 ranks at 12.5 %); --sm-share gives each "
              "rank's compute its share instead", file=sys.stderr)
    if opts.dry_run:
        renv = rank_env(k, mps_env, "<private temp dir>", sm_share)
        cmd = build_command(flavour, mpiexec, n, program, renv, is_root, slots)
        extra = OMPI_ROOT_ENV if flavour == OPENMPI and is_root else {}
        print(_summary(n, flavour, mpiexec, gpus, per_gpu,
                       mps_state and "would be " + mps_state, opts.no_mps, k, sm_share),
              file=sys.stderr)
        if need and mps_state == "started" and shutil.which(
                mps.CONTROL_BINARY) is None:
            print(f"{PREFIX}: warning: {mps.CONTROL_BINARY} not found; a real "
                  "launch would fail", file=sys.stderr)
        print("# environment added for mpiexec and every rank")
        for name, value in sorted({**renv, **extra}.items()):
            print(f"{name}={shlex.quote(value)}")
        print("# command")
        print(shlex.join(cmd))
        return 0
    fwd = _SignalForwarder()
    try:
        with fwd.installed(), contextlib.ExitStack() as stack:
            try:
                return _launch(stack, fwd, opts, flavour, mpiexec, n, k,
                               program, is_root, slots, need, mps_state,
                               gpus, per_gpu, sm_share)
            finally:
                fwd.finished = True  # signals now arriving are ignored:
                # the cleanup (stragglers, MPS, directories) is bounded
    except mps.MPSUnavailableError as exc:
        return _error(exc)
    except _Interrupted as exc:
        print(f"{PREFIX}: interrupted by signal {exc.signum}",
              file=sys.stderr)
        return 128 + exc.signum


def _launch(stack, fwd, opts, flavour, mpiexec, n, k, program, is_root,
            slots, need, mps_state, gpus, per_gpu, sm_share):
    """Start what the ranks need (cleanup on ``stack``), run mpiexec and
    report; return the exit status."""
    with fwd.deferred():  # MPS starts, or is stopped, as a whole
        calls_dir = stack.enter_context(_private_dir("cupyep-calls-"))
        if need:
            mps_env = stack.enter_context(mps.mps_daemon(os.environ))
        else:
            mps_env = {}
        # Runs before the two above on the way out: no process of the job
        # may outlive it (nor hold MPS clients open while the daemon quits).
        stack.callback(_stop_stragglers, calls_dir)
        io_dir = os.path.join(calls_dir, "io")
        os.mkdir(io_dir, 0o700)
        # Entered last, closed first: once mpiexec has ended, the ranks'
        # last lines are forwarded before anything else is cleaned up.
        stack.enter_context(lines.LineForwarder(io_dir, n))
    renv = rank_env(k, mps_env, calls_dir, sm_share, io_dir)
    cmd = build_command(flavour, mpiexec, n, program, renv, is_root, slots)
    env = mpiexec_env(flavour, renv, is_root)
    state = mps_state
    if state == "started":
        state += f" ({mps_env[mps.PIPE_VAR]})"
    print(_summary(n, flavour, mpiexec, gpus, per_gpu, state, opts.no_mps, k, sm_share),
          file=sys.stderr, flush=True)
    try:
        watcher = calls.EndWatcher(calls_dir).start()
    except OSError as exc:  # the report then lacks the order of the ends
        print(f"{PREFIX}: warning: not watching the ranks' ends: {exc}",
              file=sys.stderr)
        watcher = None
    else:
        stack.callback(watcher.stop)
    rc = run_mpiexec(cmd, env, opts.timeout, fwd)
    if rc != 0:
        _report(fwd.signum, opts.timeout is not None and rc == TIMEOUT_STATUS,
                watcher, calls_dir)
    return rc


@contextlib.contextmanager
def _private_dir(prefix):
    """A fresh temporary directory for the body, removed afterwards."""
    base = tempfile.gettempdir()
    if len(base) > 60 and os.path.isdir("/tmp"):
        base = "/tmp"  # unix socket paths are limited to ~107 bytes
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _stop_stragglers(calls_dir):
    n = stop_marked(calls.ENV_VAR, calls_dir)
    if n:
        print(f"{PREFIX}: stopped {n} process(es) of the job still running "
              "after mpiexec ended", file=sys.stderr, flush=True)


def _report(signum, timed_out, watcher, calls_dir):
    """After a failed job, say on stderr which rank ended it and where the
    ranks were; after an interrupt or a timeout, where the ranks were."""
    if watcher is not None:
        watcher.settle()
    if signum is not None or timed_out:
        where = calls.where_report(calls.read_records(calls_dir))
        when = (f"at signal {signum}" if signum is not None
                else "at the timeout")
        lines = [f"{when}, the ranks were: " + "; ".join(where)] if where else []
    else:
        lines = calls.failure_report(calls_dir,
                                     watcher.ends if watcher else [])
    for line in lines:
        print(f"{PREFIX}: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
