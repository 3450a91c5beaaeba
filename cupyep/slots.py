"""In-flight slots of a pool that holds dispatch results (the one-copy
direct routes, within and across nodes).

A route whose senders write straight into the receivers' registered memory
cannot hand out fresh arrays: its results are views of a pool. The pool is
split into ``num_in_flight`` slots of equal size, taken round-robin by the
dispatches of one buffer (every rank makes the same calls in the same
order, so every rank picks the same slot). A slot's generation counts the
dispatches that took it. Each result carries the :class:`Lease` of its
slot; reading it after the slot went to a later dispatch raises
:class:`cupyep.errors.StaleResultError`, never a silently wrong array.

A dispatch captured in a CUDA graph writes its slot at every replay, so it
pins the slot: round-robin skips it while the captured result's lease is
alive (keep the captured result as long as the graph is replayed). A call
that finds every slot pinned raises ValueError.
"""
from __future__ import annotations

import weakref

from .errors import StaleResultError

DEFAULT_IN_FLIGHT = 2


def check_num_in_flight(num_in_flight) -> int:
    """``num_in_flight`` as an int >= 1; ValueError otherwise."""
    if isinstance(num_in_flight, bool) or not isinstance(num_in_flight, int) or num_in_flight < 1:
        raise ValueError(f"num_in_flight must be an int >= 1, got {num_in_flight!r}")
    return num_in_flight


class Lease:
    """One dispatch's hold on a slot: ``slot`` (index), ``generation`` (the
    slot's count when the dispatch took it), ``call`` (what made it, for the
    error message) and its :class:`InFlightSlots`."""

    __slots__ = ("owner", "slot", "generation", "call", "__weakref__")

    def __init__(self, owner: "InFlightSlots", slot: int, generation: int, call: str):
        self.owner, self.slot, self.generation, self.call = owner, slot, generation, call

    @property
    def valid(self) -> bool:
        return self.owner.generation(self.slot) == self.generation

    def check(self, what: str = "result") -> None:
        """StaleResultError unless the slot still holds this lease's dispatch."""
        if not self.valid:
            raise StaleResultError(
                f"{what} of {self.call} is stale: its slot {self.slot} of the {self.owner.name} (num_in_flight="
                f"{self.owner.num_in_flight}) now holds {self.owner.holder(self.slot)}. Keep at most "
                f"num_in_flight dispatches' results in use, raise num_in_flight, or dispatch with fresh=True")


class InFlightSlots:
    """Round-robin slots with generations (module docstring).

    Arguments:
        num_in_flight: slots, >= 1.
        name: what the slots hold, for error messages (e.g. "direct dispatch pool").
    """

    def __init__(self, num_in_flight: int = DEFAULT_IN_FLIGHT, name: str = "pool"):
        self.num_in_flight = check_num_in_flight(num_in_flight)
        self.name = name
        self._generation = [0] * self.num_in_flight
        self._holder = [None] * self.num_in_flight
        self._pinned = [False] * self.num_in_flight
        self._calls = 0
        self._next = 0

    def generation(self, slot: int) -> int:
        return self._generation[slot]

    def holder(self, slot: int) -> str:
        return self._holder[slot] or "nothing"

    def peek(self) -> int:
        """The slot the next :meth:`take` returns (ValueError when every slot is pinned)."""
        for i in range(self.num_in_flight):
            slot = (self._next + i) % self.num_in_flight
            if not self._pinned[slot]:
                return slot
        raise ValueError(f"every slot of the {self.name} (num_in_flight={self.num_in_flight}) is pinned by a "
                         f"dispatch captured in a CUDA graph; make the buffer with a larger num_in_flight, or drop "
                         f"the captured results")

    def take(self, call: str, pin: bool = False) -> Lease:
        """The next slot for dispatch ``call``: earlier leases of that slot
        become stale. ``pin``: a dispatch under CUDA-graph capture; the slot
        stays out of the rotation while the returned lease lives."""
        slot = self.peek()
        self._next = slot + 1
        self._calls += 1
        self._generation[slot] += 1
        self._holder[slot] = f"{call} #{self._calls}"
        lease = Lease(self, slot, self._generation[slot], f"{call} #{self._calls}")
        if pin:
            self._pinned[slot] = True
            self._holder[slot] += " (captured in a CUDA graph)"
            weakref.finalize(lease, self._unpin, slot, lease.generation)
        return lease

    def _unpin(self, slot: int, generation: int) -> None:
        if self._generation[slot] == generation:
            self._pinned[slot] = False

    def pinned(self, slot: int) -> bool:
        return self._pinned[slot]

    def invalidate_all(self) -> None:
        """Every lease stale (the pool's memory is gone: destroyed or replaced)."""
        for s in range(self.num_in_flight):
            self._generation[s] += 1
            self._pinned[s] = False
            self._holder[s] = "nothing (the pool was freed)"
