"""Copy a main-job run folder into the committed results.

    python -m cupyep.lab.bench.promote RUN_DIR [RUN_DIR ...] [--to results/main]

The main job writes its run folders outside the repository
(cupyep.lab.bench.main.default_runs_dir); a run that a README figure or a
notebook reads is promoted: copied, folder name and all, into ``--to``
(default ``results/main`` of this checkout), which must not hold a folder
of that name already. Only what the run's manifest lists, and the manifest,
is copied, so a folder that is not a run (no ``manifest.json``) is refused.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .main import ROOT


def promote(run_dir, to) -> Path:
    """Copy ``run_dir`` (a main-job run folder) into ``to``; returns the copy.

    Raises:
        ValueError: not a run folder, or ``to`` already holds one of its name.
    """
    run_dir, to = Path(run_dir), Path(to)
    manifest = run_dir / "manifest.json"
    if not manifest.is_file():
        raise ValueError(f"{run_dir} is not a run folder of the main job (no manifest.json)")
    files = json.loads(manifest.read_text()).get("files", [])
    dest = to / run_dir.name
    if dest.exists():
        raise ValueError(f"{dest} exists already: a promoted run is not overwritten")
    missing = [f for f in files if not (run_dir / f).is_file()]
    if missing:
        raise ValueError(f"{run_dir} lacks files its manifest lists: {missing}")
    dest.mkdir(parents=True)
    for name in ["manifest.json", *files]:
        shutil.copy2(run_dir / name, dest / name)
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.bench.promote", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--to", default=str(ROOT / "results" / "main"), help="where promoted runs go (results/main)")
    args = p.parse_args(argv)
    for d in args.run_dirs:
        try:
            print(f"promoted {d} -> {promote(d, args.to)}")
        except ValueError as exc:
            print(f"python -m cupyep.lab.bench.promote: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
