"""The two-hop dispatch across (emulated) nodes against the one-node oracle,
and its notify pass against the reference plan:
every rank receives, row for row, what cupyep.reference.intranode_dispatch
gives it over all ranks: payload bytes tagged by (source rank, token), the
source index and rank of every row, local top-k ids and weights. Runs when
the ranks form at least two nodes (python3 -m cupyep.launcher.gpu_tests --ranks 4 8
--ranks-per-node 2 -k two_hop) and nvshmem4py is installed."""
import dataclasses

import numpy as np
import pytest

from cupyep import reference as ref

from cupyep.testing import all_ranks, bf16_to_f32, global_routing, payload_bf16
from graphs import capture, replay

pytestmark = pytest.mark.gpu
E, K_TOPK, H, T_MAX = 64, 8, 2048, 256


@pytest.fixture(scope="module", params=["two_hop", "direct"])
def two_hop(request, group, nvshmem_session):
    """A TwoHopDispatch of each route: every test that takes it runs on the
    two-hop route (node dedup, forwarding) and on the direct one (each row put
    straight into its final row)."""
    if group.num_nodes < 2:
        pytest.skip("needs ranks on two or more nodes (--ranks-per-node)")
    from cupyep.normal.internode_kernels import TwoHopDispatch
    d = TwoHopDispatch(group, T_MAX, H, K_TOPK, E, route=request.param)
    yield d
    d.destroy()


def _tagged_rows(result, offset: int = 0):
    """[N, H] uint16: what a rank received (its intranode_dispatch result),
    rebuilt from the payload tags (source rank, source token + offset)."""
    rows = np.empty((result.num_recv_tokens, H), dtype=np.uint16)
    for s in np.unique(result.recv_src_rank):
        sel = result.recv_src_rank == s
        rows[sel] = payload_bf16(int(s), result.recv_src_idx[sel] + offset, H)
    return rows


def _routed(group, seed: int, num_tokens: int):
    """(tokens, idx, w, res): every rank's num_tokens, the seeded routing and
    the one-node oracle's results of every rank."""
    tokens = [num_tokens] * group.world_size
    idx, w = global_routing(seed, tokens, E, K_TOPK)
    res = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, E, topk_weights=w)
    return tokens, idx, w, res


def _received_f32(res):
    """Every rank's received rows (identity experts) as float32, for the exact combine."""
    return [bf16_to_f32(_tagged_rows(r)) for r in res]


@pytest.mark.parametrize("seed,num_tokens,zero_rank", [(1, 256, None), (2, 100, 1), (3, 1, None), (4, 256, 0)])
def test_two_hop_dispatch_matches_the_one_node_dispatch(group, two_hop, seed, num_tokens, zero_rank):
    import cupy
    R, me = group.world_size, group.rank
    tokens = [0 if r == zero_rank else num_tokens for r in range(R)]
    idx, w = global_routing(seed, tokens, E, K_TOPK)
    exp = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, E, topk_weights=w)[me]
    x = payload_bf16(me, np.arange(tokens[me]), H)
    for call in range(2):  # the counters are cumulative: a second call must land the same
        out = two_hop.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]))
        rows = _tagged_rows(exp)
        checks = {
            "recv_x": np.array_equal(out.recv_x.get(), rows),
            "recv_src_idx": np.array_equal(out.recv_src_idx.get(), exp.recv_src_idx),
            "recv_src_rank": np.array_equal(out.recv_src_rank.get(), exp.recv_src_rank),
            "recv_topk_idx": np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx),
            "recv_topk_weights": np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights),
            "rank_prefix_matrix": np.array_equal(out.rank_prefix_matrix.get(), exp.rank_prefix_matrix),
        }
        assert all_ranks(group.comm, all(checks.values())), (call, {k: v for k, v in checks.items() if not v})


