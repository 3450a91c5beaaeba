"""Normal mode on the GPU, checked against the NumPy reference.

Every rank builds the same seeded global routing, computes its own expected
result with cupyep.reference, and compares: layout and dispatch exactly
(payload rows are hashes of (source rank, token, column)), combine with the
similarity bound of REFERENCE.md, twice for determinism.
"""
import numpy as np
import pytest

from cupyep import reference as ref

from cupyep.fp8 import per_token_cast_to_fp8
from cupyep.reference.intranode import worst_token_rows
from cupyep.testing import all_ranks, bf16_to_f32, global_routing, payload_bf16
from graphs import capture, replay

pytestmark = pytest.mark.gpu
NUM_EXPERTS, NUM_TOPK = 256, 8


@pytest.fixture(scope="module")
def buf(group):
    import cupyep
    b = cupyep.Buffer(group, num_topk=16)
    yield b
    b.destroy()


def _inputs(group, seed, num_tokens, hidden, case="random", zero_rank=None):
    R = group.local_size
    tokens = [0 if r == zero_rank else num_tokens for r in range(R)]
    idx, w = global_routing(seed, tokens, NUM_EXPERTS, NUM_TOPK, case)
    me = group.local_rank
    x = payload_bf16(me, np.arange(tokens[me]), hidden)
    return tokens, idx, w, x


def _expected(group, tokens, idx, w, hidden, expert_alignment=1):
    """This rank's reference dispatch; payload rows rebuilt from (src, token)."""
    ids = [np.arange(t, dtype=np.int32)[:, None] for t in tokens]
    res = ref.intranode_dispatch(ids, idx, NUM_EXPERTS, topk_weights=w, expert_alignment=expert_alignment)
    mine = res[group.local_rank]
    rows = np.empty((mine.num_recv_tokens, hidden), dtype=np.uint16)
    for s in range(group.local_size):
        sel = mine.recv_src_rank == s
        rows[sel] = payload_bf16(s, mine.recv_src_idx[sel], hidden)
    return res, mine, rows


def _received_rows(res, hidden):
    """Every rank's received rows as float32, rebuilt from the (source, token) tags."""
    out = []
    for r in res:
        rows = np.empty((r.num_recv_tokens, hidden), dtype=np.float32)
        for s in np.unique(r.recv_src_rank):
            sel = r.recv_src_rank == s
            rows[sel] = bf16_to_f32(payload_bf16(int(s), r.recv_src_idx[sel], hidden))
        out.append(rows)
    return out


CASES = [
    # (seed, tokens per rank, hidden, routing, rank with zero tokens)
    (1, 256, 2048, "random", None),
    (2, 4096, 7168, "random", None),
    (3, 1, 7168, "random", None),
    (4, 300, 2048, "one_expert", None),
    (5, 200, 2048, "random", 0),
]


