"""FP8 e4m3 quantisation on the GPU, matching ``cupyep.reference.fp8``.

``per_token_cast_to_fp8(x)`` takes ``[T, H]`` BF16 bits (uint16, H a
multiple of 128) and returns ``(x_fp8 [T, H] uint8, scales [T, H / 128]
float32)``: one scale per token and 128 channels, ``amax / 448`` (amax
clamped at 1e-4), optionally rounded up to a power of two (UE8M0).
"""
from __future__ import annotations

import numpy as np

from . import jit
from .arrays import BF16, as_cupy, check

CAST_SPEC = jit.KernelSpec(name="fp8_cast", source="cast/fp8.cu", kernels=("cupyep::per_token_cast_to_fp8",))


def kernel_specs() -> list[jit.KernelSpec]:
    return [CAST_SPEC]


def per_token_cast_to_fp8(x, round_scale: bool = False):
    """Quantise BF16 rows to FP8 e4m3 with per-128-channel float32 scales.

    Arguments:
        x: [T, H] uint16 (BF16 bits), H a multiple of 128.
        round_scale: round scales up to powers of two (UE8M0).

    Returns:
        (x_fp8 [T, H] uint8, scales [T, H / 128] float32).
    """
    import cupy
    x = check(as_cupy(x, "x"), "x", BF16, ndim=2)
    T, H = x.shape
    if H <= 0 or H % 128:
        raise ValueError(f"hidden size must be a positive multiple of 128, got {H}")
    out = cupy.empty((T, H), dtype=np.uint8)
    scales = cupy.empty((T, H // 128), dtype=np.float32)
    warps = T * (H // 128)
    if warps:
        threads = 256
        jit.kernel(CAST_SPEC)(
            ((warps * 32 + threads - 1) // threads,), (threads,),
            (x, out, scales, np.int64(T), np.int32(H), np.int32(bool(round_scale))))
    return out, scales
