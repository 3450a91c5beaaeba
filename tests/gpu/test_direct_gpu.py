"""Normal mode's direct (one-copy) transport on the GPU: against the NumPy
reference (dispatch exactly, combine within 5e-6 and bitwise deterministic)
and bitwise against the queue transport on the same input; cached,
worst-token inside a CUDA graph, FP8, expert-major, the fixed pools, bad input
and a missing rank.
"""
import numpy as np
import pytest

from cupyep import reference as ref

from cupyep.fp8 import per_token_cast_to_fp8
from cupyep.testing import all_ranks, bf16_to_f32
from graphs import capture, replay
from test_intranode_gpu import CASES, NUM_EXPERTS, NUM_TOPK, _expected, _inputs, _poison, _received_rows, \
    _worst_rows_checks

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def buf(group):
    import cupyep
    b = cupyep.Buffer(group)
    yield b
    b.destroy()


def _host(out):
    """Host copies of a dispatch's receive arrays (direct ones are pool views)."""
    get = lambda a: None if a is None else a.get()  # noqa: E731
    return {"recv_x": get(out.recv_x), "recv_x_scales": get(out.recv_x_scales),
            "recv_topk_idx": get(out.recv_topk_idx), "recv_topk_weights": get(out.recv_topk_weights),
            "recv_src_idx": get(out.handle.recv_src_idx)}


def _same(a: dict, b: dict) -> dict:
    return {k: (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and np.array_equal(a[k], b[k]))
            for k in a}


@pytest.mark.parametrize("seed,num_tokens,hidden,case,zero_rank", CASES)
def test_direct_matches_reference_and_queue(group, buf, seed, num_tokens, hidden, case, zero_rank):
    import cupy
    tokens, idx, w, x = _inputs(group, seed, num_tokens, hidden, case, zero_rank)
    me = group.local_rank
    res, exp, exp_rows = _expected(group, tokens, idx, w, hidden, expert_alignment=4)
    xs, ids, ws = cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me])

    out = buf.dispatch(xs, ids, ws, num_experts=NUM_EXPERTS, expert_alignment=4, transport="direct")
    got = _host(out)
    checks = {
        "transport": out.handle.transport == "direct",
        "recv_x": np.array_equal(got["recv_x"], exp_rows),
        "recv_topk_idx": np.array_equal(got["recv_topk_idx"], exp.recv_topk_idx),
        "recv_topk_weights": np.array_equal(got["recv_topk_weights"], exp.recv_topk_weights),
        "recv_src_idx": np.array_equal(got["recv_src_idx"], exp.recv_src_idx),
        "rank_prefix_matrix": np.array_equal(out.handle.rank_prefix_matrix.get(), exp.rank_prefix_matrix),
        "num_recv_tokens_per_expert": out.num_recv_tokens_per_expert == exp.num_recv_tokens_per_expert,
    }
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}

    # Cached: the handle's transport, the same rows again.
    cached = buf.dispatch(xs, ids, ws, handle=out.handle, expert_alignment=4)
    same = _same(_host(cached), got)
    assert all_ranks(group.comm, all(same.values())), {f"cached {k}": v for k, v in same.items() if not v}

    # Combine: identity experts, a per-row factor and the top-k weights.
    row_w = cupy.asarray((1.0 + (got["recv_src_idx"] % 3)).astype(np.float32))
    comb = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, row_weights=row_w)
    weights = [(1.0 + (r.recv_src_idx % 3)).astype(np.float32) for r in res]
    expected = ref.intranode_combine(_received_rows(res, hidden), res, tokens, weights=weights)[me]
    cx = comb.combined_x.get()
    diff = ref.calc_diff(bf16_to_f32(cx), expected) if cx.size else 0.0
    exp_w = ref.intranode_combine_topk_weights(res, tokens)[me]
    wdiff = float(np.abs(comb.combined_topk_weights.get() - exp_w).max()) if exp_w.size else 0.0
    group.comm.Barrier()  # the reference above is seconds of host work per rank: line the ranks up again
    again = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, row_weights=row_w)
    ok = diff < 5e-6 and wdiff < 1e-6 and np.array_equal(again.combined_x.get(), cx)
    assert all_ranks(group.comm, ok), ("combine", diff, wdiff)

    # The queue transport on the same input: bitwise the same dispatch and combine.
    q = buf.dispatch(xs, ids, ws, num_experts=NUM_EXPERTS, expert_alignment=4)
    qcomb = buf.combine(q.recv_x, q.handle, topk_weights=q.recv_topk_weights, row_weights=row_w)
    same = _same(_host(q), got)
    same["combined_x"] = np.array_equal(qcomb.combined_x.get(), cx)
    same["combined_topk_weights"] = np.array_equal(qcomb.combined_topk_weights.get(), comb.combined_topk_weights.get())
    assert all_ranks(group.comm, all(same.values())), {f"queue {k}": v for k, v in same.items() if not v}


