"""Array interop and input checks.

Public functions take CuPy arrays and also anything that speaks DLPack or
``__cuda_array_interface__`` (torch tensors included), without copying.
CuPy has no bfloat16 or float8, so cupyep carries BF16 as ``uint16`` and FP8
e4m3 as ``uint8``; torch ``bfloat16`` / ``float8_e4m3fn`` tensors are viewed
as those automatically.
"""
from __future__ import annotations

import numpy as np

BF16 = np.dtype(np.uint16)   # bfloat16 bit pattern
FP8 = np.dtype(np.uint8)     # float8 e4m3fn bit pattern

_TORCH_VIEWS = {"torch.bfloat16": ("int16", np.uint16), "torch.float8_e4m3fn": ("uint8", np.uint8)}


def as_cupy(a, name: str):
    """Zero-copy view of ``a`` as a cupy array (None passes through)."""
    import cupy
    if a is None or isinstance(a, cupy.ndarray):
        return a
    view = _TORCH_VIEWS.get(str(getattr(a, "dtype", "")))
    if view is not None:  # torch: reinterpret the bits, then share memory
        import torch
        return cupy.from_dlpack(a.view(getattr(torch, view[0]))).view(view[1])
    if hasattr(a, "__cuda_array_interface__"):
        return cupy.asarray(a)
    if hasattr(a, "__dlpack__"):
        return cupy.from_dlpack(a)
    raise TypeError(f"{name} must be a CuPy array or a GPU array speaking DLPack or __cuda_array_interface__, "
                    f"got {type(a).__name__}")


def check(a, name: str, dtype=None, shape: tuple | None = None, ndim: int | None = None, contiguous: bool = True):
    """Raise ValueError unless ``a`` has the dtype, shape (None entries match
    anything) and number of dimensions asked for. Returns ``a``."""
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if shape is not None:
        if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(a.shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a
