"""Seeded routings for tests and sweeps: the one place where ``topk_idx`` and
``topk_weights`` are made.

Pure NumPy. Every generator is a function of its arguments only, so each rank
calls :func:`make` with the same arguments, gets the routing of every rank
and takes its own entry (the oracle pattern: any rank can compute what any
other rank sends).

Kinds (``make(kind, ...)``, parameters with their defaults):
- ``"uniform"``: per rank, the top-k of ``|randn(T, E)| + 1`` with
  ``min(10, T * k // 4)`` slots set to -1 (:func:`cupyep.reference.make_routing`).
- ``"zipf"`` (``s=1.0``): expert popularity ``p_e ~ 1 / rank_e ** s`` over a
  seeded order of the experts (``s=0`` is uniform); each token draws k
  distinct experts, one after the other, in proportion to popularity.
- ``"hot_expert"`` (``hot_fraction=0.5``, ``hot_expert=0``):
  ``round(hot_fraction * sum(T))`` tokens, chosen over all ranks, put the hot
  expert in their first slot (incast); their other slots and every other
  token draw uniformly from the remaining experts.
- ``"drift"`` (``s=1.0``, ``period=8``): ``"zipf"`` whose order of the
  experts is drawn anew every ``period`` steps, so the hot set moves: step
  ``step`` uses the order of epoch ``step // period``.
- ``"imbalance"``: ``"uniform"``; the imbalance is in ``num_tokens_per_rank``,
  e.g. from :func:`imbalanced_tokens`.
- ``"one_expert"``: every token to expert 0, its other slots -1.

``"zipf"``, ``"hot_expert"`` and ``"drift"`` take ``step=0``, a trace's step:
each step draws its tokens from streams of its own (step 0 is the plain
routing), while the popularity stays (``"zipf"``, ``"hot_expert"``) or moves
every ``period`` steps (``"drift"``).

Every kind takes ``drop_fraction=0.0``: ``round(drop_fraction * sum(T) * k)``
slots, chosen over all ranks among those holding an expert, set to -1.

Weights are ``|randn|`` per slot (:func:`cupyep.reference.make_weights`),
0 in -1 slots. :func:`imbalance_factor` measures the per-expert load.
"""
from __future__ import annotations

import math
import operator
from typing import List, Sequence, Tuple

import numpy as np

from . import reference

KINDS = ("uniform", "zipf", "hot_expert", "drift", "imbalance", "one_expert")
_PARAMS = {"uniform": (), "zipf": ("s", "step"), "hot_expert": ("hot_fraction", "hot_expert", "step"),
           "drift": ("s", "period", "step"), "imbalance": (), "one_expert": ()}

# Random streams next to the reference's routing (0) and weights (1) streams:
# per rank ``[seed, rank, stream]``, over all ranks ``[seed, stream]``.
_ZIPF_STREAM, _HOT_STREAM = 2, 3
_EXPERT_ORDER_STREAM, _HOT_TOKENS_STREAM, _DROP_STREAM, _IMBALANCE_STREAM, _DRIFT_STREAM = 10, 11, 12, 13, 14


