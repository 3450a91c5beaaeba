"""Expert-major dispatch output and combine from expert-major outputs, on the
GPU, checked against the NumPy reference.

Every rank builds the same seeded global routing and computes, with
cupyep.reference, every rank's dispatch and expert-major layout
(expert_major_order with the same alignment). Layout arrays and payload bytes
are compared exactly; combine (reduce in FP32 on the GPU, float64 in the
reference, both rounded to BF16 before the combine) with calc_diff < 5e-6.

Every test runs on each transport: the queue (a second pass lays the
received rows out), the direct transport (the senders write the rows
straight into the expert blocks, with no rank-major payload: recv_x is
None), by default fused, and unfused (layout, notify and send apart).
"""
import numpy as np
import pytest

from cupyep import reference as ref

from cupyep.fp8 import per_token_cast_to_fp8
from cupyep.reference.intranode import worst_token_rows
from cupyep.testing import all_ranks, bf16_to_f32, f32_to_bf16, global_routing, payload_bf16
from graphs import capture, replay

pytestmark = pytest.mark.gpu
NUM_EXPERTS = 256
BF16_NAN = np.uint16(0x7FC0)


@pytest.fixture(scope="module")
def buf(group):
    import cupyep
    b = cupyep.Buffer(group, num_topk=16)
    yield b
    b.destroy()


TRANSPORTS = ["queue", "direct", "direct_unfused"]


@pytest.fixture(params=TRANSPORTS)
def via(request):
    """Keyword arguments of dispatch for one transport."""
    from cupyep.normal.direct_kernels import DirectConfig
    return {"queue": {"transport": "queue"}, "direct": {"transport": "direct"},
            "direct_unfused": {"transport": "direct", "config": DirectConfig(fused=False)}}[request.param]


def _routing(group, seed, num_tokens, num_topk, zero_rank=None):
    tokens = [0 if r == zero_rank else num_tokens for r in range(group.local_size)]
    idx, w = global_routing(seed, tokens, NUM_EXPERTS, num_topk)
    return tokens, idx, w


def _payload_rows(result, num_ranks, hidden):
    """The BF16 payload rows a rank received (rebuilt from their (source, token) tags)."""
    rows = np.empty((result.num_recv_tokens, hidden), dtype=np.uint16)
    for s in range(num_ranks):
        sel = result.recv_src_rank == s
        rows[sel] = payload_bf16(s, result.recv_src_idx[sel], hidden)
    return rows


def _reference(group, tokens, idx, w, alignment):
    """Every rank's reference dispatch (of token ids) and expert-major layout."""
    ids = [np.arange(t, dtype=np.int32)[:, None] for t in tokens]
    res = ref.intranode_dispatch(ids, idx, NUM_EXPERTS, topk_weights=w, expert_alignment=alignment)
    E_local = NUM_EXPERTS // group.local_size
    return res, [ref.expert_major_order(r, E_local, alignment) for r in res]


def _expert_major_rows(rows, lay):
    """What expert_x must hold: rows[lay.rows], zero rows for padding."""
    out = np.zeros((lay.rows.size,) + rows.shape[1:], dtype=rows.dtype)
    keep = lay.rows >= 0
    out[keep] = rows[lay.rows[keep]]
    return out


def _layout_checks(out, exp, lay, num_topk):
    """Name -> bool: the GPU's expert-major map against the reference. In
    worst-token mode the arrays are longer: rows past the reference's are -1."""
    m, n = int(lay.expert_offsets[-1]), exp.num_recv_tokens
    offsets = out.expert_offsets.get()
    src = out.expert_src_row.get()
    rer = out.handle.recv_expert_row.get()
    return {
        "expert_offsets": offsets.dtype == np.int32 and np.array_equal(offsets, lay.expert_offsets),
        "expert_src_row": (src.dtype == np.int32 and src.shape[0] >= m and np.array_equal(src[:m], lay.rows)
                           and bool((src[m:] == -1).all())),
        "recv_expert_row": (rer.dtype == np.int32 and rer.shape[1] == num_topk
                            and np.array_equal(rer[:n], lay.pair_rows(n, num_topk)) and bool((rer[n:] == -1).all())),
        "num_expert_rows": out.handle.num_expert_rows == out.expert_x.shape[0] == src.shape[0],
    }


