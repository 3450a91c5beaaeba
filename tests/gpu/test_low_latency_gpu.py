"""Low-latency mode on the GPU, checked against the NumPy reference.

Rows carry a hash of (source rank, token, column) with the token index in
their last 128 columns. Dispatch positions are deterministic (prefix counts),
so every (expert, source) range is compared exactly with the reference,
together with counts and source indices. Combine uses identity experts and is
compared with x * sum(weights) (REFERENCE.md bounds: 1e-5 BF16, 9e-4 FP8).
"""
import time

import numpy as np
import pytest

from cupyep import CommTimeoutError

from cupyep import reference as ref

from cupyep.low_latency.buffer import ranks_of as ranks
from cupyep.testing import all_ranks, bf16_to_f32, f32_to_bf16, global_routing, payload_bf16
from graphs import capture, replay

pytestmark = pytest.mark.gpu
E, K, H, MAX_TOKENS = 256, 8, 7168, 128


@pytest.fixture(scope="module", autouse=True)
def _nvshmem_across_nodes(request, group):
    """Across nodes the buffers live on the NVSHMEM heap: NVSHMEM for the session."""
    if group.num_nodes > 1:
        request.getfixturevalue("nvshmem_session")


@pytest.fixture(scope="module")
def llbuf(group):
    import cupyep
    b = cupyep.LowLatencyBuffer(group, MAX_TOKENS, H, E)
    yield b
    b.synchronize()
    group.comm.Barrier()
    b.destroy()


def tagged_x(rank: int, num_tokens: int, hidden: int = H) -> np.ndarray:
    """[T, H] BF16 bits: hash rows, token index (as BF16) in the last 128 columns."""
    x = payload_bf16(rank, np.arange(num_tokens), hidden)
    x[:, -128:] = f32_to_bf16(np.arange(num_tokens, dtype=np.float32))[:, None]
    return x


def _routing(group, seed, tokens, k=K):
    idx, w = global_routing(seed, tokens, E, k)
    return idx, w


def _e4m3_table():
    import ml_dtypes
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _expert_outputs(res, use_fp8, ue8m0=False):
    """Identity experts: BF16 rows of recv_x (dequantised for FP8), zeros outside the ranges."""
    import cupy
    if not use_fp8:
        return res.recv_x.copy()
    table = cupy.asarray(_e4m3_table())
    vals = table[res.recv_x.astype(np.int32)]  # [El, S, H] float32
    scales = res.recv_x_scales
    if ue8m0:
        scales = cupy.ldexp(cupy.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    vals *= cupy.repeat(scales, 128, axis=2)
    bits = (vals.view(np.uint32) + np.uint32(0x7FFF) + ((vals.view(np.uint32) >> 16) & 1)) >> 16
    return bits.astype(np.uint16)


def _check_dispatch(group, res, tokens, idx, use_fp8, xs, E=E, MAX_TOKENS=MAX_TOKENS, capacity=None):
    """Exact per-(expert, source) comparison with the reference dispatch
    (regions of ``capacity`` rows, default MAX_TOKENS)."""
    me, R = ranks(group)
    refs = ref.low_latency_dispatch(xs, idx, E, MAX_TOKENS, capacity=capacity)
    region = capacity or MAX_TOKENS
    mine = refs[me]
    counts = res.handle.layout_count.get()
    ok = np.array_equal(counts, mine.layout_count.astype(np.int32))
    ok &= np.array_equal(res.recv_count.get(), mine.recv_count)
    # Where this rank's (token, slot) rows will come back in the combine.
    ok &= np.array_equal(res.handle.combine_pos.get(), ref.low_latency.return_position(idx[me], E, R))
    ok &= np.array_equal(res.handle.slot_pos.get(), ref.low_latency.slot_in_region(idx[me], E))
    src = res.handle.recv_src.get()
    recv = res.recv_x.get()
    scales = None if res.recv_x_scales is None else res.recv_x_scales.get()
    bad = []
    El = E // R
    import ml_dtypes
    for e in range(El):
        for s in range(R):
            c = int(mine.layout_count[e, s])
            sl = slice(s * region, s * region + c)
            if not np.array_equal(src[e, sl], mine.recv_src_info[e, sl]):
                bad.append(("src", e, s))
                continue
            if not use_fp8:
                if not np.array_equal(recv[e, sl], mine.recv_x[e, sl]):
                    bad.append(("x", e, s))
            else:
                # FP8 of the tagged rows: scales equal to the reference cast, values within one e4m3 step.
                rq = ref.per_token_cast_to_fp8(mine.recv_x[e, sl].view(ml_dtypes.bfloat16))
                got = recv[e, sl].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                want = rq.data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                if not (np.array_equal(scales[e, sl], rq.scales) and (np.abs(got - want) <= ref.e4m3_step(want)).all()):
                    bad.append(("fp8", e, s))
    return bool(ok) and not bad, bad[:5]


def _combine_expected(x_bits, idx, w):
    valid = idx >= 0
    sw = (w * valid).sum(axis=1, dtype=np.float64).astype(np.float32)
    return bf16_to_f32(x_bits) * sw[:, None]


@pytest.mark.parametrize("num_tokens,k", [(128, 8), (1, 8), (64, 16)])
@pytest.mark.parametrize("use_fp8", [True, False])
def test_dispatch_combine(group, llbuf, num_tokens, k, use_fp8):
    import cupy
    me, R = ranks(group)
    tokens = [num_tokens] * R
    idx, w = _routing(group, 3 + num_tokens + use_fp8, tokens, k)
    xs = [tagged_x(r, num_tokens) for r in range(R)]
    x = cupy.asarray(xs[me])
    stats = cupy.zeros(E // R, dtype=np.int32)
    wait = cupy.zeros(R, dtype=np.int64)
    res = llbuf.dispatch(x, cupy.asarray(idx[me]), use_fp8=use_fp8, cumulative_local_expert_recv_stats=stats,
                         dispatch_wait_recv_cost_stats=wait)
    ok, bad = _check_dispatch(group, res, tokens, idx, use_fp8, xs)
    ok &= np.array_equal(stats.get(), res.recv_count.get()) and bool((wait.get() >= 0).all())
    assert all_ranks(group.comm, ok), bad
    y = _expert_outputs(res, use_fp8)
    comb = llbuf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
    got = bf16_to_f32(comb.combined_x.get())
    expected = _combine_expected(xs[me], idx[me], w[me])
    diff = ref.calc_diff(got, expected)
    limit = 9e-4 if use_fp8 else 1e-5
    assert all_ranks(group.comm, diff < limit and not np.isnan(got).any()), (diff, limit)
    # Deterministic: the same combine again gives the same bits.
    again = llbuf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
    assert all_ranks(group.comm, np.array_equal(again.combined_x.get(), comb.combined_x.get()))


def test_hook_zero_copy_ue8m0(group, llbuf):
    import cupy
    me, R = ranks(group)
    tokens = [MAX_TOKENS - 7] * R
    idx, w = _routing(group, 21, tokens)
    xs = [tagged_x(r, tokens[r]) for r in range(R)]
    res = llbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=True, round_scale=True,
                         use_ue8m0=True, return_recv_hook=True)
    assert res.hook is not None
    with pytest.raises(ValueError, match="receive hook"):
        llbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]))
    res.hook()
    refs = ref.low_latency_dispatch(xs, idx, E, MAX_TOKENS)[me]
    ok = np.array_equal(res.handle.layout_count.get(), refs.layout_count.astype(np.int32))
    sc = res.recv_x_scales.get()
    # UE8M0 bytes decode to powers of two that match the reference's rounded scales.
    import ml_dtypes
    for e in range(E // R):
        for s in range(R):
            c = int(refs.layout_count[e, s])
            sl = slice(s * MAX_TOKENS, s * MAX_TOKENS + c)
            rq = ref.per_token_cast_to_fp8(refs.recv_x[e, sl].view(ml_dtypes.bfloat16), round_scale=True)
            ok &= np.array_equal(sc[e, sl], ref.pack_ue8m0(rq.scales))
    assert all_ranks(group.comm, ok), "UE8M0 dispatch differs"
    y = _expert_outputs(res, True, ue8m0=True)
    buf = llbuf.get_next_combine_buffer(res.handle)
    buf[...] = y
    comb = llbuf.combine(None, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle, zero_copy=True,
                         return_recv_hook=True)
    comb.hook()
    got = bf16_to_f32(comb.combined_x.get())
    diff = ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me]))
    assert all_ranks(group.comm, diff < 9e-4 and not np.isnan(got).any()), diff


