"""Run the GPU test suite under the launcher at several rank counts.

    python -m cupyep.launcher.gpu_tests [--ranks 2 4 8] [-k EXPR] [--timeout 900] [--ranks-per-node K] [--shard I/N]
                                        [--no-warm]

First it compiles every kernel into the run-time caches (``python -m
cupyep.jit --warm``), so that no test's ranks compile inside a call: on a
cold machine a rank compiling there made its peers' 5 s waits run out.
For each rank count it runs ``python -m cupyep.launcher -n N -- -m pytest -m gpu
tests/gpu`` (with pytest's 15 slowest tests listed), or the test files and node
ids named after ``--`` instead of the suite; the launcher starts CUDA MPS
when ranks share a GPU. Each rank
count's line gives pytest's counts (every rank prints its own summary; the
last one is reported), and a run where every test skipped says "skipped",
not "passed".

Exit status: 0 when every run passed; 1 when a run failed, ran no test or
skipped every test; 2, after the line "skipped: no GPU", on a machine
without a CUDA GPU (nothing is launched, so nothing passed).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_GPU_MESSAGE = "skipped: no GPU (python -m cupyep.launcher.gpu_tests needs a CUDA GPU; none found)"
_OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")
_SUMMARY = re.compile(r"\bin [\d.]+s\b")


def pytest_counts(output: str) -> dict[str, int]:
    """Outcome counts of the last pytest summary line in ``output``
    (e.g. ``3 passed, 2 skipped in 1.2s``), "error" for "errors"; {} if none."""
    counts: dict[str, int] = {}
    for line in output.splitlines():
        found = _OUTCOME.findall(line)
        if found and _SUMMARY.search(line):
            counts = {("error" if kind.startswith("error") else kind): int(n) for n, kind in found}
    return counts


def verdict(rc: int, counts: dict[str, int]) -> tuple[str, bool]:
    """(what one rank count's run did, whether it counts as a failure)."""
    detail = ", ".join(f"{n} {k}" for k, n in counts.items())
    if rc == 5:
        return "no tests ran (pytest status 5)", True
    if rc:
        return f"FAILED (status {rc}{'; ' + detail if detail else ''})", True
    if counts.get("skipped") and not counts.get("passed"):
        return f"skipped: every test skipped ({detail})", True
    return f"passed ({detail})" if detail else "passed", False


def shard_files(files, shard: str) -> list:
    """The test files of shard ``"i/n"`` (1-based): files i, i + n, i + 2n, ...
    of the sorted list, so that n runs together take every file once."""
    try:
        i, n = (int(v) for v in shard.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes i/n (e.g. 1/2), got {shard!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard {shard}: i must be in [1, n]")
    return sorted(files)[i - 1::n]


def named_test_path(arg: str) -> str | None:
    """A pytest argument that names test files (a path, or path::node id) as
    pytest sees it when it runs in ROOT (absolute when the path exists only
    relative to this folder); None for an option or anything else."""
    if arg.startswith("-"):
        return None
    head, sep, node = arg.partition("::")
    if (ROOT / head).exists():
        return arg
    return str(Path(head).resolve()) + sep + node if Path(head).exists() else None


def pytest_command(n: int, pytest_args, targets, k: str | None = None, timeout: float = 900.0,
                   ranks_per_node: int | None = None) -> list[str]:
    """The launcher command of one rank count: pytest over ``targets`` (the
    suite, or a shard of it), unless ``pytest_args`` name test files or
    node ids, which then replace them (so those run once, not the whole
    suite beside them)."""
    paths = [named_test_path(a) for a in pytest_args]
    named = any(paths)
    pytest_args = [p or a for p, a in zip(paths, pytest_args)]
    nodes = ["--ranks-per-node", str(ranks_per_node)] if ranks_per_node else []
    cmd = [sys.executable, "-m", "cupyep.launcher.launch", "-n", str(n), *nodes, "--timeout", str(int(timeout)), "--",
           "-m", "pytest", "-m", "gpu", "-x", "-q", "--color=no", "-p", "no:cacheprovider", "--durations=15",
           *([] if named else targets)]
    if k:
        cmd += ["-k", k]
    return cmd + list(pytest_args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.launcher.gpu_tests", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per rank count")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulate nodes of K ranks (the launcher's option; the tests across nodes need it)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run the I-th of N interleaved shares of the test files (N runs cover the suite)")
    p.add_argument("--no-warm", action="store_true", help="skip compiling every kernel first")
    p.add_argument("pytest_args", nargs="*",
                   help="extra pytest arguments (after --); test files or node ids among them run instead of the suite")
    args = p.parse_args(argv)
    if args.shard and any(named_test_path(a) for a in args.pytest_args):
        p.error("--shard picks files of tests/gpu; do not also name test files")
    targets = [str(ROOT / "tests" / "gpu")]
    if args.shard:
        try:
            targets = [str(f) for f in shard_files((ROOT / "tests" / "gpu").glob("test_*.py"), args.shard)]
        except ValueError as exc:
            p.error(str(exc))
    from ..runtime import gpu_count
    if gpu_count() == 0:
        print(NO_GPU_MESSAGE, flush=True)
        return 2
    if not args.no_warm:
        cmd = [sys.executable, "-m", "cupyep.jit", "--warm"]
        print(f"== compiling every kernel: {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            print("GPU tests not run: the kernels did not compile", file=sys.stderr)
            return 1
    failed = []
    for n in args.ranks:
        cmd = pytest_command(n, args.pytest_args, targets, k=args.k, timeout=args.timeout,
                             ranks_per_node=args.ranks_per_node)
        print(f"== GPU tests with {n} ranks: {' '.join(cmd)}", flush=True)
        lines = []
        with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              bufsize=1) as proc:
            for line in proc.stdout:
                sys.stdout.write(line)
                lines.append(line)
            rc = proc.wait()
        sys.stdout.flush()
        what, bad = verdict(rc, pytest_counts("".join(lines)))
        print(f"== {n} ranks: {what}", flush=True)
        if bad:
            failed.append(n)
    if failed:
        print(f"GPU tests failed, ran nothing or skipped everything at {failed} ranks", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
