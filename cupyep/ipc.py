"""Symmetric device buffers shared by the ranks of a node through CUDA IPC.

Every rank of the node allocates the same number of bytes with
``cudaMalloc`` (an IPC handle covers one whole allocation, so never the CuPy
pool), the handles are exchanged with ``allgather``, and each rank opens its
peers' buffers, whether they live on the same GPU (ranks sharing a GPU under
MPS) or another one (P2P). ``peer_ptrs`` is a device array ``[local_size]``
of ``uint64`` base pointers that kernels index by node-local rank.

:func:`open_mappings` counts the peer mappings this process holds open
(``cudaIpcOpenMemHandle`` not yet closed), so that tests can check that
every buffer's destroy unmaps what it mapped.
"""
from __future__ import annotations

import math

import numpy as np

_IPC_LAZY_ENABLE_PEER_ACCESS = 1
ALIGNMENT = 256
_open_mappings = 0  # peer mappings opened and not yet closed, in this process
_symmetric_handles: dict = {}  # IPC handle bytes of a peer's SymmetricBuffer -> its address in this process


def open_mappings() -> int:
    """Peer IPC mappings this process holds open (all SymmetricBuffers)."""
    return _open_mappings


def symmetric_mapping(handle: bytes) -> int | None:
    """This process's address of the peer SymmetricBuffer whose allocation
    ``handle`` exports, or None when no SymmetricBuffer here maps it (so
    that cupyep.ipc_peers reads it there instead of opening it twice)."""
    return _symmetric_handles.get(handle)


def _count_mappings(delta: int) -> None:
    global _open_mappings
    _open_mappings += delta


def open_peer(handle: bytes) -> int:
    """Map a peer's allocation (its IPC handle's bytes) into this process,
    counted in :func:`open_mappings`; returns its address here."""
    import cupy
    ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, _IPC_LAZY_ENABLE_PEER_ACCESS)
    _count_mappings(1)
    return ptr


def close_peer(ptr: int) -> None:
    """Unmap what :func:`open_peer` mapped at ``ptr``."""
    import cupy
    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    _count_mappings(-1)


def _malloc_everywhere(group, nbytes: int) -> int:
    """cudaMalloc of ``nbytes`` on every rank of the node, or on none: when
    some rank cannot allocate, every rank frees what it got and raises the
    same MemoryError (naming the bytes and the ranks), so none is left
    waiting for the others' IPC handles."""
    import cupy
    rt = cupy.cuda.runtime
    try:
        ptr, err = rt.malloc(nbytes), None
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        ptr, err = 0, str(exc)
    errors = group.node_comm.allgather(err)
    if any(e is not None for e in errors):
        if ptr:
            rt.free(ptr)
        short = [r for r, e in enumerate(errors) if e is not None]
        raise MemoryError(f"a symmetric buffer of {nbytes} bytes per rank does not fit: node-local rank(s) "
                          f"{short} could not allocate it ({next(e for e in errors if e is not None)})")
    return ptr


def same_size(comm, nbytes, what: str, who: str) -> int:
    """``nbytes`` as an int, checked positive and equal on every rank of
    ``comm`` (collective); ValueError naming ``what`` and ``who`` otherwise."""
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise ValueError(f"{what} size must be positive, got {nbytes}")
    sizes = comm.allgather(nbytes)
    if len(set(sizes)) != 1:
        raise ValueError(f"{what} sizes differ across {who}: {sizes}")
    return nbytes


_DTYPES: dict = {}  # what a caller names a dtype by -> the dtype (no np.dtype() per view)


