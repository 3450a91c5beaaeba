"""Sweeps: run a grid of knobs of a study in one call, one JSONL record per
configuration.

    from ... import experiments
    recs = experiments.run("reference", {"tokens": [128, 4096], "hidden": 7168}, ranks=2,
                           out="reference.jsonl")
    python -m cupyep.lab.experiments reference --ranks 2 --grid tokens=128,4096 hidden=7168
    experiments.run("normal", grid, ranks=8, ranks_per_node=4)  # 2 emulated nodes of 4 ranks

Modules: ``grid`` (expansion order, keys), ``studies`` (registry, ``Skip``),
``cpu_reference`` (the "reference" study), ``worker`` (the rank side and the
record fields), ``records`` (JSONL reading and appending), ``__main__``
(the command line).

:func:`run` launches ``cupyep.lab.experiments.worker`` through
``cupyep.launcher.launch`` (a subprocess, bounded by ``timeout``), shows a tqdm bar
fed by the records appearing in ``out`` and returns the grid's records.
With ``resume`` (the default) configurations that already have a record of
this study at this layout (rank count and ranks per node,
``records.select``) in ``out`` are not run again; the record returned for a
configuration is the latest in the file. Every sweep that
launches anything appends an entry (grid, command, commit, kernel-source
hash) to the manifest beside ``out`` (:func:`manifest_path`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from . import records

from . import studies
from .grid import config_key, expand
from .records import load
from .studies import Skip, Study, register

__all__ = ["run", "load", "Skip", "Study", "register", "expand", "config_key", "SweepError",
           "DEFAULT_OUT", "DEFAULT_TIMEOUT_S"]

DEFAULT_OUT = "results/sweeps/{study}.jsonl"
DEFAULT_TIMEOUT_S = 3600.0
# Seconds the launcher has past its own --timeout before it is stopped here.
LAUNCH_GRACE_S = 30.0
# Seconds between looks at the output file while the sweep runs.
POLL_S = 0.2
PACKAGE_ROOT = Path(__file__).resolve().parents[3]


def manifest_path(out) -> Path:
    """The manifest beside a records file: ``<name>.manifest.json``."""
    out = Path(out)
    return out.with_name(out.stem + ".manifest.json")


def write_manifest(study, out, grid, ranks: int, num_configs: int, num_launched: int, started_utc: str,
                   ranks_per_node: int | None = None) -> Path:
    """Append this sweep's entry to the manifest beside ``out``: the study,
    the grid, the ranks, the ranks per node (``ranks_per_node``; None: one
    node, written as ``ranks``), the command line, the git commit and the hash of
    the kernel sources (what was measured, whatever the checkout's .git
    says), when it ran and how many configurations it launched. Each
    record's ``env`` holds the rest of the environment (GPU, versions)."""
    import platform

    from ... import jit
    from .worker import _git_commit
    path = manifest_path(out)
    manifest = json.loads(path.read_text()) if path.exists() else {"study": _study(study).name,
                                                                    "records": Path(out).name, "sweeps": []}
    manifest["sweeps"].append({
        "started_utc": started_utc, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": ranks, "ranks_per_node": ranks if ranks_per_node is None else ranks_per_node,
        "grid": grid, "configurations": num_configs, "launched": num_launched,
        "argv": list(sys.argv), "cwd": os.getcwd(), "host": platform.node(), "git_commit": _git_commit(),
        "cuda_src_sha256": jit.source_hash()})
    path.write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return path


class SweepError(RuntimeError):
    """The sweep's launch failed or timed out; ``out`` keeps what finished."""


def _study(study) -> Study:
    return study if isinstance(study, Study) else studies.get(study)


def _has_gpu() -> bool:
    from ...launcher.launch import gpu_count  # CUDA_VISIBLE_DEVICES, else nvidia-smi; imports no CUDA
    return gpu_count() > 0


def _layout(ranks: int, ranks_per_node: int) -> str:
    return f"{ranks} ranks" + (f" ({ranks_per_node} per node)" if ranks_per_node != ranks else "")


