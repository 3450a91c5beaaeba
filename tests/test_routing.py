"""cupyep.routing: the seeded routing generators (CPU only)."""
import numpy as np
import pytest

from cupyep import reference as ref

from cupyep import routing

from cupyep.testing import global_routing

TOKENS = [40, 0, 17, 64]
E, K = 32, 4
PARAMS = {"uniform": {}, "zipf": {"s": 1.2}, "hot_expert": {"hot_fraction": 0.4, "hot_expert": 3},
          "drift": {"s": 1.2, "period": 3, "step": 4}, "imbalance": {}, "one_expert": {}}
ALL = [(kind, drop) for kind in routing.KINDS for drop in (0.0, 0.1)]


def _make(kind, seed=5, tokens=TOKENS, drop=0.0, num_experts=E, num_topk=K):
    return routing.make(kind, seed, tokens, num_experts, num_topk, drop_fraction=drop, **PARAMS[kind])


def _flat(arrays):
    return np.concatenate([a.reshape(-1) for a in arrays])


@pytest.mark.parametrize("kind,drop", ALL)
def test_shapes_dtypes_and_valid_rows(kind, drop):
    idx, w = _make(kind, drop=drop)
    assert len(idx) == len(w) == len(TOKENS)
    for t, a, b in zip(TOKENS, idx, w):
        assert a.shape == b.shape == (t, K)
        assert a.dtype == np.int64 and b.dtype == np.float32
        assert ((a >= -1) & (a < E)).all()
        for row in a:
            used = row[row >= 0]
            assert len(np.unique(used)) == len(used), row
        assert (b[a < 0] == 0).all()
        assert (b >= 0).all() and (b[a >= 0] > 0).all()
    assert (_flat(idx) >= 0).any()


@pytest.mark.parametrize("kind,drop", ALL)
def test_deterministic_and_seeded(kind, drop):
    idx, w = _make(kind, seed=11, drop=drop)
    idx2, w2 = _make(kind, seed=11, drop=drop)
    assert all(np.array_equal(a, b) for a, b in zip(idx + w, idx2 + w2))
    idx3, w3 = _make(kind, seed=12, drop=drop)
    assert not np.array_equal(_flat(w), _flat(w3))
    if kind != "one_expert" or drop:  # one_expert's ids do not depend on the seed without drops
        assert not np.array_equal(_flat(idx), _flat(idx3))
        same = routing.make(kind, 11, [30, 30], E, K, drop_fraction=drop, **PARAMS[kind])[0]
        assert not np.array_equal(same[0], same[1])  # each rank draws its own tokens


def test_uniform_is_reference_routing():
    for seed, tokens, e, k in [(0, [64] * 8, 256, 8), (3, [5, 0, 17, 40], 32, 4), (7, [1, 2], 8, 8)]:
        idx, w = routing.make("uniform", seed, tokens, e, k)
        old_idx = ref.make_routing(seed, tokens, e, k)
        old_w = ref.make_weights(seed, old_idx)
        for a, b, x, y in zip(idx, old_idx, w, old_w):
            assert np.array_equal(a, b)
            assert np.array_equal(x, np.where(b >= 0, y, np.float32(0)))
        assert sum((a < 0).sum() for a in idx) == sum(min(10, t * k // 4) for t in tokens)
        g_idx, g_w = global_routing(seed, tokens, e, k)
        assert all(np.array_equal(a, b) for a, b in zip(idx + w, g_idx + g_w))
        i_idx, i_w = routing.make("imbalance", seed, tokens, e, k)
        assert all(np.array_equal(a, b) for a, b in zip(idx + w, i_idx + i_w))


def test_one_expert():
    idx, w = global_routing(2, [6, 0, 3], 16, 4, case="one_expert")
    old_w = ref.make_weights(2, idx)
    for a, b, y in zip(idx, w, old_w):
        assert (a[:, 0] == 0).all() and (a[:, 1:] == -1).all()
        assert np.array_equal(b[:, 0], y[:, 0]) and (b[:, 1:] == 0).all()


def test_global_routing_rejects_unknown_case():
    with pytest.raises(ValueError, match="unknown routing kind"):
        global_routing(0, [4], 8, 2, case="randm")


def test_zipf_skew_raises_imbalance():
    tokens = [256] * 4
    factors = [routing.imbalance_factor(routing.make("zipf", 1, tokens, 64, 4, s=s)[0], 64)
               for s in (0.0, 0.5, 1.0, 2.0)]
    assert factors == sorted(factors) and len(set(factors)) == 4, factors
    assert factors[0] < 1.5 and factors[-1] > 5, factors
    # s = 0: every expert about equally likely, no expert twice in a token.
    counts = np.bincount(_flat(routing.make("zipf", 1, tokens, 64, 4, s=0)[0]), minlength=64)
    assert counts.min() > 0.6 * counts.mean()


def test_imbalance_factor():
    assert routing.imbalance_factor([np.array([[0, 1], [2, 3]])], 4) == 1.0
    assert routing.imbalance_factor([np.array([[0, 1]]), np.array([[0, -1]])], 4) == 2 * 4 / 3
    assert routing.imbalance_factor([np.full((3, 2), -1)], 4) == 1.0
    with pytest.raises(ValueError, match="outside"):
        routing.imbalance_factor([np.array([[0, 4]])], 4)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.7, 1.0])
