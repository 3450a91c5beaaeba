"""Exceptions and the device error slot.

Kernels report a timed-out wait into an ``ErrorSlot`` (see
``cuda_src/common/timeout.cuh``) held in mapped, pinned host memory; the host
turns it into :class:`CommTimeoutError`, which names the kernel, the phase,
the rank that waited and the peer it waited for.
"""
from __future__ import annotations

import numpy as np

# Must match `struct ErrorSlot` in cuda_src/common/timeout.cuh.
ERROR_SLOT_DTYPE = np.dtype([
    ("flag", np.int32), ("kernel", np.int32), ("rank", np.int32), ("peer", np.int32),
    ("phase", np.int32), ("block", np.int32), ("value", np.int64), ("expected", np.int64),
], align=True)

# Must match `struct Guard` in cuda_src/common/timeout.cuh: where a kernel reports (the error slot's
# device address), its wait budget, and which kernel and rank it is.
GUARD_DTYPE = np.dtype([("slot", np.uint64), ("timeout_ns", np.uint64), ("kernel", np.int32), ("rank", np.int32)],
                       align=True)

_REGION_CAPACITY = ("region capacity (an expert got more of this rank's rows than its (expert, source) region "
                    "holds; counter: rows, expected: the buffer's capacity; the rows past it were not sent)")

# Kernel ids passed to kernels in their Guard, and the wait sites (phases) of
# each kernel, indexed by the phase number the kernel reports.
KERNELS: dict[str, tuple[str, ...]] = {
    "barrier": ("barrier arrival",),
    "notify": ("notify barrier", "notify counts",
                         "receive capacity (more rows than num_worst_tokens)"),
    "queue_dispatch": ("dispatch queue space (sender waits for receiver head)",
                           "dispatch queue data (receiver waits for sender tail)"),
    "queue_combine": ("combine queue space (sender waits for receiver head)",
                          "combine queue data (receiver waits for sender tail)"),
    "low_latency_dispatch": ("dispatch flag (receiver waits for a source's rows and counts; "
                             "counter: blocks arrived, expected: blocks announced)",
                             "routing check (expert id outside [-1, E))",
                             _REGION_CAPACITY),
    "low_latency_combine": ("combine flag (token owner waits for an expert rank's rows; "
                            "counter: blocks arrived, 32768 more when that rank's dispatch of this "
                            "handle had timed out; expected: blocks announced)",),
    "expert_major": ("expert-major rows exceed their capacity",),
    "direct_dispatch": ("direct dispatch: receive pool free (sender waits for the receiver's ready)",
                                  "direct dispatch: rows arrived (receiver waits for a source's rows)",
                                  "direct dispatch: receive pool capacity",
                                  "fused direct dispatch: a block waits for the notify block",
                                  "fused direct dispatch: a block waits for the expert-major positions"),
    "direct_combine": ("direct combine: partial rows free (expert rank waits for the owner's ready)",
                                 "direct combine: partials arrived (owner waits for an expert rank's rows)",
                                 "direct combine: partial pool capacity",
                                 "direct combine: in-place reads done (expert rank waits for the owners to finish "
                                 "reading its x)"),
    "layout": ("routing check (expert id outside [-1, E))",),
    "shmem_put_signal": ("put with signal: a peer's rows arrived (this PE waits for the peer's signal)",),
    "two_hop_dispatch": ("two-hop dispatch: a source node's rows over the network (the rail waits for "
                                   "its signal)",
                                   "two-hop dispatch: rows arrived (receiver waits for a source's rows)"),
    "two_hop_combine": ("two-hop combine: the node's rows at the rail peer (waits for a rank of its "
                                  "node)",
                                  "two-hop combine: the own node's rows at the source",
                                  "two-hop combine: a node's partials over the network (waits for its rail's "
                                  "signal)"),
    "two_hop_notify": ("two-hop notify: count exchange (waits for a PE's row of counts)",
                                 "two-hop notify: receive capacity (a rank, this one or the peer named, would receive more "
                                 "rows than its num_worst_tokens; nothing was sent)",
                                 "two-hop notify: routing check (expert id outside [-1, E))"),
    "shmem_world_barrier": ("world barrier arrival (waits for a PE's signal)",),
    # Low-latency mode across nodes (the CUPYEP_LL_NVSHMEM build): phases 0 and 1 as within a node.
    "low_latency_dispatch_internode": ("dispatch flag (receiver waits for a source of its node; counter: blocks "
                                       "arrived, expected: blocks announced)",
                                       "routing check (expert id outside [-1, E))",
                                       "dispatch counts over the network (receiver waits for a source of another "
                                       "node to signal its counts)",
                                       "dispatch rows over the network (receiver waits for a source of another "
                                       "node; counter: messages arrived, expected: messages announced)",
                                       _REGION_CAPACITY),
    "low_latency_combine_internode": ("combine flag (token owner waits for an expert rank of its node; counter: "
                                      "blocks arrived, 32768 more when that rank's dispatch of this handle had "
                                      "timed out; expected: blocks announced)",
                                      "combine rows over the network (token owner waits for an expert rank of "
                                      "another node; counter: rows arrived, expected: rows it routed there)"),
}
KERNEL_NAMES: tuple[str, ...] = tuple(KERNELS)
# Kernels whose reported peer is a global rank (an NVSHMEM PE), not a node-local index.
GLOBAL_PEER_KERNELS = frozenset({"shmem_put_signal", "two_hop_dispatch", "two_hop_combine",
                                 "two_hop_notify", "shmem_world_barrier", "low_latency_dispatch_internode",
                                 "low_latency_combine_internode"})


