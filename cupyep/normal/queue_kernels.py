"""The queue route's kernels (cuda_src/normal/queue_dispatch.cu,
queue_combine.cu): specialisations, argument structs and launches.

Each dtype mirrors, field by field, a struct of
``cuda_src/normal/node_args.cuh``. Kernels are specialised on the number
of ranks and threads per block (and the L2 hints); everything else is a
run-time argument, so any hidden size (multiple of 128) and any top-k work
without a fixed list.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import jit
from ..errors import GUARD_DTYPE

u64, i64, i32 = np.uint64, np.int64, np.int32

RING_DTYPE = jit.struct_dtype([("ring", i64), ("counter_tail", i64), ("counter_head", i64), ("slot_bytes", i64),
                               ("x_bytes", i64), ("depth", i32), ("chunk", i32)])
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

# Threads per block of the dispatch/combine specialisations the offline check compiles.
THREAD_CHOICES = (512, 768)


@functools.cache
def dispatch_spec(num_ranks: int, num_threads: int, l2_hints: int = 0) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"queue_dispatch_ranks_{num_ranks}_threads_{num_threads}_l2_{l2_hints}",
                          source="normal/queue_dispatch.cu",
                          kernels=(f"cupyep::normal::queue_dispatch<{num_ranks}, {num_threads}, {l2_hints}>",))


@functools.cache
def combine_spec(num_ranks: int, num_threads: int, l2_hints: int = 0) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"queue_combine_ranks_{num_ranks}_threads_{num_threads}_l2_{l2_hints}",
                          source="normal/queue_combine.cu",
                          kernels=(f"cupyep::normal::queue_combine<{num_ranks}, {num_threads}, {l2_hints}>",))


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
        for t in THREAD_CHOICES:
            for l2 in L2_HINTS:
                specs += [dispatch_spec(r, t, l2), combine_spec(r, t, l2)]
    return specs


@functools.lru_cache(maxsize=256)  # a ring set is packed once (every call packs it)
def ring_struct(rs) -> np.void:
    return jit.pack(RING_DTYPE, ring=rs.offset, counter_tail=rs.counter_tail, counter_head=rs.counter_head,
                    slot_bytes=rs.slot_bytes, x_bytes=rs.x_bytes, depth=rs.depth, chunk=rs.chunk)


def dispatch_args(cfg, buffer, rs, x, x_scales, topk_idx, topk_weights, handle, recv: dict, queue_occupancy,
                  num_local_experts: int, capacity: int, rank: int, guard: np.void) -> np.void:
    """DispatchArgs of a queue dispatch (see :func:`launch_dispatch`)."""
    T, H = x.shape
    return jit.pack(
        DISPATCH_ARGS_DTYPE, peers=jit.ptr(buffer.peer_ptrs), rs=ring_struct(rs), x=jit.ptr(x),
        x_scales=jit.ptr(x_scales), topk_idx=jit.ptr(topk_idx), topk_weights=jit.ptr(topk_weights),
        send_list=handle.array_ptr("send_list"), send_channel_prefix=handle.array_ptr("send_channel_prefix"),
        recv_channel_prefix=handle.array_ptr("recv_channel_prefix"), recv_rank_offset=handle.array_ptr("recv_rank_offset"),
        **recv, queue_occupancy=jit.ptr(queue_occupancy), num_tokens=T,
        num_scales=H // 128 if x_scales is not None else 0, num_topk=topk_idx.shape[1] if topk_idx is not None else 0,
        num_local_experts=num_local_experts, num_channels=cfg.num_channels, capacity=capacity, rank=rank, guard=guard)


def launch_dispatch(fn, cfg, buffer, rs, x, x_scales, topk_idx, topk_weights, handle, recv: dict, queue_occupancy,
                    num_local_experts: int, capacity: int, rank: int, guard: np.void) -> None:
    """The queue dispatch (2 * C blocks) on the current stream: rows of x
    through the rings ``rs`` of ``buffer`` into the addresses ``recv``
    (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx;
    0 where not carried) at the offsets of ``handle`` (a DispatchHandle, or
    the CarvedRouting of one being made: its ``array_ptr``)."""
    args = dispatch_args(cfg, buffer, rs, x, x_scales, topk_idx, topk_weights, handle, recv, queue_occupancy,
                         num_local_experts, capacity, rank, guard)
    fn((2 * cfg.num_channels,), (cfg.num_threads,), (args,))


#: What a notified dispatch's args hold per call (jit.ArgTemplate sources, in launch order): the
#: notify pass's carved allocation, the inputs, the receive arrays, the metric, and the received
#: count (an int32 field: DispatchArgs.capacity).
SEND_SOURCES = ("base", "x", "x_scales", "topk_idx", "topk_weights", "recv_x", "recv_x_scales", "recv_topk_idx",
                "recv_topk_weights", "recv_src_idx", "queue_occupancy", "capacity")


def send_template(cfg, buffer, rs, parts: dict, shapes: dict, num_local_experts: int, rank: int,
                  guard: np.void) -> tuple:
    """(jit.ArgTemplate, its packing function) of the notified dispatches of
    one call shape: ``parts``: the carve plan of the notify pass's arrays
    (cupyep.arrays.carve_plan); ``shapes``: {"x", "x_scales",
    "topk_idx", "topk_weights", "queue_occupancy": shape or None}. A launch
    passes the addresses in the order of SEND_SOURCES."""
    from ..arrays import Carved
    from ..results import CarvedRouting

    def pack(a: dict) -> np.void:  # a pure function of the addresses
        routing = CarvedRouting(Carved(jit.Address((0,), a["base"]), parts))  # only its parts' addresses are read
        arr = {n: jit.Address(sh, a[n]) if sh is not None else None for n, sh in shapes.items()}
        recv = {n: a[n] for n in SEND_SOURCES[5:10]}
        return dispatch_args(cfg, buffer, rs, arr["x"], arr["x_scales"], arr["topk_idx"], arr["topk_weights"], routing,
                             recv, arr["queue_occupancy"], num_local_experts, a["capacity"], rank, guard)
    return jit.ArgTemplate(pack, SEND_SOURCES, ints=("capacity",)), pack


def launch_combine(fn, cfg, buffer, rs, x, row_weights, topk_weights, handle, combined, combined_w, rank: int,
                   guard: np.void) -> None:
    """The queue combine (2 * C blocks) on the current stream: rows of x
    back through the rings ``rs`` along ``handle``'s route, reduced into
    combined [T, H] (and topk_weights into combined_w [T, k])."""
    args = jit.pack(
        COMBINE_ARGS_DTYPE, peers=jit.ptr(buffer.peer_ptrs), rs=ring_struct(rs), x=jit.ptr(x),
        row_weights=jit.ptr(row_weights), recv_topk_weights=jit.ptr(topk_weights),
        send_head=handle.array_ptr("send_head"), recv_channel_prefix=handle.array_ptr("recv_channel_prefix"),
        recv_rank_offset=handle.array_ptr("recv_rank_offset"), combined_x=jit.ptr(combined),
        combined_topk_weights=jit.ptr(combined_w), num_tokens=combined.shape[0],
        num_topk=topk_weights.shape[1] if topk_weights is not None else 0, num_channels=cfg.num_channels, rank=rank,
        guard=guard)
    fn((2 * cfg.num_channels,), (cfg.num_threads,), (args,))
