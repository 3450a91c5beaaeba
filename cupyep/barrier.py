"""GPU barriers: across the ranks of a node, and (WorldBarrier, on NVSHMEM)
across every rank of several nodes; and the IPC self-check.

The barrier runs in one block per rank, through the ranks' symmetric IPC
buffers (``cuda_src/common/barrier.cuh``); every wait is bounded by the
group's timeout and a missing rank raises CommTimeoutError naming it.
"""
from __future__ import annotations

import numpy as np

from . import jit
from .errors import GUARD_DTYPE
from .ipc import SymmetricBuffer

BARRIER_ARGS_DTYPE = jit.struct_dtype([("peers", np.uint64), ("offset", np.int64), ("rank", np.int32),
                                       ("num_ranks", np.int32), ("guard", GUARD_DTYPE)])

RUNTIME_SPEC = jit.KernelSpec(
    name="runtime", source="runtime/runtime.cu",
    kernels=("cupyep::barrier_kernel", "cupyep::barrier_loop_kernel",
             "cupyep::ipc_write_pattern", "cupyep::ipc_check_pattern"))


def kernel_specs() -> list[jit.KernelSpec]:
    return [RUNTIME_SPEC, WORLD_BARRIER_SPEC]


def barrier_region_bytes(num_ranks: int) -> int:
    """Bytes of a barrier region (mirrors ``barrier_region_bytes`` in barrier.cuh)."""
    return ((num_ranks + 1) * 4 + 127) // 128 * 128


