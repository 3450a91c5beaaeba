"""DeepEP's packed low-latency layout over cupyep's region layout.

cupyep's low-latency dispatch (cupyep.LowLatencyBuffer) leaves local expert
e's rows from source r at rows ``[r * C, r * C + count[e, r])`` of the
expert's ``R * C`` rows (``C``: the handle's ``capacity`` <= ``T`` =
num_max_dispatch_tokens_per_rank; ``count``: the handle's ``layout_count``),
as strided views into its messages. DeepEP packs each expert's rows at rows
``[0, recv_count[e])`` of an ``[E_local, R * T, H]`` tensor, source after
source, and describes them by ``layout_range[e, r] = begin << 32 | count``.
DeepEP's kernel takes the sources in the order they arrive; here they are
packed in rank order, so ``begin[e, r] = count[e, 0] + ... + count[e, r - 1]``
(:func:`packed_begin`), which is one of the orders DeepEP can produce and the
same on every run. FP8 scales are DeepEP's column-major tensor: allocated
``[E_local, S, R * T]`` and seen transposed as ``[E_local, R * T, S]``
(``S = H / 128`` float32 scales, or ``H / 512`` int32 words of four UE8M0
exponents).

:func:`pack_dispatch` copies one dispatch's received rows into that layout
with array indexing (NumPy or CuPy): the definition the kernels are checked
against. On the GPU the dispatch fills the layout itself, in its receive half
(``LowLatencyBuffer.dispatch(packed_out=...)``, the ``dispatch_packed`` kernel
of ``cuda_src/low_latency/dispatch.cu``; with ``packed_out=True`` it makes
the arrays, as :func:`packed_outputs_for` describes them), and the combine
reads packed expert outputs in place
(``LowLatencyBuffer.combine(x_layout="packed")``): no copy has a launch of
its own. ``cupyep.deep_ep`` returns this layout from its low-latency calls.

Part of the reference: the functions take NumPy arrays, or CuPy arrays for
the GPU tests (the same indexing on the device).
"""
from __future__ import annotations

import numpy as np


def xp_of(a):
    """numpy, or cupy for a CuPy array (cupy is not imported here unless the caller already has)."""
    import sys
    cupy = sys.modules.get("cupy")
    return cupy.get_array_module(a) if cupy is not None else np


# ------------------------------------------------------------------ index math (NumPy or CuPy)
def packed_begin(layout_count):
    """[E_local, R] int64: the first packed row of each (expert, source):
    the exclusive prefix sum of ``layout_count`` ([E_local, R] int32) along
    the sources. NumPy or CuPy, as ``layout_count``."""
    xp = xp_of(layout_count)
    counts = layout_count.astype(xp.int64)
    return xp.cumsum(counts, axis=1) - counts


def layout_range(layout_count):
    """DeepEP's ``layout_range`` [E_local, R] int64 of cupyep's per-(expert,
    source) counts ``layout_count`` ([E_local, R] int32) in the packed layout:
    ``packed_begin << 32 | count``. NumPy or CuPy, as ``layout_count``."""
    xp = xp_of(layout_count)
    return (packed_begin(layout_count) << 32) | layout_count.astype(xp.int64)


def row_map(layout_count, capacity: int):
    """Every valid row of a low-latency dispatch, in both layouts.

    Arguments:
        layout_count: [E_local, R] int32 rows of each (local expert, source), each <= capacity.
        capacity: rows of each (expert, source) region (the handle's ``capacity``).

    Returns:
        (expert, region_row, packed_row): three 1-D int64 arrays with one entry
        per valid row, ordered by expert, source, row: the row
        ``r * capacity + q`` of expert e in cupyep's layout is the row
        ``packed_begin[e, r] + q`` in DeepEP's. NumPy or CuPy, as ``layout_count``.
    """
    xp = xp_of(layout_count)
    E, R = layout_count.shape
    counts = layout_count.astype(xp.int64)
    q = xp.arange(int(capacity), dtype=xp.int64)
    valid = q[None, None, :] < counts[:, :, None]                    # [E, R, C]
    e, r, qq = xp.nonzero(valid)
    e, r, qq = (a.astype(xp.int64) for a in (e, r, qq))
    return e, r * int(capacity) + qq, packed_begin(layout_count)[e, r] + qq


