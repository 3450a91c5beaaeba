"""Ctrl-C on a launched GPU job: nothing of it may be left behind.

    python experiments/ctrl_c_check.py --ranks 8 --out results/soak/ctrl_c.json

Starts ``python -m cupyep.launcher -n R experiments/soak.py`` (ranks sharing
the GPU under MPS, real dispatch/combine traffic in flight) in its own
session with a private TMPDIR, waits until every rank has made calls, sends
SIGINT to the launcher's process group as a terminal's Ctrl-C does, and then
checks, within ``--grace`` seconds:

* the launcher exited with 128 + SIGINT;
* no process of the job is alive (found by a marker in the command line);
* no MPS control daemon or server is running (none ran before);
* the private TMPDIR is empty (the launcher's and MPS's directories gone).

Writes one JSON object with each check and the launcher's last stderr lines;
exits 1 if any check failed.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cupyep.lab.bench import require_gpu  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def processes_with(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text``."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in cmdline and state != "Z" and pid != os.getpid():
            found.append(pid)
    return found


def mps_processes() -> list[int]:
    return processes_with("nvidia-cuda-mps")


def main():
    require_gpu(__file__)
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--run-s", type=float, default=20.0, help="seconds the job runs before the SIGINT")
    p.add_argument("--grace", type=float, default=30.0, help="seconds allowed for the teardown")
    p.add_argument("--out", default="results/soak/ctrl_c.json")
    args = p.parse_args()
    before_mps = mps_processes()
    tmpdir = tempfile.mkdtemp(prefix="ctrl-c-check-")
    outdir = tempfile.mkdtemp(prefix="ctrl-c-check-out-")
    marker = os.path.join(outdir, "soak.jsonl")  # in every rank's command line, via --out
    env = {**os.environ, "TMPDIR": tmpdir}
    cmd = [sys.executable, "-m", "cupyep.launcher.launch", "-n", str(args.ranks), "experiments/soak.py",
           "--calls", "10000000", "--sync-every", "50", "--out", marker]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    time.sleep(args.run_s)
    ranks_running = len([q for q in processes_with(marker) if q != proc.pid])
    mps_during = mps_processes()
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=args.grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    exit_s = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while (processes_with(marker) or mps_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(os.listdir(tmpdir))
    result = {
        "ranks": args.ranks, "run_s": args.run_s,
        "processes_of_job_before_sigint": ranks_running,
        "mps_processes_before_job": len(before_mps), "mps_processes_during_job": len(mps_during),
        "launcher_rc": proc.returncode, "expected_rc": 128 + signal.SIGINT,
        "launcher_exit_s": round(exit_s, 2),
        "processes_of_job_left": processes_with(marker),
        "mps_processes_left": [q for q in mps_processes() if q not in before_mps],
        "tmpdir_entries_left": left,
        "stderr_tail": err.splitlines()[-12:],
    }
    result["ok"] = (ranks_running >= args.ranks and proc.returncode == 128 + signal.SIGINT
                    and not result["processes_of_job_left"] and not result["mps_processes_left"]
                    and left == [])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