@pytest.mark.parametrize("use_fp8", [False, True])
def test_position_windows(group, use_fp8):
    """Many experts and tokens: the dispatch's position scan takes several token
    windows (kernels.dispatch_smem), and every range still equals the reference."""
    import cupy
    import cupyep
    from cupyep.low_latency import kernels as LK
    me, R = ranks(group)
    E2, H2, M2 = 2048, 256, 256
    buf = cupyep.LowLatencyBuffer(group, M2, H2, E2)
    try:
        assert LK.dispatch_smem(M2, buf.num_blocks, K, E2).mask_words * 32 < M2  # more than one window
        tokens = [M2 - 3 * r for r in range(R)]
        idx, w = global_routing(90 + use_fp8, tokens, E2, K)
        xs = [tagged_x(r, tokens[r], H2) for r in range(R)]
        res = buf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=use_fp8)
        ok, bad = _check_dispatch(group, res, tokens, idx, use_fp8, xs, E=E2, MAX_TOKENS=M2)
        assert all_ranks(group.comm, ok), bad
        y = _expert_outputs(res, use_fp8)
        got = bf16_to_f32(buf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle).combined_x.get())
        diff = ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me]))
        assert all_ranks(group.comm, diff < (9e-4 if use_fp8 else 1e-5) and not np.isnan(got).any()), diff
    finally:
        buf.synchronize()
        group.comm.Barrier()
        buf.destroy()


@pytest.mark.parametrize("hook", [False, True])
def test_pull_and_push(group, llbuf, hook):
    """Owners pulling the outputs from the expert ranks' combine buffers (from x
    copied there, or written there as zero-copy) give the reference result, bit
    for bit what the pushing combines give, over repeated dispatch/combine
    rounds with uneven token counts; so does x in DeepEP's packed layout
    (x_layout="packed"), pushed and pulled. Across nodes only the push runs (pull is
    refused before launch)."""
    import cupy
    me, R = ranks(group)
    tokens = [MAX_TOKENS - 5 * r for r in range(R)]
    for it in range(3):
        idx, w = _routing(group, 40 + 2 * it + hook, tokens)
        xs = [tagged_x(r, tokens[r]) for r in range(R)]
        i_me, w_me = cupy.asarray(idx[me]), cupy.asarray(w[me])
        res = llbuf.dispatch(cupy.asarray(xs[me]), i_me, use_fp8=False)
        y = res.recv_x.copy()
        outs = []
        if group.num_nodes > 1:  # ranks of other nodes cannot be read: across nodes the combine pushes
            with pytest.raises(ValueError, match="pull=True"):
                llbuf.combine(y, i_me, w_me, res.handle, pull=True)
        for pull in ((False,) if group.num_nodes > 1 else (True, False)):
            for zero_copy in (True, False):
                if zero_copy:
                    llbuf.get_next_combine_buffer(res.handle)[...] = y
                comb = llbuf.combine(None if zero_copy else y, i_me, w_me, res.handle, zero_copy=zero_copy,
                                     pull=pull, return_recv_hook=hook)
                if hook:
                    comb.hook()
                outs.append(comb.combined_x.get())
            # The same outputs in DeepEP's packed layout, read in place (x_layout="packed"); the rows past
            # each expert's count are NaN, so a row read from there shows in the result.
            comb = llbuf.combine(_packed(y, res.handle.layout_count.get(), R, llbuf.max_tokens), i_me, w_me,
                                 res.handle, pull=pull, return_recv_hook=hook, x_layout="packed")
            if hook:
                comb.hook()
            outs.append(comb.combined_x.get())
        got = bf16_to_f32(outs[0])
        diff = ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me]))
        same = all(np.array_equal(outs[0], o) for o in outs[1:])
        nan = any(np.isnan(bf16_to_f32(o)).any() for o in outs)
        assert all_ranks(group.comm, diff < 1e-5 and same and not nan), (it, diff, same, nan)


def _packed(y, counts, R, T):
    """[E_local, R * T, H] uint16: expert e's rows of y (region layout, [E_local, R * C, H]) at
    [0, sum(counts[e])), source after source in rank order, the other rows NaN (0x7FC0)."""
    import cupy
    El, slots, H = y.shape
    C = slots // R
    out = cupy.full((El, R * T, H), 0x7FC0, dtype=np.uint16)
    for e in range(El):
        off = 0
        for s in range(R):
            n = int(counts[e, s])
            out[e, off:off + n] = y[e, s * C:s * C + n]
            off += n
    return out


def _combine_as(llbuf, how, y, topk_idx, topk_weights, handle, hook, **kw):
    """combined_x (host uint16) of llbuf.combine(..., **kw) with the expert outputs y given as ``how``:
    "regions" (y as it is), "packed" (DeepEP's layout, _packed) or "zero_copy" (y copied into
    get_next_combine_buffer, x=None); in hook mode after its hook."""
    x = y
    if how == "packed":
        x = _packed(y, handle.layout_count.get(), llbuf.num_ranks, llbuf.max_tokens)
    elif how == "zero_copy":
        llbuf.get_next_combine_buffer(handle)[...] = y
        x = None
    comb = llbuf.combine(x, topk_idx, topk_weights, handle, return_recv_hook=hook, zero_copy=how == "zero_copy",
                         x_layout="packed" if how == "packed" else "regions", **kw)
    if hook:
        comb.hook()
    return comb.combined_x.get()


