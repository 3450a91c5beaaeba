"""Low-latency regions below the worst case (CPU): the layout a capacity
gives, the reference's regions and its refusal of an overflowing routing,
and the micro-batch split that no token escapes, whose combined rows equal
the whole call's exactly."""
import numpy as np
import pytest

from cupyep import reference as ref, routing
from cupyep.low_latency import layout as L
from cupyep.low_latency.overflow import POLICIES, split_tokens


def test_a_capacity_factor_sizes_the_regions_and_shrinks_the_buffer():
    # 8 ranks, 1024 tokens, 256 experts, top-8: the worst case does not fit an H200's share
    worst = L.size_hint(8, 1024, 7168, 256, 8)
    c = L.capacity_for(2.0, 1024, 8, 256)
    assert c == 64  # twice the mean 32 rows of one source per expert
    small = L.size_hint(8, 1024, 7168, 256, 8, capacity=c)
    assert worst > 15 * 2**30 and small < 1.5 * 2**30
    lay = L.low_latency_layout(8, 1024, 7168, 256, 8, capacity=c)
    assert lay.capacity == c and lay.slots == 8 * c
    assert L.low_latency_layout(8, 1024, 7168, 256, 8).capacity == 1024
    # a source returns a rank at most El * C rows, fewer than M * min(k, El) here
    assert L.return_rows(1024, 8, 32, c) == 32 * c < 1024 * 8
    assert L.return_rows(1024, 8, 32) == L.return_rows(1024, 8, 32, 1024) == 1024 * 8
    assert L.capacity_for(100.0, 16, 8, 64) == 16 and L.capacity_for(0.01, 16, 8, 64) == 1


@pytest.mark.parametrize("bad", [0, 17, -1, 2.5, True])
def test_a_capacity_outside_one_to_max_tokens_is_refused(bad):
    with pytest.raises(ValueError, match="capacity"):
        L.low_latency_layout(2, 16, 128, 4, 2, capacity=bad)


@pytest.mark.parametrize("bad", [0, -1.0, "2"])
def test_a_capacity_factor_must_be_positive(bad):
    with pytest.raises(ValueError, match="capacity_factor"):
        L.capacity_for(bad, 16, 2, 4)


def test_the_split_keeps_every_token_once_and_every_region_within_capacity():
    idx, _ = routing.make("hot_expert", 3, [200], 16, 4, drop_fraction=0.1, hot_fraction=0.6)
    for cap in (1, 7, 40, 200):
        parts = split_tokens(idx[0], cap, 16)
        assert np.array_equal(np.concatenate(parts), np.arange(200))  # in order, each token once
        for p in parts:
            sel = idx[0][p]
            assert np.bincount(sel[sel >= 0], minlength=16).max() <= cap
        # a new part only where the next token would overflow: joined with the next token it would not fit
        for p, q in zip(parts, parts[1:]):
            sel = idx[0][np.append(p, q[0])]
            assert np.bincount(sel[sel >= 0], minlength=16).max() > cap
    assert len(split_tokens(idx[0], 200, 16)) == 1
    assert [p.size for p in split_tokens(np.zeros((0, 4), np.int64), 3, 16)] == [0]


@pytest.mark.parametrize("bad,match", [(np.array([[0, 16]]), "outside"), (np.zeros(3, np.int64), r"\[T, k\]")])
def test_the_split_refuses_bad_routings(bad, match):
    with pytest.raises(ValueError, match=match):
        split_tokens(bad, 2, 16)
    with pytest.raises(ValueError, match="capacity"):
        split_tokens(np.zeros((1, 2), np.int64), 0, 16)


def _tagged(R, T, H):
    return [np.random.default_rng([9, r]).standard_normal((T, H)).astype(np.float32) for r in range(R)]


def test_the_reference_lays_out_regions_of_capacity_rows_and_refuses_an_overflow():
    R, E, k, T, H, M = 4, 16, 4, 24, 128, 32
    idx, _ = routing.make("uniform", 1, [T] * R, E, k)
    x = _tagged(R, T, H)
    most = max(int(np.bincount(i[i >= 0], minlength=E).max()) for i in idx)
    full = ref.low_latency_dispatch(x, idx, E, M)
    tight = ref.low_latency_dispatch(x, idx, E, M, capacity=most)
    El = E // R
    for a, b in zip(full, tight):
        assert b.recv_x.shape == (El, R * most, H) and b.capacity == most
        assert np.array_equal(a.layout_count, b.layout_count)
        assert np.array_equal(b.layout_begin, np.broadcast_to(np.arange(R) * most, (El, R)))
        for le in range(El):
            for r in range(R):
                n = a.layout_count[le, r]
                assert np.array_equal(a.recv_x[le, r * M:r * M + n], b.recv_x[le, r * most:r * most + n])
    with pytest.raises(ValueError, match=f"more than the capacity of its region \\({most - 1}\\)"):
        ref.low_latency_dispatch(x, idx, E, M, capacity=most - 1)


def test_micro_batches_of_an_overflowing_routing_combine_to_the_whole_call():
    """The split policy on the reference: every rank cuts its tokens with
    split_tokens, all ranks run as many micro-batches (empty ones where a
    rank has fewer), and the combined rows are bitwise those of one call
    with regions of the worst case."""
    R, E, k, T, H, M = 4, 16, 4, 40, 128, 40
    idx, w = routing.make("hot_expert", 5, [T] * R, E, k, hot_fraction=0.7)
    x = _tagged(R, T, H)
    cap = 6
    assert max(int(np.bincount(i[i >= 0], minlength=E).max()) for i in idx) > cap

    def experts(results):  # every expert doubles its rows and adds its global id
        return [res.recv_x * 2 + (d * (E // R) + np.arange(E // R))[:, None, None] for d, res in enumerate(results)]

    whole_res = ref.low_latency_dispatch(x, idx, E, M)
    whole = ref.low_latency_combine(experts(whole_res), whole_res, idx, w)
    parts = [split_tokens(i, cap, E) for i in idx]
    n = max(len(p) for p in parts)
    parts = [p + [np.arange(0)] * (n - len(p)) for p in parts]
    got = [np.zeros((T, H), np.float32) for _ in range(R)]
    for m in range(n):
        sel = [parts[r][m] for r in range(R)]
        res = ref.low_latency_dispatch([x[r][s] for r, s in enumerate(sel)], [idx[r][s] for r, s in enumerate(sel)],
                                       E, M, capacity=cap)
        out = ref.low_latency_combine(experts(res), res, [idx[r][s] for r, s in enumerate(sel)],
                                      [w[r][s] for r, s in enumerate(sel)])
        for r in range(R):
            got[r][sel[r]] = out[r]
    assert n > 1
    assert all(np.array_equal(a, b) for a, b in zip(got, whole))


def test_the_policies():
    assert POLICIES == ("split", "normal", "raise")