@pytest.mark.parametrize("seed,num_tokens,hidden,case,zero_rank", CASES)
def test_direct_fused_matches_two_launches(group, buf, seed, num_tokens, hidden, case, zero_rank):
    """DirectConfig(fused=True), the default: layout, notify and send in one launch give
    bitwise the unfused dispatch (and the same handle and counts), and its
    handle combines the same."""
    import cupy
    from cupyep.normal.direct_kernels import DirectConfig
    tokens, idx, w, x = _inputs(group, seed, num_tokens, hidden, case, zero_rank)
    me = group.local_rank
    exp = _expected(group, tokens, idx, w, hidden, expert_alignment=2)[1]
    xs, ids, ws = cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me])
    plain = buf.dispatch(xs, ids, ws, num_experts=NUM_EXPERTS, expert_alignment=2, transport="direct",
                         config=DirectConfig(fused=False))
    want = _host(plain)
    pcomb = buf.combine(plain.recv_x, plain.handle, topk_weights=plain.recv_topk_weights).combined_x.get()
    fused = buf.dispatch(xs, ids, ws, num_experts=NUM_EXPERTS, expert_alignment=2, transport="direct",
                         config=DirectConfig(fused=True))
    got = _host(fused)
    same = _same(got, want)
    same["counts"] = fused.num_recv_tokens_per_expert == exp.num_recv_tokens_per_expert
    same["matrix"] = np.array_equal(fused.handle.counts, plain.handle.counts)
    same["send_head"] = np.array_equal(fused.handle.send_head.get(), plain.handle.send_head.get())
    same["is_token_in_rank"] = np.array_equal(fused.handle.is_token_in_rank.get(),
                                              plain.handle.is_token_in_rank.get())
    fcomb = buf.combine(fused.recv_x, fused.handle, topk_weights=fused.recv_topk_weights).combined_x.get()
    same["combine"] = np.array_equal(fcomb, pcomb)
    assert all_ranks(group.comm, all(same.values())), {f"fused {k}": v for k, v in same.items() if not v}


def test_direct_fused_on_a_fresh_buffer_and_in_cuda_graph(group):
    """Fused dispatch on a fresh buffer (its first call allocates the fixed
    pools, which no later call changes), then worst-token calls captured and
    replayed in a CUDA graph with new routings."""
    import cupy
    import cupyep
    from cupyep.normal.direct_kernels import DirectConfig
    R, me = group.local_size, group.local_rank
    cfg = DirectConfig(fused=True)
    b = cupyep.Buffer(group, max_tokens=2048)
    try:
        sizes = []
        for seed, T, H in ((61, 16, 2048), (62, 16, 2048), (63, 2048, 7168)):
            tokens, idx, w, x = _inputs(group, seed, T, H)
            out = b.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                             transport="direct", config=cfg)
            res, exp, exp_rows = _expected(group, tokens, idx, w, H)
            ok = (np.array_equal(out.recv_x.get(), exp_rows) and np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx)
                  and np.array_equal(out.handle.recv_src_idx.get(), exp.recv_src_idx))
            assert all_ranks(group.comm, ok), seed
            sizes.append((b.routes["direct"].pools.pools["dispatch"].nbytes, b.routes["direct"].pools.pools["dispatch"].ptr))
        assert len(set(sizes)) == 1 and sizes[0][0] == 2 * b.routes["direct"].pools.slot_bytes, sizes
        num_tokens, hidden = 128, 2048
        worst = num_tokens * R
        stream = cupy.cuda.Stream(non_blocking=True)
        x_in = cupy.empty((num_tokens, hidden), dtype=np.uint16)
        idx_in = cupy.empty((num_tokens, NUM_TOPK), dtype=np.int64)
        w_in = cupy.empty((num_tokens, NUM_TOPK), dtype=np.float32)

        def step():
            o = b.dispatch(x_in, idx_in, w_in, num_experts=NUM_EXPERTS, num_worst_tokens=worst, validate=False,
                           transport="direct", config=cfg)
            return o, b.combine(o.recv_x, o.handle)

        with stream:
            tokens, idx, w, x = _inputs(group, 64, num_tokens, hidden)
            x_in.set(x); idx_in.set(idx[me]); w_in.set(w[me])
            step()
            stream.synchronize()
        graph, (out, comb) = capture(stream, group, step)
        for it in range(3):
            tokens, idx, w, x = _inputs(group, 65 + it, num_tokens, hidden)

            def prepare():
                x_in.set(x); idx_in.set(idx[me]); w_in.set(w[me])
                _poison(stream, out.recv_topk_idx, out.recv_topk_weights, out.handle.recv_src_idx)

            replay(stream, group, graph, prepare)
            res, exp, exp_rows = _expected(group, tokens, idx, w, hidden)
            expected = ref.intranode_combine(_received_rows(res, hidden), res, tokens)[me]
            checks = _worst_rows_checks(out, exp, exp_rows, worst)
            checks["combine"] = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), expected) < 5e-6
            assert all_ranks(group.comm, all(checks.values())), (it, {k: v for k, v in checks.items() if not v})
        group.comm.Barrier()
    finally:
        b.destroy()


