"""Kernel sources and nvcc: where ``cuda_src/`` is, what identifies a kernel
specialisation (:class:`KernelSpec`, with the hash of every source file in
its options), and the offline nvcc build with ptxas' report (registers,
spills, each kernel's mangled symbol). Below every other module:
:mod:`cupyep.jit` compiles and caches at run time on top of it, and
:mod:`cupyep.nvshmem_build` links NVSHMEM specs with it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent
CUDA_SRC = (_PKG / "cuda_src") if (_PKG / "cuda_src").is_dir() else (_PKG.parent / "cuda_src")

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

    def options(self, include: tuple[str, ...] = ()) -> tuple[str, ...]:
        """Compiler options: the base, cuda_src/ and ``include`` (NVSHMEM's
        headers for an nvshmem spec), the source hash, the defines."""
        return (*BASE_OPTIONS, f"-I{CUDA_SRC}", *include, f"-DCUPYEP_SOURCE_HASH=0x{source_hash()[:16]}",
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


def nvcc_cubin(spec: KernelSpec, out: Path, arch: str = "sm_90", nvcc: str | None = None,
               include: tuple[str, ...] = ()) -> str:
    """Compile ``spec`` with nvcc into the cubin ``out`` (relocatable device
    code for NVSHMEM specs, which then need linking; ``include``: extra
    include options, NVSHMEM's for those) and return ptxas' verbose report.
    Raises RuntimeError with the compiler output on failure."""
    nvcc = find_nvcc(nvcc)
    # Taking each kernel's address in host code makes nvcc instantiate it.
    refs = ", ".join(f"(const void*)&{k}" for k in spec.kernels)
    wrapper = f'#include "{spec.source}"\nstatic const void* cupyep_instantiate[] = {{{refs}}};\n'
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{spec.name}.cu"
        src.write_text(wrapper)
        rdc = ("-rdc=true",) if spec.nvshmem else ()
        cmd = [nvcc, f"-arch={arch}", "-cubin", *rdc, "-Xptxas", "-v", *spec.options(include), "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec.name}: nvcc failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
    return proc.stderr


def mangled_prefix(expr: str) -> str:
    """The Itanium-ABI mangled name of a kernel name expression up to its
    parameter list: namespaces and a function name, with integer or bool
    template arguments (all the kernels here use), e.g.
    ``cupyep::shmem::put_signal<256>`` -> ``_ZN6cupyep5shmem10put_signalILi256EE``."""
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
