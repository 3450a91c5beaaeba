"""The NVSHMEM library on this machine and device-side kernels built against
it: where the library is and its version, nvcc and nvlink of a
:class:`cupyep.nvcc.KernelSpec` with ``nvshmem=True`` (relocatable device
code linked against ``libnvshmem_device.a``), the disk cache of the linked
cubins (keyed by the specialisation, the hash of ``cuda_src/``, the NVSHMEM
version, the architecture and the nvcc version), and loading one as a
``cupy.RawModule`` registered with NVSHMEM. The rank runtime on top of it
is :mod:`cupyep.nvshmem`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from .nvcc import find_nvcc, kernel_symbols, nvcc_cubin, source_hash

INSTALL_HINT = ('NVSHMEM is needed for the modes whose ranks span nodes: pip install -e ".[nvshmem]" '
                "(the nvidia-nvshmem-cu13 library and the nvshmem4py-cu13 binding)")


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM (the library or its Python binding) is not installed, or its
    versions do not match."""


@lru_cache(maxsize=1)
def root() -> Path:
    """The NVSHMEM library's folder (``include/``, ``lib/``): $NVSHMEM_HOME,
    else the nvidia-nvshmem-cu13 wheel's."""
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        path = Path(home)
    else:
        try:
            import nvidia.nvshmem as pkg
        except ImportError:
            raise NvshmemUnavailable(INSTALL_HINT) from None
        path = Path(list(pkg.__path__)[0])
    if not (path / "include" / "nvshmem.h").exists() or not (path / "lib" / "libnvshmem_device.a").exists():
        raise NvshmemUnavailable(f"{path} holds no NVSHMEM headers and device library; {INSTALL_HINT}")
    return path


@lru_cache(maxsize=1)
def version() -> tuple[int, int, int]:
    """(major, minor, patch) of the NVSHMEM headers and device library in use."""
    text = (root() / "include" / "non_abi" / "nvshmem_version.h").read_text()
    parts = [re.search(rf"#define NVSHMEM_VENDOR_{p}_VERSION\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise NvshmemUnavailable(f"cannot read the NVSHMEM version from {root()}/include/non_abi/nvshmem_version.h")
    return tuple(int(m.group(1)) for m in parts)


def include_options() -> tuple[str, ...]:
    """nvcc include options of a device-side NVSHMEM source (its headers need CUDA's CCCL)."""
    cuda = Path(find_nvcc()).resolve().parent.parent
    return (f"-I{root() / 'include'}", f"-I{cuda / 'include' / 'cccl'}")


def link_cubin(unlinked: Path, out: Path, arch: str = "sm_90") -> None:
    """nvlink ``unlinked`` (relocatable device code) against NVSHMEM's device library into ``out``."""
    nvlink = shutil.which("nvlink") or str(Path(find_nvcc()).parent / "nvlink")
    cmd = [nvlink, f"-arch={arch}", str(unlinked), str(root() / "lib" / "libnvshmem_device.a"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvlink failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")


def cache_dir() -> Path:
    """Where linked NVSHMEM cubins are kept: $CUPYEP_CACHE_DIR/nvshmem, else ~/.cache/cupyep/nvshmem."""
    base = os.environ.get("CUPYEP_CACHE_DIR") or str(Path.home() / ".cache" / "cupyep")
    return Path(base) / "nvshmem"


def _nvcc_version() -> str:
    out = subprocess.run([find_nvcc(), "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def cache_key(spec, arch: str) -> str:
    """The disk-cache key of ``spec``'s linked cubin."""
    h = hashlib.sha256(json.dumps([repr(spec), source_hash(), version(), arch, _nvcc_version()]).encode())
    return h.hexdigest()[:32]


def build(spec, arch: str = "sm_90") -> tuple[Path, dict[str, str]]:
    """(linked cubin, {name expression: symbol}) of ``spec``, from the disk
    cache or built now (nvcc -rdc, then nvlink)."""
    folder = cache_dir() / f"{spec.name}-{cache_key(spec, arch)}"
    cubin, names = folder / "kernels.cubin", folder / "symbols.json"
    if cubin.exists() and names.exists():
        return cubin, json.loads(names.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"unlinked.{os.getpid()}.cubin"
    try:
        symbols = kernel_symbols(spec, nvcc_cubin(spec, tmp, arch, include=include_options()))
        link_cubin(tmp, folder / f"kernels.{os.getpid()}.cubin", arch)
        os.replace(folder / f"kernels.{os.getpid()}.cubin", cubin)  # atomic: ranks may build at once
        names.write_text(json.dumps(symbols))
    finally:
        tmp.unlink(missing_ok=True)
    return cubin, symbols


def device_arch() -> str:
    """The current CUDA device's architecture, e.g. "sm_90" (CuPy raises without a GPU)."""
    import cupy
    return f"sm_{cupy.cuda.Device().compute_capability}"  # "90" on an H100/H200


def load_module(spec):
    """(cupy.RawModule, {name expression: function}) of an NVSHMEM spec on
    the current device, registered with NVSHMEM (which must be initialised:
    :func:`init`)."""
    import cupy
    cubin, symbols = build(spec, device_arch())
    module = cupy.RawModule(path=str(cubin))
    functions = {k: module.get_function(sym) for k, sym in symbols.items()}
    try:
        from nvshmem import bindings
    except ImportError:
        raise NvshmemUnavailable(INSTALL_HINT) from None
    status = bindings.cumodule_init(int(module.module.ptr))
    if status != 0:
        raise RuntimeError(f"nvshmem cumodule_init of {spec.name} returned {status} (is NVSHMEM initialised?)")
    return module, functions


def check_versions(host: tuple[int, ...], device: tuple[int, ...]) -> None:
    """NvshmemUnavailable unless the host library's (major, minor, patch)
    equals the device library's, which kernels were linked against."""
    if tuple(host)[:3] != tuple(device)[:3]:
        raise NvshmemUnavailable(f"NVSHMEM host library {'.'.join(map(str, host))} does not match the device "
                                 f"library {'.'.join(map(str, device))} the kernels link against; install one "
                                 "nvidia-nvshmem-cu13 for both")
