"""The README's examples: the CPU one runs as written, and the GPU ones
(the first defines the shapes, the routing and the group the later ones
continue with) use no name they do not define or import (they run on a
GPU machine)."""
import ast
import builtins
import re
from pathlib import Path

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


def test_the_cpu_example_runs_as_written():
    cpu = _python_blocks()[0]
    assert "from cupyep import reference" in cpu
    exec(compile(cpu, "README.md (CPU example)", "exec"), {})


def test_every_example_defines_what_it_uses():
    cpu, *gpu = _python_blocks()
    assert not _undefined(cpu), _undefined(cpu)
    missing = {i: _undefined("\n".join(gpu[:i + 1])) for i in range(len(gpu))}
    missing = {i: names for i, names in missing.items() if names}
    assert not missing, missing