@pytest.mark.parametrize("rdma_chunk,nvlink_chunk", [(3, 1), (64, 4), (1000, 1000)])
def test_the_chunk_knobs_keep_every_row(group, two_hop, rdma_chunk, nvlink_chunk):
    """Chunks of network rows per put (rdma_chunk) and per forwarding warp
    (nvlink_chunk), down to one put and one warp per node: the same rows as
    the one-node dispatch, and the combine of them as exact as with chunks of 1."""
    import cupy
    me = group.rank
    tokens, idx, w, res = _routed(group, 21 + rdma_chunk, 200)
    x = cupy.asarray(payload_bf16(me, np.arange(tokens[me]), H))
    try:
        two_hop.rdma_chunk, two_hop.nvlink_chunk = rdma_chunk, nvlink_chunk
        out = two_hop.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]))
        exp = res[me]
        ok = (np.array_equal(out.recv_x.get(), _tagged_rows(exp))
              and np.array_equal(out.recv_src_idx.get(), exp.recv_src_idx)
              and np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx)
              and np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights))
        combined = bf16_to_f32(two_hop.combine(out.recv_x.copy(), out.handle).get())
        exact = ref.intranode_combine(_received_f32(res), res, tokens)[me]
        ok = ok and ref.calc_diff(combined, exact) < 5e-6
    finally:
        two_hop.rdma_chunk, two_hop.nvlink_chunk = 1, 1
    assert all_ranks(group.comm, ok), (rdma_chunk, nvlink_chunk)