def test_hot_expert_fraction(fraction):
    tokens = [100, 37, 0, 263]
    idx, _ = routing.make("hot_expert", 4, tokens, 64, 6, hot_fraction=fraction, hot_expert=9)
    has_hot = np.concatenate([(a == 9).any(axis=1) for a in idx])
    assert abs(has_hot.mean() - fraction) <= 1 / sum(tokens)
    assert all((a[(a == 9).any(axis=1), 0] == 9).all() for a in idx)
    assert (_flat(idx) >= 0).all()  # no empty slots without drop_fraction
    if 0 < fraction < 1:  # the hot tokens are spread over the ranks
        assert sum(bool((a == 9).any()) for a in idx) == 3


@pytest.mark.parametrize("kind", routing.KINDS)
@pytest.mark.parametrize("drop", [0.1, 0.5])
def test_drop_fraction(kind, drop):
    tokens = [200, 50, 0, 120]
    idx0, _ = routing.make(kind, 8, tokens, E, K, **PARAMS[kind])
    idx, w = routing.make(kind, 8, tokens, E, K, drop_fraction=drop, **PARAMS[kind])
    before, after = _flat(idx0), _flat(idx)
    assert ((after == before) | (after == -1)).all()  # only emptied slots change
    want = min(round(drop * before.size), int((before >= 0).sum()))
    assert int(((before >= 0) & (after == -1)).sum()) == want
    assert (_flat(w)[after < 0] == 0).all()


def test_drop_fraction_one_empties_everything():
    idx, w = routing.make("zipf", 3, [9, 4], 16, 3, drop_fraction=1.0)
    assert (_flat(idx) == -1).all() and (_flat(w) == 0).all()


@pytest.mark.parametrize("num_ranks,mean,imbalance", [(8, 100, 1.0), (8, 100, 2.5), (4, 333, 1.3), (4, 64, 4.0),
                                                      (1, 50, 1.0), (2, 0, 1.5)])
def test_imbalanced_tokens(num_ranks, mean, imbalance):
    counts = routing.imbalanced_tokens(6, num_ranks, mean, imbalance)
    assert len(counts) == num_ranks and all(isinstance(c, int) and c >= 0 for c in counts)
    assert sum(counts) == num_ranks * mean
    if mean:
        assert abs(max(counts) / mean - imbalance) <= 0.5 / mean
    assert counts == routing.imbalanced_tokens(6, num_ranks, mean, imbalance)


def test_imbalanced_tokens_seed_moves_the_heavy_rank():
    heavy = {int(np.argmax(routing.imbalanced_tokens(seed, 8, 100, 3.0))) for seed in range(20)}
    assert len(heavy) > 1