def _from_fallback(study, keys, ranks, ranks_per_node, fallback) -> list[dict]:
    found = records.select(load(fallback), study.name, keys, ranks, ranks_per_node)
    if len(found) < len(keys):
        warnings.warn(f"{fallback} holds records of {len(found)} of the {len(keys)} configurations of "
                      f"study {study.name!r} at {_layout(ranks, ranks_per_node)}", stacklevel=3)
    return [found[k] for k in keys if k in found]


def _stop(proc, grace: float = 15.0) -> None:
    """SIGTERM to the launcher (it stops its ranks), SIGKILL after ``grace``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace)


class _Follower:
    """Counts the records of one study, key set and layout (ranks, ranks per
    node; ``records.select``) appended to a file."""

    def __init__(self, path: Path, study: str, keys, ranks: int, ranks_per_node: int):
        self.path, self.study, self.keys, self.ranks = path, study, set(keys), ranks
        self.ranks_per_node = ranks_per_node
        self.offset = path.stat().st_size if path.exists() else 0
        self.last = None

    def new_records(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return 0
        end = data.rfind(b"\n") + 1
        self.offset += end
        count = 0
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if (isinstance(rec, dict) and rec.get("study") == self.study and rec.get("key") in self.keys
                    and rec.get("ranks") == self.ranks
                    and records.record_ranks_per_node(rec) == self.ranks_per_node):
                count += 1
                self.last = rec
        return count


def _launch(study, configs, keys, ranks, ranks_per_node, out, resume, progress, timeout, initial) -> None:
    """Launch the worker on ``ranks`` ranks; ``ranks_per_node`` None: the
    launcher's default (one node), else ``--ranks-per-node``."""
    from tqdm import tqdm
    with tempfile.TemporaryDirectory(prefix="cupyep-sweep-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"study": study.name, "module": study.module, "configs": configs,
                                    "out": str(out), "resume": resume}))
        log_path = Path(tmp) / "launch.log"
        cmd = _launch_command(spec, ranks, ranks_per_node, timeout)
        env = dict(os.environ)
        if ranks_per_node is None:  # one node, whatever this process's environment says
            env.pop("CUPYEP_RANKS_PER_NODE", None)
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        follow = _Follower(out, study.name, keys, ranks, ranks if ranks_per_node is None else ranks_per_node)
        deadline = time.monotonic() + timeout + LAUNCH_GRACE_S
        with log_path.open("w") as log, tqdm(total=len(configs), initial=initial, desc=study.name,
                                             unit="config", disable=not progress) as bar:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            try:
                while True:
                    try:
                        proc.wait(timeout=POLL_S)
                        finished = True
                    except subprocess.TimeoutExpired:
                        finished = False
                    n = follow.new_records()
                    if n:
                        bar.update(n)
                        bar.set_postfix_str(follow.last.get("status", ""), refresh=False)
                    if finished:
                        break
                    if time.monotonic() > deadline:
                        _stop(proc)
                        break
            finally:
                _stop(proc)  # an interrupt here stops the launcher and its ranks
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace")[-4000:]
            what = "timed out" if proc.returncode == 124 else f"failed (exit status {proc.returncode})"
            raise SweepError(f"the sweep of study {study.name!r} on {_layout(ranks, ranks_per_node or ranks)} "
                             f"{what}; {out} keeps the configurations that finished (run again to resume). "
                             f"Launcher output:\n{tail}")


def _launch_command(spec, ranks: int, ranks_per_node: int | None, timeout: float) -> list[str]:
    """The launcher's command line for the worker on ``spec``."""
    nodes = [] if ranks_per_node is None else ["--ranks-per-node", str(ranks_per_node)]
    return [sys.executable, "-m", "cupyep.launcher.launch", "-n", str(ranks), *nodes, "--timeout", f"{timeout:g}",
            "-m", "cupyep.lab.experiments.worker", str(spec)]