@pytest.mark.parametrize("seed,num_tokens,zero_rank", [(11, 256, None), (12, 37, 1)])
def test_the_device_notify_computes_the_reference_plan(group, two_hop, seed, num_tokens, zero_rank):
    """The notify pass across nodes, on the device: send_head, the network
    slots, rank_prefix_matrix and the rows per source node in this rank's
    network buffer equal cupyep.reference.internode.two_hop_plan's; a
    dispatch moves its own cumulative targets by this call's counts and
    records the combine's steps without taking them."""
    import cupy
    from cupyep.normal import internode_kernels as INTER
    from cupyep.reference import internode as I
    from cupyep.reference.layout import get_dispatch_layout
    R, me, K = group.world_size, group.rank, group.local_size
    N, own, local = R // K, me // K, me % K
    tokens = [0 if r == zero_rank else num_tokens for r in range(R)]
    idx, w = global_routing(seed, tokens, E, K_TOPK)
    plan = I.two_hop_plan(idx, E, R, K)
    counts = np.stack([get_dispatch_layout(i, E, R, K).num_tokens_per_rank for i in idx]).astype(np.int64)
    node_counts = np.stack([get_dispatch_layout(i, E, R, K).num_tokens_per_node for i in idx]).astype(np.int64)
    before = two_hop.state.get()
    x = payload_bf16(me, np.arange(tokens[me]), H)
    out = two_hop.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]))
    after = two_hop.state.get()
    dev = {k: v.get() for k, v in out.handle.plan.items()}
    T = tokens[me]
    net_count = np.array([0 if m == own else node_counts[m * K + local, own] for m in range(N)])
    sl = INTER.state_slices(R, K)
    delta = {name: after[s_] - before[s_] for name, s_ in sl.items()}
    combine_steps = {
        # direct rows in, then the gather rows each rank j of my node got from my rail sources
        "combine_total": np.array([counts[me, own * K:(own + 1) * K].sum()] +
                                  [sum(counts[m * K + local, own * K + j] for m in range(N) if m != own)
                                   for j in range(K)]),
        "combine_net_total": np.array([0 if m == own else node_counts[me, m] for m in range(N)]),
        # the direct route's: rows back from each rank of another node
        "combine_rank_total": np.array([0 if d // K == own else counts[me, d] for d in range(R)]),
    }
    # A dispatch moves its own targets; the combine's move when a combine runs (from the handle's steps).
    want_delta = {"calls": np.array([1]), "net_total": net_count, "arrived_total": counts[:, me],
                  "combine_total": np.zeros(1 + K, np.int64), "combine_net_total": np.zeros(N, np.int64),
                  "combine_rank_total": np.zeros(R, np.int64)}
    steps = out.handle.delta.get()
    want_steps = np.concatenate([net_count, counts[:, me], combine_steps["combine_total"],
                                 combine_steps["combine_net_total"], combine_steps["combine_rank_total"]])
    checks = {
        "send_head": np.array_equal(dev["head"][:T], plan.send_head[me]),
        "rdma_slot": np.array_equal(dev["slot"][:T], plan.rdma_slot[me]),
        "rank_prefix": np.array_equal(dev["rpm"], plan.rank_prefix_matrix),
        "net_count": np.array_equal(dev["net_count"], net_count) and int(net_count.sum()) == int(plan.rdma_rows[me]),
        **{f"state {k}": np.array_equal(delta[k], want_delta[k]) for k in want_delta},
        "state ok": int(after[sl["ok"]][0]) == 1,
        "steps": np.array_equal(steps, want_steps),
    }
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}


def test_fp8_rows_travel_with_their_scales(group, two_hop):
    """An FP8 dispatch (uint8 rows, float32 scales per 128 channels, as a
    tuple) lands every source's bytes and scales where the one-node oracle
    puts them, counted and cached; the combine after it (BF16 expert
    outputs) reads the FP8 rows' metadata at its own offset and is within
    5e-6 of the exact combine. Scales without FP8 rows, FP8 rows without
    scales raise before launch."""
    import cupy
    from cupyep.fp8 import per_token_cast_to_fp8
    R, me = group.world_size, group.rank
    T = 120
    tokens, idx, w, res = _routed(group, 71, T)
    exp = res[me]
    fp8 = [tuple(a.get() for a in per_token_cast_to_fp8(cupy.asarray(payload_bf16(s_, np.arange(T), H))))
           for s_ in range(R)]  # every source's FP8 rows and scales, by token
    want_x = np.empty((exp.num_recv_tokens, H), np.uint8)
    want_s = np.empty((exp.num_recv_tokens, H // 128), np.float32)
    for s_ in range(R):
        sel = exp.recv_src_rank == s_
        want_x[sel], want_s[sel] = fp8[s_][0][exp.recv_src_idx[sel]], fp8[s_][1][exp.recv_src_idx[sel]]
    xq = (cupy.asarray(fp8[me][0]), cupy.asarray(fp8[me][1]))
    checks = {}
    out = two_hop.dispatch(xq, cupy.asarray(idx[me]), cupy.asarray(w[me]))
    for name, o in (("counted", out), ("cached", None)):
        if o is None:
            o = two_hop.dispatch(xq, handle=out.handle, topk_weights=cupy.asarray(w[me]))
        checks[f"{name} x"] = o.recv_x.dtype == np.uint8 and np.array_equal(o.recv_x.get(), want_x)
        checks[f"{name} scales"] = np.array_equal(o.recv_x_scales.get(), want_s)
        checks[f"{name} src_idx"] = np.array_equal(o.recv_src_idx.get(), exp.recv_src_idx)
    got = two_hop.combine(cupy.asarray(_tagged_rows(exp)), out.handle).get()
    exact = ref.intranode_combine(_received_f32(res), res, tokens)[me]
    checks["combine"] = ref.calc_diff(bf16_to_f32(got), exact) < 5e-6
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}
    with pytest.raises(ValueError, match="x_scales"):
        two_hop.dispatch(cupy.asarray(payload_bf16(me, np.arange(T), H)), cupy.asarray(idx[me]),
                         cupy.asarray(w[me]), x_scales=xq[1])
    with pytest.raises(ValueError, match="x_scales"):
        two_hop.dispatch(xq[0], cupy.asarray(idx[me]), cupy.asarray(w[me]))
    group.comm.Barrier()


def test_two_hop_bad_input_raises_before_launch(group, two_hop):
    import cupy
    x = cupy.zeros((T_MAX + 1, H), dtype=np.uint16)
    with pytest.raises(ValueError, match="at most"):
        two_hop.dispatch(x, cupy.zeros((T_MAX + 1, K_TOPK), np.int64), cupy.zeros((T_MAX + 1, K_TOPK), np.float32))
    bad = cupy.full((4, K_TOPK), E, dtype=np.int64)
    with pytest.raises(ValueError, match="topk_idx"):
        two_hop.dispatch(cupy.zeros((4, H), np.uint16), bad, cupy.zeros((4, K_TOPK), np.float32))
    group.comm.Barrier()


@pytest.mark.parametrize("seed,num_tokens,zero_rank", [(5, 256, None), (6, 64, 1)])
def test_two_hop_combine_is_bitwise_the_emulation(group, two_hop, seed, num_tokens, zero_rank):
    """The combine's result equals, bit for bit, the emulation of its
    reduction order (cupyep.reference.internode.emulate_two_hop_combine with
    BF16 partials; for the direct route, the FP32 sum over ranks in rank
    order, which is that emulation with nodes of one rank), and is within
    5e-6 of the exact combine."""
    import cupy
    import ml_dtypes
    from cupyep.reference import internode as I
    from cupyep.testing import f32_to_bf16
    R, me, K = group.world_size, group.rank, group.local_size
    tokens = [0 if r == zero_rank else num_tokens for r in range(R)]
    idx, w = global_routing(seed, tokens, E, K_TOPK)
    res = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, E, topk_weights=w)

    ys = [f32_to_bf16(bf16_to_f32(_tagged_rows(res[d])) * np.float32((d % 5 + 1) / 3))  # per-rank experts
          for d in range(R)]
    x = payload_bf16(me, np.arange(tokens[me]), H)
    out = two_hop.dispatch(cupy.asarray(x), cupy.asarray(idx[me]), cupy.asarray(w[me]))
    got = two_hop.combine(cupy.asarray(ys[me]), out.handle).get()
    emul = I.emulate_two_hop_combine([bf16_to_f32(y) for y in ys], res, tokens, 1 if two_hop.direct else K,
                                     partial_dtype=ml_dtypes.bfloat16)
    exact = ref.intranode_combine([bf16_to_f32(y) for y in ys], res, tokens)
    want = f32_to_bf16(emul[me])
    diff = ref.calc_diff(bf16_to_f32(got), exact[me]) if got.size else 0.0
    ok = got.shape == (tokens[me], H) and np.array_equal(got, want) and diff < 5e-6
    assert all_ranks(group.comm, ok), (diff, int((got != want).sum()))


def _oracle_rows(group, tokens, idx, w):
    """(this rank's oracle result, its rows rebuilt from the (source, token) tags)."""
    exp = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, E,
                                 topk_weights=w)[group.rank]
    return exp, _tagged_rows(exp)


