"""Benchmark utilities: the copy-bandwidth roofline, event timing, JSON output,
the naive baseline (``naive``), multi-run tables (``summary``) and the main
job (``main``; its figures are ``cupyep.lab.plotting.main_figures``)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NO_GPU_STATUS = 2


def require_gpu(script: str) -> None:
    """Exit with status 2 and one line on stderr when no CUDA GPU is visible.

    For the top of an experiment's ``main()``, before anything touches CUDA:
    ``require_gpu(__file__)``. ``script`` is named relative to the repository
    when it lies inside it. Under a launcher only rank 0 prints the line; every
    rank exits.
    """
    from ...runtime import gpu_count
    if gpu_count() > 0:
        return
    path = Path(script).resolve()
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else script
    from ...launcher.calls import env_rank
    if env_rank() in (0, -1):
        print(f"{name} needs a CUDA GPU; none found (run python -m cupyep.lab.bench for the CPU reference run)",
              file=sys.stderr, flush=True)
    sys.exit(NO_GPU_STATUS)
