"""Utilities shared by the GPU tests and the benchmarks.

- :func:`payload_bf16`: tagged BF16 rows, a pure function of (source rank,
  token, column), so any rank can compute what any received row must hold
  and a misrouted row or column is caught.
- :func:`global_routing`: the seeded routing of every rank (every rank builds
  the same), from :mod:`cupyep.routing`.
- :func:`all_ranks`: AND of a condition over the ranks, so that all ranks
  fail a test together instead of hanging in the next collective.
"""
from __future__ import annotations

import numpy as np

from . import routing


def payload_bf16(src_rank: int, tokens, hidden: int) -> np.ndarray:
    """[len(tokens), hidden] uint16 BF16 bit patterns: finite values with
    magnitude < 1, a hash of (src_rank, token, column).

    Arguments:
        src_rank: int.
        tokens: [N] int token indices within the source rank.
        hidden: H.
    """
    t = np.asarray(tokens, dtype=np.uint32)[:, None]
    h = np.arange(hidden, dtype=np.uint32)[None, :]
    v = (t * np.uint32(2654435761)) ^ (h * np.uint32(40503)) ^ np.uint32(((src_rank + 1) * 374761393) & 0xFFFFFFFF)
    v ^= v >> np.uint32(13)
    v *= np.uint32(1274126177)
    v ^= v >> np.uint32(16)
    mag = (v % np.uint32(0x3F80)).astype(np.uint16)          # exponent < 127: |x| < 1
    sign = ((v >> np.uint32(20)) & np.uint32(1)).astype(np.uint16) << np.uint16(15)
    return mag | sign


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 BF16 bits -> float32 values."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 BF16 bits, round to nearest even."""
    import ml_dtypes
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def global_routing(seed: int, num_tokens_per_rank, num_experts: int, num_topk: int, case: str = "random"):
    """Every rank's topk_idx and topk_weights (lists over ranks), from
    :func:`cupyep.routing.make` with the kind's default parameters.

    case: "random" (kind "uniform": top-k of |randn| + 1 with some -1 slots),
    "one_expert" (every token to expert 0, other slots -1) or another kind
    of :data:`cupyep.routing.KINDS`.

    Returns:
        (list over ranks of [T_r, num_topk] int64, list over ranks of
        [T_r, num_topk] float32, 0 in -1 slots).
    """
    return routing.make("uniform" if case == "random" else case, seed, num_tokens_per_rank, num_experts, num_topk)


def all_ranks(comm, ok: bool) -> bool:
    """True when ``ok`` holds on every rank of ``comm``."""
    from mpi4py import MPI
    return bool(comm.allreduce(bool(ok), op=MPI.LAND))