def _worst_checks(out, exp, rows) -> dict:
    """The first rows are the oracle's; every row after them is padding."""
    n = exp.num_recv_tokens
    got = {k: getattr(out, k).get() for k in ("recv_x", "recv_src_idx", "recv_src_rank", "recv_topk_idx",
                                               "recv_topk_weights")}
    return {
        "rows": np.array_equal(got["recv_x"][:n], rows),
        "src_idx": np.array_equal(got["recv_src_idx"][:n], exp.recv_src_idx),
        "src_rank": np.array_equal(got["recv_src_rank"][:n], exp.recv_src_rank),
        "topk_idx": np.array_equal(got["recv_topk_idx"][:n], exp.recv_topk_idx),
        "topk_weights": np.array_equal(got["recv_topk_weights"][:n], exp.recv_topk_weights),
        "padding": bool((got["recv_src_idx"][n:] == -1).all() and (got["recv_src_rank"][n:] == -1).all()
                        and (got["recv_topk_idx"][n:] == -1).all() and (got["recv_topk_weights"][n:] == 0).all()),
    }


def test_a_cached_dispatch_reuses_the_plan(group, two_hop):
    """dispatch(x, handle=h, topk_weights=w) with new rows and weights lands
    them where the counted call put its rows, against the oracle; its combine
    equals a counted call's on the same rows bitwise; a handle of another
    object, a topk_idx beside a handle and a different token count raise
    before launch."""
    import cupy
    R, me = group.world_size, group.rank
    T = 150
    tokens = [T] * R
    idx, w = global_routing(61, tokens, E, K_TOPK)
    first = two_hop.dispatch(cupy.asarray(payload_bf16(me, np.arange(T), H)), cupy.asarray(idx[me]),
                             cupy.asarray(w[me]))
    h = first.handle
    w2 = (w[me] * 0.5).astype(np.float32)
    x2 = cupy.asarray(payload_bf16(me, np.arange(T) + 1000, H))  # other rows: the tags of tokens + 1000
    out = two_hop.dispatch(x2, handle=h, topk_weights=cupy.asarray(w2))
    cached_comb = two_hop.combine(out.recv_x.copy(), out.handle).get()
    exp = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, E,
                                 topk_weights=[(wi * 0.5).astype(np.float32) for wi in w])[me]
    rows = _tagged_rows(exp, offset=1000)
    checks = {
        "recv_x": np.array_equal(out.recv_x.get(), rows),
        "recv_src_idx": np.array_equal(out.recv_src_idx.get(), exp.recv_src_idx),
        "recv_topk_weights": np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights),
        "handle": out.handle is h,
    }
    counted = two_hop.dispatch(x2, cupy.asarray(idx[me]), cupy.asarray(w2))
    checks["combine"] = np.array_equal(two_hop.combine(counted.recv_x.copy(), counted.handle).get(), cached_comb)
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}
    with pytest.raises(ValueError, match="topk_idx=None"):
        two_hop.dispatch(x2, cupy.asarray(idx[me]), cupy.asarray(w2), handle=h)
    with pytest.raises(ValueError, match="tokens"):
        two_hop.dispatch(x2[:T - 1], handle=h, topk_weights=cupy.asarray(w2[:T - 1]))
    with pytest.raises(ValueError, match="made by this"):
        two_hop.dispatch(x2, handle=dataclasses.replace(h, owner=0), topk_weights=cupy.asarray(w2))
    group.comm.Barrier()