@pytest.mark.parametrize("seed,num_tokens,hidden,case,zero_rank", CASES)
def test_dispatch_combine_bf16(group, buf, seed, num_tokens, hidden, case, zero_rank):
    import cupy
    tokens, idx, w, x = _inputs(group, seed, num_tokens, hidden, case, zero_rank)
    me = group.local_rank
    res, exp, exp_rows = _expected(group, tokens, idx, w, hidden, expert_alignment=4)

    lay = buf.get_dispatch_layout(cupy.asarray(idx[me]), NUM_EXPERTS)
    ref_lay = ref.get_dispatch_layout(idx[me], NUM_EXPERTS, group.local_size)
    ok = (np.array_equal(lay.num_tokens_per_rank.get(), ref_lay.num_tokens_per_rank)
          and np.array_equal(lay.num_tokens_per_expert.get(), ref_lay.num_tokens_per_expert)
          and np.array_equal(lay.is_token_in_rank.get(), ref_lay.is_token_in_rank))
    assert all_ranks(group.comm, ok), "layout differs from the reference"

    out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                       num_tokens_per_rank=lay.num_tokens_per_rank, num_tokens_per_expert=lay.num_tokens_per_expert,
                       is_token_in_rank=lay.is_token_in_rank, expert_alignment=4)
    checks = {
        "recv_x": np.array_equal(out.recv_x.get(), exp_rows),
        "recv_topk_idx": np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx),
        "recv_topk_weights": np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights),
        "recv_src_idx": np.array_equal(out.handle.recv_src_idx.get(), exp.recv_src_idx),
        "rank_prefix_matrix": np.array_equal(out.handle.rank_prefix_matrix.get(), exp.rank_prefix_matrix),
        "num_recv_tokens_per_expert": out.num_recv_tokens_per_expert == exp.num_recv_tokens_per_expert,
    }
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}

    # Cached dispatch reuses the handle and must give identical results; its
    # per-expert counts are the handle's routing's, aligned to the cached call's
    # expert_alignment (never an empty list).
    cached = buf.dispatch(cupy.asarray(x), handle=out.handle)
    counts_a1 = _expected(group, tokens, idx, w, hidden, expert_alignment=1)[1].num_recv_tokens_per_expert
    cached_k = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), handle=out.handle,
                            expert_alignment=4)
    checks = {
        "cached recv_x": np.array_equal(cached.recv_x.get(), exp_rows),
        "cached counts": cached.num_recv_tokens_per_expert == counts_a1,
        "cached topk recv_x": np.array_equal(cached_k.recv_x.get(), exp_rows),
        "cached topk recv_topk_idx": np.array_equal(cached_k.recv_topk_idx.get(), exp.recv_topk_idx),
        "cached topk recv_topk_weights": np.array_equal(cached_k.recv_topk_weights.get(), exp.recv_topk_weights),
        "cached topk counts": cached_k.num_recv_tokens_per_expert == exp.num_recv_tokens_per_expert,
    }
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}

    # Combine: identity experts, weighted by a per-row factor, and the top-k weights.
    row_w = (1.0 + (out.handle.recv_src_idx.get() % 3)).astype(np.float32)
    comb = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, row_weights=cupy.asarray(row_w))
    # Reference combine needs every rank's rows: rebuild them from the tags.
    recv = _received_rows(res, x.shape[1])
    weights = [(1.0 + (r.recv_src_idx % 3)).astype(np.float32) for r in res]
    expected = ref.intranode_combine(recv, res, tokens, weights=weights)[me]
    got = bf16_to_f32(comb.combined_x.get())
    diff = ref.calc_diff(got, expected) if got.size else 0.0
    exp_w = ref.intranode_combine_topk_weights(res, tokens)[me]
    wdiff = float(np.abs(comb.combined_topk_weights.get() - exp_w).max()) if exp_w.size else 0.0
    assert all_ranks(group.comm, diff < 5e-6 and wdiff < 1e-6 and not np.isnan(got).any()), (diff, wdiff)

    again = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, row_weights=cupy.asarray(row_w))
    same = np.array_equal(again.combined_x.get(), comb.combined_x.get())
    assert all_ranks(group.comm, same), "combine is not deterministic"


@pytest.mark.parametrize("l2_hints", [0, 1, 2])
def test_l2_modes_top16_async(group, buf, l2_hints):
    """Every L2 mode, top-16 routing, asynchronous completion through events."""
    import cupy
    from dataclasses import replace
    R, me = group.local_size, group.local_rank
    hidden, topk = 2048, 16
    tokens = [777] * R
    idx, w = global_routing(40 + l2_hints, tokens, NUM_EXPERTS, topk)
    x = payload_bf16(me, np.arange(tokens[me]), hidden)
    ids = [np.arange(t, dtype=np.int32)[:, None] for t in tokens]
    res = ref.intranode_dispatch(ids, idx, NUM_EXPERTS, topk_weights=w)
    exp = res[me]
    exp_rows = np.empty((exp.num_recv_tokens, hidden), dtype=np.uint16)
    for s in range(R):
        sel = exp.recv_src_rank == s
        exp_rows[sel] = payload_bf16(s, exp.recv_src_idx[sel], hidden)
    dcfg = replace(buf.default_dispatch_config(), l2_hints=l2_hints)
    ccfg = replace(buf.default_combine_config(), l2_hints=l2_hints)
    out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                       config=dcfg, async_finish=True)
    out.event.current_stream_wait()
    ok = (np.array_equal(out.recv_x.get(), exp_rows) and np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx)
          and np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights)
          and np.array_equal(out.handle.recv_src_idx.get(), exp.recv_src_idx))
    assert all_ranks(group.comm, ok), f"dispatch with l2_hints={l2_hints}, top-{topk} differs from the reference"
    comb = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, config=ccfg, async_finish=True)
    comb.event.current_stream_wait()
    expected = ref.intranode_combine(_received_rows(res, hidden), res, tokens)[me]
    got = bf16_to_f32(comb.combined_x.get())
    diff = ref.calc_diff(got, expected)
    wdiff = float(np.abs(comb.combined_topk_weights.get() - ref.intranode_combine_topk_weights(res, tokens)[me]).max())
    assert all_ranks(group.comm, diff < 5e-6 and wdiff < 1e-6), (l2_hints, diff, wdiff)


