"""CPU tests of the NumPy reference (cupyep.reference): brute-force loops and properties."""

import ml_dtypes
import numpy as np
import pytest

import cupyep.reference as ref

NUM_RANKS, NUM_EXPERTS, NUM_TOPK, HIDDEN = 4, 16, 4, 256
NUM_LOCAL = NUM_EXPERTS // NUM_RANKS
TOKENS = [7, 0, 12, 5]  # rank 1 sends nothing


# ---------------------------------------------------------------- helpers


def owner(expert):
    return expert // NUM_LOCAL


def brute_force_layout(topk_idx, num_experts, num_ranks, num_ranks_per_node=None):
    num_local = num_experts // num_ranks
    per_rank = np.zeros(num_ranks, np.int64)
    per_expert = np.zeros(num_experts, np.int64)
    in_rank = np.zeros((topk_idx.shape[0], num_ranks), bool)
    for t, row in enumerate(topk_idx):
        ranks = set()
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                ranks.add(e // num_local)
        for r in ranks:
            per_rank[r] += 1
            in_rank[t, r] = True
    per_node = None
    if num_ranks_per_node:
        per_node = np.zeros(num_ranks // num_ranks_per_node, np.int64)
        for t, row in enumerate(topk_idx):
            for n in {e // num_local // num_ranks_per_node for e in row if e >= 0}:
                per_node[n] += 1
    return per_rank, per_expert, in_rank, per_node


def received_pairs(topk_idx, dst):
    """(src, token) pairs that rank dst must receive, in the expected order."""
    return [
        (s, t)
        for s, idx in enumerate(topk_idx)
        for t in range(idx.shape[0])
        if any(e >= 0 and owner(e) == dst for e in idx[t])
    ]


@pytest.fixture(scope="module")
def routing():
    return ref.make_routing(1, TOKENS, NUM_EXPERTS, NUM_TOPK, num_masked=3)


@pytest.fixture(scope="module")
def weights(routing):
    return ref.make_weights(1, routing)


@pytest.fixture(scope="module")
def tagged_x():
    return [ref.make_tagged_x(r, t, HIDDEN, ml_dtypes.bfloat16) for r, t in enumerate(TOKENS)]


@pytest.fixture(scope="module")
def dispatched(tagged_x, routing, weights):
    return ref.intranode_dispatch(tagged_x, routing, NUM_EXPERTS, topk_weights=weights)


# ---------------------------------------------------------------- test inputs


def test_make_routing_is_seeded_and_distinct():
    a = ref.make_routing(7, [9, 0, 30], 32, 6, num_masked=4)
    b = ref.make_routing(7, [9, 0, 30], 32, 6, num_masked=4)
    c = ref.make_routing(7, [20, 5, 30], 32, 6, num_masked=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert np.array_equal(a[2], c[2])  # rank 2 depends only on (seed, rank, its own size)
    assert [x.shape for x in a] == [(9, 6), (0, 6), (30, 6)]
    for idx in a:
        assert idx.dtype == np.int64
        assert (idx == -1).sum() == (4 if idx.size else 0)
        for row in idx:
            valid = row[row >= 0]
            assert len(set(valid.tolist())) == valid.size
            assert valid.size == 0 or (valid.min() >= 0 and valid.max() < 32)
    w = ref.make_weights(7, a)
    assert all(x.dtype == np.float32 and x.shape == i.shape and (x >= 0).all() for x, i in zip(w, a))


def test_tagged_x_round_trip():
    for dtype in (np.float32, ml_dtypes.bfloat16):
        x = ref.make_tagged_x(3, 70000, 256, dtype)
        tags = ref.read_tagged_x(x)
        assert (tags.rank == 3).all()
        assert np.array_equal(tags.token, np.arange(70000))
    small = ref.make_tagged_x(2, 5, 256)
    assert (small[:, :128] == 2).all()
    assert np.array_equal(small[:, -1], np.arange(5))  # DeepEP-style: the tag block holds t
    with pytest.raises(ValueError):
        ref.make_tagged_x(0, 4, 128)


def test_tags_survive_fp8_with_plain_scales():
    x = ref.make_tagged_x(5, 256, 512)
    fp8 = ref.per_token_cast_to_fp8(x)
    tags = ref.read_tagged_x(ref.per_token_cast_back(fp8.data, fp8.scales))
    assert (tags.rank == 5).all() and np.array_equal(tags.token, np.arange(256))


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("num_ranks_per_node", [None, 1, 2, 4])
def test_layout_matches_loops(num_ranks_per_node):
    for idx in ref.make_routing(3, [0, 1, 25, 64], NUM_EXPERTS, NUM_TOPK, num_masked=9):
        layout = ref.get_dispatch_layout(idx, NUM_EXPERTS, NUM_RANKS, num_ranks_per_node)
        per_rank, per_expert, in_rank, per_node = brute_force_layout(idx, NUM_EXPERTS, NUM_RANKS, num_ranks_per_node)
        assert layout.num_tokens_per_rank.dtype == np.int32
        assert layout.num_tokens_per_expert.dtype == np.int32
        assert np.array_equal(layout.num_tokens_per_rank, per_rank)
        assert np.array_equal(layout.num_tokens_per_expert, per_expert)
        assert np.array_equal(layout.is_token_in_rank, in_rank)
        if num_ranks_per_node is None:
            assert layout.num_tokens_per_node is None and layout.is_token_in_node is None
        else:
            assert np.array_equal(layout.num_tokens_per_node, per_node)
            assert np.array_equal(layout.is_token_in_node.sum(0), per_node)


def test_layout_edge_cases():
    empty = ref.get_dispatch_layout(np.zeros((0, 3), np.int64), 8, 2, 1)
    assert empty.is_token_in_rank.shape == (0, 2)
    assert not empty.num_tokens_per_rank.any() and not empty.num_tokens_per_expert.any()

    masked = ref.get_dispatch_layout(np.full((5, 2), -1, np.int64), 8, 2)
    assert not masked.num_tokens_per_rank.any() and not masked.is_token_in_rank.any()

    one_expert = np.full((6, 3), -1, np.int64)
    one_expert[:, 1] = 5
    layout = ref.get_dispatch_layout(one_expert, 8, 2, 2)
    assert layout.num_tokens_per_expert.tolist() == [0, 0, 0, 0, 0, 6, 0, 0]
    assert layout.num_tokens_per_rank.tolist() == [0, 6]
    assert layout.num_tokens_per_node.tolist() == [6]

    # Two experts of one rank count once for the rank, twice as selections.
    same_rank = np.array([[0, 1, -1], [2, 7, 3]], np.int64)
    layout = ref.get_dispatch_layout(same_rank, 8, 2)
    assert layout.num_tokens_per_rank.tolist() == [2, 1]
    assert layout.num_tokens_per_expert.tolist() == [1, 1, 1, 1, 0, 0, 0, 1]


def test_layout_rejects_bad_input():
    good = np.zeros((2, 2), np.int64)
    with pytest.raises(ValueError, match="2-D"):
        ref.validate_topk_idx(np.zeros(4, np.int64), 8)
    with pytest.raises(ValueError, match="int64"):
        ref.validate_topk_idx(good.astype(np.int32), 8)
    with pytest.raises(ValueError, match=r"-2"):
        ref.validate_topk_idx(np.array([[0, -2]], np.int64), 8)
    with pytest.raises(ValueError, match=r"\b8\b"):
        ref.validate_topk_idx(np.array([[0, 8]], np.int64), 8)
    with pytest.raises(ValueError, match="divisible"):
        ref.get_dispatch_layout(good, 10, 4)
    with pytest.raises(ValueError, match="num_ranks_per_node"):
        ref.get_dispatch_layout(good, 8, 4, 3)


def test_rank_inputs_name_the_bad_rank_of_x_and_x_scales():
    from cupyep.reference.layout import validate_rank_inputs
    idx = [np.zeros((2, 1), np.int64), np.zeros((3, 1), np.int64)]
    x = [np.zeros((2, 128), np.uint8), np.zeros((3, 128), np.uint8)]
    scales = [np.zeros((2, 1), np.float32), np.zeros((3, 1), np.float32)]
    assert validate_rank_inputs(x, idx, 4, x_scales=scales) == 2
    with pytest.raises(ValueError, match=r"^x\[1\] must be a 2-D numpy array with 3 rows"):
        validate_rank_inputs([x[0], x[1][:2]], idx, 4)
    with pytest.raises(ValueError, match=r"^x\[1\] has 256 columns of uint8, x\[0\] has 128"):
        validate_rank_inputs([x[0], np.zeros((3, 256), np.uint8)], idx, 4)
    with pytest.raises(ValueError, match=r"^x_scales\[1\] has 1 columns of float64"):
        validate_rank_inputs(x, idx, 4, x_scales=[scales[0], scales[1].astype(np.float64)])
    with pytest.raises(ValueError, match=r"^x_scales\[0\] must be a 2-D numpy array with 2 rows"):
        validate_rank_inputs(x, idx, 4, x_scales=[scales[0][:, 0], scales[1]])


# ---------------------------------------------------------------- normal-mode dispatch


def test_dispatch_rows_ordering_and_dedup(dispatched, routing):
    for dst, result in enumerate(dispatched):
        pairs = list(zip(result.recv_src_rank.tolist(), result.recv_src_idx.tolist()))
        assert pairs == received_pairs(routing, dst)  # ordered by (src rank, src token), once each
        assert result.num_recv_tokens == len(pairs) == result.recv_x.shape[0]
        assert result.recv_src_idx.dtype == np.int32 and result.recv_src_rank.dtype == np.int32


def test_dispatch_topk_idx_and_weights(dispatched, routing, weights):
    for dst, result in enumerate(dispatched):
        assert result.recv_topk_idx.dtype == np.int64 and result.recv_topk_weights.dtype == np.float32
        for row, (s, t) in enumerate(zip(result.recv_src_rank, result.recv_src_idx)):
            for j, e in enumerate(routing[s][t]):
                if e >= 0 and owner(e) == dst:
                    assert result.recv_topk_idx[row, j] == e - dst * NUM_LOCAL
                    assert result.recv_topk_weights[row, j] == weights[s][t, j]
                else:
                    assert result.recv_topk_idx[row, j] == -1
                    assert result.recv_topk_weights[row, j] == 0


def test_dispatch_rank_prefix_matrix(dispatched, routing):
    counts = np.array([brute_force_layout(idx, NUM_EXPERTS, NUM_RANKS)[0] for idx in routing])
    expected = np.cumsum(counts, axis=0)
    for dst, result in enumerate(dispatched):
        assert result.rank_prefix_matrix.dtype == np.int32
        assert np.array_equal(result.rank_prefix_matrix, expected)
        bounds = np.concatenate([[0], result.rank_prefix_matrix[:, dst]])
        for src in range(NUM_RANKS):
            assert (result.recv_src_rank[bounds[src] : bounds[src + 1]] == src).all()


def test_dispatch_tagged_payload(dispatched, tagged_x):
    for result in dispatched:
        assert result.recv_x.dtype == ml_dtypes.bfloat16
        tags = ref.read_tagged_x(result.recv_x)
        assert np.array_equal(tags.rank, result.recv_src_rank)
        assert np.array_equal(tags.token, result.recv_src_idx)
        for row, (s, t) in enumerate(zip(result.recv_src_rank, result.recv_src_idx)):
            assert np.array_equal(result.recv_x[row].view(np.uint16), tagged_x[s][t].view(np.uint16))


@pytest.mark.parametrize("dtype", [np.uint8, ml_dtypes.bfloat16, np.float32])
def test_dispatch_is_bit_exact(routing, dtype):
    rng = np.random.default_rng(5)
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    x = [rng.integers(0, np.iinfo(bits).max, (t, HIDDEN), dtype=bits, endpoint=True).view(dtype) for t in TOKENS]
    # Scales as raw float32 bit patterns (NaN payloads included) must come through unchanged too.
    scales = [rng.integers(0, 2**32, (t, HIDDEN // 128), dtype=np.uint32).view(np.float32) for t in TOKENS]
    results = ref.intranode_dispatch(x, routing, NUM_EXPERTS, x_scales=scales)
    for result in results:
        assert result.recv_x.dtype == np.dtype(dtype) and result.recv_x_scales.dtype == np.float32
        rows = [x[s][t] for s, t in zip(result.recv_src_rank, result.recv_src_idx)]
        expected = np.stack(rows) if rows else np.zeros((0, HIDDEN), dtype)
        assert np.array_equal(result.recv_x.view(bits), expected.view(bits))
        expected_scales = [scales[s][t] for s, t in zip(result.recv_src_rank, result.recv_src_idx)]
        assert np.array_equal(result.recv_x_scales.view(np.uint32), np.stack(expected_scales).view(np.uint32))
        assert result.recv_topk_weights is None


@pytest.mark.parametrize("alignment", [1, 4, 7])
def test_dispatch_expert_counts_with_alignment(tagged_x, routing, alignment):
    results = ref.intranode_dispatch(tagged_x, routing, NUM_EXPERTS, expert_alignment=alignment)
    total = sum(brute_force_layout(idx, NUM_EXPERTS, NUM_RANKS)[1] for idx in routing)
    for dst, result in enumerate(results):
        raw = total[dst * NUM_LOCAL : (dst + 1) * NUM_LOCAL]
        assert result.num_recv_tokens_per_expert == [int(-(-c // alignment) * alignment) for c in raw]
        assert [(result.recv_topk_idx == e).sum() for e in range(NUM_LOCAL)] == raw.tolist()


def test_dispatch_all_ranks_empty():
    x = [np.zeros((0, HIDDEN), np.float32)] * 2
    idx = [np.zeros((0, 2), np.int64)] * 2
    results = ref.intranode_dispatch(x, idx, 4, topk_weights=[np.zeros((0, 2), np.float32)] * 2)
    assert [r.num_recv_tokens for r in results] == [0, 0]
    assert results[0].recv_x.shape == (0, HIDDEN) and results[0].num_recv_tokens_per_expert == [0, 0]
    combined = ref.intranode_combine([r.recv_x for r in results], results, [0, 0])
    assert [c.shape for c in combined] == [(0, HIDDEN), (0, HIDDEN)]


def test_dispatch_rejects_bad_input(tagged_x, routing, weights):
    x, idx = tagged_x, routing
    with pytest.raises(ValueError, match="divisible"):
        ref.intranode_dispatch(x, idx, 18)
    with pytest.raises(ValueError, match="equal length"):
        ref.intranode_dispatch(x[:3], idx, NUM_EXPERTS)
    with pytest.raises(ValueError, match=r"x\[2\]"):
        ref.intranode_dispatch(x[:2] + [x[2][:3]] + x[3:], idx, NUM_EXPERTS)
    with pytest.raises(ValueError, match=r"topk_weights\[0\]"):
        ref.intranode_dispatch(x, idx, NUM_EXPERTS, topk_weights=[w.astype(np.float64) for w in weights])
    with pytest.raises(ValueError, match=r"x_scales\[0\]"):
        ref.intranode_dispatch(x, idx, NUM_EXPERTS, x_scales=[np.zeros((t + 1, 2), np.float32) for t in TOKENS])
    odd_x = [np.zeros((t, 200), np.float32) for t in TOKENS]
    with pytest.raises(ValueError, match="multiple of 128"):
        ref.intranode_dispatch(odd_x, idx, NUM_EXPERTS, x_scales=[np.zeros((t, 2), np.float32) for t in TOKENS])
    with pytest.raises(ValueError, match="expert_alignment"):
        ref.intranode_dispatch(x, idx, NUM_EXPERTS, expert_alignment=0)
    bad_idx = [i.copy() for i in idx]
    bad_idx[0][0, 0] = NUM_EXPERTS
    with pytest.raises(ValueError, match=str(NUM_EXPERTS)):
        ref.intranode_dispatch(x, bad_idx, NUM_EXPERTS)


# ---------------------------------------------------------------- normal-mode combine


def test_combine_unit_weights_counts_visits(routing):
    x = [ref.make_tagged_x(r, t, HIDDEN, np.float32) for r, t in enumerate(TOKENS)]
    results = ref.intranode_dispatch(x, routing, NUM_EXPERTS)
    combined = ref.intranode_combine([r.recv_x for r in results], results, TOKENS)
    for src, out in enumerate(combined):
        visits = ref.get_dispatch_layout(routing[src], NUM_EXPERTS, NUM_RANKS).is_token_in_rank.sum(1)
        assert out.dtype == np.float32
        assert np.array_equal(out, x[src] * visits[:, None])  # zeros for tokens that went nowhere


def test_combine_with_weights_matches_loops(routing):
    rng = np.random.default_rng(11)
    x = [rng.standard_normal((t, HIDDEN), dtype=np.float32).astype(ml_dtypes.bfloat16) for t in TOKENS]
    results = ref.intranode_dispatch(x, routing, NUM_EXPERTS)
    row_weights = [rng.random(r.num_recv_tokens, dtype=np.float32) for r in results]
    combined = ref.intranode_combine([r.recv_x for r in results], results, TOKENS, weights=row_weights)
    for src in range(NUM_RANKS):
        expected = np.zeros((TOKENS[src], HIDDEN), np.float64)
        for dst, result in enumerate(results):
            for row in np.flatnonzero(result.recv_src_rank == src):
                t = result.recv_src_idx[row]
                expected[t] += np.float64(row_weights[dst][row]) * result.recv_x[row].astype(np.float64)
        assert np.array_equal(combined[src], expected.astype(np.float32))
        assert ref.calc_diff(combined[src], expected) < 1e-12


def test_combine_non_finite_row_stays_in_its_token(dispatched):
    recv_x = [r.recv_x.astype(np.float32) for r in dispatched]
    dst = max(range(NUM_RANKS), key=lambda d: dispatched[d].num_recv_tokens)
    recv_x[dst][0] = np.inf
    src, token = dispatched[dst].recv_src_rank[0], dispatched[dst].recv_src_idx[0]
    combined = ref.intranode_combine(recv_x, dispatched, TOKENS)
    for s, out in enumerate(combined):
        finite = np.isfinite(out).all(axis=1)
        assert finite.tolist() == [not (s == src and t == token) for t in range(TOKENS[s])]


def test_combine_topk_weights_recovers_weights(dispatched, routing, weights):
    recovered = ref.intranode_combine_topk_weights(dispatched, TOKENS)
    for idx, w, got in zip(routing, weights, recovered):
        assert got.dtype == np.float32
        assert np.array_equal(got, np.where(idx >= 0, w, 0))


def test_combine_rejects_bad_input(dispatched):
    recv_x = [r.recv_x for r in dispatched]
    with pytest.raises(ValueError, match="recv_x"):
        ref.intranode_combine(recv_x[:1] + [r[:, :128] for r in recv_x[1:]], dispatched, TOKENS)
    with pytest.raises(ValueError, match="weights"):
        ref.intranode_combine(recv_x, dispatched, TOKENS, weights=[np.ones(1, np.float32)] * NUM_RANKS)
    with pytest.raises(ValueError, match="source rank"):
        ref.intranode_combine(recv_x, dispatched, [1] * NUM_RANKS)  # src indices out of range
    with pytest.raises(ValueError, match="equal length"):
        ref.intranode_combine(recv_x, dispatched, TOKENS[:2])


# ---------------------------------------------------------------- expert-major layout


def test_expert_major_order(tagged_x, routing):
    idx = ref.make_routing(9, TOKENS, NUM_EXPERTS, NUM_TOPK, num_masked=5)
    idx[2][0] = [5, 5, 6, -1]  # normal mode tolerates a repeated expert: one pair per slot
    x = [ref.make_tagged_x(r, t, HIDDEN) for r, t in enumerate(TOKENS)]
    for result in ref.intranode_dispatch(x, idx, NUM_EXPERTS):
        layout = ref.expert_major_order(result, NUM_LOCAL)
        offsets, rows, slot = layout.expert_offsets, layout.rows, layout.slot
        assert offsets.dtype == rows.dtype == slot.dtype == np.int64
        assert offsets[0] == 0 and offsets[-1] == rows.size == (result.recv_topk_idx >= 0).sum()
        assert np.diff(offsets).tolist() == result.num_recv_tokens_per_expert
        pairs = set()
        for e in range(NUM_LOCAL):
            r, s = rows[offsets[e] : offsets[e + 1]], slot[offsets[e] : offsets[e + 1]]
            assert (result.recv_topk_idx[r, s] == e).all()
            assert (np.diff(r) >= 0).all()
            pairs.update(zip(r.tolist(), s.tolist()))
        assert len(pairs) == rows.size  # every (row, slot) pair exactly once


# ---------------------------------------------------------------- low-latency mode

LL_TOKENS = [5, 0, 6, 3]
LL_MAX = 8


@pytest.fixture(scope="module")
def ll_inputs():
    idx = ref.make_routing(2, LL_TOKENS, NUM_EXPERTS, NUM_TOPK, num_masked=2)
    rng = np.random.default_rng(2)
    x = [rng.standard_normal((t, HIDDEN), dtype=np.float32) for t in LL_TOKENS]
    scales = [rng.random((t, HIDDEN // 128), dtype=np.float32) for t in LL_TOKENS]
    return x, idx, scales, ref.make_weights(2, idx)


def test_ll_dispatch_counts_and_ranges(ll_inputs):
    x, idx, scales, _ = ll_inputs
    results = ref.low_latency_dispatch(x, idx, NUM_EXPERTS, LL_MAX, x_scales=scales)
    per_expert = np.array([ref.get_dispatch_layout(i, NUM_EXPERTS, NUM_RANKS).num_tokens_per_expert for i in idx])
    for dst, result in enumerate(results):
        assert result.recv_x.shape == (NUM_LOCAL, NUM_RANKS * LL_MAX, HIDDEN)
        assert result.recv_x_scales.shape == (NUM_LOCAL, NUM_RANKS * LL_MAX, HIDDEN // 128)
        assert result.recv_count.dtype == np.int32 and result.recv_src_info.dtype == np.int32
        local = per_expert[:, dst * NUM_LOCAL : (dst + 1) * NUM_LOCAL].T  # [expert, src]
        assert np.array_equal(result.recv_count, local.sum(1))
        assert np.array_equal(result.layout_count, local) and result.layout_count.dtype == np.int64
        assert np.array_equal(result.num_tokens_per_expert_src, local)
        assert np.array_equal(result.layout_begin, np.tile(np.arange(NUM_RANKS) * LL_MAX, (NUM_LOCAL, 1)))
        for e in range(NUM_LOCAL):
            for s in range(NUM_RANKS):
                begin, count = result.layout_begin[e, s], result.layout_count[e, s]
                tokens = [t for t in range(LL_TOKENS[s]) if dst * NUM_LOCAL + e in idx[s][t]]
                assert result.recv_src_info[e, begin : begin + count].tolist() == tokens
                assert np.array_equal(result.recv_x[e, begin : begin + count], x[s][tokens].reshape(-1, HIDDEN))
                assert np.array_equal(result.recv_x_scales[e, begin : begin + count], scales[s][tokens].reshape(-1, 2))
                unused = slice(begin + count, (s + 1) * LL_MAX)
                assert (result.recv_src_info[e, unused] == -1).all()
                assert not result.recv_x[e, unused].any() and not result.recv_x_scales[e, unused].any()


def test_ll_combine_identity_experts(ll_inputs):
    x, idx, _, w = ll_inputs
    results = ref.low_latency_dispatch(x, idx, NUM_EXPERTS, LL_MAX)
    combined = ref.low_latency_combine([r.recv_x for r in results], results, idx, w)
    for src in range(NUM_RANKS):
        weight_sum = np.where(idx[src] >= 0, w[src], 0).astype(np.float64).sum(1)
        expected = x[src].astype(np.float64) * weight_sum[:, None]
        assert combined[src].dtype == np.float32 and combined[src].shape == x[src].shape
        np.testing.assert_allclose(combined[src], expected, rtol=1e-6, atol=1e-6)


def test_ll_combine_distinguishes_experts(ll_inputs):
    x, idx, _, w = ll_inputs
    results = ref.low_latency_dispatch(x, idx, NUM_EXPERTS, LL_MAX)
    # Expert e multiplies by (e + 1), so a wrong expert or slot shows up.
    expert_out = [
        (r.recv_x * (dst * NUM_LOCAL + np.arange(NUM_LOCAL) + 1)[:, None, None]).astype(ml_dtypes.bfloat16)
        for dst, r in enumerate(results)
    ]
    combined = ref.low_latency_combine(expert_out, results, idx, w)
    for src in range(NUM_RANKS):
        expected = np.zeros((LL_TOKENS[src], HIDDEN))
        for t in range(LL_TOKENS[src]):
            for j, e in enumerate(idx[src][t]):
                if e >= 0:
                    value = (x[src][t] * (e + 1)).astype(ml_dtypes.bfloat16).astype(np.float64)
                    expected[t] += np.float64(w[src][t, j]) * value
        assert np.array_equal(combined[src], expected.astype(np.float32))


def _ll_scaled_outputs(results):
    """Expert outputs of every rank for the partial-combine tests: expert e multiplies its rows by e + 1."""
    return [(r.recv_x * (dst * NUM_LOCAL + np.arange(NUM_LOCAL) + 1)[:, None, None]).astype(ml_dtypes.bfloat16)
            for dst, r in enumerate(results)]


def _ll_partials(x, idx, w, src):
    """[NUM_RANKS, T, HIDDEN] float32: rank src's tokens' partial rows as each expert rank sums them (FP32, slot
    order, of the BF16 outputs of _ll_scaled_outputs' experts), written out token by token."""
    partial = np.zeros((NUM_RANKS, LL_TOKENS[src], HIDDEN), np.float32)
    for t in range(LL_TOKENS[src]):
        for j, e in enumerate(idx[src][t]):
            if e >= 0:
                y = (x[src][t] * (e + 1)).astype(ml_dtypes.bfloat16).astype(np.float32)
                partial[e // NUM_LOCAL, t] += np.float32(w[src][t, j]) * y
    return partial


def test_ll_partial_combine_reduces_per_expert_rank_then_per_token(ll_inputs):
    """Expert e multiplies by (e + 1): the partial combine is, per token, the FP32 sum in rank order of
    BF16 partials, each the FP32 sum in slot order of the rank's weighted expert outputs; within
    calc_diff 5e-6 of the exact (per-slot) combine; and it checks its inputs as the per-slot one."""
    x, idx, _, w = ll_inputs
    results = ref.low_latency_dispatch(x, idx, NUM_EXPERTS, LL_MAX)
    expert_out = _ll_scaled_outputs(results)
    got = ref.low_latency_partial_combine(expert_out, results, idx, w)
    exact = ref.low_latency_combine(expert_out, results, idx, w)
    for src in range(NUM_RANKS):
        partial = _ll_partials(x, idx, w, src)
        want = np.zeros((LL_TOKENS[src], HIDDEN), np.float32)
        for d in range(NUM_RANKS):  # in rank order
            want += ref.bf16_round(partial[d])
        assert got[src].dtype == np.float32 and np.array_equal(got[src], want)
        if LL_TOKENS[src]:
            assert ref.calc_diff(got[src], exact[src]) < 5e-6
    with pytest.raises(ValueError, match="expert_out"):
        ref.low_latency_partial_combine([r.recv_x[:, :4] for r in results], results, idx, w)
    other = ref.make_routing(3, LL_TOKENS, NUM_EXPERTS, NUM_TOPK)
    with pytest.raises(ValueError, match="does not hold"):
        ref.low_latency_partial_combine(expert_out, results, other, w)


def test_ll_partial_combine_through_logfmt_sums_the_partials_roundtrip(ll_inputs):
    """logfmt=True: the owner sums LogFMT-10 roundtrips of the same BF16 partials, in rank order; that
    stays within the format's error of the BF16 partial combine."""
    from cupyep.reference import logfmt as lf
    x, idx, _, w = ll_inputs
    results = ref.low_latency_dispatch(x, idx, NUM_EXPERTS, LL_MAX)
    expert_out = _ll_scaled_outputs(results)
    got = ref.low_latency_partial_combine(expert_out, results, idx, w, logfmt=True)
    plain = ref.low_latency_partial_combine(expert_out, results, idx, w)
    for src in range(NUM_RANKS):
        partial = _ll_partials(x, idx, w, src)
        want = np.zeros((LL_TOKENS[src], HIDDEN), np.float32)
        for d in range(NUM_RANKS):
            want += lf.roundtrip(ref.bf16_round(partial[d]))
        assert got[src].dtype == np.float32 and np.array_equal(got[src], want)
        if LL_TOKENS[src]:
            assert not np.array_equal(got[src], plain[src])  # the format did act
            assert ref.calc_diff(got[src], plain[src]) < 1e-4


def test_ll_combine_rows_per_slot_and_per_rank():
    # 2 ranks of 4 experts: token 0 picks experts 0, 1 (rank 0) and 5 (rank 1); token 1 picks 6, 7 and -1.
    idx = [np.array([[0, 1, 5], [6, 7, -1]], np.int64), np.zeros((0, 3), np.int64)]
    rows = ref.low_latency.combine_rows(idx, 8, 2)
    assert rows == {"per_slot": 5, "per_rank": 3, "saved": 1 - 3 / 5}
    # the benchmark's routing, top-8 of 256: about a third fewer rows at 8 ranks, more at fewer
    from cupyep.testing import global_routing
    saved = {R: ref.low_latency.combine_rows(global_routing(0, [128] * R, 256, 8)[0], 256, R)["saved"]
             for R in (2, 4, 8)}
    assert 0.30 < saved[8] < saved[4] < saved[2] < 0.80, saved
    with pytest.raises(ValueError, match="multiple"):
        ref.low_latency.combine_rows(idx, 9, 2)


def test_ll_rejects_bad_input(ll_inputs):
    x, idx, _, w = ll_inputs
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        ref.low_latency_dispatch(x, idx, NUM_EXPERTS, 5)  # rank 2 has 6 tokens
    dup = [i.copy() for i in idx]
    dup[0][1, :2] = [3, 3]
    with pytest.raises(ValueError, match="twice"):
        ref.low_latency_dispatch(x, dup, NUM_EXPERTS, LL_MAX)
    results = ref.low_latency_dispatch(x, idx, NUM_EXPERTS, LL_MAX)
    with pytest.raises(ValueError, match="expert_out"):
        ref.low_latency_combine([r.recv_x[:, :4] for r in results], results, idx, w)
    other = ref.make_routing(3, LL_TOKENS, NUM_EXPERTS, NUM_TOPK)
    with pytest.raises(ValueError, match="does not hold"):
        ref.low_latency_combine([r.recv_x for r in results], results, other, w)


# ---------------------------------------------------------------- FP8


def test_fp8_round_trip_within_half_step():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 512), dtype=np.float32) * np.float32([1e-3, 1, 50, 1e4])[rng.integers(0, 4, 6)][:, None]
    for round_scale in (False, True):
        fp8 = ref.per_token_cast_to_fp8(x, round_scale=round_scale)
        assert fp8.data.dtype == np.uint8 and fp8.data.shape == x.shape
        assert fp8.scales.dtype == np.float32 and fp8.scales.shape == (6, 4)
        assert not np.isnan(fp8.data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).any()
        back = ref.per_token_cast_back(fp8.data, fp8.scales)
        scale = np.repeat(fp8.scales, 128, axis=1)
        bound = 0.5 * scale * ref.e4m3_step(x / scale) * (1 + 1e-6) + 1e-6 * np.abs(x)
        assert (np.abs(back - x) <= bound).all()
        assert ref.calc_diff(back, x) < 1e-3


def test_fp8_scales():
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((5, 384)) * 10).astype(ml_dtypes.bfloat16)
    amax = np.maximum(np.abs(x.astype(np.float32)).reshape(5, 3, 128).max(2), np.float32(1e-4))
    plain = ref.per_token_cast_to_fp8(x)
    assert np.array_equal(plain.scales, amax / np.float32(448))
    ue8m0 = ref.per_token_cast_to_fp8(x, round_scale=True).scales
    mantissa, _ = np.frexp(ue8m0)
    assert (mantissa == 0.5).all()  # powers of two
    assert (ue8m0 >= amax / np.float32(448)).all() and (ue8m0 < 2 * amax / np.float32(448)).all()
    assert np.array_equal(ref.unpack_ue8m0(ref.pack_ue8m0(ue8m0)), ue8m0)
    assert ref.pack_ue8m0(np.float32([1.0, 2.0, 0.5, 2.0**-127])).tolist() == [127, 128, 126, 0]
    # Quantising with UE8M0 scales and dequantising with their exponent bytes gives the same values.
    fp8 = ref.per_token_cast_to_fp8(x, round_scale=True)
    assert np.array_equal(
        ref.per_token_cast_back(fp8.data, ref.pack_ue8m0(fp8.scales)), ref.per_token_cast_back(fp8.data, fp8.scales)
    )


def test_fp8_zeros_and_saturation():
    zeros = ref.per_token_cast_to_fp8(np.zeros((2, 256), np.float32))
    assert not zeros.data.any() and np.allclose(zeros.scales, 1e-4 / 448)
    assert not ref.per_token_cast_back(zeros.data, zeros.scales).any()
    big = np.full((1, 128), 3e38, np.float32)
    big[0, 1] = -3e38
    fp8 = ref.per_token_cast_to_fp8(big)
    values = fp8.data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert not np.isnan(values).any() and np.abs(values).max() == 448


def test_e4m3_step():
    values = np.array([0, 1e-3, 2.0**-6, 0.5, 1, 1.9, -2, 300, 448, 1e6])
    expected = [2.0**-9, 2.0**-9, 2.0**-9, 2.0**-4, 2.0**-3, 2.0**-3, 2.0**-2, 32, 32, 32]
    assert ref.e4m3_step(values).tolist() == expected
    # Adjacent e4m3 values differ by exactly one step.
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
    assert np.array_equal(np.diff(grid), ref.e4m3_step(grid[:-1]))


def test_fp8_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 128"):
        ref.per_token_cast_to_fp8(np.zeros((2, 200), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        ref.per_token_cast_to_fp8(np.zeros(256, np.float32))
    with pytest.raises(ValueError, match="multiple of 128"):
        ref.per_token_cast_back(np.zeros((2, 100), np.uint8), np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="shape"):
        ref.per_token_cast_back(np.zeros((2, 256), np.uint8), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="powers of two"):
        ref.pack_ue8m0(np.float32([1.0, 3.0]))
    with pytest.raises(ValueError, match="powers of two"):
        ref.pack_ue8m0(np.float32([0.0]))
    with pytest.raises(ValueError, match="NaN"):
        ref.unpack_ue8m0(np.uint8([255]))


# ---------------------------------------------------------------- metrics


def test_metrics():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    assert ref.calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    rounded = ref.bf16_round(x)
    assert rounded.dtype == np.float32
    assert np.array_equal(rounded, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert 0 < ref.calc_diff(x, rounded) < 5e-6
    assert ref.calc_diff(x, -x) > 0.1
    with pytest.raises(ValueError):
        ref.calc_diff(x, x[:2])



def _distinct_routing(seed: int, T: int, num_experts: int, num_topk: int, empty: float) -> np.ndarray:
    """[T, num_topk] int64: distinct experts per row, a fraction ``empty`` of the slots -1."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(num_experts)[:num_topk] for _ in range(T)]).astype(np.int64)
    idx[rng.random(idx.shape) < empty] = -1
    return idx


@pytest.mark.parametrize("num_ranks,num_experts,num_topk", [(1, 4, 2), (2, 8, 3), (4, 16, 4), (8, 256, 8), (3, 9, 5)])
def test_return_position_matches_loops(num_ranks, num_experts, num_topk):
    T, El = 37, num_experts // num_ranks
    idx = _distinct_routing(num_ranks * 100 + num_topk, T, num_experts, num_topk, 0.2)
    got = ref.low_latency.return_position(idx, num_experts, num_ranks)
    assert got.shape == idx.shape and got.dtype == np.int64
    # Loops: each rank's rows listed by (local expert, token), numbered in that order.
    want = np.full(idx.shape, -1, dtype=np.int64)
    for r in range(num_ranks):
        n = 0
        for e in range(r * El, (r + 1) * El):
            for t in range(T):
                for j in np.nonzero(idx[t] == e)[0]:
                    want[t, j] = n
                    n += 1
        mine = (idx >= 0) & (idx // El == r)
        assert sorted(got[mine].tolist()) == list(range(n))  # a packed range, no gaps or repeats
    assert np.array_equal(got, want)


@pytest.mark.parametrize("num_ranks,num_experts,num_topk", [(1, 4, 2), (2, 8, 3), (4, 16, 4), (8, 256, 8), (3, 9, 5)])
def test_rank_position_numbers_each_ranks_tokens(num_ranks, num_experts, num_topk):
    T, El = 41, num_experts // num_ranks
    idx = _distinct_routing(num_ranks * 10 + num_topk, T, num_experts, num_topk, 0.3)
    got = ref.low_latency.rank_position(idx, num_experts, num_ranks)
    assert got.shape == idx.shape and got.dtype == np.int64
    # Loops: rank r's tokens in ascending order, numbered 0, 1, ...; every slot of a token on r shares it.
    want = np.full(idx.shape, -1, dtype=np.int64)
    for r in range(num_ranks):
        n = 0
        for t in range(T):
            on_r = (idx[t] >= 0) & (idx[t] // El == r)
            if on_r.any():
                want[t, on_r] = n
                n += 1
    assert np.array_equal(got, want)
    # one partial row per (token, expert rank): combine_rows' per_rank
    pairs = {(t, int(idx[t, j]) // El) for t, j in zip(*np.nonzero(idx >= 0))}
    assert ref.low_latency.combine_rows([idx], num_experts, num_ranks)["per_rank"] == len(pairs)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        ref.low_latency.rank_position(idx, 10, 3)


def test_return_position_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        ref.low_latency.return_position(np.zeros((1, 1), np.int64), 10, 3)


def test_without_ranks_is_shrink_modes_routing():
    """reference.low_latency.without_ranks: the masked ranks' experts dropped on every rank, a masked rank
    sending nothing, the others' slots untouched."""
    from cupyep.reference.low_latency import without_ranks
    # E = 6 over R = 3: rank 2 owns experts 4 and 5
    idx = [np.array([[0, 5], [3, -1]]), np.array([[4, 1], [2, 3]]), np.array([[4, 5], [0, 1]])]
    kept = without_ranks(idx, [2], 6)
    assert [k.tolist() for k in kept] == [[[0, -1], [3, -1]], [[-1, 1], [2, 3]], [[-1, -1], [-1, -1]]]
    assert all(k.dtype == np.int64 for k in kept) and idx[0].tolist() == [[0, 5], [3, -1]]  # inputs untouched
    assert [k.tolist() for k in without_ranks(idx, [], 6)] == [i.tolist() for i in idx]
    assert [k.tolist() for k in without_ranks(idx, [0, 2], 6)] == [[[-1, -1], [-1, -1]], [[-1, -1], [2, 3]],
                                                                  [[-1, -1], [-1, -1]]]
    with pytest.raises(ValueError, match="multiple"):
        without_ranks(idx, [0], 7)
    with pytest.raises(ValueError, match="not all in"):
        without_ranks(idx, [3], 6)