def test_worst_token_calls_pad_and_replay_in_a_cuda_graph(group, two_hop):
    """num_worst_tokens: the outputs hold that many rows, the received ones
    the oracle's and the rest padding, written again after being poisoned;
    the combine equals the eager (counted) call's bitwise. The same dispatch
    and combine captured in a CUDA graph and replayed with new routings
    (written into the captured inputs) give the oracle's rows each time, with
    nothing read back on the host."""
    import cupy
    R, me = group.world_size, group.rank
    T, worst = 200, group.world_size * T_MAX
    x_in = cupy.empty((T, H), dtype=np.uint16)
    idx_in = cupy.empty((T, K_TOPK), dtype=np.int64)
    w_in = cupy.empty((T, K_TOPK), dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)

    def step():
        out = two_hop.dispatch(x_in, idx_in, w_in, num_worst_tokens=worst, validate=False)
        return out, two_hop.combine(out.recv_x, out.handle)

    def load(seed):
        tokens = [T] * R
        idx, w = global_routing(seed, tokens, E, K_TOPK)
        x_in.set(payload_bf16(me, np.arange(T), H))
        idx_in.set(idx[me])
        w_in.set(w[me])
        return tokens, idx, w

    with stream:
        tokens, idx, w = load(21)
        exp, rows = _oracle_rows(group, tokens, idx, w)
        counted = two_hop.dispatch(x_in, idx_in, w_in)
        eager_comb = two_hop.combine(counted.recv_x, counted.handle).get()
        out, comb = step()
        stream.synchronize()
        from cupyep.normal.internode_kernels import slot_layout
        src = two_hop.pool.view(slot_layout(two_hop._lay, out.lease.slot, two_hop.slot_bytes)["src"], (worst,),
                                np.int32)  # the slot's sources (the handle keeps a copy)
        for arr, junk in ((out.recv_topk_idx, 5), (out.recv_topk_weights, 3.0), (src, 9)):
            arr[...] = junk  # the padding must be written again
        stream.synchronize()
        group.comm.Barrier()
        for _ in range(two_hop.slots.num_in_flight):  # the last lands in the poisoned slot again
            out, comb = step()
        stream.synchronize()
        group.check_errors()
        checks = _worst_checks(out, exp, rows)
        checks["combine"] = np.array_equal(comb.get(), eager_comb)
        assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}
    graph, (gout, gcomb) = capture(stream, group, step)
    for it in range(3):
        loaded = []
        replay(stream, group, graph, lambda: loaded.append(load(30 + it)))
        tokens, idx, w = loaded[0]
        exp, rows = _oracle_rows(group, tokens, idx, w)
        visits = ref.get_dispatch_layout(idx[me], E, R).is_token_in_rank.sum(axis=1)[:, None]
        want = bf16_to_f32(payload_bf16(me, np.arange(T), H)) * visits  # identity experts: row x ranks visited
        checks = _worst_checks(gout, exp, rows)
        checks["combine"] = ref.calc_diff(bf16_to_f32(gcomb.get()), want.astype(np.float32)) < 5e-6
        assert all_ranks(group.comm, all(checks.values())), (it, {k: v for k, v in checks.items() if not v})
    group.comm.Barrier()