# ------------------------------------------------------------------ the outputs and the definition
def packed_payload(num_local_experts: int, num_ranks: int, max_tokens: int, hidden: int, use_fp8: bool,
                   use_ue8m0: bool, xp=np):
    """Uninitialised rows and scales of DeepEP's packed low-latency layout
    (this module's layout), NumPy or CuPy (``xp``; CuPy on the
    current stream).

    Returns:
        (x [E_local, R * T, H] uint8 (FP8 bits) or uint16 (BF16 bits),
         C-contiguous; scales [E_local, R * T, S] float32 (S = H / 128) or
         int32 (S = H / 512, four UE8M0 exponents a word, use_ue8m0), the
         transpose of a C-contiguous [E_local, S, R * T] array, or None for BF16).
    """
    E, RT, H = num_local_experts, num_ranks * max_tokens, hidden
    x = xp.empty((E, RT, H), dtype=np.uint8 if use_fp8 else np.uint16)
    if not use_fp8:
        return x, None
    S = H // 512 if use_ue8m0 else H // 128
    return x, xp.empty((E, S, RT), dtype=np.int32 if use_ue8m0 else np.float32).transpose(0, 2, 1)


def packed_outputs(recv_x, recv_x_scales, num_ranks: int, max_tokens: int, use_ue8m0: bool = False):
    """Uninitialised outputs of :func:`pack_dispatch` for a dispatch result
    (NumPy or CuPy, as ``recv_x``; CuPy on the current stream).

    Arguments:
        recv_x: [E_local, R * C, H] uint8 (FP8 bits) or uint16 (BF16 bits), the
            dispatch's recv_x (gives E_local, H and the dtype).
        recv_x_scales: the dispatch's scales, or None for BF16.
        num_ranks, max_tokens: R and T (num_max_dispatch_tokens_per_rank).
        use_ue8m0: the scales are UE8M0 exponent bytes (int32 words of four in the output).

    Returns:
        (x [E_local, R * T, H] of recv_x's dtype, C-contiguous;
         scales [E_local, R * T, S] float32 (S = H / 128) or int32 (S = H / 512,
         use_ue8m0), the transpose of a C-contiguous [E_local, S, R * T] array, or None;
         src_info [E_local, R * T] int32; layout_range [E_local, R] int64).
    """
    E, _, H = recv_x.shape
    return packed_outputs_for(E, num_ranks, max_tokens, H, recv_x_scales is not None, use_ue8m0, xp_of(recv_x))


def packed_outputs_for(num_local_experts: int, num_ranks: int, max_tokens: int, hidden: int, use_fp8: bool,
                       use_ue8m0: bool, xp=np):
    """:func:`packed_outputs` from the sizes (E_local, R, T, H) and the
    format: what ``LowLatencyBuffer.dispatch(packed_out=...)`` fills.
    ``xp``: numpy or cupy."""
    x, scales = packed_payload(num_local_experts, num_ranks, max_tokens, hidden, use_fp8, use_ue8m0, xp)
    return (x, scales, xp.empty((num_local_experts, num_ranks * max_tokens), dtype=np.int32),
            xp.empty((num_local_experts, num_ranks), dtype=np.int64))


def pack_dispatch(recv_x, recv_x_scales, recv_src, layout_count, capacity: int, outputs) -> None:
    """Copy a low-latency dispatch's valid rows into DeepEP's packed layout,
    by array indexing (NumPy, or CuPy on the current stream).

    Arguments:
        recv_x: [E_local, R * C, H] uint8 (FP8 bits) or uint16 (BF16 bits)
            (cupyep's LowLatencyDispatchResult.recv_x).
        recv_x_scales: [E_local, R * C, H / 128] float32, or uint8 UE8M0 exponents
            (H a multiple of 512); None for BF16.
        recv_src: [E_local, R * C] int32 source token of each row (the handle's recv_src).
        layout_count: [E_local, R] int32 rows of each (expert, source) region.
        capacity: C, rows of each region.
        outputs: the arrays of :func:`packed_outputs`, written here: valid rows
            of x, scales and src_info, and all of layout_range; rows past
            recv_count[e] are left as they are (as DeepEP's).
    """
    x, scales, src_info, ranges = outputs
    xp = xp_of(recv_x)
    e, region, packed = row_map(layout_count, capacity)
    x[e, packed] = recv_x[e, region]
    if scales is not None:
        sc = recv_x_scales
        if sc.dtype == np.uint8:  # four UE8M0 exponents a word
            sc = xp.ascontiguousarray(sc).view(np.int32)
        scales[e, packed] = sc[e, region]
    src_info[e, packed] = recv_src[e, region]
    ranges[...] = layout_range(layout_count)
