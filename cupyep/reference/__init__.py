"""NumPy reference ("oracle") for cupyep's dispatch and combine.

Pure NumPy + ml_dtypes, no GPU. Every function computes all ranks at once from
global per-rank inputs (lists with one entry per rank), so a test on rank
``r`` builds the same seeded global inputs with :func:`make_routing`,
:func:`make_weights` and :func:`make_tagged_x`, runs the reference, and
compares entry ``r`` with what its GPU produced.

Modules:
- ``layout``: per-rank / per-expert / per-node counts (``get_dispatch_layout``).
- ``intranode``: normal-mode dispatch (deduplicated per rank) and combine.
- ``internode``: the two-hop route across nodes (rail peers, per-node
  deduplication) and its RDMA / NVLink bytes.
- ``low_latency``: low-latency dispatch (one message per selection) and combine.
- ``fp8``: per-token, per-128-channel e4m3 quantisation, UE8M0 scales.
- ``logfmt``: LogFMT-10, a 10-bit log2 format of combine rows (encode, decode, its error bound).
- ``packed_layout``: DeepEP's packed low-latency layout over cupyep's
  region layout (index math and the packing by array indexing, NumPy or CuPy).
- ``metrics``: DeepEP's ``calc_diff`` similarity and BF16 rounding.

Conventions: R ranks, E experts, ``E_local = E // R``; rank ``r`` owns experts
``[r * E_local, (r + 1) * E_local)``; ``topk_idx`` is int64 with -1 for "no
expert".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from .fp8 import (
    FP8_BLOCK_SIZE,
    FP8_E4M3_MAX,
    Fp8Tensor,
    e4m3_step,
    pack_ue8m0,
    per_token_cast_back,
    per_token_cast_to_fp8,
    unpack_ue8m0,
)
from .intranode import (
    ExpertMajorLayout,
    IntranodeDispatchResult,
    expert_major_order,
    expert_major_reduce,
    intranode_combine,
    intranode_combine_topk_weights,
    intranode_dispatch,
)
from .layout import DispatchLayout, get_dispatch_layout, validate_topk_idx
from .low_latency import LowLatencyDispatchResult, low_latency_combine, low_latency_dispatch, low_latency_partial_combine
from .metrics import bf16_round, calc_diff

__all__ = [
    "DispatchLayout",
    "get_dispatch_layout",
    "validate_topk_idx",
    "IntranodeDispatchResult",
    "ExpertMajorLayout",
    "intranode_dispatch",
    "intranode_combine",
    "intranode_combine_topk_weights",
    "expert_major_order",
    "expert_major_reduce",
    "LowLatencyDispatchResult",
    "low_latency_dispatch",
    "low_latency_combine",
    "low_latency_partial_combine",
    "FP8_E4M3_MAX",
    "FP8_BLOCK_SIZE",
    "Fp8Tensor",
    "per_token_cast_to_fp8",
    "per_token_cast_back",
    "pack_ue8m0",
    "unpack_ue8m0",
    "e4m3_step",
    "calc_diff",
    "bf16_round",
    "make_routing",
    "make_weights",
    "make_tagged_x",
    "TaggedRows",
    "read_tagged_x",
]

# Test inputs. Each rank's data comes from its own stream, seeded by
# (seed, rank, purpose), so it depends only on the seed, the rank and its sizes.
_ROUTING_STREAM, _WEIGHTS_STREAM = 0, 1
_TAG_COLUMNS = 128
_TAG_DIGITS = 4  # base-256 digits of the token index: tokens < 2**32


def make_routing(
    seed: int,
    num_tokens_per_rank: Sequence[int],
    num_experts: int,
    num_topk: int,
    num_masked: Optional[int] = None,
) -> List[np.ndarray]:
    """Seeded DeepEP-style routing for every rank.

    Per rank: ``scores = |randn(T, E)| + 1``, topk_idx = the num_topk highest
    scores (distinct experts, highest first), then num_masked distinct random
    slots set to -1.

    Arguments:
        seed: non-negative int; the same seed gives the same routing everywhere.
        num_tokens_per_rank: list over ranks of T_s (0 allowed).
        num_experts: E.
        num_topk: k, 1 <= k <= E.
        num_masked: slots set to -1 per rank, at most T_s * k of them; None
            means min(10, T_s * k // 4) (DeepEP masks 10 per rank).

    Returns:
        list over ranks of [T_s, num_topk] int64.
    """
    if not 0 < num_topk <= num_experts:
        raise ValueError(f"num_topk ({num_topk}) must be in [1, num_experts={num_experts}]")
    if num_masked is not None and num_masked < 0:
        raise ValueError(f"num_masked must be >= 0, got {num_masked}")
    routing = []
    for rank, num_tokens in enumerate(num_tokens_per_rank):
        if num_tokens < 0:
            raise ValueError(f"num_tokens_per_rank[{rank}] is negative: {num_tokens}")
        rng = np.random.default_rng([seed, rank, _ROUTING_STREAM])
        scores = np.abs(rng.standard_normal((num_tokens, num_experts))) + 1.0
        topk_idx = np.argsort(-scores, axis=1, kind="stable")[:, :num_topk].astype(np.int64)
        num_slots = num_tokens * num_topk
        masked = min(10, num_slots // 4) if num_masked is None else min(num_masked, num_slots)
        topk_idx.reshape(-1)[rng.choice(num_slots, size=masked, replace=False)] = -1
        routing.append(topk_idx)
    return routing


def make_weights(seed: int, topk_idx: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Seeded routing weights ``|randn|`` (as DeepEP's tests), one array per rank.

    Weights are drawn for every slot, -1 slots included (consumers ignore them).

    Arguments:
        seed: non-negative int.
        topk_idx: list over ranks of [T_s, num_topk] int64 (only shapes are used).

    Returns:
        list over ranks of [T_s, num_topk] float32, non-negative.
    """
    return [
        np.abs(np.random.default_rng([seed, rank, _WEIGHTS_STREAM]).standard_normal(idx.shape)).astype(np.float32)
        for rank, idx in enumerate(topk_idx)
    ]


def make_tagged_x(rank: int, num_tokens: int, hidden: int, dtype=np.float32) -> np.ndarray:
    """Activations that say where they came from.

    Columns [0, hidden - 128) hold ``rank``. In the last 128 columns, column
    ``hidden - 128 + i`` for i < 4 holds base-256 digit i of the token index
    (``(t // 256**i) % 256``) and the other 124 columns hold digit 0
    (``t % 256``). So with fewer than 256 tokens the tag block holds t except
    three zero columns. All values are integers below 256, exact in float32,
    float16 and BF16. Through per-token FP8 with plain scales (T <= 256, so
    every 128-block is a constant or zero) they come back within float32
    rounding and read_tagged_x still decodes them; UE8M0 (power-of-two)
    scales do not preserve them.

    Arguments:
        rank: source rank (0 <= rank < 256).
        num_tokens: T.
        hidden: H > 128.
        dtype: float32, float16 or ml_dtypes.bfloat16.

    Returns:
        [num_tokens, hidden] of dtype.
    """
    if hidden <= _TAG_COLUMNS:
        raise ValueError(f"hidden ({hidden}) must exceed {_TAG_COLUMNS} to hold the tag block")
    if not 0 <= rank < 256 or not 0 <= num_tokens <= 256**_TAG_DIGITS:
        raise ValueError(f"rank ({rank}) must be in [0, 256), num_tokens ({num_tokens}) in [0, 2**32]")
    x = np.full((num_tokens, hidden), rank, dtype=np.float32)
    tokens = np.arange(num_tokens, dtype=np.int64)
    x[:, hidden - _TAG_COLUMNS :] = (tokens % 256)[:, None]
    for digit in range(_TAG_DIGITS):
        x[:, hidden - _TAG_COLUMNS + digit] = (tokens // 256**digit) % 256
    return x.astype(dtype)


@dataclass(frozen=True)
class TaggedRows:
    """Origin of rows built by make_tagged_x.

    Attributes:
        rank: [N] int64, source rank (column 0).
        token: [N] int64, source token index (tag digits).
    """

    rank: np.ndarray
    token: np.ndarray


def read_tagged_x(x: np.ndarray) -> TaggedRows:
    """Decode rows made by make_tagged_x (values rounded to the nearest integer).

    Arguments:
        x: [N, hidden] float32 / float16 / bfloat16 rows (hidden > 128).

    Returns:
        TaggedRows with rank [N] int64 and token [N] int64.
    """
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] <= _TAG_COLUMNS:
        raise ValueError(f"x must be [N, hidden > {_TAG_COLUMNS}], got shape {x.shape}")
    hidden = x.shape[1]
    digits = np.rint(x[:, hidden - _TAG_COLUMNS : hidden - _TAG_COLUMNS + _TAG_DIGITS].astype(np.float32))
    weights = 256 ** np.arange(_TAG_DIGITS, dtype=np.int64)
    return TaggedRows(
        rank=np.rint(x[:, 0].astype(np.float32)).astype(np.int64),
        token=digits.astype(np.int64) @ weights,
    )
