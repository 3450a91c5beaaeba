"""Kernel specialisations and argument structs of low-latency mode.

Each dtype mirrors, field by field, a struct of ``cuda_src/low_latency/args.cuh``.
Kernels are specialised only on threads per block and on the builds (across
nodes; shrink mode's mask); sizes are run-time arguments, so any hidden size
(multiple of 128) and any top-k work.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import jit
from ..errors import GUARD_DTYPE
from .layout import FIELDS

u64, i64, i32 = np.uint64, np.int64, np.int32

PHASE_SEND, PHASE_RECV = 1, 2
THREAD_CHOICES = (512, 1024)
DEFAULT_THREADS = 512
CHUNK_ELEMS = 512
SMEM_BUDGET = 46 * 1024  # dynamic shared memory a block may use (below the 48 KiB default)

# Ablations (args.cuh kAblate*), for profiling only: parts of the work a call
# skips so that their cost can be measured; results are wrong while any is set.
ABLATIONS = {"rows": 1, "tags": 2, "scales": 4}


def ablation_bits(names) -> int:
    """The kAblate* bits of ablation ``names`` (an iterable of ABLATIONS keys)."""
    bits = 0
    for n in names:
        if n not in ABLATIONS:
            raise ValueError(f"unknown ablation {n!r}; one of {tuple(ABLATIONS)}")
        bits |= ABLATIONS[n]
    return bits


# Trace marks (args.cuh enum Mark): trace[b][m] is when block b reached mark m.
TRACE_MARKS = ("start", "prep", "sent", "flagged", "arrived", "end")
NUM_TRACE_SLOTS = 8

SET_DTYPE = jit.struct_dtype([(n, i64) for n in FIELDS])
CALL_DTYPE = jit.struct_dtype([
    ("peers", u64), ("cur", SET_DTYPE), ("next", SET_DTYPE), ("kernel_time", u64), ("trace", u64), ("mask", u64),
    ("num_tokens", i32), ("hidden", i32), ("num_topk", i32), ("num_experts", i32), ("num_ranks", i32),
    ("max_tokens", i32), ("max_topk", i32), ("capacity", i32), ("phases", i32), ("num_waiters", i32), ("rank", i32), ("ablate", i32),
    ("ranks_per_node", i32), ("guard", GUARD_DTYPE)])
DISPATCH_ARGS_DTYPE = jit.struct_dtype([
    ("c", CALL_DTYPE), ("x", u64), ("topk_idx", u64), ("layout_count", u64), ("recv_count", u64),
    ("combine_pos", u64), ("slot_pos", u64), ("cumulative_stats", u64), ("status", u64), ("wait_stats", u64),
    ("topk_weights", u64), ("rank_pos", u64),
    ("packed_x", u64), ("packed_scales", u64), ("packed_src", u64), ("packed_range", u64), ("packed_rows", i64),
    ("mask_words", i32),
    ("fp8", i32), ("round_scale", i32), ("ue8m0", i32)])
COMBINE_ARGS_DTYPE = jit.struct_dtype([
    ("c", CALL_DTYPE), ("x", u64), ("layout_count", u64), ("combine_pos", u64), ("slot_pos", u64),
    ("topk_idx", u64), ("topk_weights", u64), ("out", u64), ("x_row_bytes", i64), ("wait_stats", u64),
    ("x_expert_rows", i64), ("tags", u64), ("tag_stride", i64), ("rank_pos", u64),
    ("pull", i32), ("dispatch_status", u64)])


def _spec(kernel: str, num_threads: int, across_nodes: bool = False, shrink: bool = False) -> jit.KernelSpec:
    """The specialisation of ``kernel`` (a template of low_latency/dispatch.cu
    or combine.cu). ``across_nodes``: the build that reaches ranks of other
    nodes by NVSHMEM puts (CUPYEP_LL_NVSHMEM, args.cuh); ``shrink``: the build
    that reads a rank mask (CUPYEP_LL_SHRINK, sync.cuh), which a buffer made
    with enable_shrink uses. Without it the mask's tests are compiled out: on
    the hot paths they cost the receive half of the combine about 5 us at
    8 ranks, T = 128 (results/ll_halves)."""
    source = "dispatch" if kernel.startswith("dispatch") else "combine"
    suffix = ("_nvshmem" if across_nodes else "") + ("_shrink" if shrink else "")
    defines = ((("CUPYEP_LL_NVSHMEM", 1),) if across_nodes else ()) + ((("CUPYEP_LL_SHRINK", 1),) if shrink else ())
    return jit.KernelSpec(name=f"low_latency_{kernel}_threads_{num_threads}{suffix}", source=f"low_latency/{source}.cu",
                          kernels=(f"cupyep::low_latency::{kernel}<{num_threads}>",), defines=defines,
                          nvshmem=across_nodes)


def dispatch_spec(num_threads: int = DEFAULT_THREADS, across_nodes: bool = False, shrink: bool = False) -> jit.KernelSpec:
    return _spec("dispatch", num_threads, across_nodes, shrink)


def combine_spec(num_threads: int = DEFAULT_THREADS, across_nodes: bool = False, shrink: bool = False) -> jit.KernelSpec:
    return _spec("combine", num_threads, across_nodes, shrink)


def dispatch_packed_spec(num_threads: int = DEFAULT_THREADS, across_nodes: bool = False,
                         shrink: bool = False) -> jit.KernelSpec:
    """The dispatch whose receive half also fills DeepEP's packed layout
    (dispatch.cu dispatch_packed; a specialisation of its own, so that the
    plain dispatch keeps its registers)."""
    return _spec("dispatch_packed", num_threads, across_nodes, shrink)


def combine_logfmt_spec(num_threads: int = DEFAULT_THREADS, shrink: bool = False) -> jit.KernelSpec:
    """The combine with its rows in LogFMT-10 (within a node; combine.cu
    combine_logfmt): a specialisation of its own, so that the plain combine
    keeps its registers."""
    return _spec("combine_logfmt", num_threads, shrink=shrink)


def combine_partial_spec(num_threads: int = DEFAULT_THREADS, shrink: bool = False) -> jit.KernelSpec:
    """The combine whose expert side sums each token's rows into one partial
    row per (token, expert rank) (within a node; combine.cu
    combine_partial): a specialisation of its own, so that the plain combine
    keeps its registers."""
    return _spec("combine_partial", num_threads, shrink=shrink)


def combine_partial_logfmt_spec(num_threads: int = DEFAULT_THREADS, shrink: bool = False) -> jit.KernelSpec:
    """The partial combine with its partial rows in LogFMT-10 (within a node;
    combine.cu combine_partial_logfmt)."""
    return _spec("combine_partial_logfmt", num_threads, shrink=shrink)


def kernel_specs() -> list[jit.KernelSpec]:
    """Specialisations compiled by ``python -m cupyep.jit --check`` (those
    across nodes need the NVSHMEM library, as every NVSHMEM kernel)."""
    return [s for t in THREAD_CHOICES for m in (False, True) for a in (False, True)
            for s in (dispatch_spec(t, a, m), combine_spec(t, a, m), dispatch_packed_spec(t, a, m))] + \
        [s for t in THREAD_CHOICES for m in (False, True)
         for s in (combine_logfmt_spec(t, m), combine_partial_spec(t, m), combine_partial_logfmt_spec(t, m))]


def set_struct(s) -> np.void:
    """Pack a SetLayout."""
    return jit.pack(SET_DTYPE, **{n: getattr(s, n) for n in FIELDS})


class DispatchSmem(NamedTuple):
    """The dispatch kernel's shared-memory plan (see :func:`dispatch_smem`)."""
    mask_words: int  # 32-token words per expert in a window of the position scan
    bytes: int       # dynamic shared memory per block


