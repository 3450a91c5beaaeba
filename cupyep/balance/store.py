"""Expert weights in memory every rank reaches, and their move to a new
placement: within a node in IPC-registered memory, across nodes on the
NVSHMEM symmetric heap.

:class:`ExpertStore` holds a rank's physical experts' weights (``slots``
experts, one array per matrix name) in a SymmetricBuffer, so that every
rank of the node can read every other rank's experts. A migration
(:meth:`ExpertStore.start_migration`, then :meth:`finish_migration`) runs in
two steps:

1. *pull*: on a side stream, after a GPU barrier that every rank's side
   stream reaches only once its caller's stream has done all the work
   enqueued before the call (the weights a peer loaded or committed are
   written before anyone reads them), each rank copies every expert it gains
   (cupyep.balance.migration.plan_moves: the moves whose ``dst_rank`` is
   this rank) from the holder's slot straight into a staging area of its
   own: within a node one copy over the peer mapping per moved expert,
   across nodes one NVSHMEM get per expert and matrix
   (cuda_src/nvshmem/get_rows.cu), the holder's symmetric address on its PE. The current
   weights are only read, so the layer keeps computing with them
   meanwhile, on its own stream;
2. *commit* (collective): a bounded host wait until every rank's pulls are
   done, so that nobody reads the old weights any more, then each rank
   copies its staged experts into their slots, on the caller's stream
   (after the compute already enqueued there).

The weights arrive bit-exact (plain device copies). Every wait is bounded
by the group's timeout and names the phase.
"""
from __future__ import annotations

import numpy as np

ALIGN = 256