def test_direct_fp8_bytes_and_scales(group, buf):
    import cupy
    tokens, idx, w, x = _inputs(group, 7, 512, 7168)
    me = group.local_rank
    x_fp8, scales = per_token_cast_to_fp8(cupy.asarray(x))
    all_fp8 = group.comm.allgather((x_fp8.get(), scales.get()))
    exp = ref.intranode_dispatch([a for a, _ in all_fp8], idx, NUM_EXPERTS, topk_weights=w,
                                 x_scales=[s for _, s in all_fp8])[me]
    out = buf.dispatch((x_fp8, scales), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                       transport="direct")
    got = _host(out)
    ok = (np.array_equal(got["recv_x"], exp.recv_x) and np.array_equal(got["recv_x_scales"], exp.recv_x_scales)
          and np.array_equal(got["recv_topk_idx"], exp.recv_topk_idx))
    q = buf.dispatch((x_fp8, scales), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS)
    same = _same(_host(q), got)
    assert all_ranks(group.comm, ok and all(same.values())), (ok, {k: v for k, v in same.items() if not v})


def test_direct_worst_tokens_and_cuda_graph(group, buf):
    """Worst-token mode on the direct transport: padding rows hold -1 / 0
    whatever the pool held, eagerly, cached, and in CUDA-graph replays with
    new routings (no host work in a replay)."""
    import cupy
    seed, num_tokens, hidden = 11, 128, 2048
    R, me = group.local_size, group.local_rank
    worst = num_tokens * R
    stream = cupy.cuda.Stream(non_blocking=True)
    x_in = cupy.empty((num_tokens, hidden), dtype=np.uint16)
    idx_in = cupy.empty((num_tokens, NUM_TOPK), dtype=np.int64)
    w_in = cupy.empty((num_tokens, NUM_TOPK), dtype=np.float32)

    def step():
        out = buf.dispatch(x_in, idx_in, w_in, num_experts=NUM_EXPERTS, num_worst_tokens=worst, validate=False,
                           transport="direct")
        return out, buf.combine(out.recv_x, out.handle)

    with stream:
        tokens, idx, w, x = _inputs(group, seed, num_tokens, hidden)
        x_in.set(x); idx_in.set(idx[me]); w_in.set(w[me])
        out, comb = step()
        stream.synchronize()
        _poison(stream, out.recv_topk_idx, out.recv_topk_weights, out.handle.recv_src_idx)
        out, comb = step()  # the same pool, poisoned: every padding entry is written again
        stream.synchronize()
        res, exp, exp_rows = _expected(group, tokens, idx, w, hidden)
        checks = _worst_rows_checks(out, exp, exp_rows, worst)
        expected = ref.intranode_combine(_received_rows(res, hidden), res, tokens)[me]
        checks["combine"] = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), expected) < 5e-6
        assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}
        _poison(stream, out.recv_topk_idx, out.recv_topk_weights)  # the pool's rows; the handle's routing is its own
        cached = buf.dispatch(x_in, idx_in, w_in, handle=out.handle)
        stream.synchronize()
        checks = _worst_rows_checks(cached, exp, exp_rows, worst)
        checks["routing shared"] = cached.handle.recv_src_idx.data.ptr == out.handle.recv_src_idx.data.ptr
        assert all_ranks(group.comm, all(checks.values())), {f"cached {k}": v for k, v in checks.items() if not v}
    graph, (out, comb) = capture(stream, group, step)
    for it in range(3):
        tokens, idx, w, x = _inputs(group, seed + 100 + it, num_tokens, hidden)

        def prepare():
            x_in.set(x); idx_in.set(idx[me]); w_in.set(w[me])
            _poison(stream, out.recv_topk_idx, out.recv_topk_weights, out.handle.recv_src_idx)

        replay(stream, group, graph, prepare)
        res, exp, exp_rows = _expected(group, tokens, idx, w, hidden)
        expected = ref.intranode_combine(_received_rows(res, hidden), res, tokens)[me]
        checks = _worst_rows_checks(out, exp, exp_rows, worst)
        checks["combine"] = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), expected) < 5e-6
        assert all_ranks(group.comm, all(checks.values())), (it, {k: v for k, v in checks.items() if not v})