@pytest.mark.parametrize("hook", [False, True])
def test_profiling_stamps(group, llbuf, hook):
    """kernel_time_ns and trace: results stay exact, every block reaches every
    mark in order, and the kernel stamps bracket the marks."""
    import cupy
    from cupyep.low_latency.kernels import NUM_TRACE_SLOTS, TRACE_MARKS
    me, R = ranks(group)
    tokens = [MAX_TOKENS] * R
    idx, w = _routing(group, 41 + hook, tokens)
    xs = [tagged_x(r, MAX_TOKENS) for r in range(R)]
    G, M = llbuf.num_blocks, len(TRACE_MARKS)
    ok = True
    for what in ("dispatch", "combine"):
        kt = cupy.array([np.iinfo(np.int64).max, 0], dtype=np.int64)
        tr = cupy.zeros((G, NUM_TRACE_SLOTS), dtype=np.int64)
        if what == "dispatch":
            res = llbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=False,
                                 return_recv_hook=hook, kernel_time_ns=kt if not hook else None, trace=tr)
            if hook:
                res.hook(kernel_time_ns=kt)
            ok &= _check_dispatch(group, res, tokens, idx, False, xs)[0]
        else:
            comb = llbuf.combine(res.recv_x.copy(), cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle,
                                 return_recv_hook=hook, kernel_time_ns=kt if not hook else None, trace=tr)
            if hook:
                comb.hook(kernel_time_ns=kt)
            got = bf16_to_f32(comb.combined_x.get())
            ok &= ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me])) < 1e-5
        t, k = tr.get()[:, :M], kt.get()
        ok &= bool((t > 0).all() and (np.diff(t, axis=1) >= 0).all() and (t[:, -1] <= k[1]).all())
        if not hook:  # one launch: its first block starts no later than any start mark
            ok &= bool(k[0] <= t[:, 0].min())
    assert all_ranks(group.comm, ok)
    with pytest.raises(ValueError, match="trace"):
        llbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), trace=cupy.zeros((G + 1, NUM_TRACE_SLOTS),
                                                                                     dtype=np.int64))


@pytest.mark.parametrize("hook", [False, True])
def test_senders_beyond_waiters(group, llbuf, hook):
    """A grid three times the rank's share, of which only some blocks wait (a
    single one with the hook): exact dispatch (FP8 and BF16) and combine, and the
    senders' trace ends at 'flagged'."""
    import cupy
    import cupyep
    from cupyep.low_latency.kernels import NUM_TRACE_SLOTS, TRACE_MARKS
    me, R = ranks(group)
    G = 3 * llbuf.num_blocks
    W = 1 if hook else max(min(R, G), llbuf.num_blocks // 2)
    b = cupyep.LowLatencyBuffer(group, MAX_TOKENS, H, E, num_blocks=G, num_waiters=W)
    try:
        tokens = [MAX_TOKENS - 3 * (r % 2) for r in range(R)]
        ok = True
        for use_fp8 in (True, False):
            idx, w = _routing(group, 51 + use_fp8 + 2 * hook, tokens)
            xs = [tagged_x(r, tokens[r]) for r in range(R)]
            tr = cupy.zeros((G, NUM_TRACE_SLOTS), dtype=np.int64)
            res = b.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=use_fp8, return_recv_hook=hook,
                             trace=tr)
            if hook:
                res.hook()
            ok &= _check_dispatch(group, res, tokens, idx, use_fp8, xs)[0]
            t = tr.get()
            flagged = TRACE_MARKS.index("flagged")
            ok &= bool((t[:, :flagged + 1] > 0).all() and (t[:W, flagged + 1:len(TRACE_MARKS)] > 0).all()
                       and (t[W:, flagged + 1:] == 0).all())
            comb = b.combine(_expert_outputs(res, use_fp8), cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle,
                             return_recv_hook=hook)
            if hook:
                comb.hook()
            got = bf16_to_f32(comb.combined_x.get())
            ok &= ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me])) < (9e-4 if use_fp8 else 1e-5)
        assert all_ranks(group.comm, ok)
    finally:
        b.synchronize()
        group.comm.Barrier()
        b.destroy()