def make(
    kind: str,
    seed: int,
    num_tokens_per_rank: Sequence[int],
    num_experts: int,
    num_topk: int,
    drop_fraction: float = 0.0,
    **params,
) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """The seeded routing of every rank.

    Arguments:
        kind: one of :data:`KINDS` (see the module docstring).
        seed: non-negative int; the same arguments give the same routing on
            every rank and every run.
        num_tokens_per_rank: list over ranks of T_r >= 0.
        num_experts: E >= 1.
        num_topk: k, 1 <= k <= E.
        drop_fraction: in [0, 1], fraction of all slots emptied (-1).
        params: the kind's parameters: ``s`` >= 0 ("zipf", "drift");
            ``hot_fraction`` in [0, 1] and ``hot_expert`` in [0, E)
            ("hot_expert"); ``period`` >= 1 ("drift"); ``step`` >= 0.

    Returns:
        (topk_idx, topk_weights): lists over ranks of [T_r, k] int64 (expert
        ids in [0, E), -1 for an empty slot, no expert twice in a row) and
        [T_r, k] float32 (non-negative, 0 where topk_idx is -1).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown routing kind {kind!r}; expected one of {KINDS}")
    unknown = sorted(set(params) - set(_PARAMS[kind]))
    if unknown:
        raise ValueError(f"kind {kind!r} takes no parameter {unknown}; it takes {list(_PARAMS[kind]) + ['drop_fraction']}")
    _check_int("seed", seed)
    tokens = [_check_int(f"num_tokens_per_rank[{r}]", t) for r, t in enumerate(num_tokens_per_rank)]
    num_experts = _check_int("num_experts", num_experts, low=1)
    num_topk = _check_int("num_topk", num_topk, low=1)
    if num_topk > num_experts:
        raise ValueError(f"num_topk ({num_topk}) must be <= num_experts ({num_experts})")
    _check_fraction("drop_fraction", drop_fraction)

    if kind in ("uniform", "imbalance"):
        idx = reference.make_routing(seed, tokens, num_experts, num_topk)
    elif kind in ("zipf", "drift"):
        step = _check_int("step", params.get("step", 0))
        epoch = step // _check_int("period", params.get("period", 8), low=1) if kind == "drift" else None
        idx = _zipf(seed, tokens, num_experts, num_topk, params.get("s", 1.0), step, epoch)
    elif kind == "hot_expert":
        idx = _hot_expert(seed, tokens, num_experts, num_topk,
                          params.get("hot_fraction", 0.5), params.get("hot_expert", 0),
                          _check_int("step", params.get("step", 0)))
    else:
        idx = [np.full((t, num_topk), -1, dtype=np.int64) for t in tokens]
        for a in idx:
            a[:, 0] = 0
    _drop(seed, idx, drop_fraction)
    weights = reference.make_weights(seed, idx)
    for w, a in zip(weights, idx):
        w[a < 0] = 0
    return idx, weights


def imbalanced_tokens(seed: int, num_ranks: int, mean_tokens: int, imbalance: float) -> List[int]:
    """Per-rank token counts whose max / mean is ``imbalance``.

    One rank, chosen by the seed, holds ``round(imbalance * mean_tokens)``
    tokens; the other ranks share the rest evenly (counts differing by at most
    1). The counts sum to exactly ``num_ranks * mean_tokens``, so max / mean
    is ``imbalance`` up to the rounding of the heavy count.

    Arguments:
        seed: non-negative int.
        num_ranks: R >= 1.
        mean_tokens: >= 0.
        imbalance: in [1, R] (R means every token on one rank).

    Returns:
        list of R ints, for :func:`make`'s ``num_tokens_per_rank``.
    """
    _check_int("seed", seed)
    num_ranks = _check_int("num_ranks", num_ranks, low=1)
    mean_tokens = _check_int("mean_tokens", mean_tokens)
    if not 1 <= imbalance <= num_ranks:
        raise ValueError(f"imbalance ({imbalance}) must be in [1, num_ranks={num_ranks}]")
    total = num_ranks * mean_tokens
    heavy = min(int(round(imbalance * mean_tokens)), total)
    order = np.random.default_rng([seed, _IMBALANCE_STREAM]).permutation(num_ranks)
    counts = np.zeros(num_ranks, dtype=np.int64)
    counts[order[0]] = heavy
    if num_ranks > 1:
        base, extra = divmod(total - heavy, num_ranks - 1)
        counts[order[1:]] = base
        counts[order[1 : 1 + extra]] += 1
    return [int(c) for c in counts]


def imbalance_factor(idx_list: Sequence[np.ndarray], num_experts: int) -> float:
    """Expert load imbalance: the most (token, slot) pairs any expert receives
    over the mean over experts (1.0 is balanced; 1.0 when nothing is routed).

    Arguments:
        idx_list: list over ranks of [T_r, k] int ids in [-1, E) (-1 ignored).
        num_experts: E >= 1.
    """
    num_experts = _check_int("num_experts", num_experts, low=1)
    counts = np.zeros(num_experts, dtype=np.int64)
    for r, a in enumerate(idx_list):
        ids = np.asarray(a).reshape(-1)
        if ids.size and not (-1 <= ids.min() and ids.max() < num_experts):
            raise ValueError(f"idx_list[{r}] holds ids outside [-1, {num_experts})")
        counts += np.bincount(ids[ids >= 0].astype(np.int64), minlength=num_experts)
    total = int(counts.sum())
    return 1.0 if total == 0 else float(counts.max()) * num_experts / total


def _streams(step: int) -> tuple:
    """The extra entries of a step's token streams: none at step 0."""
    return (step,) if step else ()


