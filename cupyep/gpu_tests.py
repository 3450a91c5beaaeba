"""Run the GPU test suite under the launcher at several rank counts.

    python -m cupyep.gpu_tests [--ranks 2 4 8] [-k EXPR] [--timeout 900]

For each rank count it runs ``python -m cupyep.launch -n N -- -m pytest -m gpu
tests/gpu``; the launcher starts CUDA MPS when ranks share a GPU. Exits
non-zero if any run fails.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.gpu_tests", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per rank count")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    failed = []
    for n in args.ranks:
        cmd = [sys.executable, "-m", "cupyep.launch", "-n", str(n), "--timeout", str(int(args.timeout)), "--",
               "-m", "pytest", "-m", "gpu", "-x", "-q", "--color=no", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu")]
        if args.k:
            cmd += ["-k", args.k]
        cmd += args.pytest_args
        print(f"== GPU tests with {n} ranks: {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, cwd=ROOT)
        print(f"== {n} ranks: {'passed' if rc == 0 else f'FAILED (status {rc})'}", flush=True)
        if rc:
            failed.append(n)
    if failed:
        print(f"GPU tests failed at {failed} ranks", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
