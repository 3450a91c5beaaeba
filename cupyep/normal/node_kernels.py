"""The kernels the routes within a node share: the notify pass
(cuda_src/normal/notify.cu), its argument struct and its launch.

Each dtype mirrors, field by field, a struct of
``cuda_src/normal/node_args.cuh``.
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
NOTIFY_ARGS_DTYPE = jit.struct_dtype([
    ("peers", u64), ("off", OFFSETS_DTYPE), ("is_token_in_rank", u64), ("num_tokens_per_rank", u64),
    ("num_tokens_per_expert", u64), ("send_head", u64), ("send_list", u64), ("send_channel_prefix", u64),
    ("recv_channel_prefix", u64), ("recv_rank_offset", u64), ("rank_prefix_matrix", u64),
    ("num_recv_tokens_per_expert", u64), ("host_counts", u64),
    ("expand_base", u64), ("expert_meta", u64), ("notify_time_ns", u64), ("num_tokens", i32), ("num_experts", i32), ("num_channels", i32), ("expert_alignment", i32),
    ("capacity", i32), ("rank", i32), ("guard", GUARD_DTYPE)])

NOTIFY_LAYOUT_ARGS_DTYPE = jit.struct_dtype([("notify", NOTIFY_ARGS_DTYPE), ("topk_idx", u64), ("num_topk", i32),
                                            ("layout_guard", GUARD_DTYPE)])

NOTIFY_THREADS = 1024


@functools.cache  # a spec is built once per argument tuple (the host path looks it up every call)
def notify_spec(num_ranks: int) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"notify_ranks_{num_ranks}", source="normal/notify.cu",
                          kernels=(f"cupyep::normal::notify<{num_ranks}>",))


@functools.cache
def notify_layout_spec(num_ranks: int) -> jit.KernelSpec:
    return jit.KernelSpec(name=f"notify_layout_ranks_{num_ranks}", source="normal/notify.cu",
                          kernels=(f"cupyep::normal::notify_layout<{num_ranks}>",))


def kernel_specs() -> list[jit.KernelSpec]:
    """The notify pass, alone and with the layout in front, at 1 to 8 ranks
    (``python -m cupyep.jit --check``)."""
    return [notify_spec(r) for r in range(1, 9)] + [notify_layout_spec(r) for r in range(1, 9)]


@functools.cache  # the layout is fixed per buffer, and every notify pass packs it
def offsets_struct(layout) -> np.void:
    return jit.pack(OFFSETS_DTYPE, barrier=layout.barrier, notify=layout.notify,
                    notify_row_ints=layout.notify_row_ints, dispatch_tail=layout.counter(0),
                    dispatch_head=layout.counter(1), combine_tail=layout.counter(2),
                    combine_head=layout.counter(3), dispatch_ring=layout.dispatch_region,
                    combine_ring=layout.combine_region)


def notify_args(buffer, layout, arrays, host_counts: int, notify_time_ns, **scalars) -> np.void:
    """NotifyArgs of a pass over ``buffer`` (a SymmetricBuffer laid out as
    ``layout``) writing the handle's ``arrays`` (a cupyep.arrays.Carved,
    whose "per_rank", "per_expert" and "in_rank" it reads, 0 where absent;
    cupyep.normal.node.Node.notify_args)."""
    p = arrays.ptr
    return jit.pack(
        NOTIFY_ARGS_DTYPE, peers=jit.ptr(buffer.peer_ptrs), off=offsets_struct(layout),
        is_token_in_rank=p("in_rank"), num_tokens_per_rank=p("per_rank"),
        num_tokens_per_expert=p("per_expert"), send_head=p("send_head"), send_list=p("send_list"),
        send_channel_prefix=p("send_cp"), recv_channel_prefix=p("recv_cp"), recv_rank_offset=p("recv_off"),
        rank_prefix_matrix=p("rpm"), num_recv_tokens_per_expert=p("recv_per_expert"), host_counts=host_counts,
        expand_base=p("expand_base"), expert_meta=p("expert_meta"), notify_time_ns=jit.ptr(notify_time_ns),
        **scalars)


def notify_smem(num_ranks: int, num_channels: int) -> int:
    """Dynamic shared memory of the notify pass (bytes)."""
    return 4 * num_ranks * (num_channels + 1)


def notify_layout_args(notify: np.void, topk_idx: int, num_topk: int, layout_guard: np.void) -> np.void:
    """NotifyLayoutArgs: the notify pass's ``notify`` args and the layout's
    topk_idx address ([T, k] int64, checked), its k, and the Guard through
    which ids outside [-1, E) are reported as the layout kernel reports them."""
    return jit.pack(NOTIFY_LAYOUT_ARGS_DTYPE, notify=notify, topk_idx=topk_idx, num_topk=num_topk,
                    layout_guard=layout_guard)


def notify_layout_smem(num_ranks: int, num_channels: int, num_experts: int) -> int:
    """Dynamic shared memory of notify_layout (bytes): the notify pass's and the counts per rank and expert."""
    return notify_smem(num_ranks, num_channels) + 4 * (num_ranks + num_experts)
