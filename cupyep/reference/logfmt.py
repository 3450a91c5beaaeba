"""LogFMT-10: a 10-bit logarithmic format for combine rows (the reference;
the low-latency combine's device version is cuda_src/common/logfmt.cuh).

A row of BF16 values is cut into groups of ``GROUP`` (128) channels. Each
group keeps the base-2 logarithms of its largest magnitude and of its
smallest nonzero one, ``hi`` and ``lo`` (``lo`` at most ``MAX_OCTAVES`` below
``hi``), and each value becomes a sign bit and a 9-bit magnitude code:

- code 0 is zero;
- code c in 1..511 is the magnitude ``2 ** (lo + (c - 1) * step)``, with
  ``step = (hi - lo) / 510`` (all 511 levels evenly spaced in log2 between
  ``lo`` and ``hi``; one level when ``hi == lo``).

Encoding rounds to the nearest level in linear terms (the threshold between
two levels is their arithmetic mean), and a magnitude below ``2 ** lo`` goes
to the nearer of zero and the lowest level. So a nonzero value whose
magnitude lies in ``[2 ** lo, 2 ** hi]`` comes back within a relative error
of ``2 ** (step / 2) - 1``: 0.07 % for a group spanning one octave, 0.68 %
for ten, 2.2 % for the full 32 (BF16 itself rounds to within 0.39 %).
Magnitudes more than ``MAX_OCTAVES`` below the group's largest are not
representable (they round to zero or to the lowest level).

Bytes: 10 bits a value plus ``lo`` and ``hi`` as two float32 a group: 10.5
bits a value, 66 % of BF16.
"""
from __future__ import annotations

import numpy as np

GROUP = 128         # channels per group, each with its own (lo, hi)
CODE_BITS = 9       # magnitude bits; one sign bit more
LEVELS = (1 << CODE_BITS) - 1   # nonzero magnitudes: codes 1..511
MAX_OCTAVES = 32.0  # lo >= hi - MAX_OCTAVES


def _groups(x: np.ndarray) -> np.ndarray:
    if x.ndim != 2 or x.shape[1] % GROUP:
        raise ValueError(f"rows must be [N, H] with H a multiple of {GROUP}, got {list(x.shape)}")
    return x.reshape(x.shape[0], x.shape[1] // GROUP, GROUP)


def encode(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LogFMT-10 codes of ``x``.

    Arguments:
        x: [N, H] float32 (e.g. BF16 values), H a multiple of GROUP; finite.

    Returns:
        (codes [N, H] uint16: sign << 9 | magnitude code; lo, hi [N, H / GROUP]
        float32: each group's log2 range; lo == hi == 0 for an all-zero group).
    """
    x = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("LogFMT encodes finite values only")
    g = _groups(x).astype(np.float64)
    a = np.abs(g)
    amax = a.max(axis=2)
    nonzero = np.where(a > 0, a, np.inf).min(axis=2)
    empty = amax == 0
    hi = np.where(empty, 0.0, np.log2(np.where(empty, 1.0, amax)))
    lo = np.where(empty, 0.0, np.maximum(np.log2(np.where(empty, 1.0, nonzero)), hi - MAX_OCTAVES))
    step = (hi - lo) / (LEVELS - 1)
    codes = _codes(a, lo[..., None], step[..., None])
    codes[np.broadcast_to(empty[..., None], codes.shape)] = 0
    sign = (g < 0) & (codes > 0)
    out = (codes | (sign.astype(np.uint16) << CODE_BITS)).reshape(x.shape)
    return out.astype(np.uint16), lo.astype(np.float32), hi.astype(np.float32)


def _level(c, lo, step):
    """Magnitude of code c >= 1 (float64)."""
    return np.exp2(lo + (c - 1) * step)


def _codes(a, lo, step) -> np.ndarray:
    """Nearest code (linear rounding) of magnitudes a >= 0 in a group of range [lo, lo + 510 step]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(step > 0, (np.log2(np.where(a > 0, a, 1.0)) - lo) / np.where(step > 0, step, 1.0), 0.0)
    c = np.clip(np.floor(t), 0, LEVELS - 1) + 1  # the level at or below a (code >= 1)
    below, above = _level(c, lo, step), _level(np.minimum(c + 1, LEVELS), lo, step)
    c = np.where((a - below > above - a) & (c < LEVELS), c + 1, c)  # the nearer of the two
    lowest = np.exp2(lo)
    c = np.where(a < lowest, np.where(a >= lowest / 2, 1, 0), c)  # under the range: zero or the lowest level
    return np.where(a > 0, c, 0).astype(np.uint16)


def decode(codes, lo, hi) -> np.ndarray:
    """[N, H] float32 values of LogFMT-10 ``codes`` with their groups' ``lo``, ``hi`` ([N, H / GROUP])."""
    codes = np.asarray(codes, dtype=np.uint16)
    c = _groups(codes).astype(np.int64)
    mag, neg = c & LEVELS, (c >> CODE_BITS) & 1
    lo = np.asarray(lo, dtype=np.float64)[..., None]
    step = (np.asarray(hi, dtype=np.float64)[..., None] - lo) / (LEVELS - 1)
    v = np.where(mag > 0, _level(mag, lo, step), 0.0)
    return np.where(neg == 1, -v, v).astype(np.float32).reshape(codes.shape)


def roundtrip(x) -> np.ndarray:
    """decode(encode(x)): what a LogFMT-10 combine row carries, [N, H] float32."""
    return decode(*encode(x))


def max_relative_error(lo, hi) -> np.ndarray:
    """Per group: the bound 2 ** (step / 2) - 1 on a value in [2 ** lo, 2 ** hi]."""
    step = (np.asarray(hi, np.float64) - np.asarray(lo, np.float64)) / (LEVELS - 1)
    return np.exp2(step / 2) - 1


def payload_bytes(num_rows: int, hidden: int) -> int:
    """Bytes of ``num_rows`` rows of ``hidden`` values in LogFMT-10: 10 bits a
    value, two float32 (lo, hi) a group."""
    if hidden % GROUP:
        raise ValueError(f"hidden must be a multiple of {GROUP}, got {hidden}")
    return num_rows * (hidden * 10 // 8 + (hidden // GROUP) * 8)
