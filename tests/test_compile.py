"""CI kernel compile check: ``python -m cupyep.jit --check`` compiles every
registered kernel specialisation for sm_90 with nvcc (no GPU needed). Needs
the CUDA toolkit; without nvcc this test fails (it is not skipped)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cupyep import jit


REPO = Path(__file__).resolve().parents[1]


def _find_nvcc():
    # The same places cupyep.jit.compile_offline looks.
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def test_jit_check_compiles_every_spec():
    if _find_nvcc() is None:
        pytest.fail("nvcc not found on PATH nor at /usr/local/cuda/bin/nvcc: the kernel compile check "
                    "(python -m cupyep.jit --check) needs the CUDA toolkit installed", pytrace=False)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "cupyep.jit", "--check"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    log = f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 0, log
    specs = jit.all_specs()
    lines = res.stdout.splitlines()
    assert lines[0].split()[:2] == ["specialisation", "regs"], log
    rows = [line.split() for line in lines[1:] if line and not line.startswith("compiled ")]
    compiled = {row[0] for row in rows}
    missing = [s.name for s in specs if s.name not in compiled]
    assert not missing, f"specialisations missing from the --check table: {missing}\n{log}"
    assert compiled == {s.name for s in specs}, log
    # Every kernel of every spec got a ptxas report with registers.
    assert len(rows) == sum(len(s.kernels) for s in specs), log
    assert all(int(row[1]) > 0 for row in rows), log
    summary = [line for line in lines if line.startswith("compiled ")]
    assert summary and summary[0].startswith(f"compiled {len(specs)} specialisations ({len(rows)} kernels) "
                                             "for sm_90"), log