class ExpertStore:
    """One rank's physical experts, readable by every rank: those of its node
    by loads and stores, across nodes by NVSHMEM gets.

    Arguments:
        group: from cupyep.init; every rank of the group takes part
            (collective). Ranks are placement GPUs: node-local indices within
            one node, world ranks across nodes.
        slots: physical experts per rank (P / R).
        shapes: {name: (per-expert shape, dtype)}, the same on every rank
            (e.g. {"w1": ((H, F), float32), "w2": ((F, H), float32)}).

    Attributes:
        arrays: {name: cupy [slots, *shape]} views of this rank's weights.
    """

    def __init__(self, group, slots: int, shapes: dict):
        from ..barrier import GpuBarrier, WorldBarrier, barrier_region_bytes
        from ..ipc import SymmetricBuffer
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.group, self.slots = group, int(slots)
        self.layout = {}
        off = 0
        for name, (shape, dtype) in shapes.items():
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.layout[name] = (off, tuple(shape), np.dtype(dtype), nbytes)
            off += -(-nbytes * self.slots // ALIGN) * ALIGN
        self.across_nodes = group.num_nodes > 1
        if self.across_nodes:
            from ..nvshmem import HeapBuffer
            self.rank, self.size = group.rank, group.world_size
            self.nbytes = max(off, ALIGN)
            self.buffer = HeapBuffer(group, self.nbytes)
            self.barrier = WorldBarrier(group)
            from .. import jit
            from ..nvshmem import get_rows_spec
            jit.load(get_rows_spec(), group)  # compiled now (collectively), not inside a migration's first step
        else:
            self.rank, self.size = group.local_rank, group.local_size
            self.barrier_offset = off
            self.nbytes = off + -(-barrier_region_bytes(group.local_size) // ALIGN) * ALIGN
            self.buffer = SymmetricBuffer(group, self.nbytes)
            self.barrier = GpuBarrier(group, self.buffer, self.barrier_offset)
        self.arrays = {name: self.buffer.view(o, (self.slots, *shape), dt)
                       for name, (o, shape, dt, _) in self.layout.items()}
        self._stream = None
        self._pending = self._items = None

    def load(self, arrays: dict) -> None:
        """Copy ``arrays`` ({name: [slots, *shape]}) in (on the current stream)."""
        for name, a in arrays.items():
            dst = self.arrays[name]
            if tuple(a.shape) != dst.shape or a.dtype != dst.dtype:
                raise ValueError(f"{name} must be {list(dst.shape)} {dst.dtype}, got {list(a.shape)} {a.dtype}")
            dst[...] = a

    def start_migration(self, moves) -> None:
        """Collective: begin pulling the experts this rank gains (Move list of
        cupyep.balance.plan_moves, the same on every rank), on a side stream
        ordered after the caller's stream so far and, through a GPU barrier,
        after every other rank's (the host does not wait). The weights stay
        as they are until :meth:`finish_migration`."""
        import cupy
        if self._pending is not None:
            raise ValueError("a migration is in progress: finish it first")
        me = self.rank
        mine = [m for m in moves if m.dst_rank == me and (m.src_rank, m.src_slot) != (m.dst_rank, m.dst_slot)]
        for m in moves:
            if not (0 <= m.dst_slot < self.slots and 0 <= m.src_slot < self.slots and
                    0 <= m.src_rank < self.size and 0 <= m.dst_rank < self.size):
                raise ValueError(f"{m} lies outside {self.size} ranks of {self.slots} slots")
        if self._stream is None:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self._stream.wait_event(ready)
        self.barrier(self._stream)  # every rank's weights are written before any pull reads them
        staged = {name: cupy.empty((len(mine), *shape), dtype=dt) for name, (_, shape, dt, _) in self.layout.items()}
        if self.across_nodes:
            self._get(mine, staged)
        else:
            rt = cupy.cuda.runtime
            for i, m in enumerate(mine):
                for name, (off, _, _, nbytes) in self.layout.items():
                    src = self.buffer.peer_ptr_list[m.src_rank] + off + m.src_slot * nbytes
                    rt.memcpyAsync(staged[name].data.ptr + i * nbytes, src, nbytes, rt.memcpyDeviceToDevice,
                                   self._stream.ptr)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self._stream)
        self._pending = (mine, staged, done)

    def _get(self, mine, staged) -> None:
        """Across nodes: one NVSHMEM get per (move, matrix) on the side
        stream, from the holder's symmetric address on its PE."""
        import cupy

        from .. import jit
        from ..nvshmem import get_item_dtype, get_rows_args_dtype, get_rows_spec
        items = np.zeros(len(mine) * len(self.layout), dtype=get_item_dtype())
        for i, m in enumerate(mine):
            for j, (name, (off, _, _, nbytes)) in enumerate(self.layout.items()):
                it = items[i * len(self.layout) + j]
                it["dst"] = staged[name].data.ptr + i * nbytes
                it["src"] = self.buffer.ptr + off + m.src_slot * nbytes
                it["bytes"], it["pe"] = nbytes, m.src_rank
        if not len(items):
            return
        with self._stream:
            dev_items = cupy.asarray(items.view(np.uint8))
            self._items = dev_items  # alive until the gets are done (finish_migration)
            args = jit.pack(get_rows_args_dtype(), items=dev_items.data.ptr, num_items=len(items))
            jit.kernel(get_rows_spec())((min(len(items), 128),), (256,), (args,))

    def finish_migration(self) -> int:
        """Collective: once every rank's pulls are done (a bounded wait, then a
        bounded exchange), copy the staged experts into their slots on the
        current stream. Returns the experts this rank received."""
        if self._pending is None:
            raise ValueError("no migration to finish: start_migration first")
        mine, staged, done = self._pending
        self.group.wait(done, "expert_migration", "host wait for this rank's pulls")
        self.group.exchange(np.zeros(1, dtype=np.int8), "expert migration: every rank's pulls done")
        for i, m in enumerate(mine):
            for name in self.layout:
                self.arrays[name][m.dst_slot] = staged[name][i]
        self._pending = self._items = None
        return len(mine)

    def destroy(self) -> None:
        """Collective: free the registered memory."""
        if self._pending is not None:
            self.group.wait(self._pending[2], "expert_migration", "host wait for the pulls before destroy")
            self._pending = self._items = None
        if self.across_nodes:
            self.barrier.destroy()
        self.buffer.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