def _expert_outputs(rows, lay):
    """Host-side "experts" in the layout's order: y[m] = BF16(row * s_e) with
    s_e = (e % 7 + 1) / 4 for the entry's expert e; padding rows hold NaN
    (a kernel that reads them poisons the result)."""
    y = np.full((lay.rows.size, rows.shape[1]), BF16_NAN, dtype=np.uint16)
    for e in range(lay.expert_offsets.size - 1):
        b, end = int(lay.expert_offsets[e]), int(lay.expert_offsets[e + 1])
        entries = np.arange(b, end)[lay.rows[b:end] >= 0]
        y[entries] = f32_to_bf16(bf16_to_f32(rows[lay.rows[entries]]) * np.float32((e % 7 + 1) / 4))
    return y


def _expected_combine(res, lays, ys, tokens, num_topk, me, pair_weights):
    """ref reduce (float64 -> float32) -> BF16 -> ref.intranode_combine, for rank me;
    and this rank's reduced rows (BF16-rounded, float32)."""
    reduced = []
    for d, (r, lay, y) in enumerate(zip(res, lays, ys)):
        w = r.recv_topk_weights if pair_weights else None
        reduced.append(ref.bf16_round(ref.expert_major_reduce(bf16_to_f32(y), lay, r.num_recv_tokens, num_topk, w)))
    return ref.intranode_combine(reduced, res, tokens)[me], reduced[me]


DISPATCH_CASES = [
    # (seed, tokens per rank, hidden, top-k, expert alignment, rank with zero tokens)
    (1, 256, 2048, 8, 1, None),
    (2, 256, 2048, 8, 128, None),
    (3, 1, 2048, 8, 1, None),
    (4, 1, 2048, 8, 128, None),
    (5, 200, 2048, 8, 128, 0),
    (6, 300, 2048, 16, 1, None),
    (7, 300, 2048, 16, 128, None),
    (8, 4096, 7168, 8, 128, None),
]


@pytest.mark.parametrize("seed,num_tokens,hidden,num_topk,alignment,zero_rank", DISPATCH_CASES)
def test_expert_major_dispatch_bf16(group, buf, via, seed, num_tokens, hidden, num_topk, alignment, zero_rank):
    import cupy
    R, me = group.local_size, group.local_rank
    tokens, idx, w = _routing(group, seed, num_tokens, num_topk, zero_rank)
    x = payload_bf16(me, np.arange(tokens[me]), hidden)
    res, lays = _reference(group, tokens, idx, w, alignment)
    exp, lay = res[me], lays[me]
    rows = _payload_rows(exp, R, hidden)
    m = int(lay.expert_offsets[-1])

    out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                       expert_alignment=alignment, expert_major=True, **via)
    checks = _layout_checks(out, exp, lay, num_topk)
    expert_x = out.expert_x.get()
    checks.update({
        "recv_x": out.recv_x is None if via["transport"] == "direct" else np.array_equal(out.recv_x.get(), rows),
        "m_cap_exact": out.expert_x.shape == (m, hidden) and out.expert_x.dtype == np.uint16
                       and m == sum(out.num_recv_tokens_per_expert) and out.expert_x_scales is None,
        "expert_x": np.array_equal(expert_x, _expert_major_rows(rows, lay)),
        "padding_zero": not expert_x[lay.rows < 0].any(),
    })
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}

    # Cached dispatch: M_cap is the bound for N rows on the queue transport, exact on
    # the direct one (its pairs go where the handle's tables say); the layout is the
    # same, and so are the per-expert counts (those of the handle's routing).
    cached = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), handle=out.handle, expert_alignment=alignment,
                          expert_major=True, **via)
    E_local = NUM_EXPERTS // R
    bound = exp.num_recv_tokens * min(num_topk, E_local) + E_local * (alignment - 1)
    checks = _layout_checks(cached, exp, lay, num_topk)
    checks.update({
        "counts": out.num_recv_tokens_per_expert == exp.num_recv_tokens_per_expert,
        "cached_counts": cached.num_recv_tokens_per_expert == exp.num_recv_tokens_per_expert,
        "cached_m_cap": cached.expert_x.shape[0] == (m if via["transport"] == "direct" else bound),
        "cached_expert_x": np.array_equal(cached.expert_x[:m].get(), expert_x),
    })
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}


