"""Group.wait_word on the CPU: the bounded host wait for a word of mapped
memory that a kernel publishes (the notify pass's received rows, the fused
direct dispatch's status) returns the word once it leaves -1, raises the
device error a kernel reported, and past its deadline waits on the stream,
which names the phase."""
import threading
import time

import numpy as np
import pytest

from cupyep.errors import CommTimeoutError
from cupyep.runtime import Group


class _Slot:
    def __init__(self, raised=False):
        self._raised = raised

    def raised(self):
        return self._raised


def _group(timeout_s=0.2, slot=None, checks=None):
    g = object.__new__(Group)
    g.timeout_s, g.rank, g._error_slot = timeout_s, 0, slot
    g.check_errors = (lambda: checks.append("checked")) if checks is not None else (lambda: None)
    return g


def test_the_word_a_kernel_publishes_is_returned_after_the_error_check():
    word = np.full(1, -1, np.int32)
    checks = []
    threading.Timer(0.05, lambda: word.__setitem__(0, 7)).start()
    assert _group(checks=checks).wait_word(word, None, "notify", "receive counts") == 7
    assert checks == ["checked"]  # what a kernel before it reported is raised here


def test_a_reported_device_error_waits_on_the_stream_which_raises_it(monkeypatch):
    waited = []

    def wait(ev, kernel, phase):
        waited.append((kernel, phase))
        raise CommTimeoutError(kernel, phase, 0, 1, timeout_s=1.0)
    g = _group(slot=_Slot(raised=True))
    g.wait = wait
    monkeypatch.setattr("cupy.cuda.Event", lambda **kw: type("E", (), {"record": lambda self, s: None})())
    with pytest.raises(CommTimeoutError, match="notify"):
        g.wait_word(np.full(1, -1, np.int32), None, "notify", "host wait for receive counts")
    assert waited == [("notify", "host wait for receive counts")]


def test_past_the_deadline_a_word_never_published_is_a_timeout_naming_the_phase(monkeypatch):
    g = _group(timeout_s=0.0)  # deadline: 5 s of grace
    g.wait = lambda ev, kernel, phase: None  # the stream ended without a device error
    monkeypatch.setattr("cupy.cuda.Event", lambda **kw: type("E", (), {"record": lambda self, s: None})())
    monkeypatch.setattr(time, "monotonic", iter([0.0] + [10.0] * 100).__next__)
    with pytest.raises(CommTimeoutError, match="direct_dispatch.*fused notify") as info:
        g.wait_word(np.full(1, -1, np.int32), None, "direct_dispatch", "the fused notify's counts")
    assert "without publishing" in str(info.value)