def dispatch_smem(num_tokens: int, num_blocks: int, num_topk: int, num_experts: int,
                  num_ranks: int = 0) -> DispatchSmem:
    """The dispatch kernel's shared-memory plan for a call.

    Layout: total [E + R'], seg [E], own_e / own_pos [Tb][k], own_rpos
    [Tb][k] (with R' only), then the token window's bitmasks [E + R'][mask_words],
    all 32-bit, with Tb = ceil(T / blocks). R' = ``num_ranks`` for a dispatch
    given the weights (its per-rank rows, dispatch.cu), else 0. A window holds
    as many tokens (32 per word) as fit in SMEM_BUDGET, at most all T; more
    tokens take more windows. Raises ValueError if not even one word per row
    fits.
    """
    tb = (num_tokens + num_blocks - 1) // num_blocks
    rows = num_experts + num_ranks
    fixed = 4 * (num_experts + rows + (3 if num_ranks else 2) * tb * num_topk)
    words = min((num_tokens + 31) // 32, (SMEM_BUDGET - fixed) // (4 * rows))
    if words < 1:
        raise ValueError(f"low-latency dispatch needs {fixed + 4 * rows} bytes of shared memory for "
                         f"{num_experts} experts, top-{num_topk} and {tb} tokens per block; the budget is "
                         f"{SMEM_BUDGET}: use fewer experts or more blocks")
    return DispatchSmem(words, fixed + 4 * rows * words)


MAX_BLOCKS = 0x7FFF  # a flag holds the arriving blocks' count in 15 bits (sync.cuh)


def check_blocks(num_blocks, default: int) -> int:
    """The number of sending blocks: ``num_blocks`` (default ``default``), an
    int from 1 to MAX_BLOCKS; ValueError otherwise."""
    g = default if num_blocks is None else num_blocks
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or not 1 <= g <= MAX_BLOCKS:
        raise ValueError(f"num_blocks must be an int in [1, {MAX_BLOCKS}], got {num_blocks!r}")
    return int(g)


def check_waiters(num_waiters, num_blocks: int) -> int:
    """The number of waiting blocks: ``num_waiters`` (default ``num_blocks``),
    from 1 to ``num_blocks`` (the send side never waits, so any block may be a
    sender only); ValueError otherwise."""
    w = num_blocks if num_waiters is None else num_waiters
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or not 1 <= w <= num_blocks:
        raise ValueError(f"num_waiters must be an int in [1, num_blocks={num_blocks}], got {num_waiters!r}")
    return int(w)


def check_peer_atomics(devices, native_atomics) -> None:
    """The low-latency kernels add to counters in peers' buffers (sync.cuh), so
    the GPUs of every two local ranks must take each other's atomics natively:
    always true on one GPU and over NVLink, not over every PCIe link.
    ``devices``: each local rank's CUDA device (every rank passes the same
    list, so all ranks agree); ``native_atomics(device, peer)``: the link
    attribute (cupyep.driver.peer_native_atomics). RuntimeError otherwise."""
    pairs = sorted({(a, b) for a in set(devices) for b in set(devices) if a != b and not native_atomics(a, b)})
    if pairs:
        raise RuntimeError(f"low-latency mode needs native atomics between the ranks' GPUs; these (GPU, peer GPU) "
                           f"pairs have none: {pairs} (e.g. a PCIe link without peer atomics). Put the ranks on "
                           "one GPU (MPS) or on NVLink-connected GPUs")


def combine_smem(num_experts: int) -> int:
    """Bytes of the combine kernel's shared memory: the [E] rows of each (local
    expert, source) pair, their [E + 1] prefix, and the [E] offsets of each
    pair's rows in its source's return range (int32)."""
    return 4 * (3 * num_experts + 1)
