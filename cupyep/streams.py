"""The communication stream of a normal-mode buffer, and how its calls are
ordered with the caller's stream (within a node and across nodes).

A call begins with :meth:`CommStream.begin`: the communication stream waits
for ``previous_event`` (an EventHandle or a cupy Event), or else for the
caller's current stream's work so far. It ends with :meth:`CommStream.end`:
an EventHandle recorded on the communication stream, which the current
stream waits for unless ``async_finish``. With ``async_finish`` the arrays
the call's kernels read (its inputs, and temporaries it made) are held until
that event completes, so that no stream reuses their memory while the
kernels still run; under graph capture the graph's owner keeps them alive.
"""
from __future__ import annotations

from .results import EventHandle


class CommStream:
    """``stream``: a non-blocking cupy Stream; ``group``: whose device errors
    a call raises first."""

    def __init__(self, group, stream=None):
        import cupy
        self.group = group
        self.stream = cupy.cuda.Stream(non_blocking=True) if stream is None else stream
        self._held: list = []  # (event, arrays) of async calls
        self._mark = None  # the event begin records on the caller's stream, made once (a wait takes its state then)

    def begin(self, previous_event) -> None:
        """Raise a device error an earlier call left; order this call after
        ``previous_event`` (default: the current stream's work so far)."""
        import cupy
        self.group.check_errors()
        if previous_event is not None:
            ev = previous_event.event if isinstance(previous_event, EventHandle) else previous_event
        else:
            if self._mark is None:
                self._mark = cupy.cuda.Event(disable_timing=True)
            ev = self._mark
            ev.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ev)

    def end(self, async_finish: bool, keep: tuple = ()) -> EventHandle:
        """The event of the call just enqueued on the stream (module docstring)."""
        import cupy
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(self.stream)
        if not async_finish:
            cupy.cuda.get_current_stream().wait_event(ev)
        elif not self.stream.is_capturing():
            self._held = [(e, a) for e, a in self._held if not e.done]
            self._held.append((ev, tuple(a for a in keep if a is not None)))
        return EventHandle(ev)

    def release(self) -> None:
        """Drop the held arrays (the buffer is being destroyed: every call is done)."""
        self._held = []
