"""The naive baseline (cupyep.lab.bench.naive) on the GPU, checked against the NumPy reference.

Every rank builds the same seeded global routing and computes its expected
result with cupyep.reference: dispatch exactly (rows, source ranks and
tokens in the reference's order: source rank, then source token), combine
(identity experts, unweighted) within 1e-2 relative.
"""
import numpy as np
import pytest

from cupyep import reference as ref

from cupyep.testing import all_ranks, bf16_to_f32, global_routing, payload_bf16

pytestmark = pytest.mark.gpu
NUM_EXPERTS, NUM_TOPK = 256, 8


@pytest.fixture(scope="module")
def naive(group):
    """NaiveBuffer per hidden size, made on first use (collectively: every rank runs the same tests)."""
    from cupyep.lab.bench.naive import NaiveBuffer
    bufs = {}

    def get(hidden):
        if hidden not in bufs:
            bufs[hidden] = NaiveBuffer(group, hidden)
        return bufs[hidden]
    yield get
    for b in bufs.values():
        b.destroy()


def _case(group, seed, num_tokens, hidden, case="random", zero_rank=None):
    """Inputs of this rank and the reference results of every rank."""
    R, me = group.local_size, group.local_rank
    tokens = [0 if r == zero_rank else num_tokens for r in range(R)]
    idx, _ = global_routing(seed, tokens, NUM_EXPERTS, NUM_TOPK, case)
    ids = [np.arange(t, dtype=np.int32)[:, None] for t in tokens]
    res = ref.intranode_dispatch(ids, idx, NUM_EXPERTS)
    x = payload_bf16(me, np.arange(tokens[me]), hidden)
    return tokens, idx, x, res


def _rows(result, hidden):
    """[N, hidden] uint16: the payload rows a reference result holds, rebuilt from its tags."""
    rows = np.empty((result.num_recv_tokens, hidden), dtype=np.uint16)
    for s in np.unique(result.recv_src_rank):
        sel = result.recv_src_rank == s
        rows[sel] = payload_bf16(int(s), result.recv_src_idx[sel], hidden)
    return rows


def _check_dispatch(group, out, exp, hidden):
    checks = {
        "recv_x": np.array_equal(out.recv_x.get(), _rows(exp, hidden)),
        "recv_src_idx": np.array_equal(out.recv_src_idx.get(), exp.recv_src_idx),
        "recv_src_rank": np.array_equal(out.recv_src_rank.get(), exp.recv_src_rank),
        "rank_prefix_matrix": np.array_equal(out.handle.rank_prefix_matrix, exp.rank_prefix_matrix),
    }
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}


def _expected_combine(group, res, tokens, hidden):
    recv = [bf16_to_f32(_rows(r, hidden)) for r in res]
    return ref.intranode_combine(recv, res, tokens)[group.local_rank]


def _combine_ok(got, expected) -> bool:
    return got.shape == expected.shape and bool(np.allclose(got, expected, rtol=1e-2, atol=1e-5))


CASES = [
    # (seed, tokens per rank, hidden, routing, rank with zero tokens)
    (1, 256, 2048, "random", None),
    (3, 1, 7168, "random", None),
    (4, 300, 2048, "one_expert", None),
    (5, 200, 2048, "random", 0),
    (2, 512, 7168, "random", None),   # needs more staging rows than the cases before: the buffer grows
]


@pytest.mark.parametrize("seed,num_tokens,hidden,case,zero_rank", CASES)
def test_naive_dispatch_combine(group, naive, seed, num_tokens, hidden, case, zero_rank):
    import cupy
    tokens, idx, x, res = _case(group, seed, num_tokens, hidden, case, zero_rank)
    me = group.local_rank
    buf = naive(hidden)
    out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), NUM_EXPERTS)
    _check_dispatch(group, out, res[me], hidden)

    comb = buf.combine(out.recv_x, out.handle).get()
    expected = _expected_combine(group, res, tokens, hidden)
    assert all_ranks(group.comm, _combine_ok(comb, expected)), \
        float(np.abs(comb - expected).max()) if comb.shape == expected.shape else comb.shape

    again = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), NUM_EXPERTS)
    assert all_ranks(group.comm, np.array_equal(again.recv_x.get(), out.recv_x.get())), "dispatch not repeatable"


def test_naive_interleaved_calls(group, naive):
    """Two dispatches, then their combines in turn, then again: every staging
    region reused while the handles of earlier calls are still in use."""
    import cupy
    hidden, me = 2048, group.local_rank
    cases = [_case(group, seed, n, hidden) for seed, n in ((21, 128), (22, 96))]
    buf = naive(hidden)
    for _ in range(2):
        outs = [buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), NUM_EXPERTS) for _, idx, x, _ in cases]
        combs = [buf.combine(o.recv_x, o.handle) for o in outs]
        for out, comb, (tokens, _, _, res) in zip(outs, combs, cases):
            _check_dispatch(group, out, res[me], hidden)
            expected = _expected_combine(group, res, tokens, hidden)
            assert all_ranks(group.comm, _combine_ok(comb.get(), expected)), "interleaved combine differs"


def test_naive_rejects_bad_inputs(group, naive):
    import cupy
    buf = naive(2048)
    x = cupy.zeros((4, 1024), dtype=np.uint16)
    with pytest.raises(ValueError, match="x must be"):
        buf.dispatch(x, cupy.zeros((4, NUM_TOPK), dtype=np.int64), NUM_EXPERTS)
    with pytest.raises(ValueError, match="num_experts"):
        buf.dispatch(cupy.zeros((4, 2048), dtype=np.uint16), cupy.zeros((4, NUM_TOPK), dtype=np.int64),
                     group.local_size * 3 + 1)
