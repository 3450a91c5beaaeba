"""DeepEP's events on torch streams: :class:`EventHandle` (a CUDA event) and
:class:`EventOverlap` (what every call returns).

An event recorded by a cupyep call lives on cupyep's communication stream;
``current_stream_wait()`` makes torch's current stream wait for it, on the
device (no host wait).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from .tensors import current_stream_ptr, cupy_stream


class EventHandle:
    """A CUDA event. ``EventHandle()`` records one on torch's current stream
    (DeepEP's constructor); ``EventHandle(event=...)`` wraps a CuPy event (or a
    cupyep.EventHandle) that a cupyep call recorded."""

    __slots__ = ("event",)

    def __init__(self, *, event=None):
        import cupy
        if event is None:
            event = cupy.cuda.Event(disable_timing=True)
            event.record(cupy_stream(current_stream_ptr()))
        self.event = getattr(event, "event", event)  # a cupyep EventHandle holds its CuPy event

    def current_stream_wait(self) -> None:
        """torch's current stream waits for the event (on the device)."""
        import cupy
        cupy.cuda.runtime.streamWaitEvent(current_stream_ptr(), self.event.ptr, 0)

    def synchronize(self) -> None:
        self.event.synchronize()


class EventOverlap:
    """DeepEP's event wrapper.

    Attributes:
        event: the EventHandle of a call that ran with ``async_finish=True``
            (None otherwise: torch's current stream already waits for it).
        extra_tensors: tensors to keep alive until the event (DeepEP's
            replacement for ``record_stream``, which also works in CUDA graphs).

    Use ``current_stream_wait()``, or ``with event_overlap: ...`` to overlap
    the block's work on the current stream with the call and wait at its end.
    """

    __slots__ = ("event", "extra_tensors")

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise ValueError("this EventOverlap holds no event (the call ran with async_finish=False, so torch's "
                             "current stream already waits for it)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def event_of(previous_event):
    """The CuPy event of ``previous_event`` (an EventOverlap, an EventHandle,
    a cupyep.EventHandle or a CuPy event), or None."""
    if previous_event is None:
        return None
    ev = getattr(previous_event, "event", previous_event)  # EventOverlap -> EventHandle
    ev = getattr(ev, "event", ev)  # EventHandle -> CuPy event
    if ev is None:
        raise ValueError("previous_event holds no event (it came from a call with async_finish=False); pass "
                         "Buffer.capture() instead")
    return ev


def overlap(native_event, async_finish: bool, extra=None) -> EventOverlap:
    """The EventOverlap a call returns: its event with ``async_finish``, else
    none (as DeepEP)."""
    if not async_finish or native_event is None:
        return EventOverlap(None)
    return EventOverlap(EventHandle(event=native_event), extra)