@pytest.mark.parametrize("alignment", [1, 128])
def test_expert_major_dispatch_fp8(group, buf, via, alignment):
    import cupy
    seed, num_tokens, hidden, num_topk = 17, 512, 2048, 8
    R, me = group.local_size, group.local_rank
    tokens, idx, w = _routing(group, seed, num_tokens, num_topk)
    x_fp8, scales = per_token_cast_to_fp8(cupy.asarray(payload_bf16(me, np.arange(num_tokens), hidden)))
    all_fp8 = group.comm.allgather((x_fp8.get(), scales.get()))
    exp = ref.intranode_dispatch([a for a, _ in all_fp8], idx, NUM_EXPERTS, topk_weights=w,
                                 x_scales=[s for _, s in all_fp8], expert_alignment=alignment)[me]
    lay = ref.expert_major_order(exp, NUM_EXPERTS // R, alignment)

    out = buf.dispatch((x_fp8, scales), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                       expert_alignment=alignment, expert_major=True, **via)
    checks = _layout_checks(out, exp, lay, num_topk)
    ex, es = out.expert_x.get(), out.expert_x_scales.get()
    checks.update({
        "dtypes": ex.dtype == np.uint8 and es.dtype == np.float32 and es.shape == (ex.shape[0], hidden // 128),
        "expert_x": np.array_equal(ex, _expert_major_rows(exp.recv_x, lay)),
        "expert_x_scales": np.array_equal(es, _expert_major_rows(exp.recv_x_scales, lay)),
        "padding_zero": not ex[lay.rows < 0].any() and not es[lay.rows < 0].any(),
    })
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}


COMBINE_CASES = [
    # (seed, tokens per rank, hidden, top-k, expert alignment, rank with zero tokens, pair weights)
    (31, 256, 2048, 8, 1, None, False),
    (32, 256, 2048, 8, 128, None, True),
    (33, 1, 2048, 8, 128, None, True),
    (34, 200, 2048, 8, 4, 0, True),
    (35, 300, 2048, 16, 128, None, True),
    (36, 300, 2048, 16, 1, None, False),
]


@pytest.mark.parametrize("seed,num_tokens,hidden,num_topk,alignment,zero_rank,use_pair_weights", COMBINE_CASES)
def test_combine_from_expert_major(group, buf, via, seed, num_tokens, hidden, num_topk, alignment, zero_rank,
                                   use_pair_weights):
    import cupy
    R, me = group.local_size, group.local_rank
    tokens, idx, w = _routing(group, seed, num_tokens, num_topk, zero_rank)
    x = payload_bf16(me, np.arange(tokens[me]), hidden)
    res, lays = _reference(group, tokens, idx, w, alignment)
    ys = [_expert_outputs(_payload_rows(r, R, hidden), lay) for r, lay in zip(res, lays)]
    expected, expected_reduced = _expected_combine(res, lays, ys, tokens, num_topk, me, use_pair_weights)

    out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                       expert_alignment=alignment, expert_major=True, **via)
    ok = all(_layout_checks(out, res[me], lays[me], num_topk).values())
    assert all_ranks(group.comm, ok), "expert-major layout differs from the reference"
    y = cupy.asarray(ys[me])
    pw = out.recv_topk_weights if use_pair_weights else None
    comb = buf.combine(y, out.handle, pair_weights=pw, expert_major=True)
    got = bf16_to_f32(comb.combined_x.get())
    red = bf16_to_f32(comb.expert_reduced_x.get())
    diff = ref.calc_diff(got, expected) if got.size else 0.0
    rdiff = ref.calc_diff(red, expected_reduced) if red.size else 0.0
    ok = (comb.expert_reduced_x.shape == (res[me].num_recv_tokens, hidden) and not np.isnan(got).any()
          and not np.isnan(red).any() and diff < 5e-6 and rdiff < 5e-6)
    assert all_ranks(group.comm, ok), (diff, rdiff)

    # The row count alone selects the expert-major path when it differs from N.
    if y.shape[0] != res[me].num_recv_tokens:
        auto = buf.combine(y, out.handle, pair_weights=pw)
        same = np.array_equal(auto.combined_x.get(), comb.combined_x.get())
    else:
        same = True
    again = buf.combine(y, out.handle, pair_weights=pw, expert_major=True)
    same = same and np.array_equal(again.combined_x.get(), comb.combined_x.get())
    assert all_ranks(group.comm, same), "combine from expert-major outputs is not deterministic"

    # Rank-major rows still combine as before with an expert-major handle.
    plain = buf.combine(cupy.asarray(_payload_rows(res[me], R, hidden)), out.handle, expert_major=False)
    recv = [bf16_to_f32(_payload_rows(r, R, hidden)) for r in res]
    pdiff = ref.calc_diff(bf16_to_f32(plain.combined_x.get()), ref.intranode_combine(recv, res, tokens)[me]) \
        if got.size else 0.0
    assert all_ranks(group.comm, pdiff < 5e-6 and plain.expert_reduced_x is None), pdiff