def test_worst_token_capacity_is_checked(group, two_hop):
    """More rows than the pool can hold is a ValueError before launch. More
    rows for one rank to receive than its num_worst_tokens is one verdict on
    every rank: a DeviceCapacityError (on that rank naming no peer, on the
    others naming it), nothing is sent and no target moves, so the next call
    lands. An expert id out of range that the host did not check is a
    DeviceInputError on its rank; the pair is dropped and every other rank
    receives what the oracle gives without it. Both run on a TwoHopDispatch
    of their own."""
    import cupy
    from cupyep.errors import DeviceCapacityError, DeviceInputError
    from cupyep.normal.internode_kernels import TwoHopDispatch
    R, me = group.world_size, group.rank
    with pytest.raises(ValueError, match="num_worst_tokens"):
        two_hop.dispatch(cupy.zeros((4, H), np.uint16), cupy.zeros((4, K_TOPK), np.int64),
                         cupy.zeros((4, K_TOPK), np.float32), num_worst_tokens=R * T_MAX + 1)
    small = TwoHopDispatch(group, 64, H, K_TOPK, E)
    try:
        tokens, idx, w, _ = _routed(group, 41, 64)  # rank 0 receives far more than 2 rows
        x = cupy.asarray(payload_bf16(me, np.arange(64), H))
        small.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]), num_worst_tokens=2 if me == 0 else R * 64)
        cupy.cuda.runtime.deviceSynchronize()
        with pytest.raises(DeviceCapacityError) as info:
            group.check_errors()
        ok = ("capacity" in str(info.value) and info.value.expected == 2
              and info.value.peer == (None if me == 0 else 0))
        group.error_slot.reset()
        # An expert id past E with validate=False: the notify drops that pair and reports it on its rank.
        bad = [i.copy() for i in idx]
        bad[0][0, 0] = E + 3
        if me == 0:
            with pytest.raises(DeviceInputError) as info:
                small.dispatch(x, cupy.asarray(bad[0]), cupy.asarray(w[0]), validate=False)
            ok = ok and info.value.value == E + 3 and "routing check" in str(info.value)
            group.error_slot.reset()
        else:
            out = small.dispatch(x, cupy.asarray(bad[me]), cupy.asarray(w[me]), validate=False)
            dropped = [i.copy() for i in idx]
            dropped[0][0, 0] = -1
            exp = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], dropped, E,
                                         topk_weights=w)[me]
            ok = ok and np.array_equal(out.recv_x.get(), _tagged_rows(exp)) and np.array_equal(
                out.recv_topk_idx.get(), exp.recv_topk_idx)
    finally:
        group.comm.Barrier()
        small.destroy()
    assert all_ranks(group.comm, ok)


@pytest.mark.parametrize("transport", [None, "direct"])
def test_cupyep_buffer_across_nodes_is_the_two_hop_mode(group, nvshmem_session, transport):
    """cupyep.Buffer(group) across nodes, on the two-hop route (transport
    None) and the direct one: the intranode calls (dispatch with
    num_experts, expert_alignment's per-expert counts, combine of the rows
    with the handle, unweighted and with row_weights, and the top-k weights
    combined back) give the one-node oracle's rows and counts, combines
    within 5e-6 of the exact ones and the weights exactly; an expert-major
    combine after a rank-major dispatch and a cached dispatch on the other
    route than its handle's raise before launch."""
    import cupy

    import cupyep
    from cupyep.normal.internode import InternodeRoute
    if group.num_nodes < 2:
        pytest.skip("needs ranks on two or more nodes (--ranks-per-node)")
    R, me = group.world_size, group.rank
    T = 90
    tokens, idx, w, res = _routed(group, 81, T)
    exp = res[me]
    with cupyep.Buffer(group) as buf:
        assert all(isinstance(r, InternodeRoute) for r in buf.routes.values())
        x = cupy.asarray(payload_bf16(me, np.arange(T), H))
        out = buf.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=E, expert_alignment=4,
                           transport=transport)
        rows = _tagged_rows(exp)
        counts = np.bincount(exp.recv_topk_idx[exp.recv_topk_idx >= 0], minlength=E // R)
        checks = {
            "recv_x": np.array_equal(out.recv_x.get(), rows),
            "recv_topk_idx": np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx),
            "recv_topk_weights": np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights),
            "per_expert": out.num_recv_tokens_per_expert == [int(-(-c // 4) * 4) for c in counts],
        }
        comb = buf.combine(out.recv_x.copy(), out.handle)
        ys = _received_f32(res)
        exact = ref.intranode_combine(ys, res, tokens)[me]
        checks["combine"] = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), exact) < 5e-6
        # Weighted: row r of rank d by (1 + r % 3) / 2, against the exact weighted sum.
        wts = [((1.0 + np.arange(r.num_recv_tokens) % 3) / 2).astype(np.float32) for r in res]
        out = buf.dispatch(x, cupy.asarray(idx[me]), cupy.asarray(w[me]), num_experts=E, transport=transport)
        comb = buf.combine(out.recv_x.copy(), out.handle, out.recv_topk_weights, row_weights=cupy.asarray(wts[me]))
        exact_w = ref.intranode_combine(ys, res, tokens, weights=wts)[me]
        checks["weighted combine"] = ref.calc_diff(bf16_to_f32(comb.combined_x.get()), exact_w) < 5e-6
        # The top-k weights back: every slot's weight from its expert's rank, 0 for a -1 slot, exactly.
        checks["topk weights"] = np.array_equal(comb.combined_topk_weights.get(),
                                                ref.intranode_combine_topk_weights(res, tokens)[me])
        assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}
        with pytest.raises(ValueError, match="expert_major=True needs a handle"):
            buf.combine(out.recv_x.copy(), out.handle, expert_major=True)  # its dispatch was rank-major
        with pytest.raises(ValueError, match="the handle was made by the .* transport, not"):
            buf.dispatch(x, handle=out.handle, transport="queue" if transport == "direct" else "direct")
        group.comm.Barrier()