def test_dispatch_fp8(group, buf):
    import cupy
    seed, num_tokens, hidden = 7, 512, 7168
    tokens, idx, w, x = _inputs(group, seed, num_tokens, hidden)
    me = group.local_rank
    x_fp8, scales = per_token_cast_to_fp8(cupy.asarray(x))
    # The on-GPU cast is within one e4m3 step of the reference.
    import ml_dtypes
    rq = ref.per_token_cast_to_fp8(x.view(ml_dtypes.bfloat16))
    # Compare in the e4m3 domain (scales equal), where the arithmetic is exact.
    gpu_q = x_fp8.get().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ref_q = rq.data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    cast_ok = np.array_equal(scales.get(), rq.scales) and bool((np.abs(gpu_q - ref_q) <= ref.e4m3_step(ref_q)).all())
    assert all_ranks(group.comm, cast_ok), "GPU FP8 cast differs from the reference by more than one e4m3 step"

    # Payload bytes and scales are carried through exactly.
    all_fp8 = group.comm.allgather((x_fp8.get(), scales.get()))
    res = ref.intranode_dispatch([a for a, _ in all_fp8], idx, NUM_EXPERTS, topk_weights=w,
                                 x_scales=[s for _, s in all_fp8])[me]
    out = buf.dispatch((x_fp8, scales), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS)
    ok = (np.array_equal(out.recv_x.get(), res.recv_x) and np.array_equal(out.recv_x_scales.get(), res.recv_x_scales)
          and np.array_equal(out.recv_topk_idx.get(), res.recv_topk_idx))
    assert all_ranks(group.comm, ok), "FP8 dispatch differs from the reference"


POISON = 0xA5  # garbage byte: int64 / int32 entries that are neither -1 nor ids, float weights that are not 0


def _poison_pool(stream, sizes):
    """Leave garbage where the next allocations on ``stream`` come from: blocks
    of each of ``sizes`` bytes (a few of each), filled with POISON bytes and
    freed back to CuPy's pool."""
    import cupy
    with stream:
        junk = [cupy.full(int(b), POISON, dtype=np.uint8) for b in sizes for _ in range(3)]
        stream.synchronize()
    del junk


def _poison(stream, *arrays):
    """Overwrite ``arrays`` with POISON bytes on ``stream`` (e.g. a graph's outputs before a replay)."""
    import cupy
    for a in arrays:
        cupy.cuda.runtime.memsetAsync(a.data.ptr, POISON, a.nbytes, stream.ptr)


def _worst_rows_checks(out, exp, exp_rows, worst):
    """Name -> bool: a worst-token dispatch against the reference, every row of
    recv_topk_idx / recv_topk_weights / recv_src_idx exactly (padding -1, 0, -1),
    the valid rows of recv_x."""
    pad = worst_token_rows(exp, worst)
    n = exp.num_recv_tokens
    return {
        "shapes": out.recv_x.shape[0] == out.recv_topk_idx.shape[0] == out.handle.recv_src_idx.shape[0] == worst,
        "recv_x": np.array_equal(out.recv_x.get()[:n], exp_rows),
        "recv_topk_idx": np.array_equal(out.recv_topk_idx.get(), pad.recv_topk_idx),
        "recv_topk_weights": np.array_equal(out.recv_topk_weights.get(), pad.recv_topk_weights),
        "recv_src_idx": np.array_equal(out.handle.recv_src_idx.get(), pad.recv_src_idx),
        "rank_prefix_matrix": np.array_equal(out.handle.rank_prefix_matrix.get(), exp.rank_prefix_matrix),
        "counts_none": out.num_recv_tokens_per_expert is None,
    }