@pytest.mark.parametrize("alignment", [1, 128])
def test_expert_major_worst_tokens_and_cuda_graph(group, buf, via, alignment):
    """Worst-token expert-major dispatch in a CUDA graph: every padding entry
    (recv_topk_idx / weights / recv_src_idx rows past the count, alignment
    padding rows of expert_x, expert_src_row and recv_expert_row past the
    layout) is rewritten by each replay over poisoned outputs; a cached call
    with the worst-token handle gives the same."""
    import cupy
    seed, num_tokens, hidden, num_topk = 41, 128, 2048, 8
    R, me = group.local_size, group.local_rank
    E_local = NUM_EXPERTS // R
    worst = num_tokens * R
    m_cap = worst * min(num_topk, E_local) + E_local * (alignment - 1)
    stream = cupy.cuda.Stream(non_blocking=True)
    x_in = cupy.empty((num_tokens, hidden), dtype=np.uint16)
    idx_in = cupy.empty((num_tokens, num_topk), dtype=np.int64)
    w_in = cupy.empty((num_tokens, num_topk), dtype=np.float32)

    def step():
        out = buf.dispatch(x_in, idx_in, w_in, num_experts=NUM_EXPERTS, num_worst_tokens=worst,
                           expert_alignment=alignment, expert_major=True, validate=False, **via)
        # Identity experts: the expert-major rows themselves are the outputs.
        comb = buf.combine(out.expert_x, out.handle, pair_weights=out.recv_topk_weights)
        return out, comb

    def check(out, comb, it):
        tokens, idx, w = _routing(group, seed + it, num_tokens, num_topk)
        res, lays = _reference(group, tokens, idx, w, alignment)
        exp, lay = res[me], lays[me]
        rows = _payload_rows(exp, R, hidden)
        m = int(lay.expert_offsets[-1])
        pad = worst_token_rows(exp, worst)
        checks = _layout_checks(out, exp, lay, num_topk)
        checks["m_cap"] = out.expert_x.shape == (m_cap, hidden) and out.handle.num_expert_rows == m_cap
        checks["expert_x"] = np.array_equal(out.expert_x.get()[:m], _expert_major_rows(rows, lay))
        checks["recv_topk_idx"] = np.array_equal(out.recv_topk_idx.get(), pad.recv_topk_idx)
        checks["recv_topk_weights"] = np.array_equal(out.recv_topk_weights.get(), pad.recv_topk_weights)
        checks["recv_src_idx"] = np.array_equal(out.handle.recv_src_idx.get(), pad.recv_src_idx)
        checks["counts_none"] = out.num_recv_tokens_per_expert is None
        if comb is not None:
            ys = [_expert_major_rows(_payload_rows(r, R, hidden), l) for r, l in zip(res, lays)]
            expected, _ = _expected_combine(res, lays, ys, tokens, num_topk, me, pair_weights=True)
            diff = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), expected)
            checks["combine"] = diff < 5e-6
        assert all_ranks(group.comm, all(checks.values())), (it, {k: v for k, v in checks.items() if not v})

    def poison(out, routing=True):
        """0xA5 bytes over the outputs: ids neither -1 nor valid, nonzero finite BF16 rows; over the
        handle's source indices too unless ``routing`` is False (a cached call reads them)."""
        for a in (out.recv_topk_idx, out.recv_topk_weights, out.handle.recv_src_idx if routing else None,
                  out.expert_x, out.expert_src_row, out.handle.recv_expert_row):
            if a is not None:
                cupy.cuda.runtime.memsetAsync(a.data.ptr, 0xA5, a.nbytes, stream.ptr)

    def load(it):
        tokens, idx, w = _routing(group, seed + it, num_tokens, num_topk)
        x_in.set(payload_bf16(me, np.arange(num_tokens), hidden))
        idx_in.set(idx[me])
        w_in.set(w[me])

    with stream:
        load(0)
        out, comb = step()  # warm-up outside the graph (also compiles)
        stream.synchronize()
        check(out, comb, 0)
        # A cached call with the worst-token handle, over poisoned outputs (the handle's routing is its own).
        poison(out, routing=False)
        cached = buf.dispatch(x_in, idx_in, w_in, handle=out.handle, expert_alignment=alignment, expert_major=True,
                              **via)
        stream.synchronize()
        check(cached, None, 0)
    graph, (out, comb) = capture(stream, group, step)
    for it in range(1, 4):
        # The replay must rewrite every padding entry (the tail of expert_x is not read).
        replay(stream, group, graph, lambda: (load(it), poison(out)))
        check(out, comb, it)