@pytest.mark.parametrize("stage", [4096, 1024, 4000])
@pytest.mark.parametrize("seed,num_tokens,hidden,case,zero_rank", CASES)
def test_direct_bulk_copies_match_warp_copies(group, buf, seed, num_tokens, hidden, case, zero_rank, stage):
    """DirectConfig(bulk_stage_bytes=stage): the rows move by bulk copies
    through shared memory (a 1024- or 4000-byte stage splits each row into
    several pieces, the last one short). Bitwise the warp copies' results:
    the fused and unfused notified dispatch, a cached FP8 dispatch, an
    expert-major dispatch (fused and unfused) and the pushing combine of each."""
    import cupy
    from dataclasses import replace
    from cupyep.normal.direct_kernels import DirectConfig
    tokens, idx, w, x = _inputs(group, seed, num_tokens, hidden, case, zero_rank)
    me = group.local_rank
    xs, ids, ws = cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me])
    x8 = per_token_cast_to_fp8(xs)
    got = {}
    for bulk in (0, stage):
        base = DirectConfig(bulk_stage_bytes=bulk)
        r = got[bulk] = {}
        for fused in (True, False):
            cfg = replace(base, fused=fused)
            out = buf.dispatch(xs, ids, ws, num_experts=NUM_EXPERTS, transport="direct", config=cfg)
            r[f"dispatch fused={fused}"] = _host(out)
            r[f"combine fused={fused}"] = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights,
                                                      config=cfg).combined_x.get()
            fp8 = buf.dispatch(x8, handle=out.handle, config=cfg)
            r[f"cached fp8 fused={fused}"] = (fp8.recv_x.get(), fp8.recv_x_scales.get())
            em = buf.dispatch(xs, ids, ws, num_experts=NUM_EXPERTS, expert_alignment=8, expert_major=True,
                              transport="direct", config=cfg)
            r[f"expert-major fused={fused}"] = (em.expert_x.get(), em.expert_src_row.get())
            r[f"expert-major combine fused={fused}"] = buf.combine(
                em.expert_x, em.handle, pair_weights=em.recv_topk_weights, config=cfg).combined_x.get()

    def equal(a, b):
        if isinstance(a, dict):
            return all(equal(a[k], b[k]) for k in a)
        if isinstance(a, tuple):
            return all(equal(u, v) for u, v in zip(a, b))
        return (a is None and b is None) or np.array_equal(a, b)
    same = {k: equal(got[0][k], got[stage][k]) for k in got[0]}
    assert all_ranks(group.comm, all(same.values())), {k: v for k, v in same.items() if not v}


def test_direct_combine_words_do_not_change_a_bit(group, buf):
    """DirectConfig(combine_words=w): the combine's reduce loads w row words
    per lane and rank before summing; each word's sum runs over the ranks in
    the same order whatever w is, so the pushing and the zero-copy combine
    (with top-k weights and row weights, H = 7168 and 2048, whose rows do not
    split evenly into 32 * w words) are bitwise those of the default."""
    import cupy
    from cupyep.normal.direct_kernels import COMBINE_WORDS, DirectConfig, max_combine_words
    R, me = group.local_size, group.local_rank
    words = [None] + [w for w in COMBINE_WORDS if w <= max_combine_words(R)]
    for seed, T, H in ((61, 1000, 7168), (62, 300, 2048)):
        tokens, idx, w, x = _inputs(group, seed, T, H)
        got = {}
        for cw in words:
            cfg = DirectConfig(combine_words=cw)
            out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                               transport="direct", config=cfg)
            zc = buf.get_combine_buffer(out.handle)
            zc[...] = out.recv_x
            row_w = cupy.asarray((1.0 + (np.arange(zc.shape[0]) % 3)).astype(np.float32))
            pushed = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, row_weights=row_w,
                                 config=cfg)
            pulled = buf.combine(zc, out.handle, topk_weights=out.recv_topk_weights, row_weights=row_w,
                                 zero_copy=True, config=cfg)
            got[cw] = [a.get() for a in (pushed.combined_x, pushed.combined_topk_weights, pulled.combined_x,
                                         pulled.combined_topk_weights)]
        same = {(H, cw): all(np.array_equal(a, b) for a, b in zip(got[None], got[cw])) for cw in words[1:]}
        assert all_ranks(group.comm, all(same.values())), {k: v for k, v in same.items() if not v}