def test_worst_tokens_and_cuda_graph(group, buf):
    """Worst-token mode: padding rows hold -1 ids / sources and 0 weights
    whatever the memory held before (a poisoned pool, poisoned graph outputs,
    a cached handle), outside and inside a CUDA graph."""
    import cupy
    seed, num_tokens, hidden = 11, 128, 2048
    R, me = group.local_size, group.local_rank
    worst = num_tokens * R
    stream = cupy.cuda.Stream(non_blocking=True)
    x_in = cupy.empty((num_tokens, hidden), dtype=np.uint16)
    idx_in = cupy.empty((num_tokens, NUM_TOPK), dtype=np.int64)
    w_in = cupy.empty((num_tokens, NUM_TOPK), dtype=np.float32)

    def step():
        out = buf.dispatch(x_in, idx_in, w_in, num_experts=NUM_EXPERTS, num_worst_tokens=worst, validate=False)
        comb = buf.combine(out.recv_x, out.handle)
        return out, comb

    with stream:
        tokens, idx, w, x = _inputs(group, seed, num_tokens, hidden)
        x_in.set(x); idx_in.set(idx[me]); w_in.set(w[me])
        _poison_pool(buf.comm_stream, [worst * NUM_TOPK * 8, worst * NUM_TOPK * 4, worst * 4])
        out, comb = step()  # warm-up outside the graph (also compiles)
        stream.synchronize()
        res, exp, exp_rows = _expected(group, tokens, idx, w, hidden)
        checks = _worst_rows_checks(out, exp, exp_rows, worst)
        assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}

        # Cached dispatch with the worst-token handle: the handle's recv_src_idx is
        # written again (poisoned first), fresh outputs come from a poisoned pool.
        _poison(stream, out.handle.recv_src_idx)
        _poison_pool(buf.comm_stream, [out.recv_topk_idx.nbytes, out.recv_topk_weights.nbytes])
        cached = buf.dispatch(x_in, idx_in, w_in, handle=out.handle)
        stream.synchronize()
        checks = _worst_rows_checks(cached, exp, exp_rows, worst)
        assert all_ranks(group.comm, all(checks.values())), {f"cached {k}": v for k, v in checks.items() if not v}
    graph, (out, comb) = capture(stream, group, step)
    for it in range(3):
        tokens, idx, w, x = _inputs(group, seed + 100 + it, num_tokens, hidden)

        def prepare():
            x_in.set(x); idx_in.set(idx[me]); w_in.set(w[me])
            # The replay must rewrite every padding entry, not inherit them.
            _poison(stream, out.recv_topk_idx, out.recv_topk_weights, out.handle.recv_src_idx)

        replay(stream, group, graph, prepare)
        res, exp, exp_rows = _expected(group, tokens, idx, w, hidden)
        expected = ref.intranode_combine(_received_rows(res, hidden), res, tokens)[me]
        diff = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), expected)
        checks = _worst_rows_checks(out, exp, exp_rows, worst)
        checks["combine"] = diff < 5e-6
        assert all_ranks(group.comm, all(checks.values())), (it, diff, {k: v for k, v in checks.items() if not v})


def test_bad_input_raises_before_launch(group, buf):
    import cupy
    x = cupy.zeros((4, 2048), dtype=np.uint16)
    idx = cupy.zeros((4, NUM_TOPK), dtype=np.int64)
    with pytest.raises(ValueError, match="must be uint16"):
        buf.dispatch(x.astype(np.float32), idx, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="dtype int64"):
        buf.dispatch(x, idx.astype(np.int32), num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="outside"):
        buf.dispatch(x, idx + NUM_EXPERTS, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="outside"):
        buf.dispatch(x, idx - 2, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="divisible"):
        buf.dispatch(x, idx, num_experts=group.local_size * 3 + 1 if group.local_size > 1 else 0)
    with pytest.raises(ValueError, match="multiple of 128"):
        buf.dispatch(cupy.zeros((4, 100), dtype=np.uint16), idx, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="x_scales"):
        buf.dispatch((cupy.zeros((4, 2048), dtype=np.uint8), cupy.zeros((4, 3), dtype=np.float32)), idx,
                     num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="shape"):
        buf.dispatch(x, idx[:, :3].copy(), cupy.zeros((4, NUM_TOPK), dtype=np.float32), num_experts=NUM_EXPERTS)
    out = buf.dispatch(x, idx, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="tokens"):
        buf.dispatch(cupy.zeros((5, 2048), dtype=np.uint16), handle=out.handle)
    with pytest.raises(ValueError, match="rows"):
        buf.combine(cupy.zeros((out.recv_x.shape[0] + 1, 2048), dtype=np.uint16), out.handle)
    with pytest.raises(ValueError, match="hidden=7168|holds"):
        buf.dispatch(cupy.zeros((4, 2048 * 64), dtype=np.uint16), idx, num_experts=NUM_EXPERTS)
    buf.synchronize()
    group.comm.Barrier()


