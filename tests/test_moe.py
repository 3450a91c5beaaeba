"""CPU tests of the end-to-end MoE layer (cupyep.moe), no GPU.

- BF16 bit conversions against ml_dtypes;
- routing: shapes, dtypes, softmax-then-top-k renormalised weights, the k
  largest logits, lower expert id first on ties, determinism;
- weights: the same for the same seed (also in another process), BF16 values;
- the math of the distributed layer: a NumPy emulation of it, built from
  cupyep.reference's dispatch, expert_major_order, expert_major_reduce and
  combine around the layer's own expert_ffn and expert_blocks, agrees with
  reference_forward within the bounds of cupyep.moe; and those checks fail
  for a layer with one dropped slot or the wrong expert's weights.
"""
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import cupyep.reference as ref
from cupyep import moe

from cupyep.testing import bf16_to_f32, f32_to_bf16

H, F, E, K = 256, 128, 16, 4


@pytest.fixture(scope="module")
def weights():
    return moe.MoEWeights.random(3, H, F, E)


def _tokens(seed, tokens, hidden=H):
    """Each rank's [T_r, hidden] BF16 bits, normal values."""
    return [f32_to_bf16(np.random.default_rng([seed, r]).standard_normal((t, hidden), dtype=np.float32))
            for r, t in enumerate(tokens)]


# ----------------------------------------------------------------- BF16 bits