@pytest.mark.parametrize("alignment", [128, 1])
@pytest.mark.parametrize("rule", [None, "nearest"])
def test_the_moe_layer_runs_across_nodes(group, nvshmem_session, alignment, rule):
    """cupyep.moe.MoELayer on cupyep.Buffer(group) across nodes (expert-major
    dispatch, the FFN over the blocks, the expert-major combine) against the
    single-process layer on all ranks' tokens: calc_diff and the worst
    token's error within cupyep.moe's bounds, no NaN; twice the same bits.
    ``rule``: with replicated experts (a hierarchical placement planned from
    skewed loads), each slot to the replica the rule picks."""
    import cupy

    import cupyep
    from cupyep import moe

    from cupyep.testing import f32_to_bf16
    if group.num_nodes < 2:
        pytest.skip("needs ranks on two or more nodes (--ranks-per-node)")
    R, me = group.world_size, group.rank
    Hm, F, T = 1024, 256, 128
    w = moe.MoEWeights.random(2026, Hm, F, E)
    weights = moe.MoEWeights(cupy.asarray(w.router), cupy.asarray(w.w1), cupy.asarray(w.w2))
    xs = [f32_to_bf16(np.random.default_rng([7, r]).standard_normal((T, Hm), dtype=np.float32)) for r in range(R)]
    group.comm.Barrier()
    placement = None
    if rule is not None:
        from cupyep.balance import rebalance_experts
        load = np.ones((1, E))
        load[0, :2] = [30.0, 12.0]
        placement = rebalance_experts(load, E + 2 * R, group.num_nodes, group.num_nodes, R).layer(0)
    with cupyep.Buffer(group) as buf:
        layer = moe.MoELayer(buf, weights, K_TOPK, expert_alignment=alignment, placement=placement,
                             rule=rule or "round_robin")
        got = layer.forward(cupy.asarray(xs[me])).get()
        again = layer.forward(cupy.asarray(xs[me])).get()
        group.comm.Barrier()
    plain = moe.reference_forward(cupy.asarray(np.concatenate(xs)), weights, K_TOPK)[me * T:(me + 1) * T].get()
    d, worst = moe.agreement(got, plain)
    ok = (got.shape == (T, Hm) and not np.isnan(bf16_to_f32(got)).any() and np.array_equal(got, again)
          and d < moe.MOE_CALC_DIFF_BOUND and worst < moe.MOE_TOKEN_BOUND)
    assert all_ranks(group.comm, ok), {"rank": me, "calc_diff": d, "worst token": worst}


def test_kernel_stamps_bound_each_kernel_inside_its_events(group, two_hop):
    """kernel_ns / notify_ns: the dispatch, notify and combine kernels write
    their first block start and last block end; each span is positive and
    inside the CUDA events around the kernel; the results are those of a
    call without stamps; a stamps array of the wrong dtype or shape is a
    ValueError before anything is launched."""
    import cupy
    from cupyep.lab.bench.stamps import kernel_seconds, new_kernel_stamps
    me = group.rank
    idx, w = global_routing(9, [200] * group.world_size, E, K_TOPK)
    x, ids, ws = cupy.asarray(payload_bf16(me, np.arange(200), H)), cupy.asarray(idx[me]), cupy.asarray(w[me])
    plain = two_hop.dispatch(x, ids, ws).recv_x.get()
    st = new_kernel_stamps(3)
    out = two_hop.dispatch(x, ids, ws, kernel_ns=st[0], notify_ns=st[1])
    events = [two_hop.last_kernel_us, two_hop.last_notify_us]
    same = np.array_equal(out.recv_x.get(), plain)
    two_hop.combine(out.recv_x.copy(), out.handle, kernel_ns=st[2])
    events.append(two_hop.last_kernel_us)
    us = kernel_seconds(st.get()) * 1e6
    ok = same and all(0 < u <= e + 2.0 for u, e in zip(us, events))
    assert all_ranks(group.comm, ok), {"same": same, "kernel_us": us.tolist(), "event_us": events}
    for bad in (cupy.zeros(2, dtype=np.uint64), cupy.zeros((1, 2), dtype=np.int64)):
        with pytest.raises(ValueError, match="kernel_ns"):
            two_hop.dispatch(x, ids, ws, kernel_ns=bad)
        with pytest.raises(ValueError, match="notify_ns"):
            two_hop.dispatch(x, ids, ws, notify_ns=bad)
    group.comm.Barrier()


