"""NVSHMEM for the modes whose ranks span nodes: the rank runtime, the
heap, and the put-with-signal primitive.

Device side (:mod:`cupyep.nvshmem_build`, whose names this module also
gives): a :class:`cupyep.jit.KernelSpec` with ``nvshmem=True`` is built by
nvcc and nvlink against NVSHMEM's device library, cached on disk, and
registered with NVSHMEM when loaded.

Host side: :func:`init` starts NVSHMEM over a group's mpi4py communicator
(nvshmem4py's ``nvshmem.core.init(..., initializer_method="mpi")``) after
checking that the host library is the version the device library came
from; :func:`finalize` ends it.

The library comes from the ``nvidia-nvshmem-cu13`` wheel (headers, device
library, host library), the Python binding from ``nvshmem4py-cu13``; both
are in the ``nvshmem`` extra (``pip install -e ".[nvshmem]"``).
"""
from __future__ import annotations

import os

from .errors import GUARD_DTYPE
# The library and its device-side build, also used as cupyep.nvshmem.root, .version, .build, ...
from .nvshmem_build import (INSTALL_HINT, NvshmemUnavailable, build, cache_dir, cache_key,  # noqa: F401
                            check_versions, include_options, link_cubin, load_module, root, version)

# Environment for NVSHMEM when every PE is on this host (nodes emulated with
# --ranks-per-node): no InfiniBand, peers reachable by load/store, MPS.
SINGLE_HOST_ENV = {"NVSHMEM_IB_ENABLE_IBGDA": "0", "NVSHMEM_REMOTE_TRANSPORT": "none",
                   "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}


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
    """NumPy mirror of ``PutSignalArgs`` (cuda_src/nvshmem/put_signal.cu)."""
    import numpy as np

    from . import jit
    u64, i64, i32 = np.uint64, np.int64, np.int32
    return jit.struct_dtype([("dst", u64), ("src", u64), ("sig", u64), ("peers", u64), ("bytes", i64),
                             ("expected", u64), ("num_peers", i32), ("my_slot", i32), ("guard", GUARD_DTYPE)])


def put_signal_spec(num_threads: int = 256):
    """The put-with-signal kernel (cuda_src/nvshmem/put_signal.cu): the
    primitive of every hop between nodes."""
    from .jit import KernelSpec
    return KernelSpec(name=f"shmem_put_signal_threads_{num_threads}", source="nvshmem/put_signal.cu",
                      kernels=(f"cupyep::shmem::put_signal<{num_threads}>",), nvshmem=True)


def get_item_dtype():
    """NumPy mirror of ``GetItem`` (cuda_src/nvshmem/get_rows.cu): one range
    pulled from another PE."""
    import numpy as np

    from . import jit
    return jit.struct_dtype([("dst", np.uint64), ("src", np.uint64), ("bytes", np.int64), ("pe", np.int32),
                             ("pad", np.int32)])


def get_rows_args_dtype():
    """NumPy mirror of ``GetRowsArgs`` (cuda_src/nvshmem/get_rows.cu)."""
    import numpy as np

    from . import jit
    return jit.struct_dtype([("items", np.uint64), ("num_items", np.int32)])


def get_rows_spec():
    """The pull kernel (cuda_src/nvshmem/get_rows.cu): byte ranges from other
    PEs' symmetric buffers, a block-wide blocking get each."""
    from .jit import KernelSpec
    return KernelSpec(name="shmem_get_rows", source="nvshmem/get_rows.cu", kernels=("cupyep::shmem::get_rows",),
                      nvshmem=True)


def kernel_specs() -> list:
    """Specialisations the offline check compiles (it needs the NVSHMEM library)."""
    return [put_signal_spec(), get_rows_spec()]


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
