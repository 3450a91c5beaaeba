"""Run-time compilation of the kernels in ``cuda_src/``.

Each kernel specialisation is a frozen :class:`KernelSpec`: a source file, the
kernel name expressions to instantiate (template arguments are the
compile-time constants), and a readable name such as
``intranode_dispatch_ranks_8``. :func:`load` compiles through
``cupy.RawModule`` (NVRTC) and caches per process; CuPy caches the cubin on
disk. CuPy's disk cache key covers the source text and the options but not the
headers pulled in with ``-I``, so the options carry a hash of every file under
``cuda_src/``: editing any header recompiles.

``python -m cupyep.jit --check`` compiles every registered specialisation for
sm_90 with ``nvcc`` (no GPU needed) and prints registers, stack and spills.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np

_PKG = Path(__file__).resolve().parent
CUDA_SRC = (_PKG / "cuda_src") if (_PKG / "cuda_src").is_dir() else (_PKG.parent / "cuda_src")

# Modules that own kernels; each defines ``kernel_specs() -> list[KernelSpec]``
# listing the specialisations the check command compiles.
SPEC_MODULES = (
    "cupyep.barrier",
    "cupyep.bench.copy",
    "cupyep.bench.scatter",
    "cupyep.bench.skew",
    "cupyep.bench.timing",
    "cupyep.fp8",
    "cupyep.intranode.kernels",
    "cupyep.intranode.direct",
    "cupyep.low_latency.kernels",
    "cupyep.intranode.expert_major",
    "cupyep.nvshmem",
    "cupyep.internode",
)

BASE_OPTIONS = ("-std=c++17",)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compiled specialisation.

    Attributes:
        name: readable unique name, e.g. ``intranode_dispatch_ranks_8``.
        source: path of the ``.cu`` file relative to ``cuda_src/``.
        kernels: name expressions, e.g. ``cupyep::dispatch<8, 512>``.
        defines: extra ``-D`` macros as (name, value) pairs.
        nvshmem: the source calls device-side NVSHMEM: it is built with nvcc
            (relocatable device code) and linked against NVSHMEM's device
            library (:mod:`cupyep.nvshmem`), not compiled through NVRTC.
    """
    name: str
    source: str
    kernels: tuple[str, ...]
    defines: tuple[tuple[str, int], ...] = ()
    nvshmem: bool = False

    def options(self) -> tuple[str, ...]:
        extra = ()
        if self.nvshmem:
            from .nvshmem import include_options
            extra = include_options()
        return (*BASE_OPTIONS, f"-I{CUDA_SRC}", *extra, f"-DCUPYEP_SOURCE_HASH=0x{source_hash()[:16]}",
                *(f"-D{k}={v}" for k, v in self.defines))


