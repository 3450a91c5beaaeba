"""A dispatch routed by ``is_token_in_rank`` alone (DeepEP's dispatch without
top-k), on cupyep's dispatch, which routes by top-k.
"""
from __future__ import annotations

import numpy as np


def rank_routing(is_token_in_rank, num_experts: int):
    """[T, R] int64 top-k that sends token t to exactly the ranks of
    ``is_token_in_rank[t]``: column r is rank r's first local expert
    (r * num_experts / R) where the token goes to rank r, else -1.

    Arguments:
        is_token_in_rank: [T, R] bool, NumPy or CuPy (the result is of the same kind).
        num_experts: E, a multiple of R.
    """
    from ..arrays import xp_of
    xp = xp_of(is_token_in_rank)
    T, R = is_token_in_rank.shape
    if num_experts % R:
        raise ValueError(f"num_experts={num_experts} is not a multiple of the {R} ranks")
    first = xp.arange(R, dtype=np.int64) * (num_experts // R)
    return xp.where(is_token_in_rank, first[None, :], np.int64(-1)).astype(np.int64, copy=False)
