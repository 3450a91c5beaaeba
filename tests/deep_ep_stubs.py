"""Host-only stand-ins for cupyep.deep_ep's CPU tests: NumPy arrays take the
place of torch tensors and CuPy arrays, so the conversions become identities
and torch's stream a null context."""
import contextlib

from cupyep.deep_ep import buffer as buffer_module
from cupyep.deep_ep import handles as handles_module


def stub_tensors(monkeypatch) -> None:
    """Make cupyep.deep_ep's tensor conversions and torch stream no-ops (for this test)."""
    monkeypatch.setattr(buffer_module, "to_cupy", lambda t, name: t)
    monkeypatch.setattr(buffer_module, "to_torch", lambda a, view=None: a)
    monkeypatch.setattr(handles_module, "to_torch", lambda a, view=None: a)
    monkeypatch.setattr(buffer_module, "torch_stream", contextlib.nullcontext)