@lru_cache(maxsize=1)
def source_hash() -> str:
    """SHA-256 over the path and contents of every file under ``cuda_src/``."""
    h = hashlib.sha256()
    for path in sorted(CUDA_SRC.rglob("*")):
        if path.is_file() and path.suffix in (".cu", ".cuh", ".h"):
            h.update(str(path.relative_to(CUDA_SRC)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class Module:
    """A compiled specialisation: ``module[kernel_name_expression]`` gives the
    ``cupy.RawKernel``-like function."""

    def __init__(self, spec: KernelSpec):
        import cupy
        self.spec = spec
        if spec.nvshmem:  # nvcc + nvlink against NVSHMEM's device library, then NVSHMEM's module init
            from .nvshmem import load_module
            self._module, self._functions = load_module(spec)
            return
        code = (CUDA_SRC / spec.source).read_text()
        self._module = cupy.RawModule(code=code, options=spec.options(), name_expressions=list(spec.kernels))
        self._functions = {k: self._module.get_function(k) for k in spec.kernels}

    def __getitem__(self, kernel: str):
        return self._functions[kernel]


_modules: dict[tuple[int, KernelSpec], Module] = {}


def load(spec: KernelSpec, group=None) -> Module:
    """Compile (or fetch from cache) ``spec`` for the current device.

    With ``group`` this is collective over the node: local rank 0 compiles
    first, the others wait at a node barrier and then hit CuPy's disk cache.
    """
    import cupy
    key = (cupy.cuda.Device().id, spec)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    if group is not None and group.local_size > 1:
        if group.local_rank == 0:
            mod = Module(spec)
        group.node_comm.Barrier()
        if group.local_rank != 0:
            mod = Module(spec)
    else:
        mod = Module(spec)
    _modules[key] = mod
    return mod


def kernel(spec: KernelSpec, group=None):
    """The kernel function of a single-kernel ``spec`` (loaded as by :func:`load`)."""
    if len(spec.kernels) != 1:
        raise ValueError(f"{spec.name} has {len(spec.kernels)} kernels; look one up in jit.load(spec)")
    return load(spec, group)[spec.kernels[0]]


# --- kernel argument structs -------------------------------------------------

def struct_dtype(fields: list[tuple[str, object]]) -> np.dtype:
    """A NumPy dtype laid out like the C struct with the same fields in order
    (natural alignment), for passing structs by value to kernels."""
    return np.dtype(fields, align=True)


def pack(dtype: np.dtype, **values) -> np.void:
    """One struct value of ``dtype``; unspecified fields are zero."""
    a = np.zeros((), dtype=dtype)
    for k, v in values.items():
        a[k] = v
    return a[()]


def ptr(a) -> int:
    """Device pointer of a CuPy array for a struct field, or 0 (null) for None."""
    return 0 if a is None else a.data.ptr


def max_resident_blocks(function, num_threads: int, shared_bytes: int = 0) -> int:
    """Blocks of a loaded kernel ``function`` one SM can hold at once."""
    from cupy.cuda import driver
    return driver.occupancyMaxActiveBlocksPerMultiprocessor(function.kernel.ptr, num_threads, shared_bytes)


def require_resident(what: str, per_sm: int, blocks: int, num_threads: int, ranks_per_gpu: int, num_sms: int,
                     knob: str, step: int = 1, spare: int = 0) -> None:
    """ValueError unless ``ranks_per_gpu`` ranks x ``blocks`` blocks (``per_sm``
    fit on one SM), plus ``spare`` more, can all be resident on ``num_sms`` SMs
    at once: kernels whose blocks wait on other ranks' blocks would otherwise
    deadlock (``spare``: room kept for blocks that do not wait, so they always
    progress). ``knob`` names the setting to lower (a multiple of ``step``)."""
    if per_sm < 1 or blocks * ranks_per_gpu + spare > per_sm * num_sms:
        limit = (per_sm * num_sms - spare) // max(1, ranks_per_gpu) // step * step
        raise ValueError(
            f"{what}: {ranks_per_gpu} ranks x {knob}={blocks} blocks of {num_threads} threads cannot all be "
            f"resident on {num_sms} SMs ({per_sm} such blocks per SM); the ranks wait on each other and would "
            f"deadlock. Use {knob} <= {limit}")


# --- offline compile check -----------------------------------------------------

_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


@dataclasses.dataclass
class CompileReport:
    spec: str
    kernel: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0


def all_specs() -> list[KernelSpec]:
    """Every registered specialisation, from the modules in SPEC_MODULES."""
    import importlib
    specs: list[KernelSpec] = []
    for name in SPEC_MODULES:
        specs.extend(importlib.import_module(name).kernel_specs())
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate kernel spec names: {sorted(dup)}")
    return specs


def _demangle(names: list[str]) -> dict[str, str]:
    try:
        nvcc_dir = Path(find_nvcc()).parent
    except RuntimeError:
        nvcc_dir = Path(".")
    tool = shutil.which("cu++filt") or shutil.which("c++filt") or str(nvcc_dir / "cu++filt")
    if not Path(tool).exists():
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def find_nvcc(nvcc: str | None = None) -> str:
    """The nvcc to use: ``nvcc``, else the one on PATH, else /usr/local/cuda's."""
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists() and not shutil.which(nvcc):
        raise RuntimeError("nvcc not found: install the CUDA toolkit or put nvcc on PATH")
    return nvcc


def nvcc_cubin(spec: KernelSpec, out: Path, arch: str = "sm_90", nvcc: str | None = None) -> str:
    """Compile ``spec`` with nvcc into the cubin ``out`` (relocatable device
    code for NVSHMEM specs, which then need linking) and return ptxas'
    verbose report. Raises RuntimeError with the compiler output on failure."""
    nvcc = find_nvcc(nvcc)
    # Taking each kernel's address in host code makes nvcc instantiate it.
    refs = ", ".join(f"(const void*)&{k}" for k in spec.kernels)
    wrapper = f'#include "{spec.source}"\nstatic const void* cupyep_instantiate[] = {{{refs}}};\n'
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{spec.name}.cu"
        src.write_text(wrapper)
        rdc = ("-rdc=true",) if spec.nvshmem else ()
        cmd = [nvcc, f"-arch={arch}", "-cubin", *rdc, "-Xptxas", "-v", *spec.options(), "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec.name}: nvcc failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
    return proc.stderr


def mangled_prefix(expr: str) -> str:
    """The Itanium-ABI mangled name of a kernel name expression up to its
    parameter list: namespaces and a function name, with integer or bool
    template arguments (all the kernels here use), e.g.
    ``cupyep::internode::put_signal<256>`` -> ``_ZN6cupyep9internode10put_signalILi256EE``."""
    m = re.fullmatch(r"\s*([\w:]+?)\s*(?:<(.*)>)?\s*", expr)
    if not m:
        raise ValueError(f"cannot mangle the kernel name expression {expr!r}")
    parts = [p for p in m.group(1).split("::") if p]
    name = "".join(f"{len(p)}{p}" for p in parts)
    targs = ""
    if m.group(2) is not None:
        for arg in (a.strip() for a in m.group(2).split(",")):
            if arg in ("true", "false"):
                targs += f"Lb{int(arg == 'true')}E"
            elif re.fullmatch(r"-?\d+", arg):
                targs += f"Li{arg.replace('-', 'n')}E"
            else:
                raise ValueError(f"cannot mangle the template argument {arg!r} of {expr!r}")
        targs = f"I{targs}E"
    return f"_ZN{name}{targs}E" if len(parts) > 1 else f"_Z{name}{targs}"


def kernel_symbols(spec: KernelSpec, ptxas_report: str) -> dict[str, str]:
    """{name expression: mangled symbol} of ``spec``'s kernels, from ptxas'
    report of their compilation (a path-loaded module is looked up by symbol)."""
    mangled = [m.group(1) for line in ptxas_report.splitlines() if (m := _PTXAS_ENTRY.search(line))]
    out = {}
    for k in spec.kernels:
        prefix = mangled_prefix(k)
        hits = [m for m in mangled if m.startswith(prefix)]
        if len(hits) != 1:
            raise RuntimeError(f"{spec.name}: no single symbol of {k} ({prefix}...) among {mangled}")
        out[k] = hits[0]
    return out


def compile_offline(spec: KernelSpec, arch: str = "sm_90", nvcc: str | None = None) -> list[CompileReport]:
    """Compile ``spec`` to a cubin with nvcc and parse ptxas' resource usage
    (NVSHMEM specs are also linked against NVSHMEM's device library, so a
    missing device function shows here).

    Raises RuntimeError with the compiler output when compilation fails.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = nvcc_cubin(spec, Path(tmp) / "k.cubin", arch, nvcc)
        kernel_symbols(spec, report)  # every name expression has its symbol (what a path-loaded module needs)
        if spec.nvshmem:
            from .nvshmem import link_cubin
            link_cubin(Path(tmp) / "k.cubin", Path(tmp) / "linked.cubin", arch)
    reports: list[CompileReport] = []
    cur: CompileReport | None = None
    for line in report.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            cur = CompileReport(spec.name, m.group(1))
            reports.append(cur)
        elif cur is not None and (m := _PTXAS_FRAME.search(line)):
            cur.stack, cur.spill_stores, cur.spill_loads = map(int, m.groups())
        elif cur is not None and (m := _PTXAS_REGS.search(line)):
            cur.registers = int(m.group(1))
            if s := _PTXAS_SMEM.search(line):
                cur.smem = int(s.group(1))
            cur = None
    names = _demangle([r.kernel for r in reports])
    for r in reports:
        r.kernel = names[r.kernel]
    return reports


def check_all(arch: str = "sm_90", jobs: int | None = None, out=sys.stdout) -> list[CompileReport]:
    """Compile every registered specialisation offline and print a table."""
    specs = all_specs()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda s: compile_offline(s, arch), specs))
    rows = [r for rs in results for r in rs]
    print(f"{'specialisation':44s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s} {'smem':>6s}  kernel", file=out)
    for r in rows:
        print(f"{r.spec:44s} {r.registers:4d} {r.stack:5d} {r.spill_stores:5d}/{r.spill_loads:<5d} {r.smem:6d}  {r.kernel}", file=out)
    print(f"compiled {len(specs)} specialisations ({len(rows)} kernels) for {arch}; "
          f"{sum(r.spill_stores > 0 for r in rows)} kernels spill", file=out)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.jit", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compile every specialisation with nvcc (no GPU needed)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--list", action="store_true", help="list the specialisations")
    args = p.parse_args(argv)
    if args.list:
        for s in all_specs():
            print(s.name, s.source, *s.kernels)
        return 0
    if args.check:
        try:
            check_all(args.arch, args.jobs)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

