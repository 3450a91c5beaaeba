"""The mpi4py communicator a ``torch.distributed`` process group stands in for.

cupyep's rank runtime (:func:`cupyep.runtime.init`, :class:`cupyep.Group`,
the IPC and JIT helpers) talks to its ranks through an mpi4py communicator.
:class:`TorchComm` serves exactly the calls they make, over object
collectives and point-to-point messages of a CPU (gloo) process group:

======================  ===============================================
``Get_rank``/``Get_size``  the position in the group
``allgather(obj)``      ``all_gather_object``
``allreduce(obj, op)``  an allgather reduced on the host (MIN, MAX, SUM, PROD, LAND, LOR)
``bcast(obj, root)``    ``broadcast_object_list``
``gather(obj, root)``   an allgather, kept on ``root``
``Barrier()``           ``barrier``
``Split(color, key)``   a new group per color (ranks ordered by key, then rank)
``Split_type(COMM_TYPE_SHARED, key)``  ``Split`` by host name
``Dup()``               a new group of the same ranks
``Isend``/``Irecv``     ``isend``/``irecv`` of NumPy buffers with a tag (:class:`TorchRequest`)
``Free()``              drops the communicator (the process group stays with torch)
======================  ===============================================

Any other mpi4py call raises ``NotImplementedError`` naming it.
``cupyep.init`` takes any object with the methods in
``cupyep.runtime.COMM_METHODS``; this one holds no MPI communicator, and no
call reaches MPI through it. NVSHMEM across nodes bootstraps from a real MPI
communicator, so a group of several nodes needs ``comm=`` (mpi4py) instead.

The transport is a small object (``backend``) with the methods of
:class:`TorchBackend`; the tests drive the same logic through an in-process
stand-in.
"""
from __future__ import annotations

import socket

import numpy as np
from mpi4py import MPI

SERVED = frozenset({"Get_rank", "Get_size", "allgather", "allreduce", "bcast", "gather", "Barrier", "barrier",
                    "Split", "Split_type", "Dup", "Free", "Isend", "Irecv"})

# (op, name, reduction of every rank's value); MPI.Op is not hashable.
_REDUCE = (
    (MPI.MIN, "MIN", min), (MPI.MAX, "MAX", max),
    (MPI.SUM, "SUM", lambda vals: _fold(vals, lambda a, b: a + b)),
    (MPI.PROD, "PROD", lambda vals: _fold(vals, lambda a, b: a * b)),
    (MPI.LAND, "LAND", all), (MPI.LOR, "LOR", any),
)


def _fold(vals, f):
    out = vals[0]
    for v in vals[1:]:
        out = f(out, v)
    return out


class TorchBackend:
    """The transport of a :class:`TorchComm`: one ``torch.distributed``
    process group on a CPU backend (gloo), ranks addressed within it."""

    def __init__(self, pg):
        import torch.distributed as dist
        self.dist, self.pg = dist, pg
        self._ranks = dist.get_process_group_ranks(pg)  # group rank -> global rank
        self._pending = []  # (work, tensor) of sends still in flight

    def rank(self) -> int:
        return self.dist.get_rank(self.pg)

    def size(self) -> int:
        return self.dist.get_world_size(self.pg)

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size()
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj, root: int):
        box = [obj]
        self.dist.broadcast_object_list(box, src=self._ranks[root], group=self.pg)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier(group=self.pg)

    def subgroup(self, members: list[int]) -> "TorchBackend":
        """A new CPU group of ``members`` (ranks of this group, in order);
        called by exactly those members."""
        pg = self.dist.new_group([self._ranks[m] for m in members], backend="gloo",
                                 use_local_synchronization=True)
        return TorchBackend(pg)

    def isend(self, array: np.ndarray, dest: int, tag: int):
        import torch
        t = torch.from_numpy(np.array(array, copy=True))  # the send owns its bytes
        work = self.dist.isend(t, dst=self._ranks[dest], group=self.pg, tag=tag)
        self._pending = [(w, b) for w, b in self._pending if not w.is_completed()]
        self._pending.append((work, t))
        return work

    def irecv(self, array: np.ndarray, source: int, tag: int):
        import torch
        return self.dist.irecv(torch.from_numpy(array), src=self._ranks[source], group=self.pg, tag=tag)

    @staticmethod
    def done(work) -> bool:
        if work.is_completed():
            work.wait()  # raises what the transfer failed with
            return True
        return False

    @staticmethod
    def cancel(work) -> None:
        """Abort a transfer that timed out, where the backend can (best effort:
        the caller is about to raise CommTimeoutError)."""
        abort = getattr(work, "abort", None)
        if abort is not None:
            try:
                abort()
            except RuntimeError:
                pass