def _zipf(seed, tokens, num_experts, num_topk, s, step=0, epoch=None) -> List[np.ndarray]:
    if not (isinstance(s, (int, float, np.number)) and math.isfinite(s) and s >= 0):
        raise ValueError(f"zipf skew s must be finite and >= 0, got {s!r}")
    # Gumbel top-k: the k largest log p_e + Gumbel noise are k draws without
    # replacement, each in proportion to p_e among the experts left.
    order_stream = [seed, _EXPERT_ORDER_STREAM] + ([] if epoch is None else [_DRIFT_STREAM, epoch])
    order = np.random.default_rng(order_stream).permutation(num_experts)
    log_p = np.empty(num_experts)
    log_p[order] = -s * np.log1p(np.arange(num_experts))
    return [_top_k(log_p + np.random.default_rng([seed, r, _ZIPF_STREAM, *_streams(step)])
                   .gumbel(size=(t, num_experts)), num_topk)
            for r, t in enumerate(tokens)]


def _hot_expert(seed, tokens, num_experts, num_topk, fraction, hot, step=0) -> List[np.ndarray]:
    _check_fraction("hot_fraction", fraction)
    hot = _check_int("hot_expert", hot)
    if hot >= num_experts:
        raise ValueError(f"hot_expert ({hot}) must be in [0, num_experts={num_experts})")
    total = sum(tokens)
    num_hot = int(round(fraction * total))
    if num_hot < total and num_topk == num_experts:
        raise ValueError(f"hot_fraction ({fraction}) < 1 needs num_topk ({num_topk}) < num_experts: "
                         "with k = E every token holds the hot expert")
    is_hot = np.zeros(total, dtype=bool)
    is_hot[np.random.default_rng([seed, _HOT_TOKENS_STREAM, *_streams(step)])
           .choice(total, num_hot, replace=False)] = True
    idx, start = [], 0
    for r, t in enumerate(tokens):
        scores = np.random.default_rng([seed, r, _HOT_STREAM, *_streams(step)]).random((t, num_experts))  # [0, 1)
        scores[:, hot] = np.where(is_hot[start : start + t], 2.0, -1.0)  # always first / never picked
        idx.append(_top_k(scores, num_topk))
        start += t
    return idx


def _drop(seed, idx, fraction) -> None:
    if fraction == 0 or not idx:
        return
    flat = np.concatenate([a.reshape(-1) for a in idx])
    valid = np.flatnonzero(flat >= 0)
    num_drop = min(int(round(fraction * flat.size)), valid.size)
    flat[np.random.default_rng([seed, _DROP_STREAM]).choice(valid, num_drop, replace=False)] = -1
    start = 0
    for a in idx:
        a.reshape(-1)[:] = flat[start : start + a.size]
        start += a.size


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """[T, k] int64: the columns of the k highest scores per row, highest first."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)


def _check_int(name: str, value, low: int = 0) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _check_fraction(name: str, value) -> None:
    if not (isinstance(value, (int, float, np.number)) and 0 <= value <= 1):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
