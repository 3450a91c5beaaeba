"""Low-latency mode: one message per (token, expert) selection, fixed slots.

Each destination rank holds, for every local expert, ``R * capacity`` slots
(``capacity``: ``max_tokens = num_max_dispatch_tokens_per_rank`` unless a
smaller one is given): the region of source rank ``r`` starts at slot
``r * capacity``. The reference stores the tokens of
source ``r`` for local expert ``e`` packed from the start of that region in
ascending source-token order. (A GPU kernel that claims slots with atomics may
store them in another order within the region: compare such results as sets,
e.g. after sorting each region by ``recv_src_info``.)

Tokens are not deduplicated: a token that picks two experts of one rank is
sent twice. DeepEP assumes the experts of one token are distinct, so rows
naming the same expert twice are rejected.

Combine accumulates in float64 (exact products of float32 factors) and rounds
once to float32. :func:`low_latency_partial_combine` is the combine with the
reduce split between the expert ranks (one BF16 partial per token and expert
rank) and the owner (the partials summed in rank order), as normal mode
reduces; :func:`combine_rows` counts the rows each form sends (with the
benchmark's routing, top-8 of 256 experts: 33 % fewer at 8 ranks, 54 % at 4,
75 % at 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from .layout import validate_rank_inputs
from .metrics import bf16_round

__all__ = ["LowLatencyDispatchResult", "low_latency_dispatch", "low_latency_combine",
           "low_latency_partial_combine", "combine_rows", "return_position", "slot_in_region", "without_ranks"]


@dataclass(frozen=True)
class LowLatencyDispatchResult:
    """What one destination rank receives from a low-latency dispatch.

    Attributes:
        recv_x: [E_local, R * capacity, hidden], the dtype of x, unused slots zero.
        recv_x_scales: [E_local, R * capacity, num_scales] (the dtype of
            x_scales, normally float32 with hidden / 128 columns; unused zero) or None.
        recv_count: [E_local] int32, tokens received per local expert.
        recv_src_info: [E_local, R * capacity] int32, source token index of
            each slot, -1 where unused.
        layout_begin: [E_local, R] int64, first slot of source rank r's tokens
            for local expert e (always r * capacity).
        layout_count: [E_local, R] int64, number of those tokens.
        num_tokens_per_expert_src: [E_local, R] int32, the same counts as int32.
        num_max_dispatch_tokens_per_rank: int, max_tokens.
        capacity: int, rows of each (expert, source) region (max_tokens unless given).
    """

    recv_x: np.ndarray
    recv_x_scales: Optional[np.ndarray]
    recv_count: np.ndarray
    recv_src_info: np.ndarray
    layout_begin: np.ndarray
    layout_count: np.ndarray
    num_tokens_per_expert_src: np.ndarray
    num_max_dispatch_tokens_per_rank: int
    capacity: int


def _check_distinct_experts(topk_idx: np.ndarray, src_rank: int) -> None:
    """Reject rows that name one expert in two slots."""
    ordered = np.sort(topk_idx, axis=1)
    duplicate = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if duplicate.any():
        token = int(np.flatnonzero(duplicate.any(axis=1))[0])
        raise ValueError(
            f"topk_idx[{src_rank}] row {token} names an expert twice: {topk_idx[token].tolist()} "
            f"(low-latency mode needs distinct experts per token)"
        )


def slot_in_region(topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
    """Position of each (token, slot) among the source's tokens of that expert.

    Arguments:
        topk_idx: [num_tokens, num_topk] int64, distinct experts per row or -1.
        num_experts: E.

    Returns:
        [num_tokens, num_topk] int64: how many earlier tokens of this source
        picked the same expert (so the slot is region start + this), -1 for -1 slots.
    """
    tokens, slots = np.nonzero(topk_idx >= 0)  # ascending token order
    experts = topk_idx[tokens, slots]
    order = np.argsort(experts, kind="stable")
    counts = np.bincount(experts, minlength=num_experts)
    starts = np.cumsum(counts) - counts
    position = np.empty(experts.size, dtype=np.int64)
    position[order] = np.arange(experts.size) - starts[experts[order]]
    result = np.full(topk_idx.shape, -1, dtype=np.int64)
    result[tokens, slots] = position
    return result


def return_position(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """Where each (token, slot) of one source comes back in the combine.

    An expert rank returns a source's rows as one packed range, in the order
    the source's dispatch listed its rows to that rank: by local expert, then
    by position within the expert's region (ascending token).

    Arguments:
        topk_idx: [num_tokens, num_topk] int64 of this source, distinct experts per row or -1.
        num_experts: E, divisible by num_ranks.
        num_ranks: R.

    Returns:
        [num_tokens, num_topk] int64: the row of (t, j) within the range rank
        topk_idx[t, j] // (E / R) returns to this source (the source's rows to
        that rank for experts before topk_idx[t, j], plus slot_in_region), -1
        for -1 slots.
    """
    topk_idx = np.asarray(topk_idx)
    num_local = _local_experts(num_experts, num_ranks)
    valid = topk_idx >= 0
    counts = np.bincount(topk_idx[valid], minlength=num_experts).reshape(num_ranks, num_local)
    before = (np.cumsum(counts, axis=1) - counts).reshape(-1)  # rows to the same rank for earlier experts
    result = slot_in_region(topk_idx, num_experts)
    result[valid] += before[topk_idx[valid]]
    return result


def _local_experts(num_experts: int, num_ranks: int) -> int:
    """E / R; ValueError unless E is a positive multiple of R."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of num_ranks={num_ranks}")
    return num_experts // num_ranks