def kernel_id(name: str) -> int:
    """Index of kernel ``name`` in :data:`KERNEL_NAMES`."""
    return KERNEL_NAMES.index(name)


class CupyepError(RuntimeError):
    """Base class of cupyep's communication failures."""


class DeviceError(CupyepError):
    """A failure a kernel recorded in the error slot.

    Attributes: ``kernel``, ``phase``, ``rank``, ``peer`` (None when unknown),
    ``value`` and ``expected`` (the counter or value involved), ``timeout_s``.
    """

    what = "error"

    def __init__(self, kernel: str, phase: str, rank: int, peer: int | None,
                 value: int | None = None, expected: int | None = None,
                 timeout_s: float | None = None, detail: str = ""):
        self.kernel, self.phase, self.rank, self.peer = kernel, phase, rank, peer
        self.value, self.expected, self.timeout_s = value, expected, timeout_s
        link = " waited for peer rank" if self.what == "timeout" else ", because of peer rank"
        who = f"rank {rank}" + (f"{link} {peer}" if peer is not None and peer >= 0 else "")
        msg = f"{kernel}: {self.what} in phase '{phase}': {who}"
        if timeout_s is not None and self.what == "timeout":
            msg += f" for more than {timeout_s:g} s"
        if value is not None:
            msg += f" (counter {value}, expected {expected})"
        if detail:
            msg += f"; {detail}"
        super().__init__(msg + ". The communication state is now undefined: destroy the buffer.")


class CommTimeoutError(DeviceError):
    """A bounded wait on the GPU or the host ran out of time."""

    what = "timeout"


class DeviceCapacityError(DeviceError):
    """A kernel found more rows than a buffer holds (value: rows, expected: capacity).
    Nothing was written out of bounds; no row was silently dropped."""

    what = "capacity exceeded"


class DeviceInputError(DeviceError):
    """A kernel found invalid input, e.g. an expert id outside [-1, E)
    (value: the id, expected: E), when host validation was skipped."""

    what = "invalid input"


# ErrorSlot.flag -> exception class (cuda_src/common/timeout.cuh kError*).
ERROR_KINDS = {1: CommTimeoutError, 3: DeviceCapacityError, 4: DeviceInputError}


def error_from_slot(slot: np.void, timeout_s: float, rank_of_peer=lambda p: p) -> DeviceError:
    """Build the exception for a raised device error slot (``slot['flag'] != 0``).

    ``rank_of_peer`` maps the peer index a kernel reports (a node-local index)
    to a global rank; the kernels across nodes (GLOBAL_PEER_KERNELS) report
    global ranks (NVSHMEM PEs) already.
    """
    k = int(slot["kernel"])
    kernel = KERNEL_NAMES[k] if 0 <= k < len(KERNEL_NAMES) else f"kernel#{k}"
    if kernel in GLOBAL_PEER_KERNELS:
        rank_of_peer = lambda p: p  # noqa: E731
    phases = KERNELS.get(kernel, ())
    p = int(slot["phase"])
    phase = phases[p] if 0 <= p < len(phases) else f"phase#{p}"
    peer = int(slot["peer"])
    cls = ERROR_KINDS.get(int(slot["flag"]), DeviceError)
    return cls(kernel, phase, int(slot["rank"]), rank_of_peer(peer) if peer >= 0 else None,
                            int(slot["value"]), int(slot["expected"]), timeout_s,
                            detail=f"block {int(slot['block'])}")


class StaleResultError(CupyepError):
    """A dispatch result read after the pool slot it lives in was reused by a
    later dispatch (``num_in_flight`` dispatches later). Names the call that
    made the result and the one that reused its slot."""
