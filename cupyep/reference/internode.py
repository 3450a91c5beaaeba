"""Reference of the hierarchical (two-hop) route across nodes: which rows
cross the network, to which GPU, and which GPU forwards them.

R ranks in nodes of K (node of rank r: r // K, local index r % K). A token
of rank s bound for node n != node(s) crosses the network once, to its rail
peer ``n * K + s % K`` (the GPU with the same local index), however many of
node n's ranks it goes to: the per-node deduplication. The rail peer
forwards it over NVLink to each destination rank in node n. Tokens bound
for s's own node go straight over NVLink. What arrives at each rank is what
normal mode's dispatch within a node delivers (``intranode_dispatch``: one
row per (token, rank), by source rank then source token), so the two-hop
mode is checked against the same oracle; this module gives the traffic.

Byte counts follow DeepEP's internode test: logical RDMA bytes are the
rows sent over the network (one per (token, remote node)), NVLink bytes
the rows every rank receives (each arrives over NVLink on its last hop).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from .layout import get_dispatch_layout

__all__ = ["TwoHopRoute", "TwoHopTraffic", "two_hop_routes", "two_hop_traffic", "rail_peer"]


def rail_peer(src_rank: int, dst_node: int, ranks_per_node: int) -> int:
    """The rank in ``dst_node`` a token of ``src_rank`` crosses the network to."""
    return dst_node * ranks_per_node + src_rank % ranks_per_node


@dataclass(frozen=True)
class TwoHopRoute:
    """How one source rank's tokens travel.

    Attributes:
        rank: the source rank s.
        rdma_tokens: [N] int64, tokens s sends over the network to each node
            (one per token and node; 0 for s's own node).
        rdma_rows_per_rank: [N] int64, the rows that would cross the network
            to each node without the per-node deduplication (one per token
            and destination rank there; 0 for s's own node).
        forwarded: [N, K] int64, rows the rail peer in node n forwards to its
            local rank j (tokens of s for rank n * K + j; 0 for s's own node).
        direct: [K] int64, rows s sends straight to each rank of its own node.
        is_token_in_node: [T, N] bool.
    """
    rank: int
    rdma_tokens: np.ndarray
    rdma_rows_per_rank: np.ndarray
    forwarded: np.ndarray
    direct: np.ndarray
    is_token_in_node: np.ndarray


def two_hop_routes(topk_idx: Sequence[np.ndarray], num_experts: int, num_ranks: int,
                   ranks_per_node: int) -> List[TwoHopRoute]:
    """The route of every source rank's tokens.

    Arguments:
        topk_idx: list over ranks of [T_s, k] int64 expert ids in [-1, E).
        num_experts: E, divisible by num_ranks.
        num_ranks: R, a multiple of ranks_per_node.
        ranks_per_node: K.
    """
    if len(topk_idx) != num_ranks:
        raise ValueError(f"topk_idx has {len(topk_idx)} ranks' routings, num_ranks is {num_ranks}")
    K = int(ranks_per_node)
    routes = []
    for s, idx in enumerate(topk_idx):
        lay = get_dispatch_layout(idx, num_experts, num_ranks, K)
        N = num_ranks // K
        own = s // K
        per_rank = lay.num_tokens_per_rank.astype(np.int64).reshape(N, K)
        rdma_tokens = lay.num_tokens_per_node.astype(np.int64).copy()
        rdma_tokens[own] = 0
        rdma_rows = per_rank.sum(axis=1)
        rdma_rows[own] = 0
        forwarded = per_rank.copy()
        forwarded[own] = 0
        routes.append(TwoHopRoute(rank=s, rdma_tokens=rdma_tokens, rdma_rows_per_rank=rdma_rows, forwarded=forwarded,
                                  direct=per_rank[own].copy(), is_token_in_node=lay.is_token_in_node))
    return routes


@dataclass(frozen=True)
class TwoHopTraffic:
    """Bytes of one dispatch over all ranks (``row_bytes`` per row).

    Attributes:
        rdma_bytes: logical bytes over the network (one row per (token, remote node)).
        rdma_bytes_without_dedup: the same, one row per (token, remote rank).
        saved_bytes: rdma_bytes_without_dedup - rdma_bytes.
        nvlink_bytes: bytes every rank receives (the last hop's).
        rdma_bytes_per_rank: [R] what each rank sends over the network.
        rail_in_bytes: [R] what each rank receives over the network (as rail peer).
    """
    rdma_bytes: int
    rdma_bytes_without_dedup: int
    saved_bytes: int
    nvlink_bytes: int
    rdma_bytes_per_rank: np.ndarray
    rail_in_bytes: np.ndarray


def two_hop_traffic(routes: Sequence[TwoHopRoute], ranks_per_node: int, row_bytes: int) -> TwoHopTraffic:
    """The traffic of ``routes`` (two_hop_routes) with ``row_bytes`` per row."""
    R, K = len(routes), int(ranks_per_node)
    sent = np.array([int(r.rdma_tokens.sum()) for r in routes], dtype=np.int64) * row_bytes
    rail_in = np.zeros(R, dtype=np.int64)
    received = 0
    for r in routes:
        for n, tokens in enumerate(r.rdma_tokens):
            rail_in[rail_peer(r.rank, n, K)] += int(tokens) * row_bytes
        received += int(r.forwarded.sum() + r.direct.sum())
    without = sum(int(r.rdma_rows_per_rank.sum()) for r in routes) * row_bytes
    total = int(sent.sum())
    return TwoHopTraffic(rdma_bytes=total, rdma_bytes_without_dedup=without, saved_bytes=without - total,
                         nvlink_bytes=received * row_bytes, rdma_bytes_per_rank=sent, rail_in_bytes=rail_in)