def test_direct_expert_major_matches_queue(group, buf):
    """expert_major=True on the direct transport: the same expert-major arrays,
    and the same combine of expert-major outputs, as the queue transport."""
    import cupy
    tokens, idx, w, x = _inputs(group, 21, 300, 2048)
    me = group.local_rank
    xs, ids, ws = cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me])
    outs, combs = {}, {}
    for t in ("direct", "queue"):
        out = buf.dispatch(xs, ids, ws, num_experts=NUM_EXPERTS, expert_alignment=8, expert_major=True, transport=t)
        comb = buf.combine(out.expert_x, out.handle, pair_weights=out.recv_topk_weights)
        outs[t] = {"expert_x": out.expert_x.get(), "expert_offsets": out.expert_offsets.get(),
                   "expert_src_row": out.expert_src_row.get(), "counts": out.num_recv_tokens_per_expert}
        combs[t] = comb.combined_x.get()
    same = {k: (outs["direct"][k] == outs["queue"][k]) if k == "counts"
            else np.array_equal(outs["direct"][k], outs["queue"][k]) for k in outs["queue"]}
    same["combined_x"] = np.array_equal(combs["direct"], combs["queue"])
    assert all_ranks(group.comm, all(same.values())), {k: v for k, v in same.items() if not v}


@pytest.mark.parametrize("worst", [False, True])
def test_direct_zero_copy_combine(group, buf, worst):
    """combine(get_combine_buffer(handle), zero_copy=True), the owners reading
    the expert outputs in place: bitwise the pushing combine, against the
    reference, twice, and again after the next dispatch reuses the buffer."""
    import cupy
    R, me = group.local_size, group.local_rank
    for it, (seed, T, H) in enumerate(((51, 300, 2048), (52, 1000, 7168))):
        tokens, idx, w, x = _inputs(group, seed, T, H)
        res = _expected(group, tokens, idx, w, H)[0]
        kw = {"num_worst_tokens": T * R} if worst else {}
        out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                           transport="direct", **kw)
        zc = buf.get_combine_buffer(out.handle)
        zc[...] = out.recv_x  # identity experts: the outputs are the received rows
        n = res[me].num_recv_tokens
        row_w = cupy.asarray((1.0 + (np.arange(zc.shape[0]) % 3)).astype(np.float32))
        pushed = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, row_weights=row_w)
        pulled = buf.combine(zc, out.handle, topk_weights=out.recv_topk_weights, row_weights=row_w, zero_copy=True)
        again = buf.combine(zc, out.handle, topk_weights=out.recv_topk_weights, row_weights=row_w, zero_copy=True)
        weights = [(1.0 + (np.arange(r.num_recv_tokens) % 3)).astype(np.float32) for r in res]
        expected = ref.intranode_combine(_received_rows(res, H), res, tokens, weights=weights)[me]
        px = pulled.combined_x.get()
        checks = {
            "rows": zc.shape == (T * R if worst else n, H),
            "same as push": np.array_equal(px, pushed.combined_x.get()),
            "weights same as push": np.array_equal(pulled.combined_topk_weights.get(),
                                                   pushed.combined_topk_weights.get()),
            "deterministic": np.array_equal(again.combined_x.get(), px),
            "reference": ref.calc_diff(bf16_to_f32(px), expected) < 5e-6,
        }
        assert all_ranks(group.comm, all(checks.values())), (it, {k: v for k, v in checks.items() if not v})
    with pytest.raises(ValueError, match="get_combine_buffer"):
        buf.combine(out.recv_x, out.handle, zero_copy=True)
    q = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="direct transport"):
        buf.combine(q.recv_x, q.handle, zero_copy=True)
    with pytest.raises(ValueError, match="direct transport"):
        buf.get_combine_buffer(q.handle)
    buf.synchronize()
    group.comm.Barrier()