def test_notified_calls_whose_received_rows_grow_shrink_and_jump(group, buf):
    """A notified queue dispatch makes its receive arrays before its counts,
    for the rows the shape's last calls received: routings whose received
    rows change a little and then jump (every token to expert 0: rank 0
    receives more than any guess, the others nothing). Every result, all
    kept alive to the end, matches the reference with exactly N rows."""
    import cupy
    me, H, T = group.local_rank, 1024, 192
    kept = []
    for seed, case in [(11, "random"), (12, "random"), (13, "random"), (14, "one_expert"), (15, "random")]:
        tokens, idx, w, x = _inputs(group, seed, T, H, case)
        out = buf.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=NUM_EXPERTS,
                           transport="queue")
        kept.append((seed, tokens, idx, w, out))
    for seed, tokens, idx, w, out in kept:
        _, exp, exp_rows = _expected(group, tokens, idx, w, H)
        checks = {
            "rows": out.recv_x.shape == (exp.num_recv_tokens, H) and out.recv_topk_idx.shape[0] == exp.num_recv_tokens
            and out.handle.recv_src_idx.shape == (exp.num_recv_tokens,),
            "recv_x": np.array_equal(out.recv_x.get(), exp_rows),
            "recv_topk_idx": np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx),
            "recv_topk_weights": np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights),
            "recv_src_idx": np.array_equal(out.handle.recv_src_idx.get(), exp.recv_src_idx),
        }
        assert all_ranks(group.comm, all(checks.values())), (seed, {k: v for k, v in checks.items() if not v})


def test_fault_missing_rank_times_out_naming_it(group):
    """A rank that never dispatches: the others raise CommTimeoutError naming
    the notify kernel and that rank, within the timeout, with no hang."""
    import time

    import cupy
    import cupyep
    from cupyep import CommTimeoutError

    if group.local_size < 2:
        pytest.skip("needs two ranks")
    missing = group.node_ranks[-1]
    b = cupyep.Buffer(group)
    try:
        if group.rank != missing:
            x = cupy.zeros((16, 2048), dtype=np.uint16)
            idx = cupy.asarray(np.tile(np.arange(NUM_TOPK, dtype=np.int64), (16, 1)))
            t0 = time.monotonic()
            with pytest.raises(CommTimeoutError) as info:  # validate=False: no host exchange, the kernel's wait
                b.dispatch(x, idx, num_experts=NUM_EXPERTS, validate=False)
            elapsed = time.monotonic() - t0
            group.error_slot.reset()
            err = info.value
            assert err.kernel == "notify" and err.peer == missing and err.rank == group.rank, str(err)
            assert elapsed < group.timeout_s + 5, elapsed
        group.comm.Barrier()
    finally:
        b.destroy()


def test_fault_worst_token_overflow_is_an_error(group):
    """More received rows than num_worst_tokens: DeviceCapacityError, never a silent drop."""
    import cupy
    import cupyep
    from cupyep import DeviceCapacityError

    me = group.local_rank
    tokens, idx, w, x = _inputs(group, 77, 64, 2048)
    b = cupyep.Buffer(group)
    try:
        b.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), num_experts=NUM_EXPERTS, num_worst_tokens=3,
                   validate=False)
        with pytest.raises(DeviceCapacityError) as info:
            b.synchronize()
        group.error_slot.reset()
        assert info.value.kernel == "notify" and info.value.expected == 3, str(info.value)
        assert "num_worst_tokens" in info.value.phase, str(info.value)
        group.comm.Barrier()
    finally:
        b.destroy()


def test_fault_device_finds_bad_expert_id(group):
    """validate=False with an expert id out of range: the layout kernel reports
    DeviceInputError naming the id; nothing is launched after it."""
    import cupy
    import cupyep
    from cupyep import DeviceInputError

    b = cupyep.Buffer(group)
    try:
        x = cupy.zeros((8, 2048), dtype=np.uint16)
        idx = np.tile(np.arange(NUM_TOPK, dtype=np.int64), (8, 1))
        idx[5, 2] = NUM_EXPERTS + 7
        with pytest.raises(DeviceInputError) as info:
            b.dispatch(x, cupy.asarray(idx), num_experts=NUM_EXPERTS, validate=False)
        group.error_slot.reset()
        assert info.value.kernel == "layout" and "expert id" in info.value.phase, str(info.value)
        assert info.value.value == NUM_EXPERTS + 7 and info.value.expected == NUM_EXPERTS, str(info.value)
        group.comm.Barrier()
    finally:
        b.destroy()