def _rank_hits(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> tuple:
    """(valid, ranks, hit) of one source's [T, k] routing: valid [T, k] bool (not -1), ranks [T, k] the
    rank of each slot's expert (0 for -1 slots), hit [T, R] int64, 1 where token t has an expert on rank r."""
    topk_idx = np.asarray(topk_idx)
    valid = topk_idx >= 0
    ranks = np.where(valid, topk_idx // _local_experts(num_experts, num_ranks), 0)
    hit = np.zeros((topk_idx.shape[0], num_ranks), dtype=np.int64)
    rows, cols = np.nonzero(valid)
    hit[rows, ranks[rows, cols]] = 1
    return valid, ranks, hit


def rank_position(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """Where each token's partial row from an expert rank comes back in the
    partial combine (:func:`low_latency_partial_combine`; a dispatch given the
    weights records it, ``LowLatencyHandle.rank_pos``).

    Arguments:
        topk_idx: [num_tokens, num_topk] int64 of this source, distinct experts per row or -1.
        num_experts: E, divisible by num_ranks.
        num_ranks: R.

    Returns:
        [num_tokens, num_topk] int64: for slot (t, j), how many earlier tokens
        of this source have an expert on the rank of topk_idx[t, j] (the same
        for every slot of t on that rank), -1 for -1 slots.
    """
    valid, ranks, hit = _rank_hits(topk_idx, num_experts, num_ranks)
    before = np.cumsum(hit, axis=0) - hit  # [T, R] earlier tokens with an expert on each rank
    return np.where(valid, np.take_along_axis(before, ranks, axis=1), -1)


def _check_ll_inputs(topk_idx: Sequence[np.ndarray], num_max_dispatch_tokens_per_rank: int) -> None:
    if not isinstance(num_max_dispatch_tokens_per_rank, (int, np.integer)) or num_max_dispatch_tokens_per_rank <= 0:
        raise ValueError(
            f"num_max_dispatch_tokens_per_rank must be a positive integer, got {num_max_dispatch_tokens_per_rank!r}"
        )
    for src, idx in enumerate(topk_idx):
        if idx.shape[0] > num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"rank {src} has {idx.shape[0]} tokens, more than "
                f"num_max_dispatch_tokens_per_rank ({num_max_dispatch_tokens_per_rank})"
            )
        _check_distinct_experts(idx, src)


def low_latency_dispatch(
    x: Sequence[np.ndarray],
    topk_idx: Sequence[np.ndarray],
    num_experts: int,
    num_max_dispatch_tokens_per_rank: int,
    x_scales: Optional[Sequence[np.ndarray]] = None,
    capacity: Optional[int] = None,
) -> List[LowLatencyDispatchResult]:
    """Low-latency dispatch of every rank's tokens, as every rank sees it.

    Arguments:
        x: list over source ranks s of [num_tokens_s, hidden], any dtype,
            carried bit-exactly; num_tokens_s <= num_max_dispatch_tokens_per_rank.
        topk_idx: list over s of [num_tokens_s, num_topk] int64 in [-1, E),
            distinct experts within a row.
        num_experts: total experts E, divisible by the number of ranks R.
        num_max_dispatch_tokens_per_rank: max_tokens, slots per (expert, source).
        x_scales: None or list over s of [num_tokens_s, hidden / 128] float32
            (any dtype and column count is carried; hidden must be a multiple of 128).
        capacity: rows of each (expert, source) region, in [1, max_tokens]
            (None: max_tokens). A routing that gives one expert more of one
            source's tokens raises ValueError naming them: a region never
            drops a token.

    Returns:
        list over destination ranks d of LowLatencyDispatchResult.
    """
    num_local_experts = validate_rank_inputs(x, topk_idx, num_experts, None, x_scales)
    _check_ll_inputs(topk_idx, num_max_dispatch_tokens_per_rank)
    num_ranks = len(x)
    max_tokens = int(num_max_dispatch_tokens_per_rank)
    region = max_tokens if capacity is None else int(capacity)
    if not 1 <= region <= max_tokens:
        raise ValueError(f"capacity must be in [1, num_max_dispatch_tokens_per_rank={max_tokens}], got {capacity}")
    for src, idx in enumerate(topk_idx):
        per_expert = np.bincount(idx[idx >= 0], minlength=num_experts)
        if per_expert.max(initial=0) > region:
            e = int(per_expert.argmax())
            raise ValueError(f"source rank {src} sends {int(per_expert[e])} tokens to expert {e}, more than the "
                             f"capacity of its region ({region})")
    num_slots = num_ranks * region
    hidden = x[0].shape[1]

    recv_x = [np.zeros((num_local_experts, num_slots, hidden), dtype=x[0].dtype) for _ in range(num_ranks)]
    recv_x_scales = None
    if x_scales is not None:
        scales_shape = (num_local_experts, num_slots, x_scales[0].shape[1])
        recv_x_scales = [np.zeros(scales_shape, dtype=x_scales[0].dtype) for _ in range(num_ranks)]
    recv_src_info = [np.full((num_local_experts, num_slots), -1, dtype=np.int32) for _ in range(num_ranks)]
    counts = np.zeros((num_ranks, num_local_experts, num_ranks), dtype=np.int64)  # [dst, expert, src]

    for src in range(num_ranks):
        idx = topk_idx[src]
        position = slot_in_region(idx, num_experts)
        tokens, slots = np.nonzero(idx >= 0)
        experts = idx[tokens, slots]
        dst_of = experts // num_local_experts
        local = experts % num_local_experts
        slot = src * region + position[tokens, slots]
        for dst in range(num_ranks):
            mask = dst_of == dst
            rows, where_expert, where_slot = tokens[mask], local[mask], slot[mask]
            recv_x[dst][where_expert, where_slot] = x[src][rows]
            if x_scales is not None:
                recv_x_scales[dst][where_expert, where_slot] = x_scales[src][rows]
            recv_src_info[dst][where_expert, where_slot] = rows
            counts[dst, :, src] = np.bincount(where_expert, minlength=num_local_experts)

    layout_begin = np.broadcast_to(
        np.arange(num_ranks, dtype=np.int64) * region, (num_local_experts, num_ranks)
    ).copy()
    return [
        LowLatencyDispatchResult(
            recv_x=recv_x[dst],
            recv_x_scales=None if recv_x_scales is None else recv_x_scales[dst],
            recv_count=counts[dst].sum(axis=1).astype(np.int32),
            recv_src_info=recv_src_info[dst],
            layout_begin=layout_begin.copy(),
            layout_count=counts[dst].copy(),
            num_tokens_per_expert_src=counts[dst].astype(np.int32),
            num_max_dispatch_tokens_per_rank=max_tokens,
            capacity=region,
        )
        for dst in range(num_ranks)
    ]


def low_latency_combine(
    expert_out: Sequence[np.ndarray],
    results: Sequence[LowLatencyDispatchResult],
    topk_idx: Sequence[np.ndarray],
    topk_weights: Sequence[np.ndarray],
) -> List[np.ndarray]:
    """Weighted reduction of expert outputs back to the source tokens.

    combined_s[t] = sum over valid slots j of topk_weights_s[t, j] *
    expert_out_d[e_j % E_local, slot of (s, t)], d = e_j // E_local, with
    e_j = topk_idx_s[t, j]; accumulated in float64, rounded once to float32.

    Arguments:
        expert_out: list over destination ranks d of
            [E_local, R * capacity, hidden] float32 / bfloat16 / float16.
        results: list over d of the LowLatencyDispatchResult of the dispatch.
        topk_idx: list over source ranks s of [num_tokens_s, num_topk] int64
            (the routing that was dispatched).
        topk_weights: list over s of [num_tokens_s, num_topk] float32 (-1
            slots are ignored).

    Returns:
        list over source ranks s of [num_tokens_s, hidden] float32.
    """
    num_local_experts, region, hidden = _check_combine_inputs(expert_out, results, topk_idx, topk_weights)
    combined = []
    for src, idx in enumerate(topk_idx):
        acc = np.zeros((idx.shape[0], hidden), dtype=np.float64)
        for j, tokens, _, values in _expert_rows(expert_out, results, src, idx, num_local_experts, region):
            values *= topk_weights[src][tokens, j][:, None]
            acc[tokens] += values
        combined.append(acc.astype(np.float32))
    return combined


def _check_combine_inputs(expert_out, results, topk_idx, topk_weights) -> tuple:
    """(E_local, capacity, hidden) of a combine's inputs; ValueError unless every rank has its expert
    outputs of its dispatch result's shape and a valid routing and weights."""
    num_ranks = len(results)
    if num_ranks == 0 or len(expert_out) != num_ranks:
        raise ValueError(f"expert_out and results must be non-empty lists of equal length, "
                         f"got {len(expert_out)} and {num_ranks}")
    num_local_experts, num_slots = results[0].recv_src_info.shape
    hidden = results[0].recv_x.shape[2]
    expected = (num_local_experts, num_slots, hidden)
    for dst in range(num_ranks):
        if np.shape(expert_out[dst]) != expected or results[dst].recv_src_info.shape != expected[:2]:
            raise ValueError(f"expert_out[{dst}] has shape {np.shape(expert_out[dst])}, expected {expected}")
    if len(topk_idx) != num_ranks or topk_weights is None:
        raise ValueError(f"topk_idx and topk_weights need one entry per rank ({num_ranks})")
    validate_rank_inputs(None, topk_idx, num_local_experts * num_ranks, topk_weights)
    _check_ll_inputs(topk_idx, results[0].num_max_dispatch_tokens_per_rank)
    return num_local_experts, results[0].capacity, hidden


def _expert_rows(expert_out, results, src: int, idx: np.ndarray, num_local_experts: int, region: int):
    """Per slot j of source ``src``'s routing ``idx`` and destination rank d: (j, the tokens whose slot j
    expert lives on d, d, their expert output rows [n, hidden] as float64 from ``expert_out[d]``);
    ValueError when a result does not hold the tokens where the routing places them."""
    num_experts = num_local_experts * len(results)
    position = slot_in_region(idx, num_experts)
    for j in range(idx.shape[1]):  # one slot at a time: tokens are unique within it
        experts = idx[:, j]
        for dst in range(len(results)):
            tokens = np.flatnonzero((experts >= 0) & (experts // num_local_experts == dst))
            local = experts[tokens] % num_local_experts
            slot = src * region + position[tokens, j]
            if np.any(results[dst].recv_src_info[local, slot] != tokens):
                raise ValueError(f"results[{dst}] does not hold the tokens of source rank {src} where "
                                 f"topk_idx[{src}] places them")
            yield j, tokens, dst, expert_out[dst][local, slot].astype(np.float64)


def low_latency_partial_combine(
    expert_out: Sequence[np.ndarray],
    results: Sequence[LowLatencyDispatchResult],
    topk_idx: Sequence[np.ndarray],
    topk_weights: Sequence[np.ndarray],
    logfmt: bool = False,
) -> List[np.ndarray]:
    """The combine with the reduce split between the expert ranks and the
    owner: each expert rank first sums, for every token, the weighted
    outputs of its local experts and sends one BF16 row per (token, expert
    rank) instead of one per (token, expert); the owner then sums those
    partials.

    partial_{s,d}[t] = BF16(FP32 sum, in slot order j, of topk_weights_s[t, j]
    * expert_out_d[slot of (s, t, j)] over the slots j whose expert lives on
    rank d); combined_s[t] = FP32 sum over d in rank order of
    partial_{s,d}[t] (the caller rounds it to BF16, as the kernels do). The
    rounding points are those of normal mode's partials (cupyep.reference.
    intranode: BF16 partials stay within calc_diff 5e-6 of the exact sum,
    results/direct, "Partials"). The expert side needs the weights, so a
    dispatch that feeds this combine carries them with its rows.

    With ``logfmt`` the partials travel in LogFMT-10 (cupyep.reference.logfmt):
    the owner sums roundtrip(partial_{s,d}[t]) instead, the format applied to
    the BF16 partial rows.

    Arguments and shapes: as :func:`low_latency_combine` (expert_out is
    taken as BF16 values: float32 holding BF16 values, or bfloat16).

    Returns:
        list over source ranks s of [num_tokens_s, hidden] float32 (before the
        final BF16 rounding).
    """
    from . import logfmt as lf
    num_local_experts, region, hidden = _check_combine_inputs(expert_out, results, topk_idx, topk_weights)
    num_ranks = len(results)
    combined = []
    for src, idx in enumerate(topk_idx):
        partial = np.zeros((num_ranks, idx.shape[0], hidden), dtype=np.float32)
        for j, tokens, dst, values in _expert_rows(expert_out, results, src, idx, num_local_experts, region):
            w = topk_weights[src][tokens, j].astype(np.float32)[:, None]
            partial[dst, tokens] += values.astype(np.float32) * w  # FP32, slot order
        acc = np.zeros((idx.shape[0], hidden), dtype=np.float32)
        for dst in range(num_ranks):  # BF16 partials (through LogFMT-10 if asked), summed in FP32 in rank order
            row = bf16_round(partial[dst])
            acc += lf.roundtrip(row) if logfmt else row
        combined.append(acc)
    return combined


def combine_rows(topk_idx: Sequence[np.ndarray], num_experts: int, num_ranks: int) -> dict:
    """Rows a low-latency combine sends back, over all ranks: one per
    (token, expert) slot (``per_slot``, as :func:`low_latency_combine`) and
    one per (token, expert rank) (``per_rank``, as
    :func:`low_latency_partial_combine`). -1 slots send nothing.

    Returns:
        {"per_slot": int, "per_rank": int, "saved": 1 - per_rank / per_slot}.
    """
    _local_experts(num_experts, num_ranks)
    per_slot = per_rank = 0
    for idx in topk_idx:
        valid, _, hit = _rank_hits(idx, num_experts, num_ranks)
        per_slot += int(valid.sum())
        per_rank += int(hit.sum())
    return {"per_slot": per_slot, "per_rank": per_rank,
            "saved": 1.0 - per_rank / per_slot if per_slot else 0.0}


def without_ranks(topk_idx: Sequence[np.ndarray], masked, num_experts: int) -> List[np.ndarray]:
    """Every rank's routing as shrink mode runs it with the ranks ``masked``
    left out (cupyep.LowLatencyBuffer(enable_shrink=True)): the slots of their
    experts become -1 on every rank, and a masked rank sends nothing (all its
    slots -1). The dispatch and combine of the other ranks then equal
    :func:`low_latency_dispatch` and :func:`low_latency_combine` of this routing.

    Arguments:
        topk_idx: list over ranks of [T_r, k] int64 (-1 for none).
        masked: the masked ranks (an iterable of ints).
        num_experts: E, a multiple of the number of ranks.
    """
    R = len(topk_idx)
    if num_experts % R:
        raise ValueError(f"num_experts={num_experts} is not a multiple of the {R} ranks")
    El, masked = num_experts // R, {int(r) for r in masked}
    if not masked <= set(range(R)):
        raise ValueError(f"masked ranks {sorted(masked)} are not all in [0, {R})")
    out = []
    for r, idx in enumerate(topk_idx):
        idx = np.array(idx, dtype=np.int64, copy=True)
        if r in masked:
            idx[:] = -1
        else:
            idx[(idx >= 0) & np.isin(idx // El, sorted(masked))] = -1
        out.append(idx)
    return out