def test_hop_stamps_delimit_every_hop(group, two_hop):
    """With hop_ns the kernels stamp every hop: each duration is written,
    non-negative and below the whole kernel's (the direct route has no
    forwarding hop: None); the results are those of a
    call without stamps (the metric changes nothing else)."""
    import cupy
    from cupyep.normal import internode_kernels as INTER
    from cupyep.lab.metrics import two_hop_metrics
    me = group.rank
    idx, w = global_routing(8, [200] * group.world_size, E, K_TOPK)
    x, ids, ws = cupy.asarray(payload_bf16(me, np.arange(200), H)), cupy.asarray(idx[me]), cupy.asarray(w[me])
    plain = two_hop.dispatch(x, ids, ws).recv_x.get()
    stamps = cupy.asarray(np.array(INTER.HOP_STAMPS_INIT, dtype=np.uint64))
    out = two_hop.dispatch(x, ids, ws, hop_ns=stamps)
    d = INTER.hop_times_us(stamps.get(), INTER.DISPATCH_HOPS)
    same = np.array_equal(out.recv_x.get(), plain)
    stamps = cupy.asarray(np.array(INTER.HOP_STAMPS_INIT, dtype=np.uint64))
    two_hop.combine(out.recv_x.copy(), out.handle, hop_ns=stamps)
    c = INTER.hop_times_us(stamps.get(), INTER.COMBINE_HOPS)
    # the direct route forwards nothing: its forward hop is None
    forward = d.pop("forward")
    timed = [*d.values(), *c.values(), *([] if two_hop.direct else [forward])]
    ok = same and (forward is None) == two_hop.direct and all(v is not None and 0 <= v < 1e6 for v in timed)
    ok = ok and d["network"] <= d["total"] and abs(c["node"] + c["network"] + c["reduce"] - c["total"]) < 1e-6
    assert all_ranks(group.comm, ok), (same, forward, d, c)
    m = two_hop_metrics(group, two_hop, x, ids, ws, calls=3)
    timed = [v for part in m.values() for k, v in part.items() if k != "forward" or not two_hop.direct]
    ok = set(m["dispatch_hop_us"]) == {"network", "forward", "total"} and \
        (m["dispatch_hop_us"]["forward"] is None) == two_hop.direct and all(v is not None and v >= 0 for v in timed)
    assert all_ranks(group.comm, ok), m
    with pytest.raises(ValueError, match="hop_ns"):
        two_hop.dispatch(x, ids, ws, hop_ns=cupy.zeros(4, dtype=np.int64))
    group.comm.Barrier()


def test_a_rank_that_never_dispatches_is_named_within_the_timeout(group, two_hop):
    """Rank 0 stays away from one dispatch: every other rank's notify pass
    times out waiting for its row of counts and raises CommTimeoutError
    naming rank 0 within the (shortened) timeout, and sends nothing (its
    dispatch kernel sees the failed notify). Last in the module: after a
    timeout the buffer's state is undefined."""
    import time

    import cupy
    from cupyep import CommTimeoutError

    me = group.rank
    idx, w = global_routing(9, [16] * group.world_size, E, K_TOPK)
    if me == 0:
        ok = True
    else:
        saved, group.timeout_s = group.timeout_s, 3.0
        t0 = time.monotonic()
        try:
            with pytest.raises(CommTimeoutError) as info:
                two_hop.dispatch(cupy.asarray(payload_bf16(me, np.arange(16), H)), cupy.asarray(idx[me]),
                                 cupy.asarray(w[me]))
        finally:
            group.timeout_s = saved
        ok = info.value.peer == 0 and "count exchange" in str(info.value) and time.monotonic() - t0 < 30
        group.error_slot.reset()
    group.comm.Barrier()
    assert all_ranks(group.comm, ok)
