"""torch tensors in and out of cupyep without copies, and torch's current
stream as CuPy's.

In: :func:`to_cupy` views a CUDA tensor's memory as a CuPy array
(``cupyep.arrays.torch_view``: BF16 as ``uint16`` bits, FP8 e4m3 as
``uint8`` bits, the others as their NumPy dtype), holding the tensor alive;
nothing is copied and no stream is synchronised (the call orders itself
after torch's current stream instead).
Out: :func:`to_torch` hands a CuPy array to torch through DLPack, again
without a copy or a stream synchronisation, and reinterprets the bits as
``torch.bfloat16`` / ``torch.float8_e4m3fn`` where asked; the tensor
remembers its array, so that handing it back (a layout to dispatch, received
weights to combine) converts nothing.

:func:`torch_stream` makes torch's current stream CuPy's current stream for
the length of a call, so that cupyep's "current stream" (what a call waits
for, what waits for it, where low-latency kernels run) is torch's.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..arrays import as_cupy

_capsule = None  # how a CuPy array becomes a DLPack capsule without a stream synchronisation (chosen once)
_from_dlpack = None  # torch's capsule import (torch._C._from_dlpack, what torch.utils.dlpack.from_dlpack calls)
_uint16_ok = True  # whether torch imports uint16 through DLPack (else BF16 bits cross as int16)
_streams: dict = {}  # torch stream handle -> cupy ExternalStream


# A CuPy view of a CUDA torch tensor (CuPy arrays and None pass through): the
# one conversion cupyep has, which hands back the array of a tensor
# to_torch made.
to_cupy = as_cupy


def _pick_capsule(a):
    """Choose the DLPack export that skips the producer-side stream sync."""
    global _capsule
    try:
        cap = a.__dlpack__(stream=-1)  # the DLPack protocol's "no synchronisation"
        _capsule = lambda arr: arr.__dlpack__(stream=-1)  # noqa: E731
        return cap
    except (TypeError, ValueError, NotImplementedError):
        _capsule = lambda arr: arr.toDlpack()  # noqa: E731
        return a.toDlpack()


def to_torch(a, view=None):
    """A torch tensor sharing ``a``'s memory (None passes through).

    Arguments:
        a: a CuPy array.
        view: None, or "bf16" (``a`` holds BF16 bits as uint16) or "fp8"
            (FP8 e4m3 bits as uint8): the tensor's dtype then.
    """
    global _from_dlpack, _uint16_ok
    if a is None:
        return None
    if _from_dlpack is None:
        import torch
        _from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
    b = a
    if view == "bf16" and not _uint16_ok:  # a torch without uint16 in DLPack: the same bits as int16
        b = a.view(np.int16)
    try:
        t = _from_dlpack(_capsule(b) if _capsule is not None else _pick_capsule(b))
    except (RuntimeError, TypeError, BufferError):
        if b is not a or a.dtype != np.uint16:
            raise
        _uint16_ok = False
        return to_torch(a, view)
    if view is not None:
        import torch
        t = t.view(torch.bfloat16 if view == "bf16" else torch.float8_e4m3fn)
    t._cupyep_array = a  # so that to_cupy of this tensor is free (the array keeps nothing else alive)
    return t


_raw_stream = None  # torch's current raw stream of a device (torch's own fast query where it has one)


def current_stream_ptr() -> int:
    """The handle of torch's current CUDA stream (on torch's current device)."""
    global _raw_stream
    if _raw_stream is None:
        import torch
        raw, dev = getattr(torch._C, "_cuda_getCurrentRawStream", None), getattr(torch._C, "_cuda_getDevice", None)
        if raw is not None and dev is not None:
            _raw_stream = lambda: raw(dev())  # noqa: E731
        else:
            _raw_stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    return _raw_stream()


def cupy_stream(ptr: int):
    """The CuPy stream of a CUDA stream handle (made once per handle)."""
    s = _streams.get(ptr)
    if s is None:
        import cupy
        s = _streams[ptr] = cupy.cuda.ExternalStream(ptr) if ptr else cupy.cuda.Stream.null
    return s


def torch_stream():
    """A context in which CuPy's current stream is torch's current stream
    (nothing to enter when they are already the same)."""
    import cupy
    ptr = current_stream_ptr()
    if cupy.cuda.get_current_stream().ptr == ptr:
        return contextlib.nullcontext()
    return cupy_stream(ptr)