def test_expert_major_bad_input_raises_before_launch(group, buf, via):
    import cupy
    me = group.local_rank
    tokens, idx, w = _routing(group, 51, 64, 8)
    x = cupy.asarray(payload_bf16(me, np.arange(64), 2048))
    out = buf.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS, expert_major=True,
                       **via)
    rank_major = cupy.zeros((out.handle.num_recv_tokens, 2048), dtype=np.uint16)
    with pytest.raises(ValueError, match="needs topk_idx"):
        buf.dispatch(x, handle=out.handle, expert_major=True)
    with pytest.raises(ValueError, match="pair_weights"):
        buf.combine(rank_major, out.handle, pair_weights=out.recv_topk_weights, expert_major=False)
    with pytest.raises(ValueError, match="pair_weights must have"):
        buf.combine(out.expert_x, out.handle, pair_weights=out.recv_topk_weights[:, :4].copy(), expert_major=True)
    with pytest.raises(ValueError, match="rows"):
        buf.combine(cupy.zeros((out.expert_x.shape[0] + 1, 2048), dtype=np.uint16), out.handle, expert_major=True)
    if via["transport"] == "direct":  # its pairs' expert-major rows were laid out for the handle's alignment
        with pytest.raises(ValueError, match="expert_alignment"):
            buf.dispatch(x, cupy.asarray(idx[me]), handle=out.handle, expert_major=True, expert_alignment=4)
    plain = buf.dispatch(x, cupy.asarray(idx[me]), num_experts=NUM_EXPERTS, **via)
    with pytest.raises(ValueError, match="needs a handle"):
        buf.combine(plain.recv_x, plain.handle, expert_major=True)
    with pytest.raises(ValueError, match="pair_weights"):
        buf.combine(plain.recv_x, plain.handle, pair_weights=cupy.zeros((plain.recv_x.shape[0], 8), np.float32))
    buf.synchronize()
    group.comm.Barrier()


