"""In-kernel metrics on the GPU (cupyep.lab.metrics): the notify pass's clock in
normal mode, the signal waits, slot use and received-token counts of
low-latency dispatch, checked against what the routing implies."""
import numpy as np
import pytest

from cupyep.lab import metrics as M
from cupyep import routing

from cupyep.testing import all_ranks, global_routing, payload_bf16

pytestmark = pytest.mark.gpu
E, K = 256, 8


@pytest.fixture(scope="module")
def buf(group):
    import cupyep
    b = cupyep.Buffer(group)
    yield b
    b.destroy()


@pytest.mark.parametrize("via", ["queue", "direct", "direct_unfused"])
def test_notify_time_ns_counts_each_notified_call(group, buf, via):
    """A notified dispatch adds its notify time and one call; a cached one
    adds nothing; worst-token calls count too; the figures are plausible."""
    import cupy
    from cupyep.normal.direct_kernels import DirectConfig
    kw = {"queue": {"transport": "queue"}, "direct": {"transport": "direct"},
          "direct_unfused": {"transport": "direct", "config": DirectConfig(fused=False)}}[via]
    me, R = group.local_rank, group.local_size
    idx, w = global_routing(3, [512] * R, E, K)
    x = cupy.asarray(payload_bf16(me, np.arange(512), 2048))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    buf.dispatch(x, ids, ws, num_experts=E, **kw)  # the pools exist before the fused calls
    stats = cupy.zeros(2, dtype=np.int64)
    out = buf.dispatch(x, ids, ws, num_experts=E, notify_time_ns=stats, **kw)
    buf.synchronize()
    one = stats.get()
    buf.dispatch(x, handle=out.handle, notify_time_ns=stats)
    buf.synchronize()
    cached = stats.get()
    buf.dispatch(x, ids, ws, num_experts=E, num_worst_tokens=512 * R, notify_time_ns=stats, **kw)
    buf.synchronize()
    worst = stats.get()
    ok = (one[1] == 1 and 0 < one[0] < 10**9 and np.array_equal(cached, one) and worst[1] == 2
          and worst[0] > one[0])
    assert all_ranks(group.comm, ok), (one, cached, worst)
    m = M.normal_metrics(group, lambda notify_time_ns: buf.dispatch(x, ids, ws, num_experts=E,
                                                                     notify_time_ns=notify_time_ns, **kw), calls=5)
    ok = all(m[k] is not None and 0 < m[k] < 1e6 for k in m) and m["notify_us_p50"] <= m["notify_us_max"]
    assert all_ranks(group.comm, ok), m


def test_kernel_time_ns_stamps_each_direct_kernel(group, buf):
    """kernel_time_ns on the direct route: every kernel (fused and unfused
    notified dispatch, cached dispatch, pushing and zero-copy combine) stamps
    its first block's start and last block's end in its own row, in stream
    order, and a row no call was given stays as made; the queue route refuses
    the metric before launch."""
    import cupy
    from cupyep.lab.bench.stamps import new_kernel_stamps
    from cupyep.normal.direct_kernels import DirectConfig
    me, R = group.local_rank, group.local_size
    idx, w = global_routing(5, [512] * R, E, K)
    x = cupy.asarray(payload_bf16(me, np.arange(512), 2048))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    st = new_kernel_stamps(6)
    fused = buf.dispatch(x, ids, ws, num_experts=E, transport="direct", kernel_time_ns=st[0])
    buf.combine(fused.recv_x, fused.handle, topk_weights=fused.recv_topk_weights, kernel_time_ns=st[1])
    zc = buf.get_combine_buffer(fused.handle)
    zc[...] = fused.recv_x
    buf.combine(zc, fused.handle, topk_weights=fused.recv_topk_weights, zero_copy=True, kernel_time_ns=st[2])
    buf.dispatch(x, ids, ws, num_experts=E, transport="direct", config=DirectConfig(fused=False),
                 kernel_time_ns=st[3])
    buf.dispatch(x, handle=fused.handle, kernel_time_ns=st[4])  # a handle outlives its slot's rows
    buf.synchronize()
    got = st.get()
    used, unused = got[:5], got[5]
    ok = bool(np.all(used[:, 0] > 0) and np.all(used[:, 1] > used[:, 0]) and np.all(used[:, 1] - used[:, 0] < 10**9)
              and np.all(used[1:, 0] >= used[:-1, 0]) and unused[0] == np.iinfo(np.int64).max and unused[1] == 0)
    assert all_ranks(group.comm, ok), got
    with pytest.raises(ValueError, match="kernel_time_ns is a metric the queue"):
        buf.dispatch(x, ids, ws, num_experts=E, transport="queue", kernel_time_ns=st[5])


