"""Peers' own arrays, read in place through CUDA IPC.

A rank's array lives inside some ``cudaMalloc`` allocation (CuPy's memory
pool, and torch's, carve many arrays from one), and CUDA IPC exports whole
allocations. So each rank finds the allocation around its array
(``cuMemGetAddressRange``), exports the allocation's handle and sends
(handle, offset of the array) to the other ranks of its node; they open the
handle and read base + offset. Opening costs about a millisecond
(``results/normal_combine/ipc_caller_memory_*``), so mappings are kept,
keyed by the handle's bytes: an allocation freed and another made at the
same address exports other bytes, so a stale mapping is never reused. An
array inside one of cupyep's own IPC buffers (a dispatch's received rows in
the direct route's pool) is read where that buffer is mapped already
(cupyep.ipc.symmetric_mapping). The exchange itself is a bounded host
collective of the node (cupyep.runtime.Group.exchange) on every call.

An array cannot be exported when its memory is not ``cudaMalloc``'d (a
stream-ordered pool, managed or host memory): then :meth:`PeerArrays.exchange`
returns None on every rank, and the caller uses a path that copies.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict

MAX_MAPPINGS = 64  # mappings of peers' allocations kept open per PeerArrays (least recently used closed first)

_address_range_fn = None


def address_range(ptr: int) -> tuple[int, int]:
    """(base, bytes) of the device allocation holding address ``ptr``
    (``cuMemGetAddressRange``). RuntimeError when ``ptr`` is not in one."""
    global _address_range_fn
    if _address_range_fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _address_range_fn = fn
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _address_range_fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}")
    return base.value, size.value


class _CudaIpc:
    """The CUDA calls PeerArrays makes (a stand-in replaces them in CPU tests)."""

    @staticmethod
    def export(ptr: int) -> tuple[bytes, int]:
        """(handle bytes of the allocation holding ``ptr``, ``ptr``'s offset in it)."""
        import cupy
        base, _ = address_range(ptr)
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
        if len(handle) != HANDLE_BYTES:
            raise RuntimeError(f"an IPC handle of {len(handle)} bytes, not {HANDLE_BYTES}")
        return handle, ptr - base

    @staticmethod
    def symmetric(handle: bytes) -> int | None:
        """Where a SymmetricBuffer of this process maps the allocation, or None."""
        from .ipc import symmetric_mapping
        return symmetric_mapping(handle)

    @staticmethod
    def open(handle: bytes) -> int:
        from .ipc import open_peer
        return open_peer(handle)

    @staticmethod
    def close(ptr: int) -> None:
        from .ipc import close_peer
        close_peer(ptr)


HANDLE_BYTES = 64  # a cudaIpcMemHandle_t
_CANNOT, _EXPORTED, _EMPTY = 0, 1, 2  # what a rank offers: nothing, (handle, offset), or no rows at all


def _record(status: int, handle: bytes = b"", offset: int = 0):
    """One rank's part of an exchange: [8 + 8 + HANDLE_BYTES] uint8 (status,
    offset, handle)."""
    import numpy as np
    rec = np.zeros(16 + HANDLE_BYTES, dtype=np.uint8)
    rec[:16].view(np.int64)[:] = (status, offset)
    if handle:
        rec[16:16 + len(handle)] = np.frombuffer(handle, dtype=np.uint8)
    return rec


class PeerArrays:
    """Every node-local rank's array of one collective call, as addresses in
    this process.

    Arguments:
        exchange: ``exchange(record) -> records``: every rank's record
            (uint8 [80]) stacked in rank order, a bounded host collective
            over the node (cupyep.runtime.Group.exchange).
        rank: this rank's index in those records.
        max_mappings: peers' allocations kept mapped (least recently used
            closed first, after ``before_close``).
        before_close: called before a mapping is closed (the caller waits
            there for the kernels that may still read it); None: nothing.
        ipc: the CUDA calls (tests pass a stand-in).

    Attributes: opened (mappings opened so far), closed (mappings closed).
    """

    def __init__(self, exchange, rank: int, max_mappings: int = MAX_MAPPINGS, before_close=None, ipc=_CudaIpc):
        self._exchange, self.rank = exchange, int(rank)
        self.max_mappings, self.before_close, self.ipc = int(max_mappings), before_close, ipc
        self._mapped: OrderedDict = OrderedDict()  # (peer, handle bytes) -> base address here
        self.opened = self.closed = 0

    def exchange(self, ptr: int | None, empty: bool = False) -> list[int] | None:
        """Collective over the node: [R] addresses in this process of every
        rank's array (``ptr`` here, a peer's mapped; 0 for a rank whose
        array is ``empty``, which nobody reads), or None on every rank when
        some rank's cannot be exported (``ptr`` None, or not in a
        ``cudaMalloc`` allocation)."""
        mine = _record(_CANNOT)
        if empty:
            mine = _record(_EMPTY)
        elif ptr:
            try:
                handle, offset = self.ipc.export(int(ptr))
                mine = _record(_EXPORTED, handle, offset)
            except RuntimeError:  # not IPC-exportable memory: this call copies instead, on every rank
                pass
        records = self._exchange(mine)
        status = records[:, :8].view("<i8")[:, 0]
        if (status == _CANNOT).any():
            return None
        out = []
        for peer, rec in enumerate(records):
            if status[peer] == _EMPTY:
                out.append(0)
            elif peer == self.rank:
                out.append(int(ptr))
            else:
                offset = int(rec[8:16].view("<i8")[0])
                out.append(self._base(peer, rec[16:].tobytes()) + offset)
        return out

    def _base(self, peer: int, handle: bytes) -> int:
        key = (peer, handle)
        base = self._mapped.get(key)
        if base is not None:
            self._mapped.move_to_end(key)
            return base
        base = self.ipc.symmetric(handle)  # a peer's cupyep buffer (a dispatch's received rows): mapped already
        if base is not None:
            return base
        while len(self._mapped) >= self.max_mappings:
            self._close_oldest()
        base = self._mapped[key] = self.ipc.open(handle)
        self.opened += 1
        return base

    def _close_oldest(self) -> None:
        if self.before_close is not None:
            self.before_close()
        _, base = self._mapped.popitem(last=False)
        self.ipc.close(base)
        self.closed += 1

    @property
    def num_mapped(self) -> int:
        """Peers' allocations mapped now."""
        return len(self._mapped)

    def close(self) -> None:
        """Close every mapping (after ``before_close``)."""
        if self._mapped and self.before_close is not None:
            self.before_close()
        while self._mapped:
            _, base = self._mapped.popitem(last=False)
            self.ipc.close(base)
            self.closed += 1
