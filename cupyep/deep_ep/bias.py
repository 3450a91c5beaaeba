"""DeepEP's combine bias: ``combined = bf16(sum + bias_0 + bias_1)``.

cupyep's combine kernels return the reduced rows already rounded to BF16, so
the bias is added afterwards, in FP32, and the sum rounded to nearest even
once more. Against DeepEP, which adds the bias before its single rounding,
each element may differ by one BF16 unit in the last place (a relative
2^-8 at most); ``cupyep.reference.calc_diff`` of such a pair is below 1e-5.
"""
from __future__ import annotations

import numpy as np

_KERNELS: dict = {}


def unpack_bias(bias) -> tuple:
    """DeepEP's ``bias`` argument as a tuple of 0, 1 or 2 arrays: None, one
    tensor, or a tuple of two (either of which may be None)."""
    if bias is None:
        return ()
    if isinstance(bias, tuple):
        if len(bias) != 2:
            raise ValueError(f"bias must be a tensor or a tuple of two tensors, got a tuple of {len(bias)}")
        return tuple(b for b in bias if b is not None)
    return (bias,)


def check_bias(biases, num_tokens: int, hidden: int) -> None:
    """ValueError unless every bias is [num_tokens, hidden] BF16 bits (uint16), C-contiguous."""
    for i, b in enumerate(biases):
        if b.dtype != np.uint16 or tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"bias_{i} must be a [{num_tokens}, {hidden}] torch.bfloat16 tensor (the combined "
                             f"x's shape), got {list(b.shape)} {b.dtype}")
        if not b.flags.c_contiguous:
            raise ValueError(f"bias_{i} must be contiguous")


def add_bias(rows, biases) -> None:
    """In place: rows[t, h] = bf16(f32(rows[t, h]) + f32(b[t, h]) for each b),
    rounded to nearest even. ``rows`` and each of ``biases`` are [T, H] uint16
    BF16 bits, CuPy (one elementwise kernel on the current stream) or NumPy."""
    if not biases:
        return
    if isinstance(rows, np.ndarray):
        from ..moe import bf16_bits_to_f32, f32_to_bf16_bits
        acc = bf16_bits_to_f32(rows).copy()
        for b in biases:
            acc += bf16_bits_to_f32(b)
        rows[...] = f32_to_bf16_bits(acc)
        return
    _kernel(len(biases))(*biases, rows)


def _kernel(n: int):
    k = _KERNELS.get(n)
    if k is None:
        import cupy
        names = [f"b{i}" for i in range(n)]
        body = " + ".join(["__uint_as_float(((unsigned int)r) << 16)"] +
                          [f"__uint_as_float(((unsigned int){b}) << 16)" for b in names])
        k = _KERNELS[n] = cupy.ElementwiseKernel(
            ", ".join(f"uint16 {b}" for b in names), "uint16 r",
            f"float v = {body};"
            "unsigned int u = __float_as_uint(v);"
            "r = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)"
            " : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);",
            f"cupyep_deep_ep_bias{n}")
    return k