@pytest.mark.parametrize("worst", [False, True])
def test_direct_in_place_combine(group, buf, worst):
    """The default combine of the caller's own x reads every expert rank's x
    where it lies (DirectConfig.combine_in_place): bitwise the pushing
    combine and within 5e-6 of the reference, whether x is a copy in CuPy's
    pool, the dispatch's own recv_x (a view of cupyep's pool) or managed
    memory, which CUDA IPC cannot export (then every rank pushes, and
    combine_in_place=True is a ValueError); the caller may overwrite x as soon as the
    combine returns (the kernel ends after every owner has read it); the
    mappings are opened once."""
    import cupy
    from cupyep.normal.direct_kernels import DirectConfig
    R, me = group.local_size, group.local_rank
    pushed_cfg, in_place_cfg = DirectConfig(combine_in_place=False), DirectConfig(combine_in_place=True)
    for it, (seed, T, H) in enumerate(((71, 300, 2048), (72, 1000, 7168), (73, 1, 2048))):
        tokens, idx, w, x = _inputs(group, seed, T, H)
        res = _expected(group, tokens, idx, w, H)[0]
        kw = {"num_worst_tokens": T * R} if worst else {}
        out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                           transport="direct", **kw)
        y = out.recv_x.copy()  # the experts' outputs, in the caller's own memory (identity experts)
        row_w = cupy.asarray((1.0 + (np.arange(y.shape[0]) % 3)).astype(np.float32))
        args = dict(topk_weights=out.recv_topk_weights, row_weights=row_w)
        pushed = buf.combine(y, out.handle, config=pushed_cfg, **args)
        in_place = buf.combine(y, out.handle, config=in_place_cfg, **args)
        peers = buf.routes["direct"]._peer_x
        opened = peers.opened
        default = buf.combine(y, out.handle, **args)
        reopened = peers.opened - opened  # the same x again: its mappings are kept
        from_pool = buf.combine(out.recv_x, out.handle, config=in_place_cfg, **args)
        memory = cupy.cuda.MemoryPointer(cupy.cuda.ManagedMemory(max(y.nbytes, 1)), 0)
        managed = cupy.ndarray(y.shape, y.dtype, memory)
        managed[...] = y  # memory CUDA IPC cannot export: every rank pushes
        not_exported = buf.combine(managed, out.handle, **args)
        weights = [(1.0 + (np.arange(r.num_recv_tokens) % 3)).astype(np.float32) for r in res]
        expected = ref.intranode_combine(_received_rows(res, H), res, tokens, weights=weights)[me]
        # overwritten on the caller's stream right after the combine: the owners have read it by then
        y2 = out.recv_x.copy()
        late = buf.combine(y2, out.handle, config=in_place_cfg, **args)
        y2.fill(0x7FC0)  # BF16 NaN
        px = pushed.combined_x.get()
        checks = {
            "reference": ref.calc_diff(bf16_to_f32(px), expected) < 5e-6,
            "mapped once": reopened == 0,
            **{name: np.array_equal(r.combined_x.get(), px) and
               np.array_equal(r.combined_topk_weights.get(), pushed.combined_topk_weights.get())
               for name, r in (("in place", in_place), ("default", default), ("from the pool", from_pool),
                               ("not exportable", not_exported), ("overwritten after", late))},
        }
        assert all_ranks(group.comm, all(checks.values())), (it, {k: v for k, v in checks.items() if not v})
    with pytest.raises(ValueError, match="cannot be read in place"):
        buf.combine(managed, out.handle, config=in_place_cfg, **args)
    buf.synchronize()
    group.comm.Barrier()


