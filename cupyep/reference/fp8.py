"""Per-token, per-128-channel FP8 (e4m3) quantisation, as DeepEP does it.

Each row is cut into blocks of 128 channels. For each block
``amax = max(|x|)`` clamped at 1e-4 and ``scale = amax / 448`` (448 is the
largest finite e4m3fn value); the stored values are ``x * (448 / amax)``
computed in float32 (the formula of DeepEP's test utilities), clamped to
[-448, 448] and rounded to e4m3fn with round-to-nearest-even, so nothing
becomes NaN. With ``round_scale=True`` (UE8M0 scales) the scale is rounded
up to a power of two, ``2 ** ceil(log2(amax / 448))`` (computed exactly from
the float32 value of ``amax / 448``), and the stored values are
``x / scale`` (exact division by a power of two before rounding).

Dequantisation is ``float32(e4m3) * scale``. Power-of-two scales can be
stored as UE8M0 exponent bytes (``127 + log2(scale)``); viewing a
``[T, S]`` uint8 array of them (``S % 4 == 0``) as int32 gives DeepEP's
packed layout of four scales per int32 (little-endian).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


__all__ = [
    "FP8_E4M3_MAX",
    "FP8_BLOCK_SIZE",
    "Fp8Tensor",
    "check_fp8_hidden",
    "per_token_cast_to_fp8",
    "per_token_cast_back",
    "pack_ue8m0",
    "unpack_ue8m0",
    "e4m3_step",
]

FP8_E4M3_MAX = 448.0
FP8_BLOCK_SIZE = 128
_AMAX_MIN = 1e-4


@dataclass(frozen=True)
class Fp8Tensor:
    """Quantised activations.

    Attributes:
        data: [num_tokens, hidden] uint8, e4m3fn bytes.
        scales: [num_tokens, hidden / 128] float32, one scale per 128 channels.
    """

    data: np.ndarray
    scales: np.ndarray


def check_fp8_hidden(hidden: int) -> None:
    """Raise ValueError unless hidden is a positive multiple of 128."""
    if hidden <= 0 or hidden % FP8_BLOCK_SIZE != 0:
        raise ValueError(
            f"hidden ({hidden}) must be a positive multiple of {FP8_BLOCK_SIZE} for FP8 scales"
        )


def _round_up_pow2(values: np.ndarray) -> np.ndarray:
    """Smallest power of two >= each (positive, finite) float32 value, exactly."""
    mantissa, exponent = np.frexp(values)  # values = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent)
    return np.ldexp(np.float32(1.0), exponent).astype(np.float32)


def per_token_cast_to_fp8(x: np.ndarray, round_scale: bool = False) -> Fp8Tensor:
    """Quantise per token and per 128 channels to e4m3.

    Arguments:
        x: [num_tokens, hidden] float32, float16 or ml_dtypes.bfloat16;
            hidden a multiple of 128.
        round_scale: round each scale up to a power of two (UE8M0).

    Returns:
        Fp8Tensor with data [num_tokens, hidden] uint8 (e4m3fn bytes) and
        scales [num_tokens, hidden / 128] float32.
    """
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [num_tokens, hidden], got shape {x.shape}")
    num_tokens, hidden = x.shape
    check_fp8_hidden(hidden)
    blocks = x.astype(np.float32, copy=False).reshape(num_tokens, hidden // FP8_BLOCK_SIZE, FP8_BLOCK_SIZE)
    amax = np.maximum(np.abs(blocks).max(axis=2), np.float32(_AMAX_MIN))
    scales = (amax / np.float32(FP8_E4M3_MAX)).astype(np.float32)
    if round_scale:
        scales = _round_up_pow2(scales)
        inverse = np.float32(1.0) / scales  # exact: scales are powers of two
    else:
        inverse = np.float32(FP8_E4M3_MAX) / amax
    values = np.clip(blocks * inverse[:, :, None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    data = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(num_tokens, hidden)
    return Fp8Tensor(data=data, scales=scales)


def per_token_cast_back(data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantise e4m3 data with per-128-channel scales.

    Arguments:
        data: [num_tokens, hidden] uint8 (e4m3fn bytes) or ml_dtypes.float8_e4m3fn.
        scales: [num_tokens, hidden / 128] float32, or uint8 UE8M0 exponents.

    Returns:
        [num_tokens, hidden] float32.
    """
    data = np.asarray(data)
    scales = np.asarray(scales)
    if data.ndim != 2 or data.dtype not in (np.uint8, ml_dtypes.float8_e4m3fn):
        raise ValueError(
            f"data must be 2-D uint8 or float8_e4m3fn, got shape {data.shape} dtype {data.dtype}"
        )
    num_tokens, hidden = data.shape
    check_fp8_hidden(hidden)
    expected = (num_tokens, hidden // FP8_BLOCK_SIZE)
    if scales.shape != expected:
        raise ValueError(f"scales must have shape {expected}, got {scales.shape}")
    if scales.dtype == np.uint8:
        scales = unpack_ue8m0(scales)
    values = data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = values.reshape(num_tokens, -1, FP8_BLOCK_SIZE) * scales.astype(np.float32)[:, :, None]
    return values.reshape(num_tokens, hidden)


def pack_ue8m0(scales: np.ndarray) -> np.ndarray:
    """Encode power-of-two scales as UE8M0 exponent bytes.

    Arguments:
        scales: any shape, float32 powers of two in [2**-127, 2**127].

    Returns:
        same shape, uint8 with ``127 + log2(scale)``.
    """
    scales = np.asarray(scales, dtype=np.float32)
    mantissa, exponent = np.frexp(scales)
    ok = np.isfinite(scales) & (mantissa == 0.5)
    log2 = exponent.astype(np.int64) - 1
    ok &= (log2 >= -127) & (log2 <= 127)
    if not np.all(ok):
        bad = np.unique(scales[~ok])[:8].tolist()
        raise ValueError(f"UE8M0 needs positive powers of two in [2**-127, 2**127], got {bad}")
    return (log2 + 127).astype(np.uint8)


def unpack_ue8m0(exponents: np.ndarray) -> np.ndarray:
    """Decode UE8M0 exponent bytes to float32 scales.

    Arguments:
        exponents: any shape, uint8 in [0, 254] (255 is UE8M0's NaN).

    Returns:
        same shape, float32 ``2 ** (exponent - 127)``.
    """
    exponents = np.asarray(exponents)
    if exponents.dtype != np.uint8:
        raise ValueError(f"UE8M0 exponents must be uint8, got {exponents.dtype}")
    if np.any(exponents == 255):
        raise ValueError("UE8M0 exponent byte 255 encodes NaN")
    return np.ldexp(np.float32(1.0), exponents.astype(np.int32) - 127).astype(np.float32)


def e4m3_step(values: np.ndarray) -> np.ndarray:
    """Spacing of e4m3fn numbers at each value's magnitude.

    For |v| in [2**e, 2**(e+1)) with e >= -6 the step is 2**(e-3) (three
    mantissa bits); below 2**-6 (subnormals) it is 2**-9; from 256 upward
    (including values clamped at 448) it is 32. Round-to-nearest moves a value
    by at most half a step. Use it in the scaled domain: an element ``x`` with
    scale ``s`` is off by at most ``0.5 * s * e4m3_step(x / s)`` after a round
    trip, and a GPU result within ``s * e4m3_step(x / s)`` of the reference
    is "within one e4m3 step".

    Arguments:
        values: any shape, float (values in the e4m3 domain, i.e. x / scale).

    Returns:
        same shape, float32 powers of two.
    """
    magnitude = np.minimum(np.abs(np.asarray(values, dtype=np.float64)), FP8_E4M3_MAX)
    _, exponent = np.frexp(magnitude)  # magnitude in [2**(exponent-1), 2**exponent)
    binade = np.where(magnitude == 0.0, -6, np.maximum(exponent - 1, -6))
    return np.ldexp(np.float32(1.0), binade - 3).astype(np.float32)
