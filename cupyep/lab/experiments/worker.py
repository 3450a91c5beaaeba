"""Rank side of a sweep: run a study's configurations, one record each.

    python -m cupyep.launcher -n R --timeout S -m cupyep.lab.experiments.worker SPEC.json

``SPEC.json`` holds ``{"study": name, "module": module registering it (or
""), "configs": [complete configurations], "out": JSONL path, "resume":
bool}`` (``cupyep.lab.experiments.run`` writes it). Rank 0 reads it and, with
``resume``, drops the configurations whose key already has a record of this
study at this layout in ``out`` (same ranks and ranks_per_node,
``records.select``); every rank then runs the rest in order:
``study.run(group, config)`` on every rank, a synchronisation that sleeps
while it waits, and rank 0 appends the configuration's record to ``out``,
flushed to disk before the next configuration starts (a killed sweep keeps
what it finished). A configuration that raises does not stop the sweep; the
exit status is 0 unless the sweep itself could not run (2: bad spec, GPU
study without a GPU). The launcher's ``--timeout`` bounds the whole run.

Record fields (one JSON object per line):
    study: str, the study's name.
    <knob>: every knob of the study, its value (JSON: int, float, str,
        bool, list or dict).
    ranks: int, ranks that ran it.
    ranks_per_node: int, ranks of each node (the group's ``local_size``:
        ``ranks`` on one node, K under ``--ranks-per-node K``). A record
        without it ran on one node.
    status: "ok", "skipped" (``Skip``, ``ValueError``, or ``MemoryError``:
        the configuration does not fit the GPU) or "error" (any
        other exception, a metric that is not JSON-able or clashes with a
        field name, a failed check).
    reason: str, only when status is not "ok": "<ExceptionType>: <message>"
        of the first rank (in rank order) that raised.
    <metric>: the study's metrics (rank 0's return; only when "ok").
    key: str, the configuration's canonical JSON (``grid.config_key``).
    run_id: str, hex id of the worker run that produced it.
    index: int, position of the configuration in that run.
    started_utc, finished_utc: str, ISO 8601 times (UTC) of the configuration.
    seconds: float, its wall time on rank 0.
    env: dict, where it ran: host, python, numpy, mpi4py, cupyep, cupy
        versions, git_commit (or None), ranks, ranks_per_node,
        ranks_per_gpu, gpu and sms with a GPU, time (worker start).
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

from . import records
from .grid import config_key, normalize
from .studies import Skip, get

__all__ = ["environment", "call_study", "main", "RECORD_FIELDS"]

RECORD_FIELDS = ("study", "ranks", "ranks_per_node", "status", "reason", "key", "run_id", "index",
                 "started_utc", "finished_utc", "seconds", "env")
SPEC_ERROR_STATUS = 2
# Seconds between checks while a rank waits for the others.
SYNC_POLL_S = 0.001
PACKAGE_ROOT = Path(__file__).resolve().parents[3]


def _version(module: str):
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _git_commit():
    try:
        res = subprocess.run(["git", "-C", str(PACKAGE_ROOT), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def environment(group) -> dict:
    """Where the records come from: the CPU fields (host, python, numpy,
    mpi4py, cupyep, git_commit, ranks, ranks_per_node) and, when CuPy
    imports, ``cupyep.lab.bench.report.environment(group)`` (cupy, ranks_per_gpu,
    gpu, sms, time)."""
    env = {"host": platform.node(), "python": sys.version.split()[0],
           **{m: _version(m) for m in ("numpy", "mpi4py", "cupyep")},
           "git_commit": _git_commit(), "ranks": group.world_size, "ranks_per_node": group.local_size,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        from ..bench.report import environment as gpu_environment
        env.update(gpu_environment(group))
    except Exception as exc:  # no CuPy here: the CPU fields are the record
        env["cupy"] = f"unavailable ({type(exc).__name__})"
    return env


def call_study(study, group, config) -> tuple[str, str | None, dict | None]:
    """Run one configuration on this rank: ("ok", None, metrics),
    ("skipped", reason, None) or ("error", reason, None)."""
    try:
        metrics = study.run(group, dict(config))
    except Skip as exc:
        return "skipped", f"Skip: {exc}", None
    except (ValueError, MemoryError) as exc:
        return "skipped", f"{type(exc).__name__}: {exc}", None
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return "error", f"{type(exc).__name__}: {exc}", None
    return "ok", None, metrics


def _sleeping_barrier(comm) -> None:
    """A barrier whose waiting ranks sleep instead of spinning on the CPU."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(SYNC_POLL_S)


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def build_record(study, config, ranks, outcomes, run_id, index, started, seconds, env,
                 ranks_per_node: int | None = None) -> dict:
    """The record of one configuration from every rank's (status, reason,
    metrics) outcome, rank 0's first. ``ranks_per_node`` None: one node
    (``ranks``)."""
    status, reason, metrics = "ok", None, outcomes[0][2]
    for st, why, _ in outcomes:
        if st != "ok":
            status, reason = st, why
            break
    if status == "ok":
        if not isinstance(metrics, dict):
            status, reason = "error", f"TypeError: run returned a {type(metrics).__name__}, not a dict"
        else:
            clash = sorted(set(metrics) & (set(config) | set(RECORD_FIELDS)))
            try:
                metrics = normalize(metrics, "metrics") if not clash else metrics
            except ValueError as exc:
                status, reason = "error", f"ValueError: metrics are not JSON-able: {exc}"
            if clash:
                status, reason = "error", f"ValueError: metric names clash with record fields: {clash}"
    rec = {"study": study.name, **config, "ranks": ranks,
           "ranks_per_node": ranks if ranks_per_node is None else ranks_per_node, "status": status}
    if status == "ok":
        rec.update(metrics)
    else:
        rec["reason"] = reason
    rec.update(key=config_key(config), run_id=run_id, index=index, started_utc=started,
               finished_utc=_utc(), seconds=round(seconds, 6), env=env)
    return rec


