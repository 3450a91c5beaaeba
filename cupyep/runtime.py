"""The rank runtime: who am I, which GPU is mine, and bounded host waits.

``init()`` builds a :class:`Group` from an mpi4py communicator. A group knows
each rank's global rank, the node it sits on (real, or emulated with
``ranks_per_node``), its rank within that node, its GPU (node-local rank
modulo the device count) and whether ranks share that GPU, which needs CUDA
MPS (see ``cupyep.launcher.mps``).
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import ERROR_SLOT_DTYPE, CommTimeoutError, error_from_slot

DEFAULT_TIMEOUT_S = 100.0
# Host waits poll without sleeping for this long, then sleep between polls.
SPIN_S = 0.02
# Most clients one MPS server accepts per device (Volta and later).
MAX_MPS_CLIENTS_PER_GPU = 48


def gpu_count() -> int:
    """Number of visible CUDA devices; 0 when there is no GPU or driver."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


class ErrorSlotHost:
    """Mapped pinned host memory holding one ErrorSlot that kernels write.

    ``device_ptr`` goes into every kernel's Guard; :meth:`check` raises the
    recorded CommTimeoutError, if any.
    """

    def __init__(self):
        import cupy
        self._rt = cupy.cuda.runtime
        n = ERROR_SLOT_DTYPE.itemsize
        self.host_ptr = self._rt.hostAlloc(n, 2)  # cudaHostAllocMapped
        self.device_ptr = self.host_ptr  # unified addressing: the host pointer is valid on the device
        self.view = np.frombuffer((ctypes.c_byte * n).from_address(self.host_ptr), dtype=ERROR_SLOT_DTYPE)
        self.view[...] = 0

    def raised(self) -> bool:
        return int(self.view["flag"][0]) != 0

    def check(self, timeout_s: float, rank_of_peer=lambda p: p) -> None:
        if self.raised():
            raise error_from_slot(self.view[0].copy(), timeout_s, rank_of_peer)

    def reset(self) -> None:
        self.view[...] = 0

    def free(self) -> None:
        if self.host_ptr:
            self.view = None
            self._rt.freeHost(self.host_ptr)
            self.host_ptr = 0


