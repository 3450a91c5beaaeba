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

:func:`pack_dispatch` copies one dispatch's received rows into that layout.
On CuPy arrays it launches the kernel of ``cuda_src/deep_ep/pack.cu`` (one
block per region row; blocks past a region's count return at once; only
valid rows are copied, 16 bytes at a time; the packed positions are summed
on the device, so nothing waits on the host and it can be captured in a CUDA
graph). On NumPy arrays it runs the same index mapping with NumPy
(:func:`row_map`), for CPU tests. The combine needs no copy back: cupyep's
low-latency combine reads packed expert outputs in place
(``LowLatencyBuffer.combine(x_layout="packed")``).
"""
from __future__ import annotations

import numpy as np

from .. import jit
from ..arrays import xp_of

PACK_SPEC = jit.KernelSpec(name="deep_ep_pack", source="deep_ep/pack.cu",
                           kernels=("cupyep::deep_ep::pack_rows",))
THREADS = 256  # kThreads of pack.cu


def kernel_specs() -> list[jit.KernelSpec]:
    return [PACK_SPEC]


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


# ------------------------------------------------------------------ host wrappers
def _ptr(a) -> np.uint64:
    return np.uint64(a.data.ptr)


def _check_counts(layout_count, E: int) -> None:
    if layout_count.dtype != np.int32 or layout_count.ndim != 2 or layout_count.shape[0] != E \
            or not layout_count.flags.c_contiguous:
        raise ValueError(f"layout_count must be a C-contiguous [{E}, R] int32 array, got {layout_count.shape} "
                         f"{layout_count.dtype}")


def load(group=None):
    """Compile (or fetch) the kernels of this module for the current device;
    with ``group`` collectively over the node (jit.load)."""
    return jit.load(PACK_SPEC, group)


def packed_outputs(recv_x, recv_x_scales, num_ranks: int, max_tokens: int, use_ue8m0: bool = False):
    """Uninitialised outputs of :func:`pack_dispatch`, on the current stream.

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
    xp = xp_of(recv_x)
    E, _, H = recv_x.shape
    RT = num_ranks * max_tokens
    x = xp.empty((E, RT, H), dtype=recv_x.dtype)
    scales = None
    if recv_x_scales is not None:
        S = H // 512 if use_ue8m0 else H // 128
        scales = xp.empty((E, S, RT), dtype=np.int32 if use_ue8m0 else np.float32).transpose(0, 2, 1)
    return x, scales, xp.empty((E, RT), dtype=np.int32), xp.empty((E, num_ranks), dtype=np.int64)


def pack_dispatch(recv_x, recv_x_scales, recv_src, layout_count, capacity: int, outputs) -> None:
    """Copy a low-latency dispatch's valid rows into DeepEP's packed layout
    (on the current stream; NumPy arrays: with NumPy).

    Arguments:
        recv_x: [E_local, R * C, H] uint8 (FP8 bits) or uint16 (BF16 bits), rows
            contiguous, any row and expert strides that are multiples of 16 bytes
            (cupyep's LowLatencyDispatchResult.recv_x).
        recv_x_scales: [E_local, R * C, H / 128] float32, or uint8 UE8M0 exponents
            (H a multiple of 512), with recv_x's strides; None for BF16.
        recv_src: [E_local, R * C] int32 source token of each row, with recv_x's strides (the handle's recv_src).
        layout_count: [E_local, R] int32 rows of each (expert, source) region.
        capacity: C, rows of each region.
        outputs: the arrays of :func:`packed_outputs`, written here: valid rows
            of x, scales and src_info, and all of layout_range; rows past
            recv_count[e] are left as they are (as DeepEP's).
    """
    x, scales, src_info, ranges = outputs
    E, RC, H = recv_x.shape
    R = layout_count.shape[1]
    if xp_of(recv_x) is np:
        e, region, packed = row_map(layout_count, capacity)
        x[e, packed] = recv_x[e, region]
        if scales is not None:
            s = recv_x_scales
            if s.dtype == np.uint8:  # four UE8M0 exponents a word
                s = np.ascontiguousarray(s).view(np.int32)
            scales[e, packed] = s[e, region]
        src_info[e, packed] = recv_src[e, region]
        ranges[...] = layout_range(layout_count)
        return
    if E == 0 or RC == 0:
        return
    _check_counts(layout_count, E)
    st = recv_x.strides
    row_bytes = H * recv_x.dtype.itemsize
    if st[2] != recv_x.dtype.itemsize or st[1] % 16 or st[0] % 16 or recv_x.data.ptr % 16 or row_bytes % 16:
        raise ValueError(f"recv_x must have contiguous rows of a multiple of 16 bytes on 16-byte strides; its "
                         f"strides are {st}")
    if scales is not None and recv_x_scales.strides[:2] != st[:2]:
        raise ValueError("recv_x_scales must have recv_x's row and expert strides")
    if recv_src.strides != st[:2]:
        raise ValueError("recv_src must have recv_x's row and expert strides")
    fn = load()["cupyep::deep_ep::pack_rows"]
    scale_words = 0 if scales is None else scales.shape[2]
    fn((RC, E), (THREADS,), (
        np.uint64(recv_x.data.ptr), np.uint64(0 if scales is None else recv_x_scales.data.ptr),
        np.uint64(recv_src.data.ptr), np.int64(st[0]), np.int64(st[1]), np.int32(row_bytes), np.int32(scale_words),
        _ptr(layout_count), np.int32(R), np.int32(capacity), np.int32(x.shape[1]),
        _ptr(x), np.uint64(0 if scales is None else scales.data.ptr), _ptr(src_info), _ptr(ranges)))


