"""The two-hop route's reference (cupyep.reference.internode): every
(token, destination rank) row is delivered exactly once, across the network
at most once per (token, node), through the rail peer; the per-node
deduplication's saving; the degenerate one-node case."""
import numpy as np
import pytest

from cupyep import reference as ref

from cupyep.reference import internode as I
from cupyep.testing import global_routing


@pytest.mark.parametrize("R,K", [(4, 2), (8, 4), (8, 2), (16, 8)])
def test_every_row_arrives_once_through_its_rail(R, K):
    E, T = 64, 200
    idx, _ = global_routing(7, [T] * R, E, 8)
    routes = I.two_hop_routes(idx, E, R, K)
    N = R // K
    arrived = np.zeros((R, R), dtype=np.int64)  # [src, dst] rows
    for r in routes:
        own = r.rank // K
        arrived[r.rank, own * K:(own + 1) * K] += r.direct
        for n in range(N):
            if n != own:
                arrived[r.rank, n * K:(n + 1) * K] += r.forwarded[n]
    expected = np.stack([ref.get_dispatch_layout(i, E, R).num_tokens_per_rank for i in idx]).astype(np.int64)
    assert np.array_equal(arrived, expected)
    # Each remote node gets each token once, and only tokens that go there.
    for r, i in zip(routes, idx):
        inn = ref.get_dispatch_layout(i, E, R).is_token_in_rank.reshape(T, N, K).any(axis=2)
        want = inn.sum(axis=0)
        want[r.rank // K] = 0
        assert np.array_equal(r.rdma_tokens, want)
        assert np.all(r.rdma_tokens <= r.rdma_rows_per_rank)
        assert np.all(r.forwarded.sum(axis=1) == r.rdma_rows_per_rank)


def test_traffic_counts_and_the_saving():
    R, K, E, T, row = 8, 4, 64, 300, 7168 * 2
    idx, _ = global_routing(3, [T] * R, E, 8)
    routes = I.two_hop_routes(idx, E, R, K)
    tr = I.two_hop_traffic(routes, K, row)
    assert tr.rdma_bytes == sum(int(r.rdma_tokens.sum()) for r in routes) * row
    assert tr.saved_bytes == tr.rdma_bytes_without_dedup - tr.rdma_bytes > 0  # top-8 of 64: tokens hit several ranks
    assert int(tr.rail_in_bytes.sum()) == tr.rdma_bytes == int(tr.rdma_bytes_per_rank.sum())
    recv = sum(int(ref.get_dispatch_layout(i, E, R).num_tokens_per_rank.sum()) for i in idx)
    assert tr.nvlink_bytes == recv * row
    # A rail peer receives only from the sources with its local index.
    for s in range(R):
        for n in range(R // K):
            assert I.rail_peer(s, n, K) % K == s % K and I.rail_peer(s, n, K) // K == n


def test_one_node_sends_nothing_over_the_network():
    R, E = 4, 32
    idx, _ = global_routing(1, [50] * R, E, 4)
    tr = I.two_hop_traffic(I.two_hop_routes(idx, E, R, R), R, 256)
    assert tr.rdma_bytes == tr.rdma_bytes_without_dedup == tr.saved_bytes == 0 and tr.nvlink_bytes > 0


def test_bad_shapes_are_refused():
    idx, _ = global_routing(1, [10] * 4, 32, 4)
    with pytest.raises(ValueError, match="ranks' routings"):
        I.two_hop_routes(idx[:3], 32, 4, 2)
    with pytest.raises(ValueError, match="divisor"):
        I.two_hop_routes(idx, 32, 4, 3)


@pytest.mark.parametrize("R,K", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_the_two_hop_offsets_deliver_exactly_the_intranode_rows(R, K):
    """Network puts into rail peers at the plan's slots, forwarding to the
    plan's final rows, and the direct rows: every rank ends up with what the
    one-node dispatch gives it, row for row (a collision or a hole asserts)."""
    E, T, H = 48, 40, 256
    tokens = [T if r != 1 else 0 for r in range(R)]  # a rank with no tokens
    idx, w = global_routing(11, tokens, E, 4)
    x = [ref.make_tagged_x(r, t, H) for r, t in enumerate(tokens)]
    want = ref.intranode_dispatch(x, idx, E, topk_weights=w)
    got = I.emulate_two_hop_dispatch(x, idx, E, K, topk_weights=w)
    for d in range(R):
        rx, rs, ri, rid, rw = got[d]
        e = want[d]
        assert np.array_equal(rx, e.recv_x) and np.array_equal(rs, e.recv_src_rank)
        assert np.array_equal(ri, e.recv_src_idx) and np.array_equal(rid, e.recv_topk_idx)
        assert np.array_equal(rw, e.recv_topk_weights)
    plan = I.two_hop_plan(idx, E, R, K)
    routes = I.two_hop_routes(idx, E, R, K)
    rail_in = I.two_hop_traffic(routes, K, 1).rail_in_bytes
    assert np.array_equal(plan.rdma_rows, rail_in)  # the buffer each rank needs holds what its rails send it


@pytest.mark.parametrize("R,K", [(4, 2), (8, 4)])
@pytest.mark.parametrize("partials", ["float32", "bfloat16"])
def test_the_two_hop_combine_matches_the_one_node_combine(R, K, partials):
    """Reduce inside the node at the rail peer, one partial per (token, node)
    over the network, the final sum at the source: within 5e-6 of the exact
    combine (after the BF16 output rounding), weighted and not."""
    import ml_dtypes
    E, T, H = 48, 60, 256
    idx, w = global_routing(13, [T] * R, E, 6)
    rng = np.random.default_rng(2)
    x = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(R)]
    res = ref.intranode_dispatch(x, idx, E, topk_weights=w)
    ys = [ref.bf16_round(r.recv_x * np.float32((d % 5 + 1) / 3)) for d, r in enumerate(res)]  # rows differ per rank
    row_w = [r.recv_topk_weights.sum(axis=1).astype(np.float32) for r in res]
    pdt = ml_dtypes.bfloat16 if partials == "bfloat16" else np.float32
    for weights in (None, row_w):
        exact = ref.intranode_combine(ys, res, [T] * R, weights)
        got = I.emulate_two_hop_combine(ys, res, [T] * R, K, weights, partial_dtype=pdt)
        again = I.emulate_two_hop_combine(ys, res, [T] * R, K, weights, partial_dtype=pdt)
        assert all(np.array_equal(a, b) for a, b in zip(got, again))
        diff = ref.calc_diff(ref.bf16_round(np.concatenate(got)), np.concatenate(exact))
        assert diff < 5e-6, diff
