"""Expert-major output of normal-mode dispatch, and its inverse for combine.

``Buffer.dispatch(..., expert_major=True)`` lays the received (row, local
expert) pairs out in contiguous per-expert blocks, ready for a grouped GEMM;
``Buffer.combine`` takes the expert outputs in that layout and reduces them
back to one row per received row before the usual combine. The kernels are
in ``cuda_src/normal/expert_major.cu``; each dtype here mirrors, field by
field, a struct of ``cuda_src/normal/expert_major_args.cuh``.

Names: N rank-major rows (``recv_x``), k top-k slots, E_local local experts,
A = ``expert_alignment``, M_cap expert-major rows.

Layout (exactly ``cupyep.reference.expert_major_order(result, E_local, A)``):

- ``expert_offsets`` [E_local + 1] int32: block e is rows
  ``[expert_offsets[e], expert_offsets[e + 1])``, ``round_up(count_e, A)``
  rows, where count_e is the number of (row, slot) pairs with
  ``recv_topk_idx[row, slot] == e`` (a row naming expert e twice gives two
  pairs). Inside a block: pairs by received row, then slot; then padding.
- ``expert_src_row`` [M_cap] int32: rank-major row of each expert-major row,
  -1 for padding rows and for every row at or after ``expert_offsets[E_local]``.
- ``recv_expert_row`` [N, k] int32: expert-major row of pair (row, slot), -1
  for slots of other ranks (and, in worst-token mode, rows past the count).
- ``expert_x`` [M_cap, H] (dtype of x): ``recv_x[expert_src_row[m]]``, zero
  for the padding rows inside the blocks; ``expert_x_scales`` [M_cap, H / 128]
  float32 likewise. Rows at or after ``expert_offsets[E_local]`` (only when
  M_cap is the bound below) are not written: their contents are unspecified,
  and zeroing them would write up to M_cap rows per call, most of them
  never used. ``expert_src_row`` marks them -1 and no ``recv_expert_row``
  entry points there, so neither the reduce nor a grouped GEMM that follows
  ``expert_offsets`` reads them.

Every padding entry of the index arrays is -1, in worst-token mode too: the
dispatch fills ``recv_topk_idx`` rows past the received count with -1, and
the kernels here only read rows before the count.

M_cap: with counts known on the host (normal mode) the exact
``sum(num_recv_tokens_per_expert)`` (aligned counts); otherwise (worst-token
mode, or cached dispatch) the bound :func:`worst_expert_rows` ``(N, k,
E_local, A) = N * min(k, E_local) + E_local * (A - 1)``, where N is
``num_worst_tokens`` (or the cached handle's row count), so nothing waits on
the host and the dispatch stays CUDA-graph capturable. Routing that names one
local expert twice in a row can exceed the bound; the map kernel then reports
a capacity error (raised by the next call) and never writes out of bounds.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

import numpy as np

from .. import jit
from ..arrays import BF16, as_cupy, check
from ..errors import GUARD_DTYPE

u64, i64, i32 = np.uint64, np.int64, np.int32

COUNT_ARGS_DTYPE = jit.struct_dtype([
    ("recv_topk_idx", u64), ("num_recv", u64), ("expert_counts", u64), ("recv_expert_row", u64),
    ("num_rows", i32), ("num_topk", i32), ("num_local_experts", i32)])
MAP_ARGS_DTYPE = jit.struct_dtype([
    ("recv_topk_idx", u64), ("num_recv", u64), ("expert_counts", u64), ("expert_offsets", u64),
    ("recv_expert_row", u64), ("expert_src_row", u64), ("num_rows", i32), ("num_topk", i32),
    ("num_local_experts", i32), ("expert_alignment", i32), ("capacity", i32), ("guard", GUARD_DTYPE)])
COPY_ARGS_DTYPE = jit.struct_dtype([
    ("x", u64), ("x_scales", u64), ("expert_src_row", u64), ("expert_offsets", u64), ("expert_x", u64),
    ("expert_x_scales", u64), ("x_int4", i64), ("num_scales", i32), ("num_local_experts", i32),
    ("capacity", i32)])
REDUCE_ARGS_DTYPE = jit.struct_dtype([
    ("y", u64), ("recv_expert_row", u64), ("pair_weights", u64), ("num_recv", u64), ("out", u64),
    ("x_int4", i64), ("num_rows", i32), ("num_topk", i32), ("capacity", i32)])

# Threads per block; must match kCountThreads etc. in permute.cu.
COUNT_THREADS, MAP_THREADS, COPY_THREADS, REDUCE_THREADS = 256, 512, 256, 256
COUNT_KERNEL = "cupyep::normal::expert_major_count"
MAP_KERNEL = "cupyep::normal::expert_major_map"
COPY_KERNEL = "cupyep::normal::expert_major_copy"
REDUCE_KERNEL = "cupyep::normal::expert_major_reduce"
INT32_MAX = 2**31 - 1


@functools.cache  # a spec is built once per argument tuple (the host path looks it up every call)
def permute_spec() -> jit.KernelSpec:
    """The one specialisation of permute.cu (everything is a run-time argument)."""
    return jit.KernelSpec(name="expert_major", source="normal/expert_major.cu",
                          kernels=(COUNT_KERNEL, MAP_KERNEL, COPY_KERNEL, REDUCE_KERNEL))


def kernel_specs() -> list[jit.KernelSpec]:
    """Specialisations compiled by ``python -m cupyep.jit --check``."""
    return [permute_spec()]


# ------------------------------------------------------------------ sizing

def worst_expert_rows(num_rows: int, num_topk: int, num_local_experts: int, expert_alignment: int) -> int:
    """M_cap when the per-expert counts are not known on the host.

    ``num_rows * min(num_topk, num_local_experts) + num_local_experts *
    (expert_alignment - 1)``: every row holds at most min(k, E_local)
    distinct local experts, and each block adds fewer than A padding rows.
    """
    for name, v, lo in (("num_rows", num_rows, 0), ("num_topk", num_topk, 0),
                        ("num_local_experts", num_local_experts, 1), ("expert_alignment", expert_alignment, 1)):
        if int(v) != v or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(num_rows) * min(int(num_topk), int(num_local_experts)) + \
        int(num_local_experts) * (int(expert_alignment) - 1)


def exact_expert_rows(num_recv_tokens_per_expert) -> int:
    """M_cap from the host-known per-expert counts (already aligned): their sum."""
    counts = [int(c) for c in num_recv_tokens_per_expert]
    if any(c < 0 for c in counts):
        raise ValueError(f"per-expert counts must be >= 0, got {counts}")
    return sum(counts)


def expert_rows_capacity(num_recv_tokens_per_expert, num_rows: int, num_topk: int, num_local_experts: int,
                         expert_alignment: int) -> int:
    """M_cap: exact when ``num_recv_tokens_per_expert`` (aligned, host list)
    is given, else the :func:`worst_expert_rows` bound for ``num_rows`` rows.
    Raises ValueError when it does not fit int32 row indices."""
    if num_recv_tokens_per_expert is not None:
        m = exact_expert_rows(num_recv_tokens_per_expert)
    else:
        m = worst_expert_rows(num_rows, num_topk, num_local_experts, expert_alignment)
    if m > INT32_MAX:
        raise ValueError(f"expert-major output needs {m} rows, more than int32 row indices address")
    return m


# -------------------------------------------------------------- validation

def check_expert_major_request(topk_idx, expert_alignment: int) -> None:
    """ValueError unless dispatch(expert_major=True) can run: it needs topk_idx
    (recv_topk_idx says which local experts a row goes to) and A >= 1."""
    if topk_idx is None:
        raise ValueError("expert_major=True needs topk_idx (also with a cached handle): the expert-major "
                         "layout is built from recv_topk_idx")
    if int(expert_alignment) != expert_alignment or expert_alignment < 1:
        raise ValueError(f"expert_alignment must be an integer >= 1, got {expert_alignment!r}")


def combine_is_expert_major(num_x_rows: int, num_rows: int, num_expert_rows: int, has_expert_map: bool,
                            expert_major: bool | None, has_pair_weights: bool) -> bool:
    """Decide whether combine's x holds expert-major rows; ValueError when it cannot.

    Arguments:
        num_x_rows: rows of x.
        num_rows: N, rows the dispatch received (num_worst_tokens in worst-token mode).
        num_expert_rows: M_cap of the handle (0 without an expert-major map).
        has_expert_map: the handle has recv_expert_row (dispatch ran with expert_major=True).
        expert_major: the caller's choice, or None to decide from the row count:
            expert-major when the handle has a map and x has M_cap rows (also
            when M_cap == N; pass False to combine rank-major rows then).
        has_pair_weights: pair_weights were given (only valid with expert-major x).
    """
    if expert_major is None:
        em = has_expert_map and num_x_rows == num_expert_rows
    else:
        em = bool(expert_major)
        if em and not has_expert_map:
            raise ValueError("expert_major=True needs a handle from dispatch(..., expert_major=True)")
    if em:
        if num_x_rows != num_expert_rows:
            raise ValueError(f"expert-major x has {num_x_rows} rows, the dispatch laid out {num_expert_rows}")
    else:
        if has_pair_weights:
            raise ValueError("pair_weights weight expert-major rows; x holds rank-major rows "
                             f"({num_x_rows} rows, the dispatch received {num_rows}"
                             + (f", expert-major would be {num_expert_rows}" if has_expert_map else "") + ")")
        if num_x_rows != num_rows:
            extra = f" (or {num_expert_rows} expert-major rows)" if has_expert_map else ""
            raise ValueError(f"x has {num_x_rows} rows, the dispatch received {num_rows}{extra}")
    return em


def check_pair_weights(pair_weights, num_rows: int, num_topk: int):
    """pair_weights must be [N, k] float32, C-contiguous (or None). Returns it."""
    if pair_weights is not None:
        check(pair_weights, "pair_weights", np.float32, shape=(num_rows, num_topk))
    return pair_weights


# ----------------------------------------------------------------- launches

@dataclass
class ExpertMajorOutput:
    """Device arrays of one expert-major layout (see the module docstring).

    Attributes:
        expert_x: [M_cap, H], dtype of recv_x; padding rows inside the blocks zero,
            rows at or after expert_offsets[E_local] not written.
        expert_x_scales: [M_cap, H / 128] float32 or None; rows as expert_x's.
        expert_offsets: [E_local + 1] int32.
        expert_src_row: [M_cap] int32, -1 for every padding row.
        recv_expert_row: [N, k] int32, -1 for non-local slots and rows past the count.
        num_expert_rows: M_cap.
    """
    expert_x: object
    expert_x_scales: object
    expert_offsets: object
    expert_src_row: object
    recv_expert_row: object
    num_expert_rows: int


def _grid(work: int, per_block: int, num_sms: int) -> int:
    return max(1, min((work + per_block - 1) // per_block, 4 * max(1, num_sms)))


def build(recv_x, recv_x_scales, recv_topk_idx, num_recv_ptr: int, num_local_experts: int,
          expert_alignment: int, num_expert_rows: int, guard: np.void, num_sms: int) -> ExpertMajorOutput:
    """Launch count, map and copy on the current stream (the caller's
    communication stream); allocate the outputs from CuPy's pool there.

    Arguments:
        recv_x: [N, H] uint16 or uint8 rank-major rows.
        recv_x_scales: [N, H / 128] float32 or None.
        recv_topk_idx: [N, k] int64 local expert ids, -1 elsewhere.
        num_recv_ptr: device pointer to the int count of valid rows (worst-token
            mode), or 0 when all N rows are valid.
        num_local_experts: E_local.
        expert_alignment: A.
        num_expert_rows: M_cap.
        guard: GUARD_DTYPE value for the capacity report.
        num_sms: SMs to size the grid-stride launches by.
    """
    import cupy
    N, H = recv_x.shape
    k = recv_topk_idx.shape[1]
    E, M = num_local_experts, num_expert_rows
    fns = jit.load(permute_spec())
    # expert_offsets is a view of `meta`: [offsets (E + 1) | counts (E)], so the
    # counts scratch lives as long as the result (CUDA graphs replay its address).
    meta = cupy.zeros(2 * E + 1, dtype=np.int32)
    expert_offsets, counts = meta[:E + 1], meta[E + 1:]
    recv_expert_row = cupy.empty((N, k), dtype=np.int32)
    expert_src_row = cupy.empty(M, dtype=np.int32)
    expert_x = cupy.empty((M, H), dtype=recv_x.dtype)
    expert_x_scales = None if recv_x_scales is None else cupy.empty((M, recv_x_scales.shape[1]), dtype=np.float32)
    if N * k:
        args = jit.pack(COUNT_ARGS_DTYPE, recv_topk_idx=jit.ptr(recv_topk_idx), num_recv=num_recv_ptr,
                        expert_counts=jit.ptr(counts), recv_expert_row=jit.ptr(recv_expert_row), num_rows=N, num_topk=k,
                        num_local_experts=E)
        fns[COUNT_KERNEL]((_grid(N * k, COUNT_THREADS, num_sms),), (COUNT_THREADS,), (args,), shared_mem=4 * E)
    args = jit.pack(MAP_ARGS_DTYPE, recv_topk_idx=jit.ptr(recv_topk_idx), num_recv=num_recv_ptr,
                    expert_counts=jit.ptr(counts), expert_offsets=jit.ptr(expert_offsets),
                    recv_expert_row=jit.ptr(recv_expert_row), expert_src_row=jit.ptr(expert_src_row), num_rows=N,
                    num_topk=k, num_local_experts=E, expert_alignment=expert_alignment, capacity=M, guard=guard)
    fns[MAP_KERNEL]((E,), (MAP_THREADS,), (args,))
    if M:
        args = jit.pack(COPY_ARGS_DTYPE, x=jit.ptr(recv_x), x_scales=jit.ptr(recv_x_scales),
                        expert_src_row=jit.ptr(expert_src_row), expert_offsets=jit.ptr(expert_offsets),
                        expert_x=jit.ptr(expert_x), expert_x_scales=jit.ptr(expert_x_scales),
                        x_int4=recv_x.dtype.itemsize * H // 16,
                        num_scales=0 if recv_x_scales is None else recv_x_scales.shape[1],
                        num_local_experts=E, capacity=M)
        fns[COPY_KERNEL]((_grid(M, COPY_THREADS // 32, num_sms),), (COPY_THREADS,), (args,))
    return ExpertMajorOutput(expert_x, expert_x_scales, expert_offsets, expert_src_row, recv_expert_row, M)


def reduce(y, recv_expert_row, pair_weights, num_recv_ptr: int, num_sms: int, out=None):
    """Launch expert_major_reduce on the current stream.

    Arguments:
        y: [M_cap, H] uint16 (BF16 bits) expert outputs, expert-major.
        recv_expert_row: [N, k] int32 from the dispatch handle.
        pair_weights: [N, k] float32 or None (weight 1).
        num_recv_ptr: device pointer to the valid-row count, or 0 (all N rows).
        num_sms: SMs to size the grid-stride launch by.
        out: [N, H] uint16 C-contiguous to write the rows into (a zero-copy
            combine's buffer), or None for a new array.

    Returns:
        [N, H] uint16 (BF16 bits), rank-major: row r = BF16(FP32 sum over its
        local slots, in slot order, of weight * y[recv_expert_row[r, j]]);
        rows at or after the device count (worst-token mode) are not written.
    """
    import cupy
    y = check(as_cupy(y, "x"), "x", BF16, ndim=2)
    M, H = y.shape
    N, k = recv_expert_row.shape
    if out is None:
        out = cupy.empty((N, H), dtype=BF16)
    elif tuple(out.shape) != (N, H) or out.dtype != BF16 or not out.flags.c_contiguous:
        raise ValueError(f"the reduce's out must be a C-contiguous [{N}, {H}] uint16 array, got "
                         f"{list(out.shape)} {out.dtype}")
    if N:
        args = jit.pack(REDUCE_ARGS_DTYPE, y=jit.ptr(y), recv_expert_row=jit.ptr(recv_expert_row),
                        pair_weights=jit.ptr(pair_weights), num_recv=num_recv_ptr, out=jit.ptr(out), x_int4=2 * H // 16,
                        num_rows=N, num_topk=k, capacity=M)
        jit.load(permute_spec())[REDUCE_KERNEL]((_grid(N, REDUCE_THREADS // 32, num_sms),), (REDUCE_THREADS,), (args,))
    return out