def buffer_view(owner, base: int, nbytes: int, offset: int, shape, dtype, strides=None, memptr=None):
    """A cupy array of ``shape`` starting ``offset`` bytes into the ``nbytes``
    buffer at device address ``base`` (kept alive by ``owner``), C-contiguous
    or with byte ``strides`` (non-negative); every element must lie inside it.
    ``memptr``: a cupy MemoryPointer of the whole buffer, to view through
    (else one is made for the view)."""
    import cupy
    dt = _DTYPES.get(dtype)
    if dt is None:
        dt = _DTYPES[dtype] = np.dtype(dtype)
    dtype = dt
    if type(shape) is not tuple:
        shape = tuple(int(d) for d in shape)
    if strides is None:
        n = math.prod(shape) * dtype.itemsize
    else:
        strides = tuple(int(s) for s in strides)
        if len(strides) != len(shape) or min(strides, default=0) < 0:
            raise ValueError(f"strides {strides} do not fit shape {shape}")
        n = 0 if 0 in shape else sum((d - 1) * s for d, s in zip(shape, strides)) + dtype.itemsize
    if offset < 0 or offset + n > nbytes:
        raise ValueError(f"view [{offset}, {offset + n}) outside the {nbytes}-byte buffer")
    if memptr is None:
        mem = cupy.cuda.UnownedMemory(base + offset, n, owner, device_id=cupy.cuda.Device().id)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), strides=strides)
    return cupy.ndarray(shape, dtype, memptr + offset, strides=strides)


class SymmetricBuffer:
    """``nbytes`` of device memory on every rank of the node, mapped by all.

    Collective over ``group.node_comm``. Use as a context manager or call
    :meth:`destroy`, which unmaps peers before freeing (collectively).

    Attributes:
        nbytes: size of each rank's buffer.
        ptr: this rank's buffer (device pointer, int).
        peer_ptr_list: list[int] ``[local_size]``; entry ``local_rank`` is ``ptr``.
        peer_ptrs: cupy ``[local_size]`` uint64, the same on the device.
    """

    def __init__(self, group, nbytes: int):
        import cupy
        group.require_gpu("SymmetricBuffer")
        nbytes = same_size(group.node_comm, nbytes, "SymmetricBuffer", "the node's ranks")
        rt = cupy.cuda.runtime
        self.group = group
        self.nbytes = nbytes
        self.ptr = _malloc_everywhere(group, nbytes)
        self._opened: list[int] = []
        self._handles: list[bytes] = []  # the peers' handles this buffer opened (symmetric_mapping)
        self._memptrs: dict = {}  # base address -> MemoryPointer of the whole buffer (views go through it)
        try:
            rt.memset(self.ptr, 0, nbytes)
            rt.deviceSynchronize()
            handles = group.node_comm.allgather(bytes(rt.ipcGetMemHandle(self.ptr)))
            ptrs = []
            for i, h in enumerate(handles):
                if i == group.local_rank:
                    ptrs.append(self.ptr)
                else:
                    p = open_peer(h)
                    self._opened.append(p)
                    self._handles.append(h)
                    _symmetric_handles[h] = p
                    ptrs.append(p)
            self.peer_ptr_list = ptrs
            self.peer_ptrs = cupy.asarray(np.asarray(ptrs, dtype=np.uint64))
            group.node_comm.Barrier()
        except BaseException:
            self._release()
            raise

    def view(self, offset: int, shape, dtype, peer: int | None = None, strides=None):
        """A cupy array of ``shape`` starting ``offset`` bytes into this rank's
        buffer (or node-local rank ``peer``'s), C-contiguous or with byte
        ``strides`` (non-negative); every element must lie inside the buffer."""
        import cupy
        base = self.ptr if peer is None else self.peer_ptr_list[peer]
        memptr = self._memptrs.get(base)
        if memptr is None:
            mem = cupy.cuda.UnownedMemory(base, self.nbytes, self, device_id=cupy.cuda.Device().id)
            memptr = self._memptrs[base] = cupy.cuda.MemoryPointer(mem, 0)
        return buffer_view(self, base, self.nbytes, offset, shape, dtype, strides, memptr)

    def _release(self) -> None:
        import cupy
        rt = cupy.cuda.runtime
        for h in self._handles:
            _symmetric_handles.pop(h, None)
        self._handles = []
        for p in self._opened:
            close_peer(p)
        self._opened = []
        self._memptrs = {}
        if self.ptr:
            rt.free(self.ptr)
            self.ptr = 0

    def destroy(self) -> None:
        """Collective: wait until no rank uses any buffer, unmap peers, free."""
        import cupy
        if not self.ptr:
            return
        cupy.cuda.runtime.deviceSynchronize()
        self.group.node_comm.Barrier()
        self._release()
        self.peer_ptrs = None
        self.group.node_comm.Barrier()

    @property
    def alive(self) -> bool:
        return bool(self.ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
