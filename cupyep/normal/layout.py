"""The layout kernel of a dispatch (``get_dispatch_layout``): for every
token, the ranks that own one of its experts, and the token counts per rank
and per expert. It counts over any number of ranks, within a node or the
world's across nodes; the kernel is ``cuda_src/normal/layout.cu``, whose
``LayoutArgs`` :data:`LAYOUT_ARGS_DTYPE` mirrors.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import jit
from ..arrays import carve
from ..errors import GUARD_DTYPE

u64, i32 = np.uint64, np.int32
LAYOUT_ARGS_DTYPE = jit.struct_dtype([
    ("topk_idx", u64), ("num_tokens_per_rank", u64), ("num_tokens_per_expert", u64), ("is_token_in_rank", u64),
    ("num_tokens", i32), ("num_topk", i32), ("num_experts", i32), ("num_ranks", i32), ("guard", GUARD_DTYPE)])
LAYOUT_THREADS = 256


@functools.cache  # a spec is built once per argument tuple (the host path looks it up every call)
def layout_spec() -> jit.KernelSpec:
    return jit.KernelSpec(name="layout", source="normal/layout.cu",
                          kernels=("cupyep::normal::get_dispatch_layout",))


def launch_layout(topk_idx, num_experts: int, num_ranks: int, guard: np.void):
    """The layout kernel on the current stream, over any ``num_ranks`` ranks
    (within a node, or the world's across nodes).

    Arguments:
        topk_idx: cupy [T, k] int64 expert ids (checked), -1 for none.
        guard: the kernel's packed Guard (the group's ``guard("layout")``).

    Returns:
        (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool), cupy.
    """
    T = topk_idx.shape[0]
    counts = carve(layout_shapes(T, num_experts, num_ranks), dtypes=LAYOUT_DTYPES)  # one allocation
    launch_layout_into(topk_idx, num_experts, num_ranks, guard, counts)
    return counts["per_rank"], counts["per_expert"], counts["in_rank"]


#: The layout's outputs as cupyep.arrays.carve parts (the counts first: one memset zeroes both).
LAYOUT_DTYPES = {"in_rank": np.bool_}


def layout_shapes(num_tokens: int, num_experts: int, num_ranks: int) -> dict:
    """{part: shape} of the layout's outputs: "per_rank" [R], "per_expert"
    [E] (int32) and "in_rank" [T, R] (bool, LAYOUT_DTYPES), in that order."""
    return {"per_rank": (num_ranks,), "per_expert": (num_experts,), "in_rank": (num_tokens, num_ranks)}


def launch_layout_into(topk_idx, num_experts: int, num_ranks: int, guard: np.void, out) -> None:
    """The layout kernel writing the parts of ``out`` (a cupyep.arrays.Carved
    holding :func:`layout_shapes`' three parts one after another, in that
    order, among others or not), after one memset of the counts (from
    "per_rank" up to "in_rank": the kernel adds to them), on the current
    stream."""
    import cupy
    T, k = topk_idx.shape
    counts, per_expert, in_rank = out.ptr("per_rank"), out.ptr("per_expert"), out.ptr("in_rank")
    if not counts < per_expert < in_rank:
        raise ValueError("the layout's parts must be carved one after another: per_rank, per_expert, in_rank")
    cupy.cuda.runtime.memsetAsync(counts, 0, in_rank - counts, cupy.cuda.get_current_stream().ptr)
    if T:
        args = jit.pack(LAYOUT_ARGS_DTYPE, topk_idx=topk_idx.data.ptr, num_tokens_per_rank=counts,
                        num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                        num_tokens=T, num_topk=k, num_experts=num_experts, num_ranks=num_ranks, guard=guard)
        jit.kernel(layout_spec())((-(-T // LAYOUT_THREADS),), (LAYOUT_THREADS,), (args,),
                                  shared_mem=4 * (num_ranks + num_experts))


def kernel_specs() -> list[jit.KernelSpec]:
    """Specialisations compiled by ``python -m cupyep.jit --check``."""
    return [layout_spec()]