def _check_ranks_per_node(ranks: int, ranks_per_node) -> None:
    if ranks_per_node is None:
        return
    if not (isinstance(ranks_per_node, int) and not isinstance(ranks_per_node, bool) and ranks_per_node >= 1
            and ranks % ranks_per_node == 0):
        raise ValueError(f"ranks_per_node must be None or an int >= 1 that divides ranks={ranks}, "
                         f"got {ranks_per_node!r}")


def run(study, grid, ranks: int = 2, out=None, resume: bool = True, progress: bool = True,
        timeout: float | None = None, fallback=None, ranks_per_node: int | None = None) -> list[dict]:
    """Run every configuration of ``grid`` for ``study`` on ``ranks`` ranks.

    Arguments:
        study: a registered study's name or a :class:`Study` (defined in an
            importable module, so that the ranks can import it).
        grid: dict knob -> value or list of values, or a list of
            configuration dicts (``cupyep.lab.experiments.grid``).
        ranks: number of ranks to launch.
        out: the JSONL file records are appended to; default
            ``results/sweeps/<study>.jsonl`` (relative to the working directory).
        resume: skip configurations already recorded in ``out`` (same
            study, key and layout: "ranks" and "ranks_per_node", a record
            without "ranks_per_node" counting as one node); False runs them
            all again.
        progress: show a tqdm bar (on stderr).
        timeout: seconds the whole launch may take (the launcher's
            ``--timeout``); default :data:`DEFAULT_TIMEOUT_S`.
        fallback: a committed JSONL file; when the study needs a GPU and this
            machine has none, its records for the grid (same study, key and
            layout) are returned instead of running anything.
        ranks_per_node: emulate nodes of this many consecutive ranks on this
            host (the launcher's ``--ranks-per-node``; an int >= 1 dividing
            ``ranks``). None: the launcher's default, one node of ``ranks``
            ranks (``CUPYEP_RANKS_PER_NODE`` is not passed on); the records
            of a None run are those with ranks_per_node == ranks.

    Returns:
        list of records (fields in ``cupyep.lab.experiments.worker``), one per
        configuration of the grid in grid order, new and resumed alike.

    Raises:
        ValueError: unknown study or knob, bad grid, rank count or ranks per
            node (raised before anything is launched).
        RuntimeError: the study needs a GPU, there is none and no fallback.
        SweepError: the launch failed or timed out.
    """
    study = _study(study)
    if not (isinstance(ranks, int) and ranks >= 1):
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    _check_ranks_per_node(ranks, ranks_per_node)
    layout = ranks if ranks_per_node is None else ranks_per_node  # the records' "ranks_per_node"
    configs = expand(grid, study.knobs, study.choices)
    keys = [config_key(c) for c in configs]
    if study.needs_gpu and not _has_gpu():
        if fallback is None:
            raise RuntimeError(f"study {study.name!r} needs a CUDA GPU and this machine has none "
                               "(CUDA_VISIBLE_DEVICES, nvidia-smi -L); to read recorded results instead, pass "
                               "fallback=<committed results .jsonl> (--fallback FILE on the command line)")
        return _from_fallback(study, keys, ranks, layout, fallback)
    if study.module in ("", "__main__"):
        raise ValueError(f"study {study.name!r} is defined in {study.module or 'no module'}; the ranks import "
                         "studies by module, so define it in an importable module")
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    out = Path(out if out is not None else DEFAULT_OUT.format(study=study.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    done = records.select(load(out), study.name, keys, ranks, layout) if resume else {}
    todo = [c for c, k in zip(configs, keys) if k not in done]
    if todo:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            _launch(study, configs, keys, ranks, ranks_per_node, out, resume, progress, timeout, len(done))
        finally:
            write_manifest(study, out, grid, ranks, len(configs), len(todo), started, layout)
    found = records.select(load(out), study.name, keys, ranks, layout)
    missing = [k for k in keys if k not in found]
    if missing:
        raise SweepError(f"{len(missing)} configuration(s) of study {study.name!r} have no record at "
                         f"{_layout(ranks, layout)} in {out} after the sweep, e.g. {missing[0]}")
    return [found[k] for k in keys]
