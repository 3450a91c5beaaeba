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
from typing import List, Optional, Sequence

import numpy as np

from .layout import get_dispatch_layout

__all__ = ["TwoHopRoute", "TwoHopTraffic", "two_hop_routes", "two_hop_traffic", "rail_peer", "TwoHopPlan",
           "two_hop_plan", "emulate_two_hop_dispatch", "emulate_two_hop_combine"]


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


@dataclass(frozen=True)
class TwoHopPlan:
    """Where every row of a two-hop dispatch goes: what the kernels compute
    from the counts every rank has after the count exchange.

    Attributes:
        ranks_per_node: K.
        send_head: list over sources s of [T_s, R] int64: token t's position
            among s's tokens for rank d (in token order), -1 where t does not
            go to d. Its final row at d is rank_prefix_matrix[s - 1, d] + this.
        rank_prefix_matrix: [R, R] int64, as in intranode_dispatch.
        rdma_slot: list over s of [T_s, N] int64: the row of token t in the
            network receive buffer of its rail peer in node n, -1 for s's own
            node and for nodes t does not go to.
        rdma_rows: [R] int64, rows each rank's network receive buffer holds
            (from every source with its local index in other nodes).
        rdma_block: [R, R] int64, [p, s]: first row of source s's block in
            rank p's network receive buffer, -1 unless p is s's rail peer in
            another node. Blocks are in source-node order.
    """
    ranks_per_node: int
    send_head: List[np.ndarray]
    rank_prefix_matrix: np.ndarray
    rdma_slot: List[np.ndarray]
    rdma_rows: np.ndarray
    rdma_block: np.ndarray