class TorchRequest:
    """An ``Isend``/``Irecv`` request: ``Test()`` polls, ``Cancel()`` aborts
    (the sends copy their bytes and complete in the background, held by the
    backend)."""

    def __init__(self, backend, work):
        self._backend, self._work = backend, work

    def Test(self, status=None) -> bool:  # noqa: N802 (mpi4py's name)
        return self._backend.done(self._work)

    def Cancel(self) -> None:  # noqa: N802
        self._backend.cancel(self._work)


class TorchComm:
    """The subset of ``mpi4py.MPI.Intracomm`` that cupyep's runtime uses, over
    ``backend`` (a :class:`TorchBackend`, or an object with its methods)."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):  # only for names not defined here
        if name[:1] != "_" and hasattr(MPI.Intracomm, name):
            raise NotImplementedError(
                f"cupyep.deep_ep: the torch.distributed group stands in for an mpi4py communicator in the calls "
                f"{sorted(SERVED)} only, not in {name!r}; pass comm=<mpi4py communicator> to Buffer instead")
        raise AttributeError(name)

    def Get_rank(self) -> int:  # noqa: N802
        return self._backend.rank()

    def Get_size(self) -> int:  # noqa: N802
        return self._backend.size()

    def allgather(self, obj) -> list:
        return self._backend.all_gather_object(obj)

    def allreduce(self, obj, op=MPI.SUM):
        for known, _, reduce in _REDUCE:
            if op == known:
                return reduce(self.allgather(obj))
        raise NotImplementedError(f"cupyep.deep_ep: allreduce serves the ops {[n for _, n, _ in _REDUCE]}, "
                                  f"not {op!r}")

    def bcast(self, obj, root: int = 0):
        return self._backend.broadcast_object(obj, root)

    def gather(self, obj, root: int = 0):
        got = self.allgather(obj)
        return got if self.Get_rank() == root else None

    def Barrier(self) -> None:  # noqa: N802
        self._backend.barrier()

    barrier = Barrier

    def Split(self, color: int = 0, key: int = 0) -> "TorchComm":  # noqa: N802
        """The ranks of one color, ordered by (key, rank), as a new communicator.
        MPI.UNDEFINED is not served (every rank joins a group)."""
        if color == MPI.UNDEFINED:
            raise NotImplementedError("cupyep.deep_ep: Split(color=MPI.UNDEFINED) is not served")
        everyone = self.allgather((color, key))
        members = sorted((k, r) for r, (c, k) in enumerate(everyone) if c == color)
        return TorchComm(self._backend.subgroup([r for _, r in members]))

    def Split_type(self, split_type, key: int = 0, info=None) -> "TorchComm":  # noqa: N802
        """``COMM_TYPE_SHARED``: the ranks on this host (by host name)."""
        if split_type != MPI.COMM_TYPE_SHARED:
            raise NotImplementedError(f"cupyep.deep_ep: Split_type serves COMM_TYPE_SHARED only, not {split_type!r}")
        hosts = self.allgather(socket.gethostname())
        return self.Split(sorted(set(hosts)).index(hosts[self.Get_rank()]), key)

    def Dup(self) -> "TorchComm":  # noqa: N802
        return TorchComm(self._backend.subgroup(list(range(self.Get_size()))))

    def Free(self) -> None:  # noqa: N802
        self._backend = _Freed()

    def Isend(self, buf, dest: int, tag: int = 0) -> TorchRequest:  # noqa: N802
        return TorchRequest(self._backend, self._backend.isend(_buffer(buf, "Isend"), dest, tag))

    def Irecv(self, buf, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> TorchRequest:  # noqa: N802
        if source == MPI.ANY_SOURCE or tag == MPI.ANY_TAG:
            raise NotImplementedError("cupyep.deep_ep: Irecv needs an explicit source and tag")
        return TorchRequest(self._backend, self._backend.irecv(_buffer(buf, "Irecv"), source, tag))


def _buffer(buf, call: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise NotImplementedError(f"cupyep.deep_ep: {call} serves C-contiguous NumPy buffers, got "
                                  f"{type(buf).__name__}")
    return buf


class _Freed:
    def __getattr__(self, name):
        raise ValueError(f"cupyep.deep_ep: this communicator was freed ({name})")


def cpu_group(group):
    """A CPU (gloo) process group of the ranks of ``group``: ``group`` itself
    when its backend already serves CPU tensors, else a new gloo group over
    the same ranks (made by those ranks only)."""
    import torch.distributed as dist
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or backend in ("mpi", "cpu:gloo"):
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)


def torch_comm(group) -> TorchComm:
    """The communicator of a ``torch.distributed`` process group (collective over it)."""
    return TorchComm(TorchBackend(cpu_group(group)))