def test_stress_1000_calls(group, llbuf):
    """1000 dispatch/combine pairs with new routing every call, alternating
    FP8/BF16; counts, sources and row tags checked on the device every call."""
    import cupy
    me, R = ranks(group)
    El = E // R
    x = cupy.asarray(tagged_x(me, MAX_TOKENS))
    bad = cupy.zeros(4, dtype=np.int64)
    worst = cupy.zeros(1, dtype=np.float32)
    xf = cupy.asarray(bf16_to_f32(tagged_x(me, MAX_TOKENS)))
    for it in range(1000):
        T = 1 + (it * 37) % MAX_TOKENS
        idx = ref.make_routing(1000 + it, [T] * R, E, K)
        w = ref.make_weights(1000 + it, idx)
        use_fp8 = it % 2 == 0
        res = llbuf.dispatch(x[:T], cupy.asarray(idx[me]), use_fp8=use_fp8, validate=False)
        # Expected (expert, source) counts and source tokens, from every rank's routing.
        exp_src = np.full((El, R * MAX_TOKENS), -1, dtype=np.int32)
        exp_cnt = np.zeros((El, R), dtype=np.int32)
        for s in range(R):
            pos = ref.low_latency.slot_in_region(idx[s], E)
            t_, j_ = np.nonzero((idx[s] >= 0) & (idx[s] // El == me))
            le = idx[s][t_, j_] % El
            exp_src[le, s * MAX_TOKENS + pos[t_, j_]] = t_
            exp_cnt[:, s] = np.bincount(le, minlength=El)
        valid = cupy.asarray(exp_src >= 0)
        bad[0] += (res.handle.layout_count != cupy.asarray(exp_cnt)).sum()
        bad[1] += ((res.handle.recv_src != cupy.asarray(exp_src)) & valid).sum()
        if not use_fp8:
            last = res.recv_x[:, :, -1]
            want = cupy.asarray(f32_to_bf16(np.arange(MAX_TOKENS, dtype=np.float32)))[cupy.maximum(res.handle.recv_src, 0)]
            bad[2] += ((last != want) & valid).sum()
        y = _expert_outputs(res, use_fp8)
        comb = llbuf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
        sw = cupy.asarray(((w[me] * (idx[me] >= 0)).sum(axis=1)).astype(np.float32))
        exp = xf[:T] * sw[:, None]
        got = (comb.combined_x.astype(np.uint32) << 16).view(np.float32)
        d = 1 - 2 * (got * exp).sum() / cupy.maximum((got * got + exp * exp).sum(), 1e-30)
        worst[0] = cupy.maximum(worst[0], d)
        bad[3] += cupy.isnan(got).sum()
    counts = bad.get()
    wd = float(worst.get()[0])
    assert all_ranks(group.comm, not counts.any() and wd < 9e-4), (counts.tolist(), wd)


def test_small_calls_among_large(group, llbuf):
    """Calls of one token, none or three among full ones, with every rank at
    another size in each step (so a rank's combine sends rows for more tokens
    than it has, or fewer; a rank with no tokens still arrives), FP8 and BF16,
    plain and hooked: every dispatch exact, every combine against x * sum(w)."""
    import cupy
    me, R = ranks(group)
    sizes = (1, MAX_TOKENS, 0, 3, MAX_TOKENS - 1, 1)
    xs = [tagged_x(r, MAX_TOKENS) for r in range(R)]
    ok, bad = True, []
    for it in range(2 * len(sizes)):
        tokens = [sizes[(it + r) % len(sizes)] for r in range(R)]
        T, use_fp8, hook = tokens[me], it % 2 == 1, it % 3 == 2
        idx, w = _routing(group, 900 + it, tokens)
        xt = [a[:t] for a, t in zip(xs, tokens)]
        res = llbuf.dispatch(cupy.asarray(xt[me]), cupy.asarray(idx[me]), use_fp8=use_fp8, return_recv_hook=hook)
        if hook:
            res.hook()
        good, why = _check_dispatch(group, res, tokens, idx, use_fp8, xt)
        got = bf16_to_f32(_combine_as(llbuf, "regions", _expert_outputs(res, use_fp8), cupy.asarray(idx[me]),
                                      cupy.asarray(w[me]), res.handle, hook))
        diff = ref.calc_diff(got, _combine_expected(xt[me], idx[me], w[me])) if T else 0.0
        good &= got.shape == (T, H) and diff < (9e-4 if use_fp8 else 1e-5) and not np.isnan(got).any()
        ok &= good
        if not good:
            bad.append((it, tokens, why, diff))
    assert all_ranks(group.comm, ok), bad[:3]


def _colliding_routing(rank: int, T: int, k: int, R: int):
    """[T, k] int64 routing of rank ``rank`` where tokens share experts (several
    tokens per (expert, source) region) and ranks (several experts of one rank
    per token), with some empty slots; distinct experts within a token, and
    every rank's routing different. Weights: [T, k] float32, 0 in empty slots."""
    El = E // R
    idx = np.full((T, k), -1, dtype=np.int64)
    for t in range(T):
        # the same few experts of rank (rank + t) % R and of rank 0 for every token, then others
        base = [((rank + t) % R) * El + q for q in range(3)] + [q * 2 for q in range(3)]
        extra = [(t * 37 + 11 * q + rank) % E for q in range(k)]
        row = list(dict.fromkeys(base + extra))[:k]
        idx[t, :len(row)] = row
        if t % 2 == 1:
            idx[t, k // 2] = -1  # an empty slot
    w = np.where(idx >= 0, np.float32(1.0) / (1 + np.arange(k, dtype=np.float32)), np.float32(0))
    return idx, w.astype(np.float32)


@pytest.mark.parametrize("shape", [(1, 8), (3, 8), (4, 8), (2, 16), (1, 16)])
def test_decode_sizes_with_colliding_experts(group, llbuf, shape):
    """At T * k <= 32 the dispatch's positions come from one warp (dispatch.cu
    decode_positions) instead of the windowed scan: with tokens that share
    experts and expert ranks, every output matches the reference exactly
    (counts, positions, rank positions, rows), and the per-slot and (within
    a node) partial combines match too. Each rank has another token count
    (T - rank % 2)."""
    import cupy
    me, R = ranks(group)
    T0, k = shape
    tokens = [max(T0 - r % 2, 0) for r in range(R)]
    routed = [_colliding_routing(r, tokens[r], k, R) for r in range(R)]
    idx, w = [i for i, _ in routed], [x for _, x in routed]
    xs = [tagged_x(r, tokens[r]) for r in range(R)]
    i_me, w_me = cupy.asarray(idx[me]), cupy.asarray(w[me])
    res = llbuf.dispatch(cupy.asarray(xs[me]), i_me, use_fp8=False, topk_weights=w_me)
    ok, bad = _check_dispatch(group, res, tokens, idx, False, xs)
    ok &= np.array_equal(res.handle.rank_pos.get(), ref.low_latency.rank_position(idx[me], E, R))
    got = bf16_to_f32(llbuf.combine(res.recv_x.copy(), i_me, w_me, res.handle).combined_x.get())
    diff = ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me])) if tokens[me] else 0.0
    ok &= diff < 1e-5 and not np.isnan(got).any()
    if group.num_nodes == 1:  # the partial combine works within a node (across nodes: test_partial_combine)
        El = E // R
        partial = _combine_as(llbuf, "regions", _scaled_experts(res.recv_x, me * El, cupy), i_me, None, res.handle,
                              False, partial=True)
        expert_out, refs = _partial_expert_outputs(xs, idx, R)
        ok &= np.array_equal(partial, f32_to_bf16(ref.low_latency_partial_combine(expert_out, refs, idx, w)[me]))
    assert all_ranks(group.comm, ok), (bad, diff)


@pytest.mark.parametrize("pattern", ["ddcc", "dcc", "dcdc"])
def test_call_sequences(group, llbuf, pattern):
    """Dispatches and combines in every order the data copies allow (layout.CallSchedule):
    two dispatches then their combines newest first, one dispatch combined twice, and the
    decode loop; each dispatch is checked exactly and each combine against x * sum(w)."""
    import cupy
    me, R = ranks(group)
    xs = [tagged_x(r, MAX_TOKENS) for r in range(R)]
    x = cupy.asarray(xs[me])
    pending, ok, bad = [], True, []
    for it, step in enumerate(pattern * 3):
        if step == "d":
            T = 1 + (it * 53) % MAX_TOKENS
            idx, w = _routing(group, 500 + it, [T] * R)
            res = llbuf.dispatch(x[:T], cupy.asarray(idx[me]), use_fp8=False)
            good, why = _check_dispatch(group, res, [T] * R, idx, False, [a[:T] for a in xs])
            ok &= good
            bad += why
            pending.append((res.handle, _expert_outputs(res, False), idx, w, T))
        else:
            handle, y, idx, w, T = pending[-1] if pattern == "dcc" else pending.pop()
            comb = llbuf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), handle)
            got = bf16_to_f32(comb.combined_x.get())
            diff = ref.calc_diff(got, _combine_expected(xs[me][:T], idx[me], w[me]))
            good = diff < 1e-5 and not np.isnan(got).any()
            ok &= good
            if not good:
                bad.append(("combine", it, diff))
    assert all_ranks(group.comm, ok), bad[:5]


def test_overwritten_handle_is_rejected(group, llbuf):
    import cupy
    me, R = ranks(group)
    idx, w = _routing(group, 77, [8] * R)
    x = cupy.asarray(tagged_x(me, 8))
    first = llbuf.dispatch(x, cupy.asarray(idx[me]), use_fp8=False)
    y = _expert_outputs(first, False)
    llbuf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), first.handle)
    llbuf.dispatch(x, cupy.asarray(idx[me]), use_fp8=False)  # after a combine: writes the first dispatch's copy again
    with pytest.raises(ValueError, match="overwritten by a later dispatch"):
        llbuf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), first.handle)
    llbuf.synchronize()


