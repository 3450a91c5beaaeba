"""Normal (high-throughput) mode: deduplicated dispatch and weighted combine.

All ranks are computed at once from the global per-rank inputs (a list with
one entry per source rank); a test on rank ``r`` builds the same seeded global
inputs and picks entry ``r`` of the result.

Dispatch sends each token once to every rank that owns at least one of its
experts. Rows received by rank ``d`` are ordered by source rank, then by
source token index; the rows from source ``s`` occupy
``[rank_prefix_matrix[s - 1, d], rank_prefix_matrix[s, d])`` (0 for s = 0).
A worst-token dispatch (``num_worst_tokens``) returns more rows:
:func:`worst_token_rows` gives them, padding included.

Combine accumulates in float64 (every product ``weight * value`` of float32
factors is exact there) and rounds once to float32, so the result does not
depend on the order of the terms; GPU kernels that accumulate in float32 agree
to a few float32 ulps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from .layout import check_num_experts, get_dispatch_layout, validate_rank_inputs

__all__ = [
    "IntranodeDispatchResult",
    "ExpertMajorLayout",
    "WorstTokenRows",
    "intranode_dispatch",
    "worst_token_rows",
    "intranode_combine",
    "intranode_combine_topk_weights",
    "expert_major_order",
    "expert_major_reduce",
]

_CHUNK_BYTES = 2 << 20  # float64 working set per combine step


@dataclass(frozen=True)
class IntranodeDispatchResult:
    """What one destination rank receives from a normal-mode dispatch.

    Attributes:
        recv_x: [num_recv_tokens, hidden], the dtype of x, bit-exact copies.
        recv_x_scales: [num_recv_tokens, num_scales] (the dtype of x_scales,
            normally float32 with num_scales = hidden / 128) or None.
        recv_topk_idx: [num_recv_tokens, num_topk] int64, local expert ids in
            [0, E_local) for slots owned by this rank, -1 elsewhere.
        recv_topk_weights: [num_recv_tokens, num_topk] float32 (0 where
            recv_topk_idx is -1) or None.
        recv_src_idx: [num_recv_tokens] int32, token index within its source rank.
        recv_src_rank: [num_recv_tokens] int32, source rank of each row.
        rank_prefix_matrix: [num_ranks, num_ranks] int32, entry [i, j] = tokens
            that sources 0..i send to rank j (the same matrix on every rank).
        num_recv_tokens_per_expert: list of E_local ints, (token, slot)
            selections of each local expert, each rounded up to expert_alignment.
        num_recv_tokens: int, number of received rows.
    """

    recv_x: np.ndarray
    recv_x_scales: Optional[np.ndarray]
    recv_topk_idx: np.ndarray
    recv_topk_weights: Optional[np.ndarray]
    recv_src_idx: np.ndarray
    recv_src_rank: np.ndarray
    rank_prefix_matrix: np.ndarray
    num_recv_tokens_per_expert: List[int]
    num_recv_tokens: int


@dataclass(frozen=True)
class ExpertMajorLayout:
    """Received (token, local expert) pairs grouped by expert, for grouped GEMM.

    Attributes:
        expert_offsets: [E_local + 1] int64, block of local expert e is
            entries [expert_offsets[e], expert_offsets[e + 1]): its pairs,
            then padding up to a multiple of the expert alignment.
        rows: [M] int64, received row of each pair, -1 for padding entries;
            ascending within an expert.
        slot: [M] int64, top-k slot of each pair (recv_topk_idx[rows, slot] == e),
            -1 for padding entries.
    """

    expert_offsets: np.ndarray
    rows: np.ndarray
    slot: np.ndarray

    def pair_rows(self, num_rows: int, num_topk: int) -> np.ndarray:
        """The inverse map: [num_rows, num_topk] int64, the entry (position in
        rows) of pair (row, slot), -1 for slots without a local expert."""
        out = np.full((int(num_rows), int(num_topk)), -1, dtype=np.int64)
        pair = np.flatnonzero(self.rows >= 0)
        if pair.size and (self.rows[pair].max() >= num_rows or self.slot[pair].max() >= num_topk):
            raise ValueError(f"layout holds pairs outside [{num_rows}, {num_topk}]")
        out[self.rows[pair], self.slot[pair]] = pair
        return out


def intranode_dispatch(
    x: Sequence[np.ndarray],
    topk_idx: Sequence[np.ndarray],
    num_experts: int,
    topk_weights: Optional[Sequence[np.ndarray]] = None,
    x_scales: Optional[Sequence[np.ndarray]] = None,
    expert_alignment: int = 1,
) -> List[IntranodeDispatchResult]:
    """Deduplicated dispatch of every rank's tokens, as every rank sees it.

    Arguments:
        x: list over source ranks s of [num_tokens_s, hidden], any dtype
            (float32, ml_dtypes.bfloat16, uint8 FP8 bytes), carried bit-exactly.
        topk_idx: list over s of [num_tokens_s, num_topk] int64 in [-1, E).
        num_experts: total experts E, divisible by the number of ranks R.
        topk_weights: None or list over s of [num_tokens_s, num_topk] float32.
        x_scales: None or list over s of [num_tokens_s, hidden / 128] float32
            (any dtype and column count is carried; hidden must be a multiple of 128).
        expert_alignment: round each per-expert received count up to this.

    Returns:
        list over destination ranks d of IntranodeDispatchResult.
    """
    num_local_experts = validate_rank_inputs(x, topk_idx, num_experts, topk_weights, x_scales)
    if not isinstance(expert_alignment, (int, np.integer)) or expert_alignment <= 0:
        raise ValueError(f"expert_alignment must be a positive integer, got {expert_alignment!r}")
    num_ranks = len(x)
    hidden = x[0].shape[1]

    layouts = [get_dispatch_layout(idx, num_experts, num_ranks) for idx in topk_idx]
    send_counts = np.stack([layout.num_tokens_per_rank for layout in layouts])  # [src, dst]
    rank_prefix_matrix = np.cumsum(send_counts, axis=0, dtype=np.int32)
    expert_counts = np.stack([layout.num_tokens_per_expert for layout in layouts]).sum(axis=0)

    results = []
    for dst in range(num_ranks):
        src_tokens = [np.flatnonzero(layout.is_token_in_rank[:, dst]) for layout in layouts]
        num_recv_tokens = int(rank_prefix_matrix[-1, dst])
        bounds = np.concatenate([[0], rank_prefix_matrix[:, dst]])

        recv_x = np.empty((num_recv_tokens, hidden), dtype=x[0].dtype)
        recv_x_scales = None
        if x_scales is not None:
            recv_x_scales = np.empty((num_recv_tokens, x_scales[0].shape[1]), dtype=x_scales[0].dtype)
        for src, tokens in enumerate(src_tokens):
            block = slice(bounds[src], bounds[src + 1])
            # mode="clip" (indices are in range anyway) lets take write straight into `out`.
            np.take(x[src], tokens, axis=0, out=recv_x[block], mode="clip")
            if x_scales is not None:
                np.take(x_scales[src], tokens, axis=0, out=recv_x_scales[block], mode="clip")

        global_idx = np.concatenate([topk_idx[src][tokens] for src, tokens in enumerate(src_tokens)])
        local_idx = global_idx - dst * num_local_experts
        is_local = (local_idx >= 0) & (local_idx < num_local_experts)  # -1 slots fall below 0
        recv_topk_weights = None
        if topk_weights is not None:
            weights = np.concatenate([topk_weights[src][tokens] for src, tokens in enumerate(src_tokens)])
            recv_topk_weights = np.where(is_local, weights, np.float32(0)).astype(np.float32)

        per_expert = expert_counts[dst * num_local_experts : (dst + 1) * num_local_experts]
        aligned = -(-per_expert // expert_alignment) * expert_alignment
        results.append(
            IntranodeDispatchResult(
                recv_x=recv_x,
                recv_x_scales=recv_x_scales,
                recv_topk_idx=np.where(is_local, local_idx, -1).astype(np.int64),
                recv_topk_weights=recv_topk_weights,
                recv_src_idx=np.concatenate(src_tokens).astype(np.int32),
                recv_src_rank=np.repeat(np.arange(num_ranks, dtype=np.int32), np.diff(bounds)),
                rank_prefix_matrix=rank_prefix_matrix.copy(),
                num_recv_tokens_per_expert=[int(count) for count in aligned],
                num_recv_tokens=num_recv_tokens,
            )
        )
    return results


@dataclass(frozen=True)
class WorstTokenRows:
    """The per-row outputs of a worst-token dispatch (num_worst_tokens = N rows).

    Rows [0, num_recv_tokens) are the result's; the rows after them are
    padding with fixed contents. recv_x and recv_x_scales padding rows are
    unspecified (the GPU does not write them), so they are not here.

    Attributes:
        recv_topk_idx: [N, num_topk] int64, -1 in padding rows.
        recv_topk_weights: [N, num_topk] float32, 0 in padding rows (None without weights).
        recv_src_idx: [N] int32, -1 in padding rows.
    """

    recv_topk_idx: np.ndarray
    recv_topk_weights: Optional[np.ndarray]
    recv_src_idx: np.ndarray


def worst_token_rows(result: IntranodeDispatchResult, num_worst_tokens: int) -> WorstTokenRows:
    """What a dispatch with ``num_worst_tokens`` returns per row, padding included.

    Arguments:
        result: IntranodeDispatchResult of one rank.
        num_worst_tokens: N >= result.num_recv_tokens (more received rows are an
            error on the GPU, DeviceCapacityError).

    Returns:
        WorstTokenRows.
    """
    n = result.num_recv_tokens
    if not isinstance(num_worst_tokens, (int, np.integer)) or num_worst_tokens < n:
        raise ValueError(f"num_worst_tokens must be an integer >= the {n} received rows, got {num_worst_tokens!r}")

    def pad(a, fill):
        out = np.full((int(num_worst_tokens),) + a.shape[1:], fill, dtype=a.dtype)
        out[:n] = a
        return out

    weights = result.recv_topk_weights
    return WorstTokenRows(
        recv_topk_idx=pad(result.recv_topk_idx, -1),
        recv_topk_weights=None if weights is None else pad(weights, 0),
        recv_src_idx=pad(result.recv_src_idx, -1),
    )


def _rows_by_source(
    results: Sequence[IntranodeDispatchResult], num_tokens: Sequence[int]
) -> List[np.ndarray]:
    """Where each source token was received, checking the results on the way.

    Returns:
        list over source ranks s of [num_tokens_s, num_ranks] int64: entry
        [t, d] is the row of results[d] holding token (s, t), or -1.
    """
    num_ranks = len(results)
    if num_ranks == 0 or len(num_tokens) != num_ranks:
        raise ValueError(
            f"results and num_tokens must be non-empty lists of equal length, "
            f"got {num_ranks} and {len(num_tokens)}"
        )
    rows_by_source = [np.full((int(count), num_ranks), -1, dtype=np.int64) for count in num_tokens]
    for dst, result in enumerate(results):
        if result.rank_prefix_matrix.shape != (num_ranks, num_ranks):
            raise ValueError(
                f"results[{dst}].rank_prefix_matrix has shape {result.rank_prefix_matrix.shape}, "
                f"expected ({num_ranks}, {num_ranks})"
            )
        bounds = np.concatenate([[0], result.rank_prefix_matrix[:, dst]])
        for src in range(num_ranks):
            src_idx = result.recv_src_idx[bounds[src] : bounds[src + 1]]
            if (
                np.any(result.recv_src_rank[bounds[src] : bounds[src + 1]] != src)
                or np.any(np.diff(src_idx) <= 0)
                or (src_idx.size and (src_idx[0] < 0 or src_idx[-1] >= num_tokens[src]))
            ):
                raise ValueError(
                    f"results[{dst}] rows {bounds[src]}:{bounds[src + 1]} do not hold distinct, ascending "
                    f"tokens of source rank {src} with indices in [0, {num_tokens[src]})"
                )
            rows_by_source[src][src_idx, dst] = np.arange(bounds[src], bounds[src + 1])
    return rows_by_source


def intranode_combine(
    recv_x: Sequence[np.ndarray],
    results: Sequence[IntranodeDispatchResult],
    num_tokens: Sequence[int],
    weights: Optional[Sequence[np.ndarray]] = None,
) -> List[np.ndarray]:
    """Send rows back to their source token and reduce.

    combined_s[t] = sum over destination ranks d that received (s, t) of
    weights_d[row] * recv_x_d[row] (weight 1 when weights is None),
    accumulated in float64 and rounded once to float32. Tokens that went
    nowhere give zeros.

    Arguments:
        recv_x: list over destination ranks d of [num_recv_tokens_d, hidden]
            float32 / bfloat16 / float16 (expert outputs in received-row order).
        results: list over d of the IntranodeDispatchResult that produced the rows.
        num_tokens: list over source ranks s of num_tokens_s.
        weights: None or list over d of [num_recv_tokens_d] float32.

    Returns:
        list over source ranks s of [num_tokens_s, hidden] float32.
    """
    rows_by_source = _rows_by_source(results, num_tokens)
    num_ranks = len(results)
    if len(recv_x) != num_ranks or (weights is not None and len(weights) != num_ranks):
        raise ValueError(f"recv_x and weights must have one entry per rank ({num_ranks})")
    hidden = np.shape(recv_x[0])[-1]
    for dst in range(num_ranks):
        rows = results[dst].num_recv_tokens
        if np.shape(recv_x[dst]) != (rows, hidden):
            raise ValueError(f"recv_x[{dst}] has shape {np.shape(recv_x[dst])}, expected ({rows}, {hidden})")
        if weights is not None and np.shape(weights[dst]) != (rows,):
            raise ValueError(f"weights[{dst}] has shape {np.shape(weights[dst])}, expected ({rows},)")

    # Pull a few tokens at a time from every rank (a miss reads row 0, then is
    # zeroed), so the float64 temporaries stay in cache and no scatter is needed.
    chunk = max(1, _CHUNK_BYTES // (8 * max(hidden, 1)))
    combined = []
    for rows_of_token in rows_by_source:
        out = np.empty((rows_of_token.shape[0], hidden), dtype=np.float32)
        for begin in range(0, out.shape[0], chunk):
            rows_of_chunk = rows_of_token[begin : begin + chunk]
            acc = np.zeros((rows_of_chunk.shape[0], hidden), dtype=np.float64)
            for dst in range(num_ranks):
                hit = rows_of_chunk[:, dst] >= 0
                if not hit.any():
                    continue
                rows = np.where(hit, rows_of_chunk[:, dst], 0)
                if weights is None:
                    values = recv_x[dst][rows].astype(np.float64)
                else:
                    scale = np.asarray(weights[dst], dtype=np.float32)[rows].astype(np.float64)
                    values = np.multiply(recv_x[dst][rows], scale[:, None], dtype=np.float64)
                values[~hit] = 0.0
                acc += values
            out[begin : begin + chunk] = acc
        combined.append(out)
    return combined


def intranode_combine_topk_weights(
    results: Sequence[IntranodeDispatchResult], num_tokens: Sequence[int]
) -> List[np.ndarray]:
    """Combine recv_topk_weights back to the sources (sum over ranks).

    Each valid slot's weight lives on exactly one rank (0 on the others), so
    the sum recovers the original weights exactly, with 0 for -1 slots.

    Arguments:
        results: list over destination ranks of IntranodeDispatchResult
            (dispatched with topk_weights).
        num_tokens: list over source ranks s of num_tokens_s.

    Returns:
        list over source ranks s of [num_tokens_s, num_topk] float32.
    """
    rows_by_source = _rows_by_source(results, num_tokens)
    if any(result.recv_topk_weights is None for result in results):
        raise ValueError("every result needs recv_topk_weights (dispatch with topk_weights)")
    num_topk = results[0].recv_topk_weights.shape[1]
    combined = []
    for rows_of_token in rows_by_source:
        acc = np.zeros((rows_of_token.shape[0], num_topk), dtype=np.float32)
        for dst, result in enumerate(results):
            hit = np.flatnonzero(rows_of_token[:, dst] >= 0)
            acc[hit] += result.recv_topk_weights[rows_of_token[hit, dst]]
        combined.append(acc)
    return combined


def expert_major_order(
    result: IntranodeDispatchResult, num_local_experts: int, expert_alignment: int = 1
) -> ExpertMajorLayout:
    """Group one rank's received (token, local expert) pairs by expert.

    Arguments:
        result: IntranodeDispatchResult of one rank.
        num_local_experts: E_local.
        expert_alignment: A >= 1; each expert's block is padded with entries
            (rows = slot = -1) to a multiple of A.

    Returns:
        ExpertMajorLayout with expert_offsets [E_local + 1] int64, rows [M]
        int64 and slot [M] int64, M = sum over experts of round_up(count_e, A)
        (with A = 1: the number of valid recv_topk_idx entries). Within an
        expert, pairs are ordered by received row (then slot), then padding.
    """
    check_num_experts(num_local_experts, 1)
    if not isinstance(expert_alignment, (int, np.integer)) or expert_alignment <= 0:
        raise ValueError(f"expert_alignment must be a positive integer, got {expert_alignment!r}")
    recv_topk_idx = result.recv_topk_idx
    if recv_topk_idx.size and recv_topk_idx.max() >= num_local_experts:
        raise ValueError(
            f"recv_topk_idx holds local expert {int(recv_topk_idx.max())}, "
            f"outside [0, {num_local_experts})"
        )
    rows, slots = np.nonzero(recv_topk_idx >= 0)  # row-major: by row, then slot
    experts = recv_topk_idx[rows, slots]
    order = np.argsort(experts, kind="stable")
    counts = np.bincount(experts, minlength=num_local_experts)
    if expert_alignment == 1:
        expert_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return ExpertMajorLayout(
            expert_offsets=expert_offsets,
            rows=rows[order].astype(np.int64),
            slot=slots[order].astype(np.int64),
        )
    aligned = (counts + expert_alignment - 1) // expert_alignment * expert_alignment
    expert_offsets = np.concatenate([[0], np.cumsum(aligned)]).astype(np.int64)
    out_rows = np.full(int(expert_offsets[-1]), -1, dtype=np.int64)
    out_slot = np.full(int(expert_offsets[-1]), -1, dtype=np.int64)
    pair_offsets = np.concatenate([[0], np.cumsum(counts)])
    # Pair i of the stable order belongs to expert experts[order[i]]: shift it by
    # the padding of the blocks before its expert.
    sorted_experts = experts[order]
    dest = np.arange(order.size) - pair_offsets[sorted_experts] + expert_offsets[sorted_experts]
    out_rows[dest] = rows[order]
    out_slot[dest] = slots[order]
    return ExpertMajorLayout(expert_offsets=expert_offsets, rows=out_rows, slot=out_slot)


def expert_major_reduce(
    y: np.ndarray,
    layout: ExpertMajorLayout,
    num_rows: int,
    num_topk: int,
    pair_weights: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Reduce expert-major outputs back to one row per received row.

    out[r] = sum over slots j with a local expert of
    pair_weights[r, j] * y[entry of pair (r, j)] (weight 1 when pair_weights
    is None), accumulated in float64 and rounded once to float32; rows
    without a local slot are zero. Padding entries of y are never read. (The
    GPU accumulates in float32 in slot order and rounds to BF16: round this
    result to BF16 to compare.)

    Arguments:
        y: [M, hidden] float32 / bfloat16 / float16 expert outputs in the
            layout's order; M >= layout.expert_offsets[-1] (extra rows ignored).
        layout: ExpertMajorLayout from expert_major_order.
        num_rows: N, rows of the rank-major dispatch output.
        num_topk: k.
        pair_weights: None or [num_rows, num_topk] float32.

    Returns:
        [num_rows, hidden] float32.
    """
    y = np.asarray(y)
    if y.ndim != 2 or y.shape[0] < int(layout.expert_offsets[-1]):
        raise ValueError(f"y must be [M >= {int(layout.expert_offsets[-1])}, hidden], got shape {y.shape}")
    if pair_weights is not None and np.shape(pair_weights) != (num_rows, num_topk):
        raise ValueError(f"pair_weights has shape {np.shape(pair_weights)}, expected ({num_rows}, {num_topk})")
    entry = layout.pair_rows(num_rows, num_topk)
    hidden = y.shape[1]
    out = np.empty((int(num_rows), hidden), dtype=np.float32)
    chunk = max(1, _CHUNK_BYTES // (8 * max(hidden, 1)))
    for begin in range(0, int(num_rows), chunk):
        ent = entry[begin : begin + chunk]
        acc = np.zeros((ent.shape[0], hidden), dtype=np.float64)
        for j in range(int(num_topk)):
            hit = ent[:, j] >= 0
            if not hit.any():
                continue
            values = y[ent[hit, j]].astype(np.float64)
            if pair_weights is not None:
                values *= np.asarray(pair_weights, dtype=np.float32)[begin : begin + chunk][hit, j].astype(np.float64)[:, None]
            acc[hit] += values
        out[begin : begin + chunk] = acc
    return out