def test_direct_pool_is_sized_when_made_and_a_call_past_it_names_the_argument(group):
    """The dispatch pool holds num_in_flight slots of the declared sizes and
    never changes; a call past max_tokens or num_worst_tokens past R *
    max_tokens is a ValueError naming the constructor argument, before
    anything is launched; the buffer then works as before."""
    import cupy
    import cupyep
    me, R = group.local_rank, group.local_size
    b = cupyep.Buffer(group, max_tokens=64, hidden=2048, num_topk=8, num_in_flight=3)
    try:
        tokens, idx, w, x = _inputs(group, 31, 64, 2048)
        xs, ids = cupy.asarray(x), cupy.asarray(idx[me])
        out = b.dispatch(xs, ids, num_experts=NUM_EXPERTS, transport="direct")
        pool = b.routes["direct"].pools.pools["dispatch"]
        assert pool.nbytes == 3 * b.routes["direct"].pools.slot_bytes
        with pytest.raises(ValueError, match="max_tokens=64"):
            b.dispatch(cupy.concatenate([xs, xs]), cupy.concatenate([ids, ids]), num_experts=NUM_EXPERTS,
                       transport="direct")
        with pytest.raises(ValueError, match="hidden=2048"):
            b.dispatch(cupy.zeros((4, 4096), np.uint16), ids[:4], num_experts=NUM_EXPERTS, transport="direct")
        with pytest.raises(ValueError, match="max_tokens=64"):
            b.dispatch(xs, ids, num_experts=NUM_EXPERTS, num_worst_tokens=R * 64 + 1, transport="direct")
        again = b.dispatch(xs, ids, num_experts=NUM_EXPERTS, transport="direct")
        exp_rows = _expected(group, tokens, idx, w, 2048)[2]
        assert all_ranks(group.comm, np.array_equal(again.recv_x.get(), exp_rows) and
                         np.array_equal(out.recv_x.get(), exp_rows) and b.routes["direct"].pools.pools["dispatch"] is pool)
        group.comm.Barrier()
    finally:
        b.destroy()