@pytest.mark.parametrize("worst", [False, True])
def test_expert_major_rows_past_the_slot_go_rank_major(group, via, worst):
    """A buffer declared for 64 tokens per rank: its direct slot holds about
    2 * 64 * 8 expert-major rows, far fewer than the alignment padding of 256
    experts at 128 (E_local * 127 rows). The direct route then sends the rows
    rank-major into the slot and lays them out locally into arrays of the
    result's own: the same layout and rows as the reference, a combine as
    exact, a cached call of the handle likewise, and the expert-major arrays
    still readable after the slot goes to later dispatches (recv_x then
    raises StaleResultError)."""
    import cupy
    import cupyep
    from cupyep.results import RECEIVE_FIELDS
    seed, num_tokens, hidden, num_topk, alignment = 61, 64, 2048, 8, 128
    R, me = group.local_size, group.local_rank
    b = cupyep.Buffer(group, max_tokens=num_tokens, hidden=hidden, num_topk=num_topk, num_in_flight=2)
    try:
        tokens, idx, w = _routing(group, seed, num_tokens, num_topk)
        res, lays = _reference(group, tokens, idx, w, alignment)
        exp, lay = res[me], lays[me]
        rows = _payload_rows(exp, R, hidden)
        m = int(lay.expert_offsets[-1])
        x = cupy.asarray(payload_bf16(me, np.arange(num_tokens), hidden))
        kw = dict(num_experts=NUM_EXPERTS, expert_alignment=alignment, expert_major=True, **via)
        if worst:
            kw.update(num_worst_tokens=num_tokens * R, validate=False)
        outs = [b.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]), **kw)]
        outs.append(b.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]), handle=outs[0].handle,
                               expert_alignment=alignment, expert_major=True))
        ys = [_expert_major_rows(_payload_rows(r, R, hidden), l) for r, l in zip(res, lays)]
        expected, _ = _expected_combine(res, lays, ys, tokens, num_topk, me, pair_weights=True)
        checks = {}
        for i, out in enumerate(outs):
            if via["transport"] == "direct":
                checks[f"{i}: pooled"] = out.pooled == RECEIVE_FIELDS and out.recv_x is not None
            checks.update({f"{i}: {k}": v for k, v in _layout_checks(out, exp, lay, num_topk).items()})
            checks[f"{i}: expert_x"] = np.array_equal(out.expert_x.get()[:m], _expert_major_rows(rows, lay))
        # Two more dispatches take both slots: the first result's rank-major views go stale, its own arrays stay.
        for _ in range(2):
            b.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS, **via)
        out = outs[0]
        checks["expert_x after reuse"] = np.array_equal(out.expert_x.get()[:m], _expert_major_rows(rows, lay))
        pair_w = worst_token_rows(exp, num_tokens * R).recv_topk_weights if worst else exp.recv_topk_weights
        comb = b.combine(out.expert_x, out.handle, pair_weights=cupy.asarray(pair_w))
        checks["combine"] = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), expected) < 5e-6
        if via["transport"] == "direct":
            try:
                out.recv_x
                checks["stale recv_x"] = False
            except cupyep.StaleResultError:
                checks["stale recv_x"] = True
        b.synchronize()
        assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}
    finally:
        b.destroy()
