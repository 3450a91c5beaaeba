"""Dispatch layout: which ranks, experts and nodes each token goes to.

This is the NumPy counterpart of DeepEP's ``get_dispatch_layout``. Rank ``r``
owns experts ``[r * E_local, (r + 1) * E_local)`` with
``E_local = num_experts // num_ranks``; ``-1`` in ``topk_idx`` means "no
expert" for that slot.

Counting rules (the same as DeepEP's):
- ``num_tokens_per_expert`` counts slots: a token that names the same expert in
  two slots counts twice for that expert (low-latency mode rejects such rows).
- ``num_tokens_per_rank`` / ``is_token_in_rank`` are deduplicated: a token
  counts once per rank however many of that rank's experts it picked.
- ``num_tokens_per_node`` / ``is_token_in_node`` are deduplicated per node
  (two-hop internode routing: a token crosses to a node once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .fp8 import check_fp8_hidden

__all__ = [
    "DispatchLayout",
    "get_dispatch_layout",
    "validate_topk_idx",
    "check_num_experts",
    "validate_rank_inputs",
]


@dataclass(frozen=True)
class DispatchLayout:
    """Routing counts of one rank's tokens.

    Attributes:
        num_tokens_per_rank: [num_ranks] int32, tokens sent to each rank
            (deduplicated per rank).
        num_tokens_per_expert: [num_experts] int32, (token, slot) selections
            of each expert.
        is_token_in_rank: [num_tokens, num_ranks] bool.
        num_tokens_per_node: [num_nodes] int32 or None, tokens sent to each
            node (deduplicated per node); None without ``num_ranks_per_node``.
        is_token_in_node: [num_tokens, num_nodes] bool or None.
    """

    num_tokens_per_rank: np.ndarray
    num_tokens_per_expert: np.ndarray
    is_token_in_rank: np.ndarray
    num_tokens_per_node: Optional[np.ndarray] = None
    is_token_in_node: Optional[np.ndarray] = None


def validate_topk_idx(topk_idx: np.ndarray, num_experts: int) -> None:
    """Check a routing table, raising ValueError with the offending values.

    Arguments:
        topk_idx: [num_tokens, num_topk] int64, expert ids in [-1, num_experts).
        num_experts: total number of experts E (> 0).
    """
    if not isinstance(num_experts, (int, np.integer)) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if not isinstance(topk_idx, np.ndarray):
        raise ValueError(f"topk_idx must be a numpy array, got {type(topk_idx).__name__}")
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be 2-D [num_tokens, num_topk], got shape {topk_idx.shape}")
    if topk_idx.dtype != np.int64:
        raise ValueError(f"topk_idx must be int64, got {topk_idx.dtype}")
    if topk_idx.size:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            bad = topk_idx[(topk_idx < -1) | (topk_idx >= num_experts)]
            raise ValueError(
                f"topk_idx values must lie in [-1, {num_experts}), "
                f"found {np.unique(bad)[:8].tolist()} (min {lo}, max {hi})"
            )


def check_num_experts(num_experts: int, num_ranks: int) -> int:
    """Return E_local = num_experts // num_ranks, raising ValueError unless it divides evenly."""
    if not isinstance(num_ranks, (int, np.integer)) or num_ranks <= 0:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    if not isinstance(num_experts, (int, np.integer)) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})"
        )
    return int(num_experts // num_ranks)


def get_dispatch_layout(
    topk_idx: np.ndarray,
    num_experts: int,
    num_ranks: int,
    num_ranks_per_node: Optional[int] = None,
) -> DispatchLayout:
    """Count where one rank's tokens go.

    Arguments:
        topk_idx: [num_tokens, num_topk] int64, expert ids in [-1, num_experts).
        num_experts: total number of experts E, divisible by num_ranks.
        num_ranks: number of ranks R.
        num_ranks_per_node: ranks per node (must divide num_ranks), or None to
            skip the per-node counts.

    Returns:
        DispatchLayout with num_tokens_per_rank [R] int32,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool and, with
        num_ranks_per_node, num_tokens_per_node [R / num_ranks_per_node] int32
        and is_token_in_node [T, R / num_ranks_per_node] bool.
    """
    validate_topk_idx(topk_idx, num_experts)
    num_local_experts = check_num_experts(num_experts, num_ranks)
    if num_ranks_per_node is not None and (
        not isinstance(num_ranks_per_node, (int, np.integer))
        or num_ranks_per_node <= 0
        or num_ranks % num_ranks_per_node != 0
    ):
        raise ValueError(
            f"num_ranks_per_node ({num_ranks_per_node!r}) must be a positive divisor "
            f"of num_ranks ({num_ranks})"
        )

    num_tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    num_tokens_per_expert = np.bincount(topk_idx[valid], minlength=num_experts).astype(np.int32)

    is_token_in_rank = np.zeros((num_tokens, num_ranks), dtype=bool)
    token_of_slot = np.broadcast_to(np.arange(num_tokens)[:, None], topk_idx.shape)
    is_token_in_rank[token_of_slot[valid], topk_idx[valid] // num_local_experts] = True
    num_tokens_per_rank = is_token_in_rank.sum(axis=0, dtype=np.int32)

    num_tokens_per_node = is_token_in_node = None
    if num_ranks_per_node is not None:
        num_nodes = num_ranks // num_ranks_per_node
        is_token_in_node = is_token_in_rank.reshape(num_tokens, num_nodes, num_ranks_per_node).any(axis=2)
        num_tokens_per_node = is_token_in_node.sum(axis=0, dtype=np.int32)

    return DispatchLayout(
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_node=num_tokens_per_node,
        is_token_in_node=is_token_in_node,
    )


def validate_rank_inputs(
    x: Optional[Sequence[np.ndarray]],
    topk_idx: Sequence[np.ndarray],
    num_experts: int,
    topk_weights: Optional[Sequence[np.ndarray]] = None,
    x_scales: Optional[Sequence[np.ndarray]] = None,
) -> int:
    """Check the global per-rank inputs of a dispatch, raising ValueError.

    Arguments:
        x: list over source ranks of [num_tokens_s, hidden] arrays, one
            dtype; None to check only the routing (and weights).
        topk_idx: list over source ranks of [num_tokens_s, num_topk] int64.
        num_experts: total experts E, divisible by the number of ranks.
        topk_weights: None or list of [num_tokens_s, num_topk] float32.
        x_scales: None or list of [num_tokens_s, num_scales] arrays of one
            dtype (carried bit-exactly); hidden must then be a multiple of 128.

    Returns:
        int, E_local = num_experts // num_ranks.
    """
    num_ranks = len(topk_idx)
    if num_ranks == 0 or (x is not None and len(x) != num_ranks):
        raise ValueError(
            f"x and topk_idx must be non-empty lists of equal length, "
            f"got {None if x is None else len(x)} and {num_ranks}"
        )
    num_local_experts = check_num_experts(num_experts, num_ranks)
    if x is None and x_scales is not None:
        raise ValueError("x_scales need x")
    for name, values in (("topk_weights", topk_weights), ("x_scales", x_scales)):
        if values is not None and len(values) != num_ranks:
            raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got {len(values)}")

    for rank in range(num_ranks):
        idx = topk_idx[rank]
        validate_topk_idx(idx, num_experts)
        if idx.shape[1] != topk_idx[0].shape[1]:
            raise ValueError(f"topk_idx[{rank}] has {idx.shape[1]} slots, topk_idx[0] has {topk_idx[0].shape[1]}")
        for name, arrays in (("x", x), ("x_scales", x_scales)):
            if arrays is not None:
                _check_rank_rows(name, arrays, rank, idx.shape[0])
        if topk_weights is not None:
            weights = topk_weights[rank]
            if not isinstance(weights, np.ndarray) or weights.shape != idx.shape or weights.dtype != np.float32:
                raise ValueError(
                    f"topk_weights[{rank}] must be float32 of shape {idx.shape}, got "
                    f"{getattr(weights, 'shape', type(weights))} {getattr(weights, 'dtype', '')}"
                )
    if x_scales is not None:
        check_fp8_hidden(x[0].shape[1])
    return num_local_experts


def _check_rank_rows(name: str, arrays, rank: int, rows: int) -> None:
    """ValueError unless ``arrays[rank]`` is a 2-D NumPy array of ``rows`` rows
    with the columns and dtype of ``arrays[0]`` (one entry per rank: x or x_scales)."""
    a = arrays[rank]
    if not isinstance(a, np.ndarray) or a.ndim != 2 or a.shape[0] != rows:
        raise ValueError(f"{name}[{rank}] must be a 2-D numpy array with {rows} rows, "
                         f"got {getattr(a, 'shape', type(a))}")
    if a.shape[1] != arrays[0].shape[1] or a.dtype != arrays[0].dtype:
        raise ValueError(f"{name}[{rank}] has {a.shape[1]} columns of {a.dtype}, "
                         f"{name}[0] has {arrays[0].shape[1]} of {arrays[0].dtype}")
