"""Low-latency regions below the worst case on the GPU (LowLatencyBuffer(capacity=)):
a routing that fits is the reference with regions of that many rows; one
that overflows is refused on every rank before launch, or, unvalidated,
reported by the kernel with nothing written past a region; and
cupyep.low_latency.overflow.run splits it into micro-batches or sends it
through normal mode, each equal to the whole call.

    python3 -m cupyep.launcher.gpu_tests --ranks 2 4 8 -k capacity
"""
import numpy as np
import pytest

from cupyep import routing

from cupyep.low_latency.buffer import ranks_of as ranks
from cupyep.testing import all_ranks, bf16_to_f32
from test_low_latency_gpu import E, H, K, MAX_TOKENS, _check_dispatch, _combine_expected, tagged_x
from test_low_latency_gpu import _nvshmem_across_nodes  # noqa: F401  (autouse: NVSHMEM across nodes)

pytestmark = pytest.mark.gpu
CAP = 12  # rows per (expert, source) region: uniform routings of 64 tokens fit, a hot expert does not
T = 64


@pytest.fixture(scope="module")
def capbuf(group):
    import cupyep
    b = cupyep.LowLatencyBuffer(group, MAX_TOKENS, H, E, capacity=CAP)
    yield b
    b.synchronize()
    group.comm.Barrier()
    b.destroy()


def _hot(R, seed=4):
    return routing.make("hot_expert", seed, [T] * R, E, K, hot_fraction=0.6)


def test_the_buffer_holds_regions_of_its_capacity(group, capbuf):
    import cupyep
    assert capbuf.layout.slots == ranks(group)[1] * CAP
    assert capbuf.num_bytes < cupyep.LowLatencyBuffer.size_hint(ranks(group)[1], MAX_TOKENS, H, E)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_a_routing_within_capacity_is_the_reference_with_its_regions(group, capbuf, use_fp8):
    import cupy
    from test_low_latency_gpu import _expert_outputs
    from cupyep import reference as ref
    me, R = ranks(group)
    idx, w = routing.make("uniform", 7 + use_fp8, [T] * R, E, K)
    assert max(int(np.bincount(i[i >= 0], minlength=E).max()) for i in idx) <= CAP
    xs = [tagged_x(r, T) for r in range(R)]
    res = capbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=use_fp8)
    ok, bad = _check_dispatch(group, res, [T] * R, idx, use_fp8, xs, capacity=CAP)
    assert all_ranks(group.comm, ok), bad
    comb = capbuf.combine(_expert_outputs(res, use_fp8), cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
    got = bf16_to_f32(comb.combined_x.get())
    diff = ref.calc_diff(got, _combine_expected(xs[me], idx[me], w[me]))
    assert all_ranks(group.comm, diff < (9e-4 if use_fp8 else 1e-5)), diff


def test_an_overflowing_routing_is_refused_on_every_rank_before_launch(group, capbuf):
    import cupy
    me, R = ranks(group)
    idx, _ = _hot(R)
    rows = max(int(np.bincount(i[i >= 0], minlength=E).max()) for i in idx)
    assert rows > CAP
    assert capbuf.region_rows(cupy.asarray(idx[me])) == rows  # every rank sees the fullest region of all
    with pytest.raises(ValueError, match=f"puts {rows} rows of one rank in one expert's region, more than this "
                                         f"buffer's capacity={CAP}"):
        capbuf.dispatch(cupy.asarray(tagged_x(me, T)), cupy.asarray(idx[me]))
    # nothing ran: the buffer goes on
    ok_idx, _ = routing.make("uniform", 8, [T] * R, E, K)
    xs = [tagged_x(r, T) for r in range(R)]
    res = capbuf.dispatch(cupy.asarray(xs[me]), cupy.asarray(ok_idx[me]), use_fp8=False)
    ok, bad = _check_dispatch(group, res, [T] * R, ok_idx, False, xs, capacity=CAP)
    assert all_ranks(group.comm, ok), bad


def test_unvalidated_the_kernel_reports_an_overflow_and_writes_no_row_past_a_region(group):
    import cupy
    import cupyep
    from cupyep import DeviceCapacityError
    me, R = ranks(group)
    idx, _ = _hot(R, seed=5)
    mine = int(np.bincount(idx[me][idx[me] >= 0], minlength=E).max())
    with cupyep.LowLatencyBuffer(group, MAX_TOKENS, H, E, capacity=CAP) as b:
        res = b.dispatch(cupy.asarray(tagged_x(me, T)), cupy.asarray(idx[me]), use_fp8=False, validate=False)
        raised = None
        try:
            b.synchronize()
        except DeviceCapacityError as exc:
            raised = exc
        group.error_slot.reset()
        ok = (raised is not None) == (mine > CAP)
        if raised is not None:
            ok &= raised.value == mine and raised.expected == CAP and "region capacity" in raised.phase
        counts = res.handle.layout_count.get()
        ok &= bool((counts <= CAP).all())  # a receiver never counts rows past its region
        assert all_ranks(group.comm, ok), (mine, raised)
        b.combine(None, cupy.asarray(idx[me]), cupy.ones((T, K), np.float32), res.handle, zero_copy=True)
        b.synchronize()
        group.error_slot.reset()


def _doubling_experts(group):
    """An expert function for overflow.run: experts of even global id double their rows (exact in BF16)."""
    import cupy
    me, R = ranks(group)
    El = E // R

    def fn(le, rows):
        if (me * El + le) % 2:
            return rows
        f = cupy.asarray(bf16_to_f32(rows.get()) * 2, dtype=np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return fn


@pytest.mark.parametrize("policy", ["split", "normal"])
def test_an_overflowing_call_split_or_in_normal_mode_is_the_whole_call(group, capbuf, policy):
    import cupy
    import cupyep
    from cupyep import reference as ref
    from cupyep.low_latency import overflow
    me, R = ranks(group)
    idx, w = _hot(R, seed=6)
    xs = [tagged_x(r, T) for r in range(R)]
    with cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=K) as nbuf:
        out, how = overflow.run(capbuf, cupy.asarray(xs[me]), cupy.asarray(idx[me]), cupy.asarray(w[me]),
                                _doubling_experts(group), on_overflow=policy, buffer=nbuf)
        got = bf16_to_f32(out.get())
    factor = np.where((idx[me] >= 0) & (idx[me] % 2 == 0), 2.0, 1.0)
    sw = (w[me] * (idx[me] >= 0) * factor).sum(axis=1, dtype=np.float64).astype(np.float32)
    want = bf16_to_f32(xs[me]) * sw[:, None]
    diff = ref.calc_diff(got, want)
    ok = diff < 1e-5 and (how.startswith("split into ") and int(how.split()[-1]) > 1 if policy == "split"
                          else how == "normal")
    assert all_ranks(group.comm, ok), (diff, how)