def test_ablations_keep_the_protocol(group, llbuf):
    """With every ablation set the calls still complete with the right counts
    (only payloads are skipped); cleared, calls are exact again."""
    import cupy
    from cupyep.low_latency import kernels as K
    me, R = ranks(group)
    idx, w = _routing(group, 91, [32] * R)
    xs = [tagged_x(r, 32) for r in range(R)]
    x = cupy.asarray(xs[me])
    llbuf.ablate = K.ablation_bits(K.ABLATIONS)
    try:
        res = llbuf.dispatch(x, cupy.asarray(idx[me]))
        y = cupy.zeros((E // R, R * MAX_TOKENS, H), dtype=np.uint16)
        llbuf.combine(y, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
        want = ref.low_latency_dispatch(xs, idx, E, MAX_TOKENS)[me].layout_count.astype(np.int32)
        ok = np.array_equal(res.handle.layout_count.get(), want)
    finally:
        llbuf.ablate = 0
    res = llbuf.dispatch(x, cupy.asarray(idx[me]), use_fp8=False)
    good, bad = _check_dispatch(group, res, [32] * R, idx, False, xs)
    assert all_ranks(group.comm, ok and good), bad


def test_cuda_graph_replay(group, llbuf):
    import cupy
    me, R = ranks(group)
    T = MAX_TOKENS
    stream = cupy.cuda.Stream(non_blocking=True)
    x_in = cupy.asarray(tagged_x(me, T))
    idx_in = cupy.empty((T, K), dtype=np.int64)
    w_in = cupy.empty((T, K), dtype=np.float32)
    with stream:
        idx, w = _routing(group, 500, [T] * R)
        idx_in.set(idx[me]); w_in.set(w[me])
        res = llbuf.dispatch(x_in, idx_in, use_fp8=False, validate=False)  # warm-up (compiles)
        llbuf.combine(res.recv_x, idx_in, w_in, res.handle)
        stream.synchronize()

    def step():
        res = llbuf.dispatch(x_in, idx_in, use_fp8=False, validate=False)
        return res, llbuf.combine(res.recv_x, idx_in, w_in, res.handle)

    graph, (res, comb) = capture(stream, group, step)
    xs = [tagged_x(r, T) for r in range(R)]
    for it in range(10):
        idx, w = _routing(group, 600 + it, [T] * R)
        replay(stream, group, graph, lambda: (idx_in.set(idx[me]), w_in.set(w[me])))
        ok, bad = _check_dispatch(group, res, [T] * R, idx, False, xs)
        diff = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), _combine_expected(xs[me], idx[me], w[me]))
        assert all_ranks(group.comm, ok and diff < 1e-5), (it, bad, diff)


@pytest.mark.parametrize("programmatic", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_launch_modes(group, llbuf, graph, programmatic):
    """Kernels launched plainly or as programmatic dependents of a GPU barrier
    (which lets them become resident early), eagerly and inside a replayed CUDA
    graph."""
    import cupy
    from cupyep.barrier import GpuBarrier
    me, R = ranks(group)
    T = MAX_TOKENS
    bar = GpuBarrier(group)
    stream = cupy.cuda.Stream(non_blocking=True)
    x_in = cupy.asarray(tagged_x(me, T))
    idx_in = cupy.empty((T, K), dtype=np.int64)
    w_in = cupy.empty((T, K), dtype=np.float32)
    xs = [tagged_x(r, T) for r in range(R)]
    default = llbuf.programmatic_launch
    llbuf.programmatic_launch = programmatic
    try:
        use_fp8 = not graph  # (the FP8 identity experts copy a table to the GPU: not capturable)

        def step():
            bar(stream)
            res = llbuf.dispatch(x_in, idx_in, use_fp8=use_fp8, validate=False)
            y = _expert_outputs(res, use_fp8)
            bar(stream)
            return res, llbuf.combine(y, idx_in, w_in, res.handle)

        with stream:
            if graph:
                idx, w = _routing(group, 700, [T] * R)
                idx_in.set(idx[me]); w_in.set(w[me])
                step()
                stream.synchronize()
                group.comm.Barrier()
                stream.begin_capture()
                res, comb = step()
                g = stream.end_capture()
            for it in range(4):
                idx, w = _routing(group, 710 + it, [T] * R)
                idx_in.set(idx[me]); w_in.set(w[me])
                stream.synchronize()
                if graph:
                    g.launch(stream)
                else:
                    res, comb = step()
                stream.synchronize()
                group.check_errors()
                ok, bad = _check_dispatch(group, res, [T] * R, idx, use_fp8, xs)
                got = bf16_to_f32(comb.combined_x.get())
                diff = ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me]))
                assert all_ranks(group.comm, ok and diff < (9e-4 if use_fp8 else 1e-5) and not np.isnan(got).any()), (it, bad, diff)
    finally:
        llbuf.programmatic_launch = default
        stream.synchronize()
        bar.destroy()


