"""How DeepEP's byte budgets become cupyep's declared sizes.

DeepEP sizes its buffers in bytes (``num_nvl_bytes``, ``num_rdma_bytes``);
cupyep declares what its calls may carry (tokens per rank, row width, top-k;
cupyep.sizes) and sizes its memory from that. Pure arithmetic, no GPU:

- **Normal mode within a node.** ``num_nvl_bytes`` is the IPC buffer of
  cupyep's queue route (``cupyep.Buffer(num_bytes=...)``: the notify region
  and the dispatch and combine rings), as DeepEP's NVLink buffer holds its
  rings. Each call checks that its rings (channels x ranks x ring slots x
  slot bytes for its row width, top-k and config) fit, and raises ValueError
  naming the bytes it needs otherwise, as DeepEP asserts. The declared sizes
  size no memory on this route; unless given they are caps that reject only
  what could never fit: ``hidden`` the widest row of which one slot per peer
  fits, ``num_topk`` DeepEP's own bound (128), ``max_tokens`` the most rows
  whose offsets fit int32 on every rank.
- **Normal mode across nodes** (with ``num_nvl_bytes > 0``, as DeepEP's
  needs). cupyep's routes there receive into pools of
  ``num_in_flight`` slots of ``R * max_tokens`` rows, sized from the
  declared sizes (cupyep.normal.internode_kernels.receive_layout). With
  ``hidden`` and ``num_topk`` given or cupyep's defaults (7168, 8),
  ``max_tokens`` is the most tokens per rank whose slots fit
  ``num_nvl_bytes + num_rdma_bytes``; none fitting is a ValueError.
- **Low-latency mode.** ``num_rdma_bytes`` must hold cupyep's low-latency
  buffer for the sizes each call names (``num_max_dispatch_tokens_per_rank``,
  the row width, ``num_experts``, top-k up to 16): :func:`low_latency_bytes`,
  which ``Buffer.get_low_latency_rdma_size_hint`` returns, so that a caller
  sizing the budget with it as with DeepEP gets a buffer that fits.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sizes import DEFAULT_HIDDEN, DEFAULT_NUM_TOPK

LOW_LATENCY_MAX_TOPK = 16
DEEPEP_MAX_TOPK = 128
INT32_MAX = 2 ** 31 - 1
NUM_IN_FLIGHT = 2


@dataclass(frozen=True)
class NormalPlan:
    """What a normal-mode cupyep.Buffer is made with.

    Attributes:
        num_bytes: the IPC buffer within a node (None across nodes).
        max_tokens, hidden, num_topk: the declared sizes.
        derived: the names of the sizes derived from the bytes (not given).
    """
    num_bytes: int | None
    max_tokens: int
    hidden: int
    num_topk: int
    derived: tuple


def _int_arg(name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def widest_row(region_bytes: int, num_ranks: int) -> int:
    """The widest row (a multiple of 128 channels, 0 if none) of which one
    BF16 dispatch slot and one combine slot per peer (top-1) fit a ring region
    of ``region_bytes``."""
    from ..normal.queue_layout import combine_slot, dispatch_slot
    per_slot = region_bytes // num_ranks
    hidden = max(per_slot // 2 // 128 * 128, 0)
    while hidden > 0 and max(dispatch_slot(hidden, 1, False)[1], combine_slot(hidden, 1)[1]) > per_slot:
        hidden -= 128
    return hidden


def normal_plan(num_nvl_bytes: int, num_rdma_bytes: int, num_ranks: int, num_nodes: int,
                max_tokens: int | None = None, hidden: int | None = None, num_topk: int | None = None,
                num_in_flight: int = NUM_IN_FLIGHT) -> NormalPlan | None:
    """The normal-mode buffer of DeepEP's budgets (module docstring), or None
    when they give normal mode no memory (``num_nvl_bytes == 0``: DeepEP's
    normal mode needs its NVLink buffer within a node and across nodes).

    Arguments:
        num_ranks: ranks of the node within a node; of the world across nodes.
    """
    from ..normal.queue_layout import buffer_layout, header_bytes
    nvl, rdma = _int_arg("num_nvl_bytes", num_nvl_bytes), _int_arg("num_rdma_bytes", num_rdma_bytes)
    derived = tuple(n for n, v in (("max_tokens", max_tokens), ("hidden", hidden), ("num_topk", num_topk))
                    if v is None)
    if num_nodes == 1:
        if nvl == 0:
            return None
        head = header_bytes(num_ranks)
        if nvl <= head + 256:
            raise ValueError(f"num_nvl_bytes={nvl} does not exceed the {head + 256} bytes of the buffer's header "
                             f"for {num_ranks} ranks; size it with Config.get_nvl_buffer_size_hint")
        region = buffer_layout(num_ranks, nvl).region_bytes
        if hidden is None:
            hidden = widest_row(region, num_ranks)
            if hidden == 0:
                raise ValueError(f"num_nvl_bytes={nvl} leaves {region} bytes per ring region, less than one "
                                 f"128-channel row per peer of {num_ranks} ranks")
        return NormalPlan(nvl, max_tokens or INT32_MAX // num_ranks, hidden, num_topk or DEEPEP_MAX_TOPK, derived)
    from ..normal.internode_kernels import receive_layout
    if nvl == 0:  # DeepEP's normal mode across nodes needs its NVLink buffer too
        return None
    budget = nvl + rdma
    hidden, num_topk = hidden or DEFAULT_HIDDEN, num_topk or DEFAULT_NUM_TOPK
    if max_tokens is None:
        def fits(t):
            return num_in_flight * receive_layout(num_ranks * t, hidden, num_topk)[1] <= budget
        if not fits(1):
            need = num_in_flight * receive_layout(num_ranks, hidden, num_topk)[1]
            raise ValueError(f"num_nvl_bytes + num_rdma_bytes = {budget} is less than the {need} bytes cupyep's "
                             f"receive pools need for one token per rank (hidden={hidden}, num_topk={num_topk}, "
                             f"{num_ranks} ranks)")
        lo, hi = 1, 2
        while fits(hi) and hi < INT32_MAX // num_ranks:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        max_tokens = lo
    return NormalPlan(None, max_tokens, hidden, num_topk, derived)


def low_latency_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                      max_topk: int = LOW_LATENCY_MAX_TOPK) -> int:
    """Bytes per rank of cupyep's low-latency buffer for these sizes
    (cupyep.LowLatencyBuffer.size_hint, top-k up to ``max_topk``)."""
    from ..low_latency.layout import check_sizes, low_latency_layout
    check_sizes(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, max_topk)
    return low_latency_layout(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, max_topk).nbytes


def check_low_latency_budget(num_rdma_bytes: int, num_max_dispatch_tokens_per_rank: int, hidden: int,
                             num_ranks: int, num_experts: int) -> int:
    """``max_topk`` of the low-latency buffer these sizes get within
    ``num_rdma_bytes``: 16 where it fits; ValueError naming the bytes needed
    where it does not."""
    need = low_latency_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    if need > num_rdma_bytes:
        raise ValueError(f"num_rdma_bytes={num_rdma_bytes} is less than the {need} bytes cupyep's low-latency "
                         f"buffer needs for num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}, "
                         f"hidden={hidden}, {num_ranks} ranks, num_experts={num_experts}; size it with "
                         f"Buffer.get_low_latency_rdma_size_hint({num_max_dispatch_tokens_per_rank}, {hidden}, "
                         f"{num_ranks}, {num_experts})")
    return LOW_LATENCY_MAX_TOPK
