"""NVSHMEM for the modes whose ranks span nodes: the library, device-side
kernels built against it, and the rank runtime.

Device side: a :class:`cupyep.jit.KernelSpec` with ``nvshmem=True`` is
compiled by nvcc as relocatable device code (``-rdc``), linked by nvlink
against NVSHMEM's device library (``libnvshmem_device.a``), loaded with
``cupy.RawModule(path=...)`` and registered with NVSHMEM
(``nvshmem.bindings.cumodule_init``) so that its ``nvshmem*`` calls work.
The linked cubin is cached on disk under :func:`cache_dir`, keyed by the
specialisation, the hash of ``cuda_src/``, the NVSHMEM version, the
architecture and the nvcc version.

Host side: :func:`init` starts NVSHMEM over a group's mpi4py communicator
(nvshmem4py's ``nvshmem.core.init(..., initializer_method="mpi")``) after
checking that the host library is the version the device library came
from; :func:`finalize` ends it.

The library comes from the ``nvidia-nvshmem-cu13`` wheel (headers, device
library, host library), the Python binding from ``nvshmem4py-cu13``; both
are in the ``nvshmem`` extra (``pip install -e ".[nvshmem]"``).
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

INSTALL_HINT = ('NVSHMEM is needed for the modes whose ranks span nodes: pip install -e ".[nvshmem]" '
                "(the nvidia-nvshmem-cu13 library and the nvshmem4py-cu13 binding)")
# Environment for NVSHMEM when every PE is on this host (nodes emulated with
# --ranks-per-node): no InfiniBand, peers reachable by load/store, MPS.
SINGLE_HOST_ENV = {"NVSHMEM_IB_ENABLE_IBGDA": "0", "NVSHMEM_REMOTE_TRANSPORT": "none",
                   "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}


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
    from .jit import find_nvcc
    cuda = Path(find_nvcc()).resolve().parent.parent
    return (f"-I{root() / 'include'}", f"-I{cuda / 'include' / 'cccl'}")


def link_cubin(unlinked: Path, out: Path, arch: str = "sm_90") -> None:
    """nvlink ``unlinked`` (relocatable device code) against NVSHMEM's device library into ``out``."""
    from .jit import find_nvcc
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
    from .jit import find_nvcc
    out = subprocess.run([find_nvcc(), "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def cache_key(spec, arch: str) -> str:
    """The disk-cache key of ``spec``'s linked cubin."""
    from .jit import source_hash
    h = hashlib.sha256(json.dumps([repr(spec), source_hash(), version(), arch, _nvcc_version()]).encode())
    return h.hexdigest()[:32]


def build(spec, arch: str = "sm_90") -> tuple[Path, dict[str, str]]:
    """(linked cubin, {name expression: symbol}) of ``spec``, from the disk
    cache or built now (nvcc -rdc, then nvlink)."""
    from .jit import kernel_symbols, nvcc_cubin
    folder = cache_dir() / f"{spec.name}-{cache_key(spec, arch)}"
    cubin, names = folder / "kernels.cubin", folder / "symbols.json"
    if cubin.exists() and names.exists():
        return cubin, json.loads(names.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"unlinked.{os.getpid()}.cubin"
    try:
        symbols = kernel_symbols(spec, nvcc_cubin(spec, tmp, arch))
        link_cubin(tmp, folder / f"kernels.{os.getpid()}.cubin", arch)
        os.replace(folder / f"kernels.{os.getpid()}.cubin", cubin)  # atomic: ranks may build at once
        names.write_text(json.dumps(symbols))
    finally:
        tmp.unlink(missing_ok=True)
    return cubin, symbols


def _arch() -> str:
    import cupy
    return f"sm_{cupy.cuda.Device().compute_capability}"  # "90" on an H100/H200


def load_module(spec):
    """(cupy.RawModule, {name expression: function}) of an NVSHMEM spec on
    the current device, registered with NVSHMEM (which must be initialised:
    :func:`init`)."""
    import cupy
    cubin, symbols = build(spec, _arch())
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


def _host_version() -> tuple[int, int, int]:
    """The loaded host library's version: nvshmem4py's binding of
    nvshmemx_vendor_get_version_info, which writes three ints through pointers."""
    import ctypes

    from nvshmem import bindings
    out = [ctypes.c_int(-1) for _ in range(3)]
    bindings.vendor_get_version_info(*(ctypes.addressof(v) for v in out))
    return tuple(v.value for v in out)


_users = 0  # init() calls not yet matched by finalize()


def init(group, single_host: bool | None = None) -> None:
    """Start NVSHMEM on every rank of ``group`` (collective), one PE per rank,
    over the group's mpi4py communicator. ``single_host``: every PE on this
    host, which sets SINGLE_HOST_ENV where unset (default: when every rank's
    host name is the same). Counted: a
    second init is a no-op and NVSHMEM ends at the matching last finalize."""
    global _users
    if _users:
        _users += 1
        return
    try:
        import nvshmem.core as core
        from cuda.core import Device
    except ImportError:
        raise NvshmemUnavailable(INSTALL_HINT) from None
    if single_host is None:  # every rank on this host: nodes emulated, or one real node
        import platform
        single_host = len(set(group.comm.allgather(platform.node()))) == 1
    if single_host:
        for k, v in SINGLE_HOST_ENV.items():
            os.environ.setdefault(k, v)
    check_versions(_host_version(), version())
    import cupy
    dev = Device(cupy.cuda.Device().id)
    dev.set_current()
    core.init(device=dev, mpi_comm=group.comm, initializer_method="mpi")
    _users = 1


def put_signal_args_dtype():
    """NumPy mirror of ``PutSignalArgs`` (cuda_src/internode/put_signal.cu)."""
    import numpy as np

    from . import jit
    from .barrier import GUARD_DTYPE
    u64, i64, i32 = np.uint64, np.int64, np.int32
    return jit.struct_dtype([("dst", u64), ("src", u64), ("sig", u64), ("peers", u64), ("bytes", i64),
                             ("expected", u64), ("num_peers", i32), ("my_slot", i32), ("guard", GUARD_DTYPE)])


def put_signal_spec(num_threads: int = 256):
    """The put-with-signal kernel (cuda_src/internode/put_signal.cu): the
    primitive of every hop between nodes."""
    from .jit import KernelSpec
    return KernelSpec(name=f"internode_put_signal_threads_{num_threads}", source="internode/put_signal.cu",
                      kernels=(f"cupyep::internode::put_signal<{num_threads}>",), nvshmem=True)


def kernel_specs() -> list:
    """Specialisations the offline check compiles (it needs the NVSHMEM library)."""
    return [put_signal_spec()]


def finalize() -> None:
    """Release one init(); the last one ends NVSHMEM (collective with the others)."""
    global _users
    if _users <= 0:
        return
    _users -= 1
    if _users == 0:
        import nvshmem.core as core
        core.finalize()


HEAP_MARGIN_BYTES = 1 << 30  # per GPU, beyond what the ranks ask: NVSHMEM's heap grows in chunks


def heap_shortfall(requests, margin: int = HEAP_MARGIN_BYTES) -> list[tuple]:
    """The GPUs that cannot hold a symmetric allocation. ``requests``: one
    ``(host, device_id, nbytes, free_bytes)`` per rank. Returns ``(host,
    device_id, demand, free)`` for each GPU whose ranks together ask for more
    than its free memory (the least any of them saw) less ``margin``."""
    gpus: dict = {}
    for host, dev, nbytes, free in requests:
        demand, seen = gpus.get((host, dev), (0, free))
        gpus[(host, dev)] = (demand + int(nbytes), min(seen, int(free)))
    return [(host, dev, demand, free) for (host, dev), (demand, free) in gpus.items() if demand + margin > free]


def reserve_heap(group, nbytes: int, what: str) -> None:
    """Collective, before ``nbytes`` per rank are taken from the NVSHMEM heap:
    MemoryError on every rank, naming the GPU, when the ranks sharing some GPU
    ask for more than its free memory (:func:`heap_shortfall`; CuPy's cached
    blocks are returned to the device first). Without it NVSHMEM, finding no
    memory to grow its heap inside a collective allocation, leaves the other
    PEs in its barrier and the process ends with an illegal address. The
    check assumes the heap grows by all of ``nbytes`` (memory a freed heap
    buffer left inside the heap is not counted)."""
    import platform

    import cupy
    cupy.get_default_memory_pool().free_all_blocks()
    free, _ = cupy.cuda.runtime.memGetInfo()
    short = heap_shortfall(group.comm.allgather((platform.node(), group.device_id, int(nbytes), int(free))))
    if short:
        host, dev, demand, free = short[0]
        raise MemoryError(f"{what}: {nbytes} bytes per rank on the NVSHMEM heap do not fit: the ranks on GPU {dev} "
                          f"of {host} ask for {demand} bytes together, {free} are free (less a margin of "
                          f"{HEAP_MARGIN_BYTES})")


class HeapBuffer:
    """One buffer of ``nbytes`` per rank on the NVSHMEM symmetric heap (collective
    over ``group``, which must span every PE), zeroed: what a kernel reaches by
    NVSHMEM puts on ranks of other nodes and by plain stores, through the peer
    pointers, on ranks of its own node.

    Attributes:
        nbytes: size of each rank's buffer.
        ptr: this rank's buffer (device pointer, int; the symmetric address that
            puts to any PE name).
        peer_ptr_list: list[int] ``[world_size]``: each rank's buffer as this
            rank can load and store it; 0 for ranks on other nodes (reached only
            by puts). Entry ``group.rank`` is ``ptr``.
        peer_ptrs: cupy ``[world_size]`` uint64, the same on the device.

    Starts NVSHMEM if needed (:func:`init`) and releases it in :meth:`destroy`.
    MemoryError on every rank, before NVSHMEM is asked, when the buffers of
    the ranks sharing a GPU do not fit in it (:func:`reserve_heap`).
    """

    def __init__(self, group, nbytes: int):
        import cupy
        import numpy as np
        from .ipc import same_size
        nbytes = same_size(group.comm, nbytes, "HeapBuffer", "the ranks")
        init(group)
        try:
            reserve_heap(group, nbytes, "HeapBuffer")
        except MemoryError:
            finalize()
            raise
        import nvshmem.core as core
        self._core, self.group, self.nbytes = core, group, nbytes
        self._arr = core.array((nbytes,), dtype="uint8")
        self._arr[...] = 0
        self.ptr = int(self._arr.data.ptr)
        nodes = group.comm.allgather(group.node)
        self.peer_ptr_list = [self.ptr if pe == group.rank else
                              int(core.get_peer_array(self._arr, pe).data.ptr) if nodes[pe] == group.node else 0
                              for pe in range(group.world_size)]
        self.peer_ptrs = cupy.asarray(np.asarray(self.peer_ptr_list, dtype=np.uint64))
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()

    def view(self, offset: int, shape, dtype, peer: int | None = None, strides=None):
        """As :meth:`cupyep.ipc.SymmetricBuffer.view`; ``peer``: a rank of this node."""
        from .ipc import buffer_view
        base = self.ptr if peer is None else self.peer_ptr_list[peer]
        if not base:
            raise ValueError(f"rank {peer} is on another node: its buffer has no address here")
        return buffer_view(self, base, self.nbytes, offset, shape, dtype, strides)

    @property
    def alive(self) -> bool:
        return self._arr is not None

    def destroy(self) -> None:
        """Collective: wait until no rank uses any buffer, free, release NVSHMEM."""
        import cupy
        if self._arr is None:
            return
        cupy.cuda.runtime.deviceSynchronize()
        self.group.comm.Barrier()
        self._core.free_array(self._arr)
        self._arr, self.peer_ptrs, self.ptr = None, None, 0
        finalize()
