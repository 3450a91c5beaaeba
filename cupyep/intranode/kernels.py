"""Kernel specialisations and argument structs of normal mode.

Each dtype mirrors, field by field, a struct of ``cuda_src/intranode/``.
Kernels are specialised on the number of ranks (and threads per block for
dispatch/combine); everything else is a run-time argument, so any hidden
size (multiple of 128) and any top-k work without a fixed list.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import jit
from ..errors import GUARD_DTYPE

u64, i64, i32 = np.uint64, np.int64, np.int32

OFFSETS_DTYPE = jit.struct_dtype([(n, i64) for n in (
    "barrier", "notify", "notify_row_ints", "dispatch_tail", "dispatch_head", "combine_tail", "combine_head",
    "dispatch_ring", "combine_ring")])
RING_DTYPE = jit.struct_dtype([("ring", i64), ("counter_tail", i64), ("counter_head", i64), ("slot_bytes", i64),
                               ("x_bytes", i64), ("depth", i32), ("chunk", i32)])
NOTIFY_ARGS_DTYPE = jit.struct_dtype([
    ("peers", u64), ("off", OFFSETS_DTYPE), ("is_token_in_rank", u64), ("num_tokens_per_rank", u64),
    ("num_tokens_per_expert", u64), ("send_head", u64), ("send_list", u64), ("send_channel_prefix", u64),
    ("recv_channel_prefix", u64), ("recv_rank_offset", u64), ("rank_prefix_matrix", u64),
    ("num_recv_tokens_per_expert", u64), ("host_counts", u64),
    ("expand_base", u64), ("expert_meta", u64), ("notify_time_ns", u64), ("num_tokens", i32), ("num_experts", i32), ("num_channels", i32), ("expert_alignment", i32),
    ("capacity", i32), ("rank", i32), ("guard", GUARD_DTYPE)])
DISPATCH_ARGS_DTYPE = jit.struct_dtype([
    ("peers", u64), ("rs", RING_DTYPE), ("x", u64), ("x_scales", u64), ("topk_idx", u64), ("topk_weights", u64),
    ("send_list", u64), ("send_channel_prefix", u64), ("recv_channel_prefix", u64), ("recv_rank_offset", u64),
    ("recv_x", u64), ("recv_x_scales", u64), ("recv_topk_idx", u64), ("recv_topk_weights", u64),
    ("recv_src_idx", u64), ("queue_occupancy", u64), ("num_tokens", i32), ("num_scales", i32), ("num_topk", i32),
    ("num_local_experts", i32), ("num_channels", i32), ("capacity", i32), ("rank", i32), ("guard", GUARD_DTYPE)])
COMBINE_ARGS_DTYPE = jit.struct_dtype([
    ("peers", u64), ("rs", RING_DTYPE), ("x", u64), ("row_weights", u64), ("recv_topk_weights", u64),
    ("send_head", u64), ("recv_channel_prefix", u64), ("recv_rank_offset", u64), ("combined_x", u64),
    ("combined_topk_weights", u64), ("num_tokens", i32), ("num_topk", i32), ("num_channels", i32), ("rank", i32),
    ("guard", GUARD_DTYPE)])

NOTIFY_THREADS = 1024
# Threads per block of the dispatch/combine specialisations the offline check compiles.
THREAD_CHOICES = (512, 768)


@functools.cache  # a spec is built once per argument tuple (the host path looks it up every call)
def notify_spec(num_ranks: int) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"intranode_notify_ranks_{num_ranks}", source="intranode/notify.cu",
                          kernels=(f"cupyep::intranode::notify<{num_ranks}>",))


@functools.cache
def dispatch_spec(num_ranks: int, num_threads: int, l2_hints: int = 0) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"intranode_dispatch_ranks_{num_ranks}_threads_{num_threads}_l2_{l2_hints}",
                          source="intranode/dispatch.cu",
                          kernels=(f"cupyep::intranode::dispatch<{num_ranks}, {num_threads}, {l2_hints}>",))


@functools.cache
def combine_spec(num_ranks: int, num_threads: int, l2_hints: int = 0) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"intranode_combine_ranks_{num_ranks}_threads_{num_threads}_l2_{l2_hints}",
                          source="intranode/combine.cu",
                          kernels=(f"cupyep::intranode::combine<{num_ranks}, {num_threads}, {l2_hints}>",))


def dispatch_spec_for(num_ranks: int, cfg) -> jit.KernelSpec:
    """The dispatch specialisation a Config selects."""
    return dispatch_spec(num_ranks, cfg.num_threads, cfg.l2_hints)


def combine_spec_for(num_ranks: int, cfg) -> jit.KernelSpec:
    """The combine specialisation a Config selects."""
    return combine_spec(num_ranks, cfg.num_threads, cfg.l2_hints)


def kernel_specs() -> list[jit.KernelSpec]:
    """Specialisations compiled by ``python -m cupyep.jit --check``: 1 to 8
    ranks with the declared thread counts and every L2 mode."""
    from .config import L2_HINTS
    specs = []
    for r in range(1, 9):
        specs.append(notify_spec(r))
        for t in THREAD_CHOICES:
            for l2 in L2_HINTS:
                specs += [dispatch_spec(r, t, l2), combine_spec(r, t, l2)]
    return specs


def ring_struct(rs) -> np.void:
    return jit.pack(RING_DTYPE, ring=rs.offset, counter_tail=rs.counter_tail, counter_head=rs.counter_head,
                    slot_bytes=rs.slot_bytes, x_bytes=rs.x_bytes, depth=rs.depth, chunk=rs.chunk)


def offsets_struct(layout) -> np.void:
    return jit.pack(OFFSETS_DTYPE, barrier=layout.barrier, notify=layout.notify,
                    notify_row_ints=layout.notify_row_ints, dispatch_tail=layout.counter(0),
                    dispatch_head=layout.counter(1), combine_tail=layout.counter(2),
                    combine_head=layout.counter(3), dispatch_ring=layout.dispatch_region,
                    combine_ring=layout.combine_region)