def test_bf16_conversions_match_ml_dtypes():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 10000),
                        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, 1.0 + 2 ** -8,
                                  1.0 + 3 * 2 ** -8], dtype=np.float32)]).astype(np.float32)
    bits = moe.f32_to_bf16_bits(x)
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    assert np.array_equal(bits, f32_to_bf16(x))  # ties (1 + 2**-8, 1 + 3 * 2**-8) to even included
    assert np.array_equal(moe.bf16_bits_to_f32(bits), bf16_to_f32(bits))
    nan = moe.f32_to_bf16_bits(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(bf16_to_f32(nan)).all()


# ------------------------------------------------------------------- routing

def _logits(x, router):
    return x.astype(np.float64) @ router.astype(np.float64)


def test_route_properties(weights):
    x = bf16_to_f32(_tokens(1, [300])[0])
    idx, w = moe.route(x, weights.router, K)
    assert idx.shape == w.shape == (300, K) and idx.dtype == np.int64 and w.dtype == np.float32
    assert ((idx >= 0) & (idx < E)).all()
    assert all(len(set(row)) == K for row in idx.tolist())  # distinct experts
    assert np.allclose(w.sum(axis=1), 1.0, atol=1e-6, rtol=0) and (w > 0).all()
    assert (np.diff(w, axis=1) <= 0).all()  # slots by decreasing logit
    logits = _logits(x, weights.router)
    chosen = np.take_along_axis(logits, idx, axis=1)
    others = np.where(np.isin(np.arange(E)[None], idx[:, :, None]).any(axis=1), -np.inf, logits)
    assert (chosen.min(axis=1) >= others.max(axis=1)).all()  # the k largest logits
    assert (np.diff(chosen, axis=1) <= 0).all()
    # Weights: the softmax over all E logits, restricted to the k and renormalised.
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    sel = np.take_along_axis(p, idx, axis=1)
    assert np.allclose(w, sel / sel.sum(axis=1, keepdims=True), rtol=1e-6, atol=0)
    idx2, w2 = moe.route(x.copy(), weights.router.copy(), K)
    assert np.array_equal(idx, idx2) and np.array_equal(w, w2)


def test_route_matches_sorting_by_logit_then_expert_id():
    rng = np.random.default_rng(5)
    # Columns repeat (ties between experts) and logits take few values (ties within a token).
    base = f32_to_bf16(rng.standard_normal((8, 4), dtype=np.float32))
    router = bf16_to_f32(base[:, rng.integers(0, 4, E)])
    x = bf16_to_f32(f32_to_bf16(rng.integers(-2, 3, (64, 8)).astype(np.float32)))
    idx, w = moe.route(x, router, K)
    logits = _logits(x, router)
    for t in range(x.shape[0]):
        want = sorted(range(E), key=lambda e: (-logits[t, e], e))[:K]
        assert idx[t].tolist() == want
        tied = logits[t, idx[t]][:, None] == logits[t, idx[t]][None, :]
        assert (w[t][:, None] == w[t][None, :])[tied].all()  # tied experts weigh the same
    assert moe.route(np.zeros((0, 8), np.float32), router, K)[0].shape == (0, K)
    with pytest.raises(ValueError, match="k must be"):
        moe.route(x, router, E + 1)
    with pytest.raises(ValueError, match="router"):
        moe.route(x, router[:7], K)


# ------------------------------------------------------------------- weights

def test_weights_are_seeded_bf16_values(weights):
    assert weights.router.shape == (H, E) and weights.w1.shape == (E, H, F) and weights.w2.shape == (E, F, H)
    assert {a.dtype for a in (weights.router, weights.w1, weights.w2)} == {np.dtype(np.float32)}
    assert (weights.hidden, weights.ffn, weights.num_experts) == (H, F, E)
    for a in (weights.router, weights.w1, weights.w2):
        assert np.array_equal(ref.bf16_round(a), a) and a.std() > 0
    again = moe.MoEWeights.random(3, H, F, E)
    other = moe.MoEWeights.random(4, H, F, E)
    for a, b, c in zip((weights.router, weights.w1, weights.w2), (again.router, again.w1, again.w2),
                       (other.router, other.w1, other.w2)):
        assert np.array_equal(a, b) and not np.array_equal(a, c)
    # Each expert depends only on the seed, its id and the sizes: fewer experts are a prefix.
    fewer = moe.MoEWeights.random(3, H, F, E // 2)
    assert np.array_equal(fewer.w1, weights.w1[:E // 2]) and np.array_equal(fewer.w2, weights.w2[:E // 2])
    w1, w2 = weights.local(2, 4)
    assert np.array_equal(w1, weights.w1[8:12]) and np.array_equal(w2, weights.w2[8:12])
    with pytest.raises(ValueError, match="divisible"):
        weights.local(0, 3)


def test_weights_are_the_same_in_another_process(weights):
    """Every rank builds the weights itself: they must not depend on process state."""
    code = ("import hashlib, numpy as np; from cupyep.moe import MoEWeights; "
            f"w = MoEWeights.random(3, {H}, {F}, {E}); "
            "print(hashlib.sha256(b''.join(a.tobytes() for a in (w.router, w.w1, w.w2))).hexdigest())")
    np.random.seed(123)  # the global RNG must not matter either
    import hashlib
    mine = hashlib.sha256(b"".join(a.tobytes() for a in (weights.router, weights.w1, weights.w2))).hexdigest()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == mine


# ------------------------------------------------------------ expert blocks

def test_expert_ffn_computes_block_rows_and_leaves_padding():
    rng = np.random.default_rng(2)
    w = moe.MoEWeights.random(1, 128, 64, 3)
    x = f32_to_bf16(rng.standard_normal((10, 128), dtype=np.float32))
    blocks = moe.expert_blocks([4, 0, 6], [3, 0, 5])  # rows 3 and 9 are padding
    assert blocks == [(0, 3), (4, 0), (4, 5)]
    out = np.full((10, 128), 0x7FC0, dtype=np.uint16)  # NaN sentinel: untouched rows keep it
    y = moe.expert_ffn(x, blocks, w.w1, w.w2, out=out)
    assert y is out
    for e, rows in ((0, range(0, 3)), (2, range(4, 9))):
        for m in rows:
            z = bf16_to_f32(x[m]) @ w.w1[e]
            want = f32_to_bf16((z / (1 + np.exp(-z))) @ w.w2[e])
            assert np.abs(bf16_to_f32(y[m]) - bf16_to_f32(want)).max() <= 2 ** -7 * np.abs(bf16_to_f32(want)).max()
    assert (out[[3, 9]] == 0x7FC0).all()
    assert not moe.expert_ffn(x, blocks, w.w1, w.w2)[[3, 9]].any()  # a fresh output: padding stays zero
    with pytest.raises(ValueError, match="fit"):
        moe.expert_blocks([4, 0], [5, 0])
    with pytest.raises(ValueError, match="local experts"):
        moe.expert_ffn(x, blocks[:2], w.w1, w.w2)


def test_result_blocks_from_host_counts_or_device_layout():
    offsets = np.array([0, 128, 128, 384], dtype=np.int32)
    src = np.full(384, -1, dtype=np.int32)
    src[:5], src[128:300] = np.arange(5), np.arange(172)
    known = SimpleNamespace(num_recv_tokens_per_expert=[128, 0, 256],
                            handle=SimpleNamespace(recv_expert_counts=(5, 0, 172)), expert_offsets=None,
                            expert_src_row=None)
    unknown = SimpleNamespace(num_recv_tokens_per_expert=None, handle=SimpleNamespace(recv_expert_counts=None),
                              expert_offsets=offsets, expert_src_row=src)
    assert moe.result_blocks(known) == moe.result_blocks(unknown) == [(0, 5), (128, 0), (128, 172)]


# ------------------------------------------------- distributed path, emulated

def emulate_layer(xs, weights, k, alignment, drop=None, swap_experts=False):
    """The distributed layer on the NumPy reference: per rank, route its
    tokens; dispatch them all (ref.intranode_dispatch); per destination, the
    expert-major layout (ref.expert_major_order) and its expert_x, the layer's
    expert_ffn over expert_blocks, the weighted reduce (float64, then BF16);
    then combine (ref.intranode_combine) and BF16. Returns the concatenated
    [T_all, H] BF16 bits and the y arrays (for padding checks).

    drop: (rank, token, slot) whose weight is zeroed (a broken layer);
    swap_experts: each rank runs its local experts' weights in reverse order."""
    R = len(xs)
    E_local = weights.num_experts // R
    routes = [moe.route(bf16_to_f32(x), weights.router, k) for x in xs]
    topk_w = [w.copy() for _, w in routes]
    if drop is not None:
        topk_w[drop[0]][drop[1], drop[2]] = 0
    res = ref.intranode_dispatch(xs, [i for i, _ in routes], weights.num_experts, topk_weights=topk_w,
                                 expert_alignment=alignment)
    reduced, ys = [], []
    for d, r in enumerate(res):
        lay = ref.expert_major_order(r, E_local, alignment)
        expert_x = np.zeros((lay.rows.size, xs[0].shape[1]), dtype=np.uint16)
        keep = lay.rows >= 0
        expert_x[keep] = r.recv_x[lay.rows[keep]]
        counts = np.bincount(r.recv_topk_idx[r.recv_topk_idx >= 0], minlength=E_local)
        blocks = moe.expert_blocks(r.num_recv_tokens_per_expert, counts)
        assert [f for f, _ in blocks] == lay.expert_offsets[:-1].tolist()
        w1, w2 = weights.local(d, R)
        if swap_experts:
            w1, w2 = w1[::-1], w2[::-1]
        y = moe.expert_ffn(expert_x, blocks, w1, w2)
        ys.append((y, keep))
        red = ref.expert_major_reduce(bf16_to_f32(y), lay, r.num_recv_tokens, k, r.recv_topk_weights)
        reduced.append(ref.bf16_round(red))
    combined = ref.intranode_combine(reduced, res, [x.shape[0] for x in xs])
    return np.concatenate([f32_to_bf16(c) for c in combined]), ys


CASES = [
    # (seed, tokens per rank, expert alignment)
    (11, [40, 40], 1),
    (12, [40, 40], 128),
    (13, [33, 0, 57, 20], 8),
    (14, [64, 64, 64, 64], 128),
    (15, [1, 2, 3, 4, 5, 6, 7, 8], 1),
]


@pytest.mark.parametrize("seed,tokens,alignment", CASES)
def test_emulated_layer_matches_reference_forward(weights, seed, tokens, alignment):
    xs = _tokens(seed, tokens)
    x_all = np.concatenate(xs)
    got, ys = emulate_layer(xs, weights, K, alignment)
    assert got.shape == x_all.shape and got.dtype == np.uint16 and not np.isnan(bf16_to_f32(got)).any()
    for y, keep in ys:  # padding rows are excluded from the math and stay zero
        assert not y[~keep].any() and y[keep].any()
    plain = moe.reference_forward(x_all, weights, K)
    mirrored = moe.reference_forward(x_all, weights, K, num_ranks=len(tokens))
    assert plain.shape == x_all.shape and plain.dtype == mirrored.dtype == np.uint16
    for want, diff_bound in ((plain, moe.MOE_CALC_DIFF_BOUND), (mirrored, 1e-9)):
        diff, worst = moe.agreement(got, want)
        assert diff < diff_bound and worst < moe.MOE_TOKEN_BOUND, (diff, worst)
    # One rank rounds like the plain layer (a single BF16 partial per token).
    assert np.array_equal(moe.reference_forward(x_all, weights, K, num_ranks=1), plain)


def test_reference_forward_matches_per_token_loops(weights):
    x_all = np.concatenate(_tokens(21, [7, 5]))
    idx, w = moe.route(bf16_to_f32(x_all), weights.router, K)
    want = np.empty(x_all.shape, dtype=np.float32)
    for t in range(x_all.shape[0]):
        acc = np.zeros(H, dtype=np.float32)
        for j in range(K):
            e = idx[t, j]
            z = bf16_to_f32(x_all[t:t + 1]) @ weights.w1[e]
            acc += w[t, j] * ref.bf16_round((z / (1 + np.exp(-z))) @ weights.w2[e])[0]
        want[t] = acc
    got = bf16_to_f32(moe.reference_forward(x_all, weights, K))
    assert ref.calc_diff(got, ref.bf16_round(want)) < 1e-9
    assert moe.reference_forward(x_all[:0], weights, K).shape == (0, H)


def test_the_checks_fail_for_a_broken_layer(weights):
    """A dropped slot of one token, or the wrong expert's weights, must fail."""
    tokens = [64, 64, 64, 64]
    xs = _tokens(14, tokens)
    want = moe.reference_forward(np.concatenate(xs), weights, K, num_ranks=4)
    _, w = moe.route(bf16_to_f32(xs[2]), weights.router, K)
    diff, worst = moe.agreement(emulate_layer(xs, weights, K, 128, drop=(2, 10, K - 1))[0], want)
    assert worst > 5 * moe.MOE_TOKEN_BOUND, (worst, w[10])
    diff, worst = moe.agreement(emulate_layer(xs, weights, K, 128, swap_experts=True)[0], want)
    assert diff > 100 * moe.MOE_CALC_DIFF_BOUND, diff
    with pytest.raises(ValueError, match="shape"):
        moe.agreement(want, want[:3])


# ------------------------------------------- MoELayer.forward over a stand-in

class _World:
    """R threads standing in for R ranks: a collective call stores each rank's
    arguments, rank 0 computes every rank's answer on the NumPy reference once
    all have arrived, and each rank takes its own."""

    def __init__(self, num_ranks, num_experts):
        import threading
        self.R, self.E = num_ranks, num_experts
        self.barrier = threading.Barrier(num_ranks, timeout=60)
        self.args, self.answers = [None] * num_ranks, [None] * num_ranks
        self.layouts = self.tokens = None

    def collective(self, rank, args, compute):
        self.args[rank] = args
        self.barrier.wait()
        if rank == 0:
            try:
                self.answers = compute(list(self.args))
            except BaseException:
                self.barrier.abort()  # the other ranks raise BrokenBarrierError instead of waiting
                raise
        self.barrier.wait()
        return self.answers[rank]

    def run(self, fn):
        """fn(rank) on every rank, in threads; a rank that raises stops the others."""
        from concurrent.futures import ThreadPoolExecutor

        def one(rank):
            try:
                return fn(rank)
            except BaseException:
                self.barrier.abort()
                raise
        with ThreadPoolExecutor(self.R) as pool:
            return list(pool.map(one, range(self.R)))


class _HostBuffer:
    """Buffer.dispatch / Buffer.combine of one rank on the NumPy reference
    (expert-major BF16 dispatch, weighted combine of expert-major outputs).
    Every call is checked against the real Buffer's signature, and the
    results are the real DispatchResult / CombineResult."""

    def __init__(self, world, rank):
        from types import SimpleNamespace
        self.world, self.rank, self.num_ranks = world, rank, world.R
        self.calls = []
        # within one node, as Buffer.routes: only the direct route has a zero-copy combine
        self.routes = {"queue": SimpleNamespace(zero_copy=False), "direct": SimpleNamespace(zero_copy=True)}

    def dispatch(self, *args, **kwargs):
        import inspect
        from cupyep.normal.buffer import Buffer
        from cupyep.results import DispatchResult
        bound = inspect.signature(Buffer.dispatch).bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        self.calls.append(("dispatch", {k: a[k] for k in ("expert_major", "expert_alignment", "transport",
                                                          "validate", "config")}))
        assert a["expert_major"] and a["num_experts"] == self.world.E and a["handle"] is None
        assert a["x"].dtype == np.uint16 and a["topk_idx"].dtype == np.int64 and a["topk_weights"].dtype == np.float32
        A, E_local = a["expert_alignment"], self.world.E // self.world.R

        def compute(all_args):
            res = ref.intranode_dispatch([x for x, _, _ in all_args], [i for _, i, _ in all_args], self.world.E,
                                         topk_weights=[w for _, _, w in all_args], expert_alignment=A)
            self.world.layouts = [(r, ref.expert_major_order(r, E_local, A)) for r in res]
            self.world.tokens = [x.shape[0] for x, _, _ in all_args]
            return self.world.layouts

        r, lay = self.world.collective(self.rank, (a["x"], a["topk_idx"], a["topk_weights"]), compute)
        keep = lay.rows >= 0
        # Padding rows are zero on the GPU; NaN here, so that a layer computing on them shows.
        expert_x = np.full((lay.rows.size, a["x"].shape[1]), 0x7FC0, dtype=np.uint16)
        expert_x[keep] = r.recv_x[lay.rows[keep]]
        counts = tuple(int(c) for c in np.bincount(r.recv_topk_idx[r.recv_topk_idx >= 0], minlength=E_local))
        handle = SimpleNamespace(recv_expert_counts=counts, rank=self.rank, num_expert_rows=lay.rows.size)
        src = np.where(keep, lay.rows, -1).astype(np.int32)
        return DispatchResult(None if a["transport"] == "direct" else r.recv_x, None, r.recv_topk_idx,
                              r.recv_topk_weights, list(r.num_recv_tokens_per_expert), handle, None, expert_x, None,
                              lay.expert_offsets.astype(np.int32), src)

    def combine(self, *args, **kwargs):
        import inspect
        from cupyep.normal.buffer import Buffer
        from cupyep.results import CombineResult
        bound = inspect.signature(Buffer.combine).bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        self.calls.append(("combine", {k: a[k] for k in ("expert_major", "zero_copy", "config")}))
        y, handle = a["x"], a["handle"]
        r, lay = self.world.layouts[self.rank]
        assert a["expert_major"] and handle.rank == self.rank and a["topk_weights"] is None
        assert y.dtype == np.uint16 and y.shape == (handle.num_expert_rows, r.recv_x.shape[1])
        assert not y[lay.rows < 0].any(), "padding rows of the expert outputs must stay zero"
        assert a["pair_weights"] is r.recv_topk_weights
        k = r.recv_topk_idx.shape[1]
        reduced = ref.bf16_round(ref.expert_major_reduce(bf16_to_f32(y), lay, r.num_recv_tokens, k, a["pair_weights"]))

        def compute(all_reduced):
            return [f32_to_bf16(c) for c in ref.intranode_combine(all_reduced, [r for r, _ in self.world.layouts],
                                                                 self.world.tokens)]

        return CombineResult(self.world.collective(self.rank, reduced, compute), None)


class _HostLayer(moe.MoELayer):
    """MoELayer with its arrays on the host (for the stand-in buffer)."""
    _to_device = staticmethod(lambda a: np.asarray(a, dtype=np.float32))
    _input = staticmethod(lambda x: x)


@pytest.mark.parametrize("transport", ["queue", "direct"])
@pytest.mark.parametrize("tokens,alignment", [([40, 40], 128), ([33, 0, 57, 20], 1)])
def test_layer_forward_over_a_host_buffer(weights, transport, tokens, alignment):
    """MoELayer.forward itself (routing, the dispatch call, the host-known
    blocks, the FFN, the combine call), with R threads as ranks over the
    NumPy reference's dispatch and combine, against reference_forward."""
    R = len(tokens)
    world = _World(R, E)
    bufs = [_HostBuffer(world, r) for r in range(R)]
    layers = [_HostLayer(b, weights, K, transport=transport, expert_alignment=alignment) for b in bufs]
    xs = _tokens(31, tokens)
    outs = world.run(lambda r: layers[r].forward(xs[r]))
    got = np.concatenate(outs)
    x_all = np.concatenate(xs)
    assert [o.shape for o in outs] == [(t, H) for t in tokens]
    for want, bound in ((moe.reference_forward(x_all, weights, K), moe.MOE_CALC_DIFF_BOUND),
                        (moe.reference_forward(x_all, weights, K, num_ranks=R), 1e-9)):
        diff, worst = moe.agreement(got, want)
        assert diff < bound and worst < moe.MOE_TOKEN_BOUND, (diff, worst)
    assert bufs[0].calls == [("dispatch", {"expert_major": True, "expert_alignment": alignment, "transport": transport,
                                           "validate": False, "config": None}),
                             ("combine", {"expert_major": True, "zero_copy": transport == "direct", "config": None})]
    # the direct transport within a node combines zero-copy by default; the queue route has no such combine
    assert [layer.zero_copy for layer in layers] == [transport == "direct"] * R
    if transport == "queue":
        with pytest.raises(ValueError, match="zero_copy=True needs the direct transport"):
            _HostLayer(bufs[0], weights, K, transport=transport, zero_copy=True)


def test_layer_passes_its_configs_to_dispatch_and_combine(weights):
    """MoELayer(dispatch_config=..., combine_config=...) reaches both calls
    unchanged (here the direct route's few-block config)."""
    from cupyep.normal.direct_kernels import DirectConfig
    R = 2
    world = _World(R, E)
    bufs = [_HostBuffer(world, r) for r in range(R)]
    cfg = DirectConfig(num_sms=4)
    layers = [_HostLayer(b, weights, K, transport="direct", dispatch_config=cfg, combine_config=cfg) for b in bufs]
    xs = _tokens(32, [24, 24])
    world.run(lambda r: layers[r].forward(xs[r]))
    assert [c["config"] for _, c in bufs[0].calls] == [cfg, cfg]


def test_layer_rejects_bad_arguments(weights):
    world = _World(3, E)
    with pytest.raises(ValueError, match="divisible"):
        _HostLayer(_HostBuffer(world, 0), weights, K)
    world = _World(2, E)
    with pytest.raises(ValueError, match="transport"):
        _HostLayer(_HostBuffer(world, 0), weights, K, transport="ring")
    with pytest.raises(ValueError, match="num_topk"):
        _HostLayer(_HostBuffer(world, 0), weights, E + 1)
    with pytest.raises(ValueError, match="hidden"):
        _HostLayer(_HostBuffer(world, 0), weights, K).forward(np.zeros((2, H + 128), np.uint16))


@pytest.mark.parametrize("rule", ["round_robin", "nearest"])
@pytest.mark.parametrize("tokens", [[40, 40], [33, 0, 57, 20]])
def test_layer_with_a_placement_is_the_logical_layer(weights, rule, tokens):
    """With replicated experts (a placement planned from skewed loads), the
    layer dispatches physical ids over P experts and returns the logical
    layer's output: the reference with the same placement (only the per-rank
    partials' rounding moves) within 1e-9, as the layer without one matches
    its reference, and the plain reference within the layer's bound."""
    from cupyep.balance import physical_topk, rebalance_experts
    R = len(tokens)
    load = np.ones((1, E))
    load[0, :3] = [20.0, 9.0, 5.0]
    placement = rebalance_experts(load, E + 2 * R, 1, 1, R).layer(0)  # two extra replicas per rank
    P = placement.num_physical
    world = _World(R, P)
    bufs = [_HostBuffer(world, r) for r in range(R)]
    layers = [_HostLayer(b, weights, K, expert_alignment=8, placement=placement, rule=rule) for b in bufs]
    assert layers[0].num_experts == P and layers[0].w1.shape[0] == P // R
    xs = _tokens(5, tokens)
    got = np.concatenate(world.run(lambda r: layers[r].forward(xs[r])))
    x_all = np.concatenate(xs)
    want = moe.reference_forward(x_all, weights, K, num_ranks=R, placement=placement, rule=rule,
                                 tokens_per_rank=tokens)
    diff, worst = moe.agreement(got, want)
    assert diff < 1e-9 and worst < moe.MOE_TOKEN_BOUND, (diff, worst)
    diff, worst = moe.agreement(got, moe.reference_forward(x_all, weights, K))
    assert diff < moe.MOE_CALC_DIFF_BOUND and worst < moe.MOE_TOKEN_BOUND, (diff, worst)
    # the hot expert's slots really went to several replicas
    idx, _ = moe.route(moe.bf16_bits_to_f32(x_all[:tokens[0]]), weights.router, K)
    assert len(set(physical_topk(idx, placement, 0, "round_robin")[idx == 0].tolist())) > 1 or not (idx == 0).any()


@pytest.mark.parametrize("replicated", [False, True])
def test_a_layer_given_a_routing_is_the_reference_under_that_routing(weights, replicated):
    """forward(x, topk_idx, topk_weights): a routing from the caller (a
    skewed, seeded one with empty slots) replaces the router's; each phase
    is marked when asked; a half-given routing is refused."""
    from cupyep import routing
    from cupyep.balance import rebalance_experts
    tokens = [24, 40, 0, 17]
    R = len(tokens)
    idx, w = routing.make("hot_expert", 3, tokens, E, K, drop_fraction=0.1, hot_fraction=0.5)
    placement = rebalance_experts(np.bincount(np.concatenate(idx).ravel() + 1, minlength=E + 1)[None, 1:]
                                  .astype(float), E + 2 * R, 1, 1, R).layer(0) if replicated else None
    world = _World(R, E + 2 * R if replicated else E)
    layers = [_HostLayer(_HostBuffer(world, r), weights, K, expert_alignment=4, placement=placement)
              for r in range(R)]
    xs = _tokens(8, tokens)
    got = np.concatenate(world.run(lambda r: layers[r].forward(xs[r], idx[r], w[r])))
    want = moe.reference_forward(np.concatenate(xs), weights, K, num_ranks=R, placement=placement,
                                 tokens_per_rank=tokens, topk_idx=np.concatenate(idx),
                                 topk_weights=np.concatenate(w))
    diff, worst = moe.agreement(got, want)
    assert diff < 1e-9 and worst < moe.MOE_TOKEN_BOUND, (diff, worst)
    routed = moe.reference_forward(np.concatenate(xs), weights, K)
    assert moe.agreement(got, routed)[0] > 1e-3  # the given routing, not the router's, decided
    with pytest.raises(ValueError, match="come together"):
        layers[0].forward(xs[0], topk_idx=idx[0])
    with pytest.raises(ValueError, match="must be"):
        layers[0].forward(xs[0], idx[0][:, :2], w[0][:, :2])


def test_a_layer_rejects_a_placement_that_does_not_fit(weights):
    from cupyep.balance import rebalance_experts
    world = _World(2, E)
    p = rebalance_experts(np.ones((2, E)), E + 4, 1, 1, 2)
    with pytest.raises(ValueError, match="one layer"):
        _HostLayer(_HostBuffer(world, 0), weights, K, placement=p)
    with pytest.raises(ValueError, match="for 4 GPUs"):
        _HostLayer(_HostBuffer(world, 0), weights, K, placement=rebalance_experts(np.ones((1, E)), E, 1, 1, 4))
    with pytest.raises(ValueError, match="rule"):
        _HostLayer(_HostBuffer(world, 0), weights, K, placement=p.layer(0), rule="random")