def _plan(spec_path, world_size, ranks_per_node=None):
    """Rank 0: (spec, pending configurations) or an error message."""
    try:
        spec = json.loads(Path(spec_path).read_text())
        study = get(spec["study"], spec.get("module") or None)
        configs = spec["configs"]
        if spec.get("resume", True):
            done = records.select(records.load(spec["out"]), study.name,
                                  [config_key(c) for c in configs], world_size, ranks_per_node)
            configs = [c for c in configs if config_key(c) not in done]
        Path(spec["out"]).parent.mkdir(parents=True, exist_ok=True)
        return spec, configs, None
    except Exception as exc:
        return None, None, f"cannot start the sweep from {spec_path}: {type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    import argparse

    import cupyep
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.experiments.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="JSON file: study, module, configs, out, resume")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    group = cupyep.init()
    comm, rank = group.comm, group.rank
    spec, pending, error = _plan(args.spec, group.world_size, group.local_size) if rank == 0 else (None, None, None)
    spec, pending, error = comm.bcast((spec, pending, error), root=0)
    if error:
        if rank == 0:
            print(f"cupyep.lab.experiments.worker: {error}", file=sys.stderr, flush=True)
        return SPEC_ERROR_STATUS
    study = get(spec["study"], spec.get("module") or None)
    if study.needs_gpu and not group.has_gpu:
        print(f"cupyep.lab.experiments.worker: rank {rank}: study {study.name!r} needs a CUDA GPU and there is none",
              file=sys.stderr, flush=True)
        return SPEC_ERROR_STATUS
    env = environment(group) if rank == 0 else None
    run_id = comm.bcast(uuid.uuid4().hex if rank == 0 else None, root=0)
    for index, config in enumerate(pending):
        started, t0 = _utc(), time.monotonic()
        status, reason, metrics = call_study(study, group, config)
        seconds = time.monotonic() - t0
        _sleeping_barrier(comm)
        outcomes = comm.gather((status, reason), root=0)
        if rank == 0:
            outcomes = [(st, why, metrics if r == 0 else None) for r, (st, why) in enumerate(outcomes)]
            rec = build_record(study, config, group.world_size, outcomes, run_id, index, started, seconds, env,
                               group.local_size)
            records.append(spec["out"], rec)
            print(json.dumps({k: rec[k] for k in ("status", "reason", "seconds") if k in rec} | config),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