def test_notify_time_ns_is_checked_before_launch(group, buf):
    import cupy
    me, R = group.local_rank, group.local_size
    idx, _ = global_routing(4, [64] * R, E, K)
    x = cupy.asarray(payload_bf16(me, np.arange(64), 2048))
    with pytest.raises(ValueError, match="notify_time_ns"):
        buf.dispatch(x, cupy.asarray(idx[me]), num_experts=E, notify_time_ns=cupy.zeros(2, dtype=np.int32))
    with pytest.raises(ValueError, match="notify_time_ns"):
        buf.dispatch(x, cupy.asarray(idx[me]), num_experts=E, notify_time_ns=cupy.zeros(3, dtype=np.int64))


@pytest.mark.parametrize("fp8", [False, True])
def test_queue_occupancy_bounds_follow_the_received_rows(group, buf, fp8):
    """Each receiver poll consumes at least one row and at most the rows it
    found waiting, which never exceed the queue depth: received rows <= sum
    of waiting rows <= polls x depth, polls <= received rows, 1 <= max <=
    depth; two calls add up; the direct transport refuses the metric."""
    import cupy
    from cupyep.fp8 import per_token_cast_to_fp8
    me, R = group.local_rank, group.local_size
    idx, w = global_routing(6, [512] * R, E, K)
    x = cupy.asarray(payload_bf16(me, np.arange(512), 2048))
    payload = per_token_cast_to_fp8(x) if fp8 else x
    ids = cupy.asarray(idx[me])
    cfg = buf.default_dispatch_config()
    q = cupy.zeros(3, dtype=np.uint64)
    out = buf.dispatch(payload, ids, num_experts=E, config=cfg, queue_occupancy=q)
    buf.synchronize()
    one = q.get().astype(np.int64)
    n = out.handle.num_recv_tokens
    depth = cfg.queue_depth
    ok = n <= one[0] <= one[1] * depth and 0 < one[1] <= n and 1 <= one[2] <= depth
    buf.dispatch(payload, handle=out.handle, config=cfg, queue_occupancy=q)
    buf.synchronize()
    two = q.get().astype(np.int64)
    ok = ok and 2 * n <= two[0] and two[1] <= 2 * n and one[2] <= two[2] <= depth
    m = M.queue_metrics(group, lambda queue_occupancy: buf.dispatch(payload, ids, num_experts=E, config=cfg,
                                                                    queue_occupancy=queue_occupancy), depth, calls=3)
    ok = ok and 0 < m["queue_occupancy_mean"] <= m["queue_occupancy_max"] <= 1
    assert all_ranks(group.comm, ok), (one, two, n, depth, m)
    with pytest.raises(ValueError, match="queue_occupancy is a metric the direct route does not fill"):
        buf.dispatch(x, ids, num_experts=E, transport="direct", queue_occupancy=q)
    with pytest.raises(ValueError, match="queue_occupancy"):
        buf.dispatch(x, ids, num_experts=E, queue_occupancy=cupy.zeros(3, dtype=np.int64))


@pytest.mark.parametrize("lined_up", [False, True])
def test_low_latency_metrics_match_the_routing(group, lined_up):
    """Slots used and tokens received per expert are exactly what the routing
    sends; the received-token imbalance equals the routing's imbalance factor;
    every wait is a non-negative time under the timeout, one per (call, source rank) of
    every rank; with a GPU barrier before each call as without."""
    import cupy
    import cupyep
    from cupyep.barrier import GpuBarrier
    from cupyep.low_latency.buffer import ranks_of
    me, R = ranks_of(group)  # the node's ranks, or every rank when they span nodes
    T, H, calls = 96, 2048, 4
    idx, _ = global_routing(5, [T] * R, E, K)
    ll = cupyep.LowLatencyBuffer(group, 128, H, E)
    bar = GpuBarrier(group) if lined_up else None
    try:
        x = cupy.asarray(payload_bf16(me, np.arange(T), H))
        m = M.low_latency_metrics(group, ll, x, cupy.asarray(idx[me]), calls=calls, barrier=bar, sleep_us=50.0)
        pairs = sum(int((a >= 0).sum()) for a in idx)  # (token, expert) pairs of all ranks per call
        slots = (E // R) * ll.layout.slots
        ok = {
            "slot_utilisation": m["slot_utilisation"] == pytest.approx(pairs / R / slots),
            "imbalance": m["expert_recv_imbalance"] == pytest.approx(routing.imbalance_factor(idx, E)),
            # Unaligned, a wait holds a peer's late launch (seconds at 8 ranks on one GPU), never past the timeout.
            "waits": all(m[k] is not None and 0 <= m[k] < group.timeout_s * 1e6
                         for k in ("wait_us_p50", "wait_us_p99", "wait_us_max"))
                     and m["wait_us_p50"] <= m["wait_us_p99"] <= m["wait_us_max"],
            "samples": len(m["wait_us_samples"]) == calls * R * R and max(m["wait_us_samples"]) == m["wait_us_max"],
        }
        assert all_ranks(group.comm, all(ok.values())), (m, ok)
    finally:
        ll.synchronize()
        group.comm.Barrier()
        ll.destroy()
        if bar is not None:
            bar.destroy()