def test_direct_pool_that_does_not_fit_names_the_bytes(group):
    """Declared sizes whose pool does not fit the GPU: MemoryError on every
    rank naming the bytes, at the first direct call and before anything is
    launched; a buffer of sizes that fit then works."""
    import cupy
    import cupyep
    me = group.local_rank
    free, total = cupy.cuda.runtime.memGetInfo()
    huge = int(total // (group.local_size * 7168 * 2)) + 1  # a slot of more rows of 14 KB than the GPU holds
    tokens, idx, w, x = _inputs(group, 35, 64, 7168)
    xs, ids = cupy.asarray(x), cupy.asarray(idx[me])
    b = cupyep.Buffer(group, max_tokens=huge)
    try:
        with pytest.raises(MemoryError, match=r"dispatch pool needs \d+ bytes") as info:
            b.dispatch(xs, ids, num_experts=NUM_EXPERTS, transport="direct")
        assert "lack the free device memory" in str(info.value)
    finally:
        b.destroy()
    b = cupyep.Buffer(group, max_tokens=64)
    try:
        out = b.dispatch(xs, ids, num_experts=NUM_EXPERTS, transport="direct")
        exp_rows = _expected(group, tokens, idx, w, 7168)[2]
        assert all_ranks(group.comm, np.array_equal(out.recv_x.get(), exp_rows))
    finally:
        b.destroy()


def test_direct_bad_input_raises_before_launch(group, buf):
    import cupy
    from cupyep.normal.direct_kernels import DirectConfig
    x = cupy.zeros((4, 2048), dtype=np.uint16)
    idx = cupy.asarray(np.tile(np.arange(NUM_TOPK, dtype=np.int64), (4, 1)))
    with pytest.raises(ValueError, match="transport must be one of"):
        buf.dispatch(x, idx, num_experts=NUM_EXPERTS, transport="rdma")
    with pytest.raises(ValueError, match="DirectConfig"):
        buf.dispatch(x, idx, num_experts=NUM_EXPERTS, transport="direct", config=buf.default_dispatch_config())
    with pytest.raises(ValueError, match="needs transport='direct'"):
        buf.dispatch(x, idx, num_experts=NUM_EXPERTS, config=DirectConfig())
    with pytest.raises(ValueError, match="num_sms"):
        buf.dispatch(x, idx, num_experts=NUM_EXPERTS, transport="direct", config=DirectConfig(num_sms=-1))
    with pytest.raises(ValueError, match="outside"):
        buf.dispatch(x, idx + NUM_EXPERTS, num_experts=NUM_EXPERTS, transport="direct")
    with pytest.raises(ValueError, match="deadlock"):
        buf.dispatch(x, idx, num_experts=NUM_EXPERTS, transport="direct", config=DirectConfig(num_sms=100000))
    out = buf.dispatch(x, idx, num_experts=NUM_EXPERTS, transport="direct")
    with pytest.raises(ValueError, match="made by the direct transport"):
        buf.dispatch(x, handle=out.handle, transport="queue")
    with pytest.raises(ValueError, match="rows"):
        buf.combine(cupy.zeros((out.recv_x.shape[0] + 1, 2048), dtype=np.uint16), out.handle)
    with pytest.raises(ValueError, match="DirectConfig"):
        buf.combine(out.recv_x, out.handle, config=buf.default_combine_config())
    buf.synchronize()
    group.comm.Barrier()


def test_direct_fault_missing_rank_times_out_naming_it(group):
    """A rank that skips a cached direct dispatch: the others raise
    CommTimeoutError naming the direct dispatch and that rank."""
    import time

    import cupy
    import cupyep
    from cupyep import CommTimeoutError

    if group.local_size < 2:
        pytest.skip("needs two ranks")
    missing = group.node_ranks[-1]
    b = cupyep.Buffer(group)
    try:
        x = cupy.zeros((16, 2048), dtype=np.uint16)
        idx = cupy.asarray(np.tile(np.arange(NUM_TOPK, dtype=np.int64) * 32 % NUM_EXPERTS, (16, 1)))
        out = b.dispatch(x, idx, num_experts=NUM_EXPERTS, transport="direct")
        b.synchronize()
        group.comm.Barrier()
        if group.rank != missing:
            t0 = time.monotonic()
            with pytest.raises(CommTimeoutError) as info:  # validate=False: no host exchange, the kernel's wait
                b.dispatch(x, handle=out.handle, validate=False)
                b.synchronize()
            elapsed = time.monotonic() - t0
            group.error_slot.reset()
            err = info.value
            assert err.kernel == "direct_dispatch" and err.peer == missing, str(err)
            assert elapsed < group.timeout_s + 5, elapsed
        group.comm.Barrier()
    finally:
        b.destroy()


def test_direct_worst_token_overflow_is_an_error(group):
    """More received rows than num_worst_tokens on the direct transport:
    DeviceCapacityError, never a silent drop."""
    import cupy
    import cupyep
    from cupyep import DeviceCapacityError

    me = group.local_rank
    tokens, idx, w, x = _inputs(group, 77, 64, 2048)
    b = cupyep.Buffer(group)
    try:
        b.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), num_experts=NUM_EXPERTS, num_worst_tokens=3,
                   validate=False, transport="direct")
        with pytest.raises(DeviceCapacityError) as info:
            b.synchronize()
        group.error_slot.reset()
        assert info.value.expected == 3 and "num_worst_tokens" in info.value.phase, str(info.value)
        group.comm.Barrier()
    finally:
        b.destroy()


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("transport", ["direct", "queue"])
def test_async_expert_major_dispatch_survives_reuse_on_the_callers_stream(group, buf, transport, cached):
    """An expert-major dispatch with async_finish=True whose kernels are held
    back (the communication stream waits for a GPU sleep) while the caller's
    stream at once allocates and fills arrays of every temporary's size:
    memory the call's kernels still use must not be handed out there. The
    output equals the same dispatch run synchronously. Cached: nothing waits
    on the host, so the caller's fills run before the held-back kernels."""
    import cupy
    from cupyep.lab.bench.timing import gpu_sleep
    tokens, idx, w, x = _inputs(group, 61, 1000, 2048)
    me = group.local_rank
    T, k = len(x), idx[me].shape[1]
    xs, ws = cupy.asarray(x), cupy.asarray(w[me])
    kw = dict(num_experts=NUM_EXPERTS, expert_alignment=8, expert_major=True, transport=transport)
    if cached:  # the reference is a synchronous cached call of the same handle (the bound's rows)
        kw = dict(handle=buf.dispatch(xs, cupy.asarray(idx[me]), ws, **kw).handle, expert_alignment=8,
                  expert_major=True)
    ref_out = buf.dispatch(xs, cupy.asarray(idx[me]), ws, **kw)
    # The rows a cached call lays out end at expert_offsets[E_local]; past it (M_cap is a bound) they are unspecified.
    used = int(ref_out.expert_offsets[-1].get())
    want = {"expert_x": ref_out.expert_x.get()[:used], "expert_src_row": ref_out.expert_src_row.get()}
    del ref_out
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        gpu_sleep(20000)  # 20 ms
        held = cupy.cuda.Event(disable_timing=True)
        held.record(side)
    ids = cupy.asarray(idx[me])  # a fresh copy, dropped by the caller right after the call
    out = buf.dispatch(xs, ids, ws, previous_event=held, async_finish=True, **kw)
    del ids
    junk = [cupy.full(n, -7, dtype=dt) for n, dt in ((T * k, np.int32), (T * k, np.int64), (T * 2, np.int64))]
    cupy.cuda.get_current_stream().wait_event(out.event.event)
    got = {"expert_x": out.expert_x.get()[:used], "expert_src_row": out.expert_src_row.get()}
    group.check_errors()
    same = {key: np.array_equal(got[key], want[key]) for key in want}
    del junk
    assert all_ranks(group.comm, all(same.values())), same