@pytest.mark.parametrize("call,match", [
    (lambda: routing.make("gaussian", 0, [4], 8, 2), "unknown routing kind"),
    (lambda: routing.make("uniform", 0, [4], 8, 9), "num_topk"),
    (lambda: routing.make("uniform", 0, [4], 8, 0), "num_topk"),
    (lambda: routing.make("uniform", 0, [4], 0, 1), "num_experts"),
    (lambda: routing.make("uniform", 0, [4, -1], 8, 2), r"num_tokens_per_rank\[1\]"),
    (lambda: routing.make("uniform", 0, [4.5], 8, 2), "must be an int"),
    (lambda: routing.make("uniform", -1, [4], 8, 2), "seed"),
    (lambda: routing.make("uniform", 0, [4], 8, 2, drop_fraction=1.5), "drop_fraction"),
    (lambda: routing.make("uniform", 0, [4], 8, 2, drop_fraction=-0.1), "drop_fraction"),
    (lambda: routing.make("uniform", 0, [4], 8, 2, drop_fraction=float("nan")), "drop_fraction"),
    (lambda: routing.make("uniform", 0, [4], 8, 2, s=1.0), "takes no parameter"),
    (lambda: routing.make("zipf", 0, [4], 8, 2, skew=1.0), "takes no parameter"),
    (lambda: routing.make("zipf", 0, [4], 8, 2, s=-0.5), "zipf skew"),
    (lambda: routing.make("zipf", 0, [4], 8, 2, s=float("inf")), "zipf skew"),
    (lambda: routing.make("hot_expert", 0, [4], 8, 2, hot_fraction=1.2), "hot_fraction"),
    (lambda: routing.make("hot_expert", 0, [4], 8, 2, hot_fraction=-0.2), "hot_fraction"),
    (lambda: routing.make("hot_expert", 0, [4], 8, 2, hot_expert=8), "hot_expert"),
    (lambda: routing.make("hot_expert", 0, [4], 8, 2, hot_expert=-1), "hot_expert"),
    (lambda: routing.make("hot_expert", 0, [4], 8, 8, hot_fraction=0.5), "num_topk"),
    (lambda: routing.imbalanced_tokens(0, 4, 10, 0.9), "imbalance"),
    (lambda: routing.imbalanced_tokens(0, 4, 10, 4.5), "imbalance"),
    (lambda: routing.imbalanced_tokens(0, 0, 10, 1.0), "num_ranks"),
    (lambda: routing.imbalanced_tokens(0, 4, -3, 1.0), "mean_tokens"),
])
def test_invalid_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_hot_expert_with_every_expert_selected():
    idx, _ = routing.make("hot_expert", 0, [5], 4, 4, hot_fraction=1.0, hot_expert=2)
    assert (idx[0][:, 0] == 2).all() and (np.sort(idx[0], axis=1) == np.arange(4)).all()


def _popularity(kind, step, **params):
    idx, _ = routing.make(kind, 9, [512] * 4, E, K, step=step, **params)
    return np.bincount(_flat(idx)[_flat(idx) >= 0], minlength=E)


@pytest.mark.parametrize("kind,params", [("zipf", {"s": 1.2}), ("hot_expert", {"hot_fraction": 0.3}),
                                         ("drift", {"s": 1.2, "period": 4})])
def test_a_step_draws_new_tokens_and_step_zero_is_the_plain_routing(kind, params):
    plain, _ = routing.make(kind, 9, TOKENS, E, K, **params)
    zero, _ = routing.make(kind, 9, TOKENS, E, K, step=0, **params)
    one, _ = routing.make(kind, 9, TOKENS, E, K, step=1, **params)
    assert all(np.array_equal(a, b) for a, b in zip(plain, zero))
    assert not all(np.array_equal(a, b) for a, b in zip(zero, one))


def test_the_hot_set_stays_within_an_epoch_and_moves_between_epochs():
    def hot(step):
        return set(np.argsort(-_popularity("drift", step, s=1.4, period=4))[:4])
    assert hot(0) == hot(3)  # same epoch: same popularity, new tokens
    assert hot(0) != hot(4)  # next epoch: another order of the experts
    assert set(np.argsort(-_popularity("zipf", 0, s=1.4))[:4]) == set(np.argsort(-_popularity("zipf", 5, s=1.4))[:4])


def test_drift_rejects_a_zero_period():
    with pytest.raises(ValueError, match="period"):
        routing.make("drift", 0, TOKENS, E, K, period=0)