@dataclass
class Group:
    """The ranks taking part in expert parallelism.

    Attributes:
        comm: the mpi4py communicator all ranks share.
        rank, world_size: position in ``comm``.
        node, num_nodes: node index of this rank and node count (emulated
            nodes when ``ranks_per_node`` was given).
        local_rank, local_size: position within the node; ``node_comm`` spans it.
        device_id: CUDA device of this rank, or None without a GPU.
        num_devices: visible CUDA devices on this host.
        ranks_per_gpu: most ranks of this host sharing one device.
        shares_gpu: True when another rank uses this rank's device.
        timeout_s: budget of every bounded wait, in seconds.
        num_sms: the SMs this rank's CUDA context sees (0 without a GPU):
            the whole GPU, or under an MPS client cap
            (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, set by the user) the SMs
            the cap leaves it.
        sm_capped: True when that cap is set for this rank.
        gpu_slot: this rank's index among the ranks sharing its GPU
            (0 .. ranks_per_gpu - 1): which SM partition is its own
            (cupyep.sm_partition).
    """
    comm: object
    rank: int
    world_size: int
    node: int
    num_nodes: int
    local_rank: int
    local_size: int
    node_comm: object
    device_id: int | None
    num_devices: int
    ranks_per_gpu: int
    shares_gpu: bool
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_sms: int = 0
    sm_capped: bool = False
    gpu_slot: int = 0
    _error_slot: ErrorSlotHost | None = field(default=None, repr=False)
    _xcomm: object = field(default=None, repr=False)  # a duplicate of comm for exchange()
    _xseq: int = field(default=0, repr=False)
    _guards: dict = field(default_factory=dict, repr=False)  # (kernel, timeout_s) -> packed Guard

    @property
    def has_gpu(self) -> bool:
        return self.device_id is not None

    @property
    def sm_share(self) -> int:
        """SMs this rank's kernels may use at once: its capped SMs, else the
        GPU's SMs over the ranks that share it (at least 1)."""
        return max(1, self.num_sms if self.sm_capped else self.num_sms // max(1, self.ranks_per_gpu))

    @property
    def co_resident_ranks(self) -> int:
        """Ranks whose blocks compete for the ``num_sms`` SMs a residency
        check counts: 1 under an SM cap (each rank has SMs of its own), else
        the ranks sharing the GPU."""
        return 1 if self.sm_capped else max(1, self.ranks_per_gpu)

    @property
    def node_ranks(self) -> list[int]:
        """Global ranks of this rank's node, indexed by local rank."""
        first = self.node * self.local_size
        return list(range(first, first + self.local_size))

    def require_gpu(self, what: str) -> None:
        if not self.has_gpu:
            raise RuntimeError(f"{what} needs a CUDA GPU, and rank {self.rank} sees none")

    @property
    def error_slot(self) -> ErrorSlotHost:
        self.require_gpu("the device error slot")
        if self._error_slot is None:
            self._error_slot = ErrorSlotHost()
        return self._error_slot

    def guard(self, kernel: str, timeout_s: float | None = None) -> np.void:
        """A kernel's ``Guard`` struct (errors.GUARD_DTYPE; see
        cuda_src/common/timeout.cuh), packed once per kernel and timeout."""
        t = self.timeout_s if timeout_s is None else timeout_s
        key = (kernel, t)
        packed = self._guards.get(key)
        if packed is None:
            from .errors import GUARD_DTYPE, kernel_id
            from .jit import pack
            packed = self._guards[key] = pack(GUARD_DTYPE, slot=self.error_slot.device_ptr, timeout_ns=int(t * 1e9),
                                              kernel=kernel_id(kernel), rank=self.rank)
        return packed

    def check_errors(self) -> None:
        """Raise the CommTimeoutError a kernel of this rank recorded, if any.
        Kernels report node-local peer indices; the error names global ranks."""
        if self._error_slot is not None:
            base = self.node * self.local_size
            self._error_slot.check(self.timeout_s, lambda p: base + p)

    def _host_deadline(self, start: float) -> float:
        """When a host wait that began at ``start`` gives up: past the kernels'
        own timeout, with grace for them to report first."""
        return start + self.timeout_s * 1.5 + 5.0

    def wait(self, event, kernel: str, phase: str = "host wait for kernel completion") -> None:
        """Bounded host wait for a CUDA event (or stream) to complete.

        Raises the device-recorded CommTimeoutError if a kernel timed out, or
        a host-side one after ``timeout_s`` plus a grace period.
        """
        start = time.monotonic()
        deadline = self._host_deadline(start)
        while not event.done:
            if self._error_slot is not None and self._error_slot.raised():
                break
            now = time.monotonic()
            if now > deadline:
                self.check_errors()
                raise CommTimeoutError(kernel, phase, self.rank, None, timeout_s=self.timeout_s,
                                       detail="the GPU work did not finish")
            if now - start > SPIN_S:  # short waits spin (latency), long ones sleep (CPU)
                time.sleep(1e-4)
        event.synchronize()
        self.check_errors()

    def wait_word(self, word, stream, kernel: str, phase: str) -> int:
        """Bounded host wait for a word of mapped host memory that a kernel on
        ``stream`` publishes (``word``: a NumPy int32 view of one element,
        -1 until then; the kernel fences its other host writes before it).
        Asks the GPU nothing while it spins: only the error slot, also mapped,
        every 256th time. Past the deadline (or after a device error) it waits
        on the stream instead, which raises the error or CommTimeoutError.
        Returns the word."""
        start = time.monotonic()
        deadline = self._host_deadline(start)
        spins = 0
        while int(word[0]) == -1:
            spins += 1
            if spins & 255:
                continue
            now = time.monotonic()
            failed = self._error_slot is not None and self._error_slot.raised()
            if failed or now > deadline:
                self.wait(stream, kernel, phase)
                if int(word[0]) == -1:  # the stream ended without the word and without a device error
                    raise CommTimeoutError(kernel, phase, self.rank, None, timeout_s=self.timeout_s,
                                           detail="the kernel ended without publishing its word")
                break
            if now - start > SPIN_S:  # short waits spin (latency), long ones sleep (CPU)
                time.sleep(1e-5)
        self.check_errors()  # what a kernel before it on the stream reported (a bad expert id, say)
        return int(word[0])

    def exchange(self, array, phase: str, timeout_s: float | None = None):
        """Every rank's ``array`` (a NumPy array of the same shape and dtype on
        every rank), stacked in rank order, within a bounded wait: the host
        counterpart of the kernels' bounded waits (an MPI collective would wait
        forever for a rank that never comes). Raises CommTimeoutError naming
        ``phase`` and the first rank whose part did not arrive.

        Point to point on a duplicate of ``comm`` (this rank's part is sent to
        every other rank); the outstanding requests of a timed-out exchange are
        cancelled."""
        import numpy as np
        if self._xcomm is None:
            self._xcomm = self.comm.Dup()
        self._xseq += 1
        tag = self._xseq % 30000
        mine = np.ascontiguousarray(array)
        out = np.empty((self.world_size, *mine.shape), dtype=mine.dtype)
        out[self.rank] = mine
        peers = [r for r in range(self.world_size) if r != self.rank]
        recvs = {r: self._xcomm.Irecv(out[r], source=r, tag=tag) for r in peers}
        sends = [self._xcomm.Isend(mine, dest=r, tag=tag) for r in peers]
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        while True:
            pending = [r for r, req in recvs.items() if not req.Test()]
            if not pending and all(req.Test() for req in sends):
                return out
            if time.monotonic() - start > t:
                for req in [*recvs.values(), *sends]:
                    try:
                        req.Cancel()
                    except Exception:  # a request that completed meanwhile, or cannot be cancelled
                        pass
                raise CommTimeoutError("host", phase, self.rank, pending[0] if pending else None, timeout_s=t,
                                       detail=f"no part from rank(s) {pending}" if pending else
                                       "the other ranks did not take this rank's part")
            if time.monotonic() - start > SPIN_S:
                time.sleep(1e-4)

    def agree(self, call: str, **fields) -> None:
        """ValueError on every rank unless every rank passes the same ``fields``
        (ints or bools: what a collective call's ranks must agree on, such as
        the row width or the top-k), naming the call, the first field that
        differs and each rank's value. A bounded exchange (:meth:`exchange`),
        so a rank that never makes the call is a CommTimeoutError."""
        import numpy as np
        names = list(fields)
        got = self.exchange(np.array([int(fields[n]) for n in names], dtype=np.int64), f"{call}: its arguments")
        for i, name in enumerate(names):
            column = got[:, i]
            if (column != column[0]).any():
                values = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
                raise ValueError(f"{call}: the ranks disagree on {name} ({values}); a collective call takes the "
                                 f"same {name} on every rank")

    def destroy(self) -> None:
        if self._xcomm is not None:
            self._xcomm.Free()
            self._xcomm = None
        if self._error_slot is not None:
            self._error_slot.free()
            self._error_slot = None
        self._guards.clear()  # they point at the error slot

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


#: The communicator methods the runtime calls: an mpi4py Intracomm has them; any other object
#: that has them (e.g. cupyep.deep_ep's stand-in over a torch.distributed group) serves too.
COMM_METHODS = ("Get_rank", "Get_size", "allgather", "allreduce", "bcast", "gather", "Barrier", "Split",
                "Split_type", "Dup", "Free", "Isend", "Irecv")


def _as_intracomm(comm):
    from mpi4py import MPI
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL: this process is not part of the communicator")
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py.MPI.Intracomm (e.g. MPI.COMM_WORLD), got {type(comm).__name__}")
        return comm
    missing = [m for m in COMM_METHODS if not callable(getattr(comm, m, None))]
    if missing:
        raise TypeError(f"comm must be an mpi4py.MPI.Intracomm (e.g. MPI.COMM_WORLD) or an object with its methods "
                        f"{', '.join(COMM_METHODS)}; got {type(comm).__name__}, which lacks {', '.join(missing)}")
    return comm


def _env_ranks_per_node() -> int | None:
    v = os.environ.get("CUPYEP_RANKS_PER_NODE")
    return int(v) if v else None


def init(comm=None, ranks_per_node: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         require_mps: bool = True) -> Group:
    """Set up this rank. Collective over ``comm``.

    Arguments:
        comm: an ``mpi4py.MPI.Intracomm`` (default ``MPI.COMM_WORLD``), or an
            object with its methods in :data:`COMM_METHODS` (requests whose
            ``Test()`` polls and ``Cancel()`` aborts).
        ranks_per_node: emulate nodes of this many consecutive ranks on one
            host (must divide the world size and keep each emulated node on one
            host). Default: the launcher's ``--ranks-per-node``
            (``CUPYEP_RANKS_PER_NODE``), else the real hosts.
        timeout_s: budget of every bounded wait (device spin-waits and host waits).
        require_mps: refuse ranks sharing a GPU when CUDA MPS is not running.

    Returns:
        Group.
    """
    from mpi4py import MPI
    comm = _as_intracomm(comm)
    if not (timeout_s > 0):
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    rank, size = comm.Get_rank(), comm.Get_size()

    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    host_rank = host.Get_rank()
    host_leader = host.allreduce(rank, op=MPI.MIN)
    host_of_rank = comm.allgather(host_leader)

    if ranks_per_node is None:
        ranks_per_node = _env_ranks_per_node()
    if ranks_per_node is None:
        leaders = sorted(set(host_of_rank))
        node = leaders.index(host_leader)
        node_comm = comm.Split(color=node, key=rank)
    else:
        if ranks_per_node <= 0 or size % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be positive and divide the world size {size}")
        node = rank // ranks_per_node
        members = host_of_rank[node * ranks_per_node:(node + 1) * ranks_per_node]
        if len(set(members)) != 1:
            raise ValueError(f"ranks_per_node={ranks_per_node}: emulated node {node} would span several hosts")
        node_comm = comm.Split(color=node, key=rank)
        leaders = list(range(size // ranks_per_node))
    num_nodes = len(leaders)
    node_ranks = node_comm.allgather(rank)
    if node_ranks != list(range(node_ranks[0], node_ranks[0] + len(node_ranks))) or \
            node_comm.Get_size() * num_nodes != size:
        raise ValueError("cupyep needs the same number of consecutive ranks on every node; "
                         f"node {node} holds ranks {node_ranks}")

    ndev = gpu_count()
    device_id = host_rank % ndev if ndev else None
    devices_on_host = host.allgather(device_id)
    ranks_per_gpu = max(devices_on_host.count(d) for d in set(devices_on_host)) if ndev else 0
    shares_gpu = ndev > 0 and devices_on_host.count(device_id) > 1
    host.Free()

    from .launcher.mps import SM_CAP_VAR
    num_sms, sm_capped = 0, bool(os.environ.get(SM_CAP_VAR))
    if ndev:
        import cupy
        if ranks_per_gpu > MAX_MPS_CLIENTS_PER_GPU:
            raise ValueError(f"{ranks_per_gpu} ranks share one GPU, more than the {MAX_MPS_CLIENTS_PER_GPU} "
                             "processes CUDA MPS can co-schedule on it; use fewer ranks or more GPUs")
        num_sms = int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])  # the capped count under a cap
        if (num_sms if sm_capped else num_sms // ranks_per_gpu) < 2:
            raise ValueError(f"{ranks_per_gpu} ranks share one GPU of {num_sms} SMs"
                             f"{' (capped by ' + SM_CAP_VAR + ')' if sm_capped else ''}: each rank needs at least "
                             "2 SMs for its communication kernels to be resident together")
        if shares_gpu and require_mps:
            from .launcher.mps import mps_is_running
            if not mps_is_running():
                raise RuntimeError(
                    f"rank {rank}: {devices_on_host.count(device_id)} ranks share GPU {device_id} but CUDA MPS "
                    "is not running. cupyep's ranks spin-wait on each other; without MPS the kernels of different "
                    "processes are time-sliced, a round trip takes milliseconds instead of microseconds and "
                    "protocols look hung. Launch with `python -m cupyep.launcher`, which starts MPS, or start "
                    "`nvidia-cuda-mps-control -d` yourself.")
        cupy.cuda.Device(device_id).use()

    return Group(comm=comm, rank=rank, world_size=size, node=node, num_nodes=num_nodes,
                 local_rank=node_comm.Get_rank(), local_size=node_comm.Get_size(), node_comm=node_comm,
                 device_id=device_id, num_devices=ndev, ranks_per_gpu=ranks_per_gpu, shares_gpu=shares_gpu,
                 timeout_s=float(timeout_s), num_sms=num_sms, sm_capped=sm_capped and bool(ndev),
                 gpu_slot=devices_on_host[:host_rank].count(device_id) if ndev else 0)