class _BarrierCalls:
    """What both GPU barriers share: a bounded host wait, and use as a context
    (destroyed at its end). Subclasses have ``group``, ``KERNEL`` (their
    guard's kernel name), ``__call__`` and ``destroy``."""

    def sync(self, timeout_s: float | None = None) -> None:
        """Barrier, then a bounded host wait for it (raises CommTimeoutError)."""
        import cupy
        self(timeout_s=timeout_s)
        ev = cupy.cuda.Event()
        ev.record()
        self.group.wait(ev, self.KERNEL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


class GpuBarrier(_BarrierCalls):
    """Barrier over the node's ranks on the GPU.

    Arguments:
        group: the rank group.
        buffer: a SymmetricBuffer to hold the barrier region, or None to
            allocate a private one (freed by :meth:`destroy`).
        offset: byte offset of the region in ``buffer``.
    """

    KERNEL = "barrier"

    def __init__(self, group, buffer: SymmetricBuffer | None = None, offset: int = 0):
        self.group = group
        nbytes = barrier_region_bytes(group.local_size)
        self._owns = buffer is None
        self.buffer = buffer if buffer is not None else SymmetricBuffer(group, nbytes)
        if offset + nbytes > self.buffer.nbytes:
            raise ValueError(f"barrier region [{offset}, {offset + nbytes}) does not fit a {self.buffer.nbytes}-byte buffer")
        self.offset = offset
        self.module = jit.load(RUNTIME_SPEC, group)

    def args(self, timeout_s: float | None = None) -> np.void:
        g = self.group
        return jit.pack(BARRIER_ARGS_DTYPE, peers=self.buffer.peer_ptrs.data.ptr, offset=self.offset,
                        rank=g.local_rank, num_ranks=g.local_size,
                        guard=g.guard(self.KERNEL, timeout_s))

    def __call__(self, stream=None, timeout_s: float | None = None) -> None:
        """Enqueue one barrier on ``stream`` (default: current stream)."""
        import cupy
        with (stream or cupy.cuda.get_current_stream()):
            self.module["cupyep::barrier_kernel"]((1,), (32,), (self.args(timeout_s),))

    def loop(self, iters: int, stream=None, timeout_s: float | None = None) -> None:
        """Enqueue ``iters`` barriers inside one kernel."""
        import cupy
        with (stream or cupy.cuda.get_current_stream()):
            self.module["cupyep::barrier_loop_kernel"]((1,), (32,), (self.args(timeout_s), np.int32(iters)))

    def destroy(self) -> None:
        if self._owns and self.buffer.alive:
            self.buffer.destroy()


WORLD_BARRIER_ARGS_DTYPE = jit.struct_dtype([("arrive", np.uint64), ("epoch", np.uint64), ("num_pes", np.int32),
                                             ("my_pe", np.int32), ("guard", GUARD_DTYPE)])
WORLD_BARRIER_SPEC = jit.KernelSpec(name="shmem_world_barrier", source="nvshmem/world_barrier.cu",
                                    kernels=("cupyep::shmem::world_barrier",), nvshmem=True)


class WorldBarrier(_BarrierCalls):
    """Barrier over every rank of the world on the GPU, through NVSHMEM signals
    (``cuda_src/nvshmem/world_barrier.cu``): what lines calls up when the
    ranks span nodes. The same calls as :class:`GpuBarrier`; it orders the
    ranks in time, not their memory. Needs nvshmem4py (starts NVSHMEM,
    released by :meth:`destroy`). A missing rank raises CommTimeoutError
    naming it (by world rank)."""

    KERNEL = "shmem_world_barrier"

    def __init__(self, group):
        import cupy
        from .nvshmem import HeapBuffer
        self.group = group
        self._epoch = cupy.zeros(1, dtype=np.int64)
        self._arrive = HeapBuffer(group, 8 * group.world_size)  # uint64 [R], zeroed: each PE's epoch
        self._fn = jit.kernel(WORLD_BARRIER_SPEC)

    def args(self, timeout_s: float | None = None) -> np.void:
        g = self.group
        return jit.pack(WORLD_BARRIER_ARGS_DTYPE, arrive=self._arrive.ptr, epoch=self._epoch.data.ptr,
                        num_pes=g.world_size, my_pe=g.rank,
                        guard=g.guard(self.KERNEL, timeout_s))

    def __call__(self, stream=None, timeout_s: float | None = None) -> None:
        """Enqueue one barrier on ``stream`` (default: current stream)."""
        self.loop(1, stream, timeout_s)

    def loop(self, iters: int, stream=None, timeout_s: float | None = None) -> None:
        """Enqueue ``iters`` barriers inside one kernel."""
        import cupy
        with (stream or cupy.cuda.get_current_stream()):
            self._fn((1,), (min(1024, max(32, -(-self.group.world_size // 32) * 32)),),
                     (self.args(timeout_s), np.int32(iters)))

    def destroy(self) -> None:
        """Collective: free the signals and release NVSHMEM."""
        self._arrive.destroy()


def gpu_barrier(group):
    """The GPU barrier that lines up every rank a call involves: the node's
    (:class:`GpuBarrier`), or across nodes the world's (:class:`WorldBarrier`)."""
    return WorldBarrier(group) if group.num_nodes > 1 else GpuBarrier(group)


def ipc_pattern_check(group, buffer: SymmetricBuffer, barrier: GpuBarrier, num_words: int, offset: int = 0) -> int:
    """Every rank writes a tagged pattern into every peer's ``buffer`` through
    the device peer table, passes the barrier, then checks both what it
    received and (reading remotely) what it wrote. Returns the number of bad
    words on this rank (0 when IPC works). Collective over the node."""
    import cupy
    need = offset + group.local_size * num_words * 4
    if need > buffer.nbytes:
        raise ValueError(f"ipc_pattern_check needs {need} bytes, buffer has {buffer.nbytes}")
    m = barrier.module
    args = (buffer.peer_ptrs, np.int64(offset), np.int32(group.local_rank), np.int32(group.local_size),
            np.int64(num_words))
    m["cupyep::ipc_write_pattern"]((64,), (256,), args)
    barrier()
    bad = cupy.zeros(1, dtype=np.uint64)
    m["cupyep::ipc_check_pattern"]((64,), (256,), (*args, bad))
    barrier()
    ev = cupy.cuda.Event()
    ev.record()
    group.wait(ev, "barrier")
    return int(bad.get()[0])