def two_hop_plan(topk_idx: Sequence[np.ndarray], num_experts: int, num_ranks: int, ranks_per_node: int) -> TwoHopPlan:
    """The offsets of a two-hop dispatch of ``topk_idx`` (list over ranks of [T_s, k])."""
    R, K = num_ranks, int(ranks_per_node)
    if len(topk_idx) != R:
        raise ValueError(f"topk_idx has {len(topk_idx)} ranks' routings, num_ranks is {R}")
    layouts = [get_dispatch_layout(i, num_experts, R, K) for i in topk_idx]
    N = R // K
    counts = np.stack([lay.num_tokens_per_rank for lay in layouts]).astype(np.int64)  # [s, d]
    node_counts = np.stack([lay.num_tokens_per_node for lay in layouts]).astype(np.int64)  # [s, n]
    rpm = np.cumsum(counts, axis=0)
    send_head = []
    for lay in layouts:
        inr = lay.is_token_in_rank
        send_head.append(np.where(inr, np.cumsum(inr, axis=0) - 1, -1).astype(np.int64))
    rdma_block = np.full((R, R), -1, dtype=np.int64)
    rdma_rows = np.zeros(R, dtype=np.int64)
    for p in range(R):
        acc = 0
        for m in range(N):  # source nodes in order
            s = m * K + p % K
            if m == p // K:
                continue
            rdma_block[p, s] = acc
            acc += node_counts[s, p // K]
        rdma_rows[p] = acc
    rdma_slot = []
    for s, lay in enumerate(layouts):
        inn = lay.is_token_in_node
        slot = np.where(inn, np.cumsum(inn, axis=0) - 1, -1).astype(np.int64)
        for n in range(N):
            if n == s // K:
                slot[:, n] = -1
            else:
                p = rail_peer(s, n, K)
                slot[:, n] = np.where(slot[:, n] >= 0, slot[:, n] + rdma_block[p, s], -1)
        rdma_slot.append(slot)
    return TwoHopPlan(K, send_head, rpm, rdma_slot, rdma_rows, rdma_block)


def emulate_two_hop_dispatch(x: Sequence[np.ndarray], topk_idx: Sequence[np.ndarray], num_experts: int,
                             ranks_per_node: int, topk_weights: Optional[Sequence[np.ndarray]] = None):
    """Run the two-hop dispatch's data movement as the kernels do, hop by hop
    (network puts into rail peers' receive buffers with each row's metadata,
    then the rail peers' forwarding, and the direct rows within each node),
    and return what every rank receives: list over d of (recv_x, recv_src_rank,
    recv_src_idx, recv_topk_idx (global ids), recv_topk_weights or None).
    Equal to intranode_dispatch's rows by construction of the offsets, which
    is what the tests check."""
    R, K = len(x), int(ranks_per_node)
    plan = two_hop_plan(topk_idx, num_experts, R, K)
    N, H, k = R // K, x[0].shape[1], topk_idx[0].shape[1]
    E_local = num_experts // R
    n_recv = plan.rank_prefix_matrix[-1]
    recv = [np.zeros((int(n_recv[d]), H), dtype=x[0].dtype) for d in range(R)]
    src_rank = [np.full(int(n_recv[d]), -1, dtype=np.int32) for d in range(R)]
    src_idx = [np.full(int(n_recv[d]), -1, dtype=np.int32) for d in range(R)]
    ids = [np.full((int(n_recv[d]), k), -2, dtype=np.int64) for d in range(R)]
    ws = [np.zeros((int(n_recv[d]), k), dtype=np.float32) for d in range(R)] if topk_weights is not None else None

    def deliver(d, s, t, row, tidx, tw):
        at = (plan.rank_prefix_matrix[s - 1, d] if s > 0 else 0) + plan.send_head[s][t, d]
        assert src_rank[d][at] == -1, "two rows land on one slot"
        recv[d][at], src_rank[d][at], src_idx[d][at], ids[d][at] = row, s, t, tidx
        if ws is not None:
            ws[d][at] = tw

    # Hop 1 (network): one put per (token, remote node) into the rail peer's buffer, with its metadata.
    net = [dict() for _ in range(R)]  # p -> {slot: (s, t, row, topk ids, weights, positions at p's node)}
    for s in range(R):
        for t in range(x[s].shape[0]):
            for n in range(N):
                slot = plan.rdma_slot[s][t, n]
                if slot < 0:
                    continue
                p = rail_peer(s, n, K)
                assert slot not in net[p] and slot < plan.rdma_rows[p], "network rows collide"
                pos = plan.send_head[s][t, n * K:(n + 1) * K]
                net[p][int(slot)] = (s, t, x[s][t], topk_idx[s][t], None if ws is None else topk_weights[s][t], pos)
            own = s // K
            for j in range(K):  # within the node: straight to the destination
                d = own * K + j
                if plan.send_head[s][t, d] >= 0:
                    deliver(d, s, t, x[s][t], topk_idx[s][t], None if ws is None else topk_weights[s][t])
    # Hop 2 (NVLink): each rail peer forwards every received row to its node's destination ranks.
    for p in range(R):
        for slot, (s, t, row, tidx, tw, pos) in sorted(net[p].items()):
            for j in range(K):
                if pos[j] >= 0:
                    deliver((p // K) * K + j, s, t, row, tidx, tw)
    out = []
    for d in range(R):
        assert (src_rank[d] >= 0).all(), "a row never arrived"
        local = ids[d] - d * E_local
        is_local = (local >= 0) & (local < E_local)
        out.append((recv[d], src_rank[d], src_idx[d], np.where(is_local, local, -1),
                    None if ws is None else np.where(is_local, ws[d], np.float32(0)).astype(np.float32)))
    return out


def emulate_two_hop_combine(recv_x: Sequence[np.ndarray], results, num_tokens: Sequence[int], ranks_per_node: int,
                            weights: Optional[Sequence[np.ndarray]] = None, partial_dtype=np.float32) -> List[np.ndarray]:
    """The two-hop combine's reduction, in the order the kernels use: each
    rank's rows for a token of another node go to its node's rail peer for
    that token's source, which sums its node's rows (float32, in local rank
    order) into one partial, rounded to ``partial_dtype`` (float32 or
    ml_dtypes.bfloat16) for the network hop; the source sums its own node's
    rows (rank order) and the other nodes' partials (node order) in float32.

    Arguments:
        recv_x: list over d of [N_d, H] expert outputs in received-row order.
        results: list over d of intranode_dispatch results (which source row
            each received row is).
        num_tokens: list over s of T_s.
        weights: None or list over d of [N_d] float32 (one weight per row).

    Returns:
        list over s of [T_s, H] float32 (deterministic: fixed orders).
    """
    R, K = len(results), int(ranks_per_node)
    N, H = R // K, np.shape(recv_x[0])[-1]
    f32 = np.float32
    node_partial = [np.zeros((N, int(t), H), dtype=f32) for t in num_tokens]  # [s][n, t] (the rail's sum)
    direct = [np.zeros((int(t), H), dtype=f32) for t in num_tokens]
    hit = [np.zeros((N, int(t)), dtype=bool) for t in num_tokens]
    for n in range(N):
        for j in range(K):  # local rank order inside each node
            d = n * K + j
            res = results[d]
            vals = np.asarray(recv_x[d], dtype=f32)
            if weights is not None:
                vals = vals * np.asarray(weights[d], dtype=f32)[:, None]
            for r in range(res.num_recv_tokens):
                s, t = int(res.recv_src_rank[r]), int(res.recv_src_idx[r])
                if s // K == n:
                    direct[s][t] += vals[r]
                else:
                    node_partial[s][n, t] += vals[r]
                    hit[s][n, t] = True
    out = []
    for s in range(R):
        acc = np.zeros((int(num_tokens[s]), H), dtype=f32)
        for n in range(N):  # node order; the source's own node is its direct rows
            if n == s // K:
                acc += direct[s]
            else:
                part = node_partial[s][n].astype(partial_dtype).astype(f32)  # the network hop's rounding
                acc += np.where(hit[s][n][:, None], part, f32(0))
        out.append(acc)
    return out
