"""The README and its examples: at most 200 lines, usage first; the CPU
example runs as written (and is the README's CPU block); the GPU example
uses no name it does not define or import (it runs on a GPU machine)."""
import ast
import builtins
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def _undefined(code: str) -> set[str]:
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            bound |= {a.arg for a in node.args.args}
            if isinstance(node, ast.FunctionDef):
                bound.add(node.name)
        elif isinstance(node, ast.comprehension):
            bound |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def test_the_readme_is_short_and_starts_with_usage():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    headings = re.findall(r"^## (.*)$", text, re.M)
    assert headings[:2] == ["Two commands", "Using it"], headings


def test_the_cpu_example_runs_as_written_and_is_the_readmes():
    example = REPO / "examples" / "cpu_reference.py"
    assert _python_blocks()[0] in example.read_text()
    res = subprocess.run([sys.executable, str(example)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_the_gpu_example_defines_what_it_uses():
    code = (REPO / "examples" / "gpu_dispatch.py").read_text()
    assert not _undefined(code), _undefined(code)
    assert not _undefined((REPO / "examples" / "cpu_reference.py").read_text())


def test_the_gpu_example_exits_2_with_one_line_without_a_gpu():
    from cupyep.runtime import gpu_count
    if gpu_count():
        pytest.skip("a GPU is visible")
    res = subprocess.run([sys.executable, str(REPO / "examples" / "gpu_dispatch.py")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