def test_bad_input(group, llbuf):
    import cupy
    x = cupy.zeros((4, H), dtype=np.uint16)
    idx = cupy.asarray(np.tile(np.arange(K, dtype=np.int64), (4, 1)))
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank"):
        llbuf.dispatch(cupy.zeros((MAX_TOKENS + 1, H), dtype=np.uint16), cupy.zeros((MAX_TOKENS + 1, K), np.int64))
    with pytest.raises(ValueError, match="hidden size 2048"):
        llbuf.dispatch(cupy.zeros((4, 2048), dtype=np.uint16), idx)
    with pytest.raises(ValueError, match="outside"):
        llbuf.dispatch(x, idx + E)
    dup = idx.copy()
    dup[1, 1] = dup[1, 0]
    with pytest.raises(ValueError, match="same expert twice"):
        llbuf.dispatch(x, dup)
    with pytest.raises(ValueError, match="use_ue8m0"):
        llbuf.dispatch(x, idx, use_ue8m0=True)
    with pytest.raises(ValueError, match="int32"):
        llbuf.dispatch(x, idx, cumulative_local_expert_recv_stats=cupy.zeros(E // ranks(group)[1], np.int64))
    with pytest.raises(ValueError, match="uint16"):
        llbuf.dispatch(x.astype(np.float32), idx)
    with pytest.raises(ValueError, match="max_topk=16"):
        llbuf.dispatch(x, cupy.asarray(np.tile(np.arange(17, dtype=np.int64), (4, 1))))
    res = llbuf.dispatch(x, idx, use_fp8=False)
    with pytest.raises(ValueError, match="columns"):
        llbuf.combine(cupy.zeros((E // ranks(group)[1], ranks(group)[1] * MAX_TOKENS, H), np.uint16),
                      idx[:, :4].copy(), cupy.zeros((4, 4), np.float32), res.handle)
    with pytest.raises(ValueError, match="shape"):
        llbuf.combine(cupy.zeros((1, 2, H), np.uint16), idx, cupy.zeros((4, K), np.float32), res.handle)
    El, S = E // ranks(group)[1], ranks(group)[1] * MAX_TOKENS
    for bad in (cupy.zeros((El, S, H + 1), np.uint16)[:, :, :H],       # row stride not a multiple of 16 bytes
                cupy.zeros((El, H, S), np.uint16).transpose(0, 2, 1),  # rows not contiguous
                cupy.zeros((2 * El, S, H), np.uint16)[::2]):           # gaps between experts
        with pytest.raises(ValueError, match="row stride"):
            llbuf.combine(bad, idx, cupy.zeros((4, K), np.float32), res.handle)
    with pytest.raises(ValueError, match="combine_wait_recv_cost_stats"):
        llbuf.combine(res.recv_x, idx, cupy.ones((4, K), np.float32), res.handle,
                      combine_wait_recv_cost_stats=cupy.zeros(ranks(group)[1] + 1, np.int64))
    with pytest.raises(ValueError, match="x_layout"):
        llbuf.combine(res.recv_x, idx, cupy.ones((4, K), np.float32), res.handle, x_layout="deepep")
    with pytest.raises(ValueError, match="packed"):
        llbuf.combine(None, idx, cupy.ones((4, K), np.float32), res.handle, zero_copy=True, x_layout="packed")
    with pytest.raises(ValueError, match="shape"):  # packed: [E_local, R * max_tokens, H]
        llbuf.combine(cupy.zeros((El, S - 1, H), np.uint16), idx, cupy.ones((4, K), np.float32), res.handle,
                      x_layout="packed")
    # The skipped combine left the peers' flags untouched: run it so all ranks stay in step.
    llbuf.combine(res.recv_x, idx, cupy.ones((4, K), np.float32), res.handle)
    group.comm.Barrier()


def test_timeout_names_missing_rank(group):
    """A rank that never dispatches: every other rank's wait times out naming it
    (across nodes, ranks of its node wait on its flag, the others on its
    counts' signal)."""
    import cupy
    import cupyep
    me, R = ranks(group)
    if R < 2:
        pytest.skip("needs two ranks")
    missing = R - 1
    b = cupyep.LowLatencyBuffer(group, 8, 1024, E)
    try:
        if me != missing:
            x = cupy.zeros((8, 1024), dtype=np.uint16)
            idx = cupy.asarray(np.tile(np.arange(K, dtype=np.int64), (8, 1)))
            t0 = time.monotonic()
            b.dispatch(x, idx)
            with pytest.raises(CommTimeoutError) as info:
                b.synchronize()
            elapsed = time.monotonic() - t0
            group.error_slot.reset()
            err = info.value
            kernel = "low_latency_dispatch" + ("_internode" if group.num_nodes > 1 else "")
            assert err.kernel == kernel and err.peer == missing and err.rank == group.rank, str(err)
            if group.num_nodes > 1:
                same_node = group.rank // group.local_size == missing // group.local_size
                assert ("dispatch flag" if same_node else "counts over the network") in err.phase, str(err)
            assert elapsed < group.timeout_s + 5, elapsed
        group.comm.Barrier()
    finally:
        b.destroy()


def test_late_rank_times_out_without_a_silent_result(group):
    """A rank later than the timeout between two calls: the other ranks' dispatch
    times out naming it and publishes zero counts (never stale or uninitialised
    ones), so the combine of that handle moves no row out of range and no rank
    faults. The late rank's combine, which would otherwise reduce without their
    rows, times out too instead of returning a silently wrong result: their
    arrivals are poisoned (sync.cuh kPoison), or, where they came before the late
    rank's dispatch, that dispatch cleared them as the next call's flags (the
    order in this test). A new buffer then works."""
    import cupy
    import cupyep
    me, R = ranks(group)
    if R < 2:
        pytest.skip("needs two ranks")
    late, T, HS = R - 1, 8, 1024
    idx, w = _routing(group, 41, [T] * R)
    x = cupy.asarray(tagged_x(me, T, HS))
    b = cupyep.LowLatencyBuffer(group, T, HS, E)
    try:
        res = b.dispatch(x, cupy.asarray(idx[me]), use_fp8=False)  # one good call, so the memory is not fresh
        b.combine(res.recv_x, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
        b.synchronize()
        group.comm.Barrier()
        if me == late:
            time.sleep(group.timeout_s + 2.0)
        res = b.dispatch(x, cupy.asarray(idx[me]), use_fp8=False)
        comb = b.combine(res.recv_x, cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
        counts, status = res.handle.layout_count.get(), res.handle.status.get()
        got = comb.combined_x.get()  # no fault on any rank
        # The checks are gathered and asserted after the collective steps, so that one rank's
        # failed check cannot leave the others waiting in a barrier.
        err = None
        try:
            b.synchronize()
        except CommTimeoutError as e:
            err = e
        group.error_slot.reset()
        if err is None:
            ok, why = False, "no CommTimeoutError"
        elif me != late:
            ok = (err.kernel, err.peer, err.rank) == ("low_latency_dispatch", late, me) and "flag" in err.phase
            ok &= bool(status.all()) and not counts.any() and not res.recv_count.get().any()
            why = (str(err), status, counts)
        else:  # its dispatch was complete; its combine times out waiting for the peers that gave up on it
            ok = (err.kernel, err.rank) == ("low_latency_combine", me) and err.peer != late
            ok &= not status.any() and bool(np.isfinite(bf16_to_f32(got)).all())
            why = (str(err), status)
        group.comm.Barrier()
    finally:
        b.destroy()
    with cupyep.LowLatencyBuffer(group, T, HS, E) as b2:  # the group works on
        res = b2.dispatch(x, cupy.asarray(idx[me]), use_fp8=False)
        good, bad = _check_dispatch(group, res, [T] * R, idx, False, [tagged_x(r, T, HS) for r in range(R)],
                                    MAX_TOKENS=T)
        b2.synchronize()
        group.comm.Barrier()
    assert all_ranks(group.comm, ok and good), (why, bad)


def test_fault_device_finds_bad_expert_id(group, llbuf):
    """validate=False with an expert id out of range on every rank: DeviceInputError,
    the slot is skipped consistently, and the buffer keeps working."""
    import cupy
    from cupyep import DeviceInputError

    me, R = ranks(group)
    idx = np.tile(np.arange(K, dtype=np.int64), (4, 1))
    idx[1, 3] = E + 5
    res = llbuf.dispatch(cupy.zeros((4, H), dtype=np.uint16), cupy.asarray(idx), validate=False)
    with pytest.raises(DeviceInputError) as info:
        llbuf.synchronize()
    group.error_slot.reset()
    kernel = "low_latency_dispatch" + ("_internode" if group.num_nodes > 1 else "")
    assert info.value.kernel == kernel and info.value.value == E + 5, str(info.value)
    assert "expert id" in info.value.phase
    llbuf.combine(None, cupy.asarray(np.where(idx >= E, -1, idx)), cupy.ones((4, K), np.float32), res.handle,
                  zero_copy=True)
    llbuf.synchronize()
    # The buffer still works: a correct call afterwards.
    tokens = [16] * R
    ridx, w = _routing(group, 99, tokens)
    xs = [tagged_x(r, 16) for r in range(R)]
    out = llbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(ridx[me]), use_fp8=False)
    ok, bad = _check_dispatch(group, out, tokens, ridx, False, xs)
    assert all_ranks(group.comm, ok), bad
    llbuf.combine(out.recv_x, cupy.asarray(ridx[me]), cupy.asarray(w[me]), out.handle)
    llbuf.synchronize()


@pytest.mark.parametrize("hook", [False, True])
def test_logfmt_combine(group, llbuf, hook):
    """use_logfmt=True: the rows travel in LogFMT-10 and the result is the reference's combine of the
    rows through the format (cupyep.reference.logfmt), from x in the region layout and in DeepEP's packed
    one; within its stated accuracy of the BF16 combine; refused across nodes and with pull=True."""
    import cupy
    from cupyep.reference import logfmt as LF
    me, R = ranks(group)
    tokens = [MAX_TOKENS - 2 * r for r in range(R)]
    idx, w = _routing(group, 95 + hook, tokens)
    xs = [tagged_x(r, tokens[r]) for r in range(R)]
    i_me, w_me = cupy.asarray(idx[me]), cupy.asarray(w[me])
    res = llbuf.dispatch(cupy.asarray(xs[me]), i_me, use_fp8=False)
    y = res.recv_x.copy()
    if group.num_nodes > 1:
        with pytest.raises(ValueError, match="within a node"):
            llbuf.combine(y, i_me, w_me, res.handle, use_logfmt=True)
        llbuf.combine(y, i_me, w_me, res.handle)  # the refused call took no set: keep the ranks in step
        return
    with pytest.raises(ValueError, match="pull"):
        llbuf.combine(y, i_me, w_me, res.handle, use_logfmt=True, pull=True)
    outs = [bf16_to_f32(_combine_as(llbuf, how, y, i_me, w_me, res.handle, hook, use_logfmt=True))
            for how in ("regions", "packed")]
    # identity experts: every slot of token t returns x[t], through the format
    valid = idx[me] >= 0
    sw = (w[me] * valid).sum(axis=1, dtype=np.float64).astype(np.float32)[:, None]
    want_lf = LF.roundtrip(bf16_to_f32(xs[me])) * sw
    want = bf16_to_f32(xs[me]) * sw
    # The hash columns (|x| <= 1 with zeros and tiny values: groups of the full 32 octaves, the format's
    # coarsest step) show the format: the reference's LogFMT combine is off the exact one by d_fmt
    # (~6.5e-6); the GPU's must be an order of magnitude closer to it than that (its float32 log2/exp2
    # put a value on the neighbouring level now and then: ~2.7e-7 measured), and no further from the
    # exact combine than the format itself. The token-index columns (one value a group, which the format
    # carries exactly) would swamp calc_diff; they are checked to one BF16 unit instead.
    hcols = slice(0, H - 128)
    d_fmt = ref.calc_diff(want_lf[:, hcols], want[:, hcols])
    d_lf = ref.calc_diff(outs[0][:, hcols], want_lf[:, hcols])
    d_exact = ref.calc_diff(outs[0][:, hcols], want[:, hcols])
    tag_ok = np.all(np.abs(outs[0][:, -128:] - want[:, -128:]) <= np.abs(want[:, -128:]) * 2.0 ** -7 + 1e-30)
    ok = (np.array_equal(outs[0], outs[1]) and d_lf < 0.1 * d_fmt and d_exact < 1.5 * d_fmt and tag_ok
          and not np.isnan(outs[0]).any())
    assert all_ranks(group.comm, ok), (d_lf, d_exact, d_fmt, bool(tag_ok), np.array_equal(outs[0], outs[1]))


@pytest.mark.parametrize("kind", ["bf16", "fp8", "ue8m0"])
@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("made", [False, True], ids=["given", "made"])
def test_the_dispatch_fills_deepeps_packed_layout(group, llbuf, kind, hook, made):
    """packed_out: the dispatch's receive half (dispatch_packed) fills DeepEP's packed layout with what
    cupyep.reference.packed_layout's definition makes of the same result: rows, scales, source tokens and ranges,
    bit for bit over the received rows (in the hook with return_recv_hook); into the caller's arrays, or
    (packed_out=True) into new ones of the same shapes and strides, returned as result.packed."""
    import cupy
    from cupyep.reference import packed_layout as P
    me, R = ranks(group)
    fp8, ue8m0 = kind != "bf16", kind == "ue8m0"
    tokens = [MAX_TOKENS - 3 * r for r in range(R)]
    idx, _ = _routing(group, 100 + 2 * hook + fp8 + ue8m0, tokens)
    xs = [tagged_x(r, tokens[r]) for r in range(R)]
    El, RT = E // R, R * llbuf.max_tokens
    S = H // 512 if ue8m0 else H // 128
    out = (cupy.empty((El, RT, H), np.uint8 if fp8 else np.uint16),
           cupy.empty((El, S, RT), np.int32 if ue8m0 else np.float32).transpose(0, 2, 1) if fp8 else None,
           cupy.empty((El, RT), np.int32), cupy.empty((El, R), np.int64))
    res = llbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=fp8, round_scale=ue8m0,
                         use_ue8m0=ue8m0, return_recv_hook=hook, packed_out=True if made else out)
    if hook:
        res.hook()
    if made:
        assert all((a is None and b is None) or (a.shape == b.shape and a.strides == b.strides
                                                 and a.dtype == b.dtype) for a, b in zip(res.packed, out))
        out = res.packed
    else:
        assert res.packed is not None and all(a is b or a.data.ptr == b.data.ptr
                                              for a, b in zip(res.packed, out) if b is not None)
    want = P.packed_outputs(res.recv_x, res.recv_x_scales, R, llbuf.max_tokens, ue8m0)
    P.pack_dispatch(res.recv_x, res.recv_x_scales, res.handle.recv_src, res.handle.layout_count,
                    res.handle.capacity, want)
    n = res.recv_count.get()
    ok = np.array_equal(out[3].get(), want[3].get())
    for got, w in zip(out[:3], want[:3]):
        if w is None:
            continue
        g, w = got.get(), w.get()
        ok &= all(np.array_equal(np.ascontiguousarray(g[e, :n[e]]).view(np.uint8),
                                 np.ascontiguousarray(w[e, :n[e]]).view(np.uint8)) for e in range(El))
    assert all_ranks(group.comm, ok), kind
    with pytest.raises(ValueError, match="packed"):
        llbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=False, packed_out=out[:2])


def _scaled_experts(bits, first_expert, xp):
    """Expert e's output of its row x: x * 2 ** (e % 4), exactly, on the BF16 bits (the exponent field
    raised; zeros and subnormals, exponent field 0, pass unchanged), from [E_local, S, H] uint16 rows
    (``first_expert``: the global id of local expert 0). Integer arithmetic, so NumPy and the GPU
    agree bit for bit (CuPy's float kernels flush subnormals). Every expert scales differently, so a
    row combined with the wrong expert's weight or from the wrong expert changes the result."""
    El = bits.shape[0]
    shift = (((first_expert + xp.arange(El)) % 4).astype(np.uint16) << np.uint16(7))[:, None, None]
    return xp.where((bits & np.uint16(0x7F80)) != 0, bits + shift, bits).astype(np.uint16)


def _partial_expert_outputs(xs, idx, R):
    """What reference.low_latency_partial_combine takes for every rank's tokens xs through
    _scaled_experts (only the rows the routings name are filled): (expert_out, dispatch results)."""
    import ml_dtypes
    El = E // R
    refs = ref.low_latency_dispatch(xs, idx, E, MAX_TOKENS)
    expert_out = []
    for d in range(R):
        out = np.zeros(refs[d].recv_x.shape, dtype=np.uint16)
        for e in range(El):
            for s in range(R):
                n = int(refs[d].layout_count[e, s])
                sl = slice(s * MAX_TOKENS, s * MAX_TOKENS + n)
                out[e, sl] = _scaled_experts(refs[d].recv_x[e:e + 1, sl], d * El + e, np)[0]
        expert_out.append(out.view(ml_dtypes.bfloat16))
    return expert_out, refs


def _partial_inputs(group, seed):
    """The partial-combine tests' inputs: (me, R, idx, w, xs, i_me, w_me), MAX_TOKENS - 3 r tokens on
    rank r routed by _routing(seed), xs their tagged rows, i_me / w_me this rank's routing on the GPU."""
    import cupy
    me, R = ranks(group)
    tokens = [MAX_TOKENS - 3 * r for r in range(R)]
    idx, w = _routing(group, seed, tokens)
    xs = [tagged_x(r, tokens[r]) for r in range(R)]
    return me, R, idx, w, xs, cupy.asarray(idx[me]), cupy.asarray(w[me])


@pytest.mark.parametrize("hook", [False, True])
def test_partial_combine(group, llbuf, hook):
    """combine(partial=True): each expert rank returns one partial row per (token, expert rank); the
    result equals cupyep.reference.low_latency_partial_combine bit for bit, from x in the region layout,
    in DeepEP's packed one and zero-copy, and stays within the BF16 bound of the per-slot combine.
    Experts scale their rows by an expert-dependent factor, so a misrouted row or weight shows."""
    import cupy
    me, R, idx, w, xs, i_me, w_me = _partial_inputs(group, 211 + hook)
    El = E // R
    if group.num_nodes > 1:
        res = llbuf.dispatch(cupy.asarray(xs[me]), i_me, use_fp8=False, topk_weights=w_me)
        with pytest.raises(ValueError, match="within a node"):
            llbuf.combine(res.recv_x.copy(), i_me, None, res.handle, partial=True)
        llbuf.combine(res.recv_x.copy(), i_me, w_me, res.handle)  # the refused call took no set
        return
    # Without the weights in the dispatch, or with other weights, or pulled: refused before any launch.
    res = llbuf.dispatch(cupy.asarray(xs[me]), i_me, use_fp8=False)
    y = _scaled_experts(res.recv_x, me * El, cupy)
    with pytest.raises(ValueError, match="dispatch with topk_weights"):
        llbuf.combine(y, i_me, w_me, res.handle, partial=True)
    res = llbuf.dispatch(cupy.asarray(xs[me]), i_me, use_fp8=False, topk_weights=w_me)
    ok = np.array_equal(res.handle.rank_pos.get(), ref.low_latency.rank_position(idx[me], E, R))
    y = _scaled_experts(res.recv_x, me * El, cupy)
    with pytest.raises(ValueError, match="same array"):
        llbuf.combine(y, i_me, w_me.copy(), res.handle, partial=True)
    with pytest.raises(ValueError, match="pull=True"):
        llbuf.combine(y, i_me, None, res.handle, partial=True, pull=True)
    outs = [_combine_as(llbuf, how, y, i_me, None, res.handle, hook, partial=True)
            for how in ("regions", "packed", "zero_copy")]
    outs.append(_combine_as(llbuf, "regions", y, i_me, w_me, res.handle, hook, partial=True))  # weights again
    per_slot = bf16_to_f32(llbuf.combine(y, i_me, w_me, res.handle).combined_x.get())
    expert_out, refs = _partial_expert_outputs(xs, idx, R)
    want = f32_to_bf16(ref.low_latency_partial_combine(expert_out, refs, idx, w)[me])
    exact = all(np.array_equal(o, want) for o in outs)
    diff = ref.calc_diff(bf16_to_f32(outs[0]), per_slot)
    ok &= exact and diff < 1e-5
    assert all_ranks(group.comm, ok), (exact, [int((o != want).sum()) for o in outs], diff)


@pytest.mark.parametrize("hook", [False, True])
def test_partial_logfmt_combine(group, llbuf, hook):
    """combine(partial=True, use_logfmt=True): the partial rows travel in LogFMT-10; the result is
    reference.low_latency_partial_combine(..., logfmt=True) within the device's rounding of the format
    (as test_logfmt_combine: an order of magnitude closer to it than the format is to the BF16 partial
    combine), the same from x in the region layout, packed and zero-copy, and no further from the BF16
    partial combine than the format itself. Experts scale their rows by an expert-dependent factor."""
    import cupy
    me, R, idx, w, xs, i_me, w_me = _partial_inputs(group, 223 + hook)
    El = E // R
    res = llbuf.dispatch(cupy.asarray(xs[me]), i_me, use_fp8=False, topk_weights=w_me)
    y = _scaled_experts(res.recv_x, me * El, cupy)
    if group.num_nodes > 1:
        with pytest.raises(ValueError, match="within a node"):
            llbuf.combine(y, i_me, None, res.handle, partial=True, use_logfmt=True)
        llbuf.combine(y, i_me, w_me, res.handle)  # the refused call took no set
        return
    with pytest.raises(ValueError, match="pull=True"):
        llbuf.combine(y, i_me, None, res.handle, partial=True, use_logfmt=True, pull=True)
    outs = [_combine_as(llbuf, how, y, i_me, None, res.handle, hook, partial=True, use_logfmt=True)
            for how in ("regions", "packed", "zero_copy")]
    got = bf16_to_f32(outs[0])
    expert_out, refs = _partial_expert_outputs(xs, idx, R)
    want_lf = ref.low_latency_partial_combine(expert_out, refs, idx, w, logfmt=True)[me]
    want = ref.low_latency_partial_combine(expert_out, refs, idx, w)[me]
    hcols = slice(0, H - 128)  # hash columns; the token-index ones are exact in the format (one value a group)
    d_fmt = ref.calc_diff(want_lf[:, hcols], want[:, hcols])
    d_lf = ref.calc_diff(got[:, hcols], want_lf[:, hcols])
    d_exact = ref.calc_diff(got[:, hcols], want[:, hcols])
    tag_ok = np.all(np.abs(got[:, -128:] - want[:, -128:]) <= np.abs(want[:, -128:]) * 2.0 ** -7 + 1e-30)
    same = all(np.array_equal(o, outs[0]) for o in outs)
    ok = same and d_lf < 0.1 * d_fmt and d_exact < 1.5 * d_fmt and tag_ok and not np.isnan(got).any()
    assert all_ranks(group.comm, ok), (same, d_lf, d_exact, d_fmt, bool(tag_ok))
