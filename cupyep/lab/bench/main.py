"""The main job: the dispatch/combine benchmark on whatever this machine has.

    python -m cupyep.lab.bench.main [--ranks N ...] [--out DIR]

Every run writes a fresh folder ``<out>/<UTC time, YYYYmmddTHHMMSSZ>/``
(``--out`` default: :func:`default_runs_dir`, ``~/.cache/cupyep/runs``,
outside the repository; ``python -m cupyep.lab.bench.promote RUN_DIR`` copies
a run into the committed ``results/main/``),
holding ``manifest.json`` (the command, the git commit, the environment, and
each benchmark command with its exit status), the results
(``normal.jsonl``, ``low_latency.jsonl``, ``naive.jsonl``) and the figures
(``normal.png``, ``low_latency.png`` and their ``.svg``, from
``cupyep.lab.plotting.main_figures``); it ends with a table (kind, ranks, median
time, GB/s per rank, speed-up over the naive baseline). ``python -m cupyep.lab.bench.summary`` compares several runs.

With GPUs it launches N ranks (default: 2, 4 and 8 when there is one GPU,
else one per GPU) through ``cupyep.launcher.launch`` (which starts CUDA MPS when ranks
share a GPU) and runs, at each rank count, ``experiments/bench_normal.py``
(4096 tokens per rank, hidden 7168, top-8 of 256 experts),
``experiments/bench_low_latency.py --zero-copy`` (128 and 1 tokens per rank)
and ``experiments/bench_naive.py`` (the naive baseline at 4096, 128 and 1
tokens); with ``--ranks-per-node K`` also ``experiments/bench_internode.py``
across emulated nodes of K ranks, ``--route two_hop`` then ``--route direct``,
into ``internode.jsonl``. A benchmark that fails does not stop the others; the job's status is
then the first failure's. Without a GPU it runs the normal-mode experiment at
a small size on the NumPy reference, labelled as such in the output and the
plot, so that the toolkit can be seen working anywhere.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCHES = (("bench_normal.py", "normal.jsonl", []),
           ("bench_low_latency.py", "low_latency.jsonl", ["--zero-copy"]),
           ("bench_naive.py", "naive.jsonl", []))


EXPERTS = 256  # the job's routing: top-8 of 256 experts


def reference_run(num_ranks: int, num_tokens: int, hidden: int, out: Path) -> list[dict]:
    """Dispatch + combine of every rank on the NumPy reference (CPU); appends
    one record per kind to ``out`` and returns them."""
    import numpy as np

    from ... import reference as ref
    from ...testing import bf16_to_f32, global_routing, payload_bf16
    idx, w = global_routing(0, [num_tokens] * num_ranks, EXPERTS, 8)
    x = [payload_bf16(r, np.arange(num_tokens), hidden) for r in range(num_ranks)]
    t0 = time.perf_counter()
    res = ref.intranode_dispatch(x, idx, EXPERTS, topk_weights=w)
    t1 = time.perf_counter()
    comb = ref.intranode_combine([bf16_to_f32(r.recv_x) for r in res], res, [num_tokens] * num_ranks)
    t2 = time.perf_counter()
    visits = [ref.get_dispatch_layout(i, EXPERTS, num_ranks).is_token_in_rank.sum(1) for i in idx]
    ok = all(np.allclose(c, bf16_to_f32(xx) * v[:, None]) for c, xx, v in zip(comb, x, visits))
    recv_bytes = sum(r.recv_x.nbytes for r in res)
    records = [{"bench": "normal", "backend": "numpy-reference (no GPU)", "kind": kind, "ranks": num_ranks,
                "tokens": num_tokens, "hidden": hidden, "time_us": dt * 1e6,
                "rank_GBps": recv_bytes / num_ranks / dt / 1e9, "combine_check": bool(ok)}
               for kind, dt in (("dispatch_bf16", t1 - t0), ("combine_bf16", t2 - t1))]
    with out.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return records


def default_runs_dir() -> Path:
    """Where the main job's run folders go by default: ``$CUPYEP_RUNS``, else
    ``$XDG_CACHE_HOME/cupyep/runs``, else ``~/.cache/cupyep/runs`` (never the
    repository's tracked results)."""
    if os.environ.get("CUPYEP_RUNS"):
        return Path(os.environ["CUPYEP_RUNS"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cupyep" / "runs"


def new_run_dir(parent: Path) -> Path:
    """A folder ``parent/<UTC time>/`` that did not exist (``-2``, ``-3``, ...
    appended when one run already took this second)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        path = parent / (stamp if i == 1 else f"{stamp}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot make a fresh run folder for {stamp} in {parent}")


def _git(*args) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def environment(ngpu: int) -> dict:
    """Where the run happens: host, Python, package versions, GPUs, CUDA and cupyep variables."""
    env = {"host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
           "executable": sys.executable, "gpus": ngpu,
           **{m: _version(m) for m in ("numpy", "cupy", "mpi4py", "matplotlib")},
           "variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("CUDA_", "CUPYEP_"))}}
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if res.returncode == 0:
            env["nvidia_smi"] = [line.strip() for line in res.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def planned_runs(num_ranks: int, ranks_per_node: int | None) -> list[tuple]:
    """The benchmarks the job launches at ``num_ranks``: (script, results file,
    script arguments, launcher arguments) for each of BENCHES, then, with
    ``ranks_per_node`` K where the ranks make two or more nodes of K, the
    benchmark across nodes on both routes, the two-hop route first."""
    runs = [(script, dest, tuple(extra), ()) for script, dest, extra in BENCHES]
    K = ranks_per_node
    if K and num_ranks % K == 0 and num_ranks // K >= 2:
        runs += [("bench_internode.py", "internode.jsonl", ("--route", route), ("--ranks-per-node", str(K)))
                 for route in ("two_hop", "direct")]
    return runs


def _write_manifest(run_dir: Path, manifest: dict) -> None:
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv=None) -> int:
    import argparse

    from ... import jit

    from .. import plotting
    from ...runtime import gpu_count
    from . import summary
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.bench.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=None)
    p.add_argument("--out", default=None, help="parent folder of the run folders (default: $CUPYEP_RUNS or "
                   "~/.cache/cupyep/runs; python -m cupyep.lab.bench.promote copies a run into results/main)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="also time both routes across nodes of K ranks (experiments/bench_internode.py) "
                        "at every rank count with two or more such nodes")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    for n in args.ranks or []:  # before anything is written: a bad count leaves no run folder behind
        if n < 1 or EXPERTS % n:
            p.error(f"--ranks {n}: the job's {EXPERTS} experts must split evenly over the ranks "
                    f"(a divisor of {EXPERTS}: 1, 2, 4, 8, ...)")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        p.error(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    ngpu = gpu_count()
    if args.ranks_per_node and not ngpu:
        print("note: --ranks-per-node needs a GPU (the runs across nodes); without one the job runs the "
              "reference within a node only", file=sys.stderr)
    run_dir = new_run_dir(Path(args.out) if args.out else default_runs_dir())
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    manifest = {"command": shlex.join([sys.executable, "-m", "cupyep.lab.bench", *argv]), "argv": sys.argv,
                "cwd": os.getcwd(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "git_commit": commit, "git_dirty": None if status is None else bool(status),
                # What was measured, whatever the checkout's .git says: the kernels' sources.
                "cuda_src_sha256": jit.source_hash(),
                "environment": environment(ngpu), "runs": []}
    _write_manifest(run_dir, manifest)
    print(f"run folder: {run_dir}", flush=True)
    rc_first = 0
    if ngpu == 0:
        print("no CUDA GPU found: running the small-size experiment on the NumPy reference (CPU), not the kernels")
        manifest["backend"] = "numpy-reference (no GPU)"
        for n in args.ranks or [2, 4]:
            t0 = time.monotonic()
            for r in reference_run(n, 256, 1024, run_dir / "normal.jsonl"):
                print(json.dumps(r))
            manifest["runs"].append({"what": f"reference_run(num_ranks={n}, num_tokens=256, hidden=1024)",
                                     "status": 0, "seconds": round(time.monotonic() - t0, 3)})
    else:
        ranks = args.ranks or ([2, 4, 8] if ngpu == 1 else [ngpu])

        def bench(n: int, script: str, dest: str, extra=(), launcher=()) -> int:
            """Launch one benchmark at ``n`` ranks, record it in the manifest; its exit status."""
            cmd = [sys.executable, "-m", "cupyep.launcher.launch", "-n", str(n), *launcher, "--timeout", "600", "--",
                   str(ROOT / "experiments" / script), "--out", str(run_dir / dest), *extra]
            print("==", " ".join(cmd), flush=True)
            t0 = time.monotonic()
            rc = subprocess.call(cmd)
            manifest["runs"].append({"command": cmd, "status": rc, "seconds": round(time.monotonic() - t0, 1)})
            _write_manifest(run_dir, manifest)
            if rc:
                print(f"== {script} at {n} ranks failed (status {rc}); going on with the others", flush=True)
            return rc

        for n in ranks:
            for script, dest, extra, launcher in planned_runs(n, args.ranks_per_node):
                rc = bench(n, script, dest, extra, launcher)  # every benchmark runs, whatever failed before
                rc_first = rc_first or rc
    figures = plotting.main_figures(run_dir)
    rows = summary.summarize([summary.load_run(run_dir)])
    manifest.update(finished_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), status=rc_first,
                    files=sorted(p.name for p in run_dir.iterdir() if p.name != "manifest.json"))
    _write_manifest(run_dir, manifest)
    if rows:
        print()
        print(summary.format_table(rows, columns=summary.RUN_COLUMNS))
    print(f"\nwrote {run_dir}: {', '.join(manifest['files'] + ['manifest.json'])}"
          + ("" if figures else " (no figure: no results)"))
    return rc_first


if __name__ == "__main__":
    sys.exit(main())
