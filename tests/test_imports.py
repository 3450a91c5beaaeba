"""The package's import graph: no circle anywhere (the layers below the
modes, the error slot, the nvcc build, the JIT, NVSHMEM and the barriers,
included), and the shared types import no mode. Every relative import
counts, those inside functions too."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "cupyep"
def _modules() -> dict:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def import_graph() -> dict:
    """{module: the package's modules it imports}."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            here = base[:len(base) - node.level + 1]
            if node.module:
                targets = [".".join(here + node.module.split("."))]
            else:
                targets = [".".join(here + [a.name]) for a in node.names]
            deps.update(t for t in targets if t in mods)
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict) -> list[set]:
    """The strongly connected components of more than one module."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    g = import_graph()
    assert "cupyep.nvshmem" in g["cupyep.barrier"]  # WorldBarrier's import inside __init__
    assert "cupyep.nvcc" in g["cupyep.jit"] and "cupyep.nvshmem_build" in g["cupyep.jit"]


def test_no_module_of_the_package_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_shared_types_import_no_mode():
    g = import_graph()
    modes = {m for m in g if m.startswith(("cupyep.normal", "cupyep.low_latency", "cupyep.normal.internode_kernels"))}
    for below in ("cupyep.results", "cupyep.streams", "cupyep.sizes", "cupyep.slots"):
        assert not g[below] & modes, (below, g[below] & modes)
    assert "cupyep.normal.results" not in g["cupyep.low_latency.buffer"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_normal_mode_is_a_front_over_routes_that_import_nothing_above_them():
    """The front (cupyep.normal.buffer) reaches the kernels only through the
    routes; each route's launches are in its kernels module; nothing in
    normal mode imports the lab or the modes and layers above it."""
    g = import_graph()
    front = g["cupyep.normal.buffer"]
    assert not {m for m in front if m.endswith("_kernels")}, front
    assert {"cupyep.normal.queue", "cupyep.normal.direct", "cupyep.normal.internode"} <= front
    assert "cupyep.normal.queue_kernels" in g["cupyep.normal.queue"]
    assert "cupyep.normal.direct_kernels" in g["cupyep.normal.direct"]
    above = ("cupyep.lab.bench", "cupyep.lab.experiments", "cupyep.lab.plotting", "cupyep.lab.advisor", "cupyep.low_latency")
    for name, deps in g.items():
        if name.startswith("cupyep.normal"):
            assert not {d for d in deps if d.startswith(above)}, (name, deps)


def test_the_library_imports_none_of_the_lab():
    """Nothing outside cupyep.lab imports it (the core: runtime, modes,
    reference, MoE layer, balance, launcher)."""
    g = import_graph()
    for name, deps in g.items():
        if not name.startswith("cupyep.lab"):
            assert not {d for d in deps if d.startswith("cupyep.lab")}, (name, deps)


def test_importing_cupyep_and_its_buffers_loads_no_matplotlib_and_no_tqdm():
    import subprocess
    import sys
    code = ("import sys, cupyep\n"
            "cupyep.Buffer, cupyep.LowLatencyBuffer, cupyep.moe.MoELayer\n"
            "import cupyep.balance, cupyep.reference, cupyep.launcher.launch\n"
            "print(sorted(m for m in ('matplotlib', 'tqdm') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr)
