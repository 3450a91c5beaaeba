"""Low-latency shrink mode on the GPU (LowLatencyBuffer(enable_shrink=True)):
a masked rank takes no part, and a peer that stops answering is masked by the
waiting kernel instead of failing the call.

The victim is the last rank. The others' results are checked against the
reference with the victim's experts dropped (their slots -1) and without the
victim's tokens: dispatch exactly per (expert, source), positions as the
unmasked routing's (they count per expert), combine against identity
experts with the victim's slots left out. The victim skips the calls and
joins the collective checks only.
"""
import numpy as np
import pytest

from cupyep import reference as ref
from cupyep.low_latency.buffer import ranks_of as ranks
from cupyep.testing import all_ranks, bf16_to_f32, global_routing, payload_bf16

pytestmark = pytest.mark.gpu
E, K, H, MAX_TOKENS = 64, 8, 2048, 32


@pytest.fixture(scope="module", autouse=True)
def _nvshmem_across_nodes(request, group):
    if group.num_nodes > 1:
        request.getfixturevalue("nvshmem_session")


def _survivor_checks(group, buf, victim, seed):
    """Dispatch and combine on every rank but the victim; returns whether they match the reference."""
    import cupy
    me, R = ranks(group)
    El = E // R
    idx, w = global_routing(seed, [MAX_TOKENS] * R, E, K)
    xs = [payload_bf16(r, np.arange(MAX_TOKENS), H) for r in range(R)]
    kept = ref.low_latency.without_ranks(idx, [victim], E)
    mine = ref.low_latency_dispatch(xs, kept, E, MAX_TOKENS)[me]
    res = buf.dispatch(cupy.asarray(xs[me]), cupy.asarray(idx[me]), use_fp8=False)
    counts = res.handle.layout_count.get()
    ok = np.array_equal(counts, mine.layout_count.astype(np.int32)) and not counts[:, victim].any()
    ok &= np.array_equal(res.recv_count.get(), mine.recv_count)
    ok &= np.array_equal(res.handle.combine_pos.get(), ref.low_latency.return_position(idx[me], E, R))
    recv, src = res.recv_x.get(), res.handle.recv_src.get()
    for e in range(El):
        for s in range(R):
            sl = slice(s * MAX_TOKENS, s * MAX_TOKENS + int(mine.layout_count[e, s]))
            ok &= np.array_equal(recv[e, sl], mine.recv_x[e, sl]) and np.array_equal(src[e, sl],
                                                                                   mine.recv_src_info[e, sl])
    comb = buf.combine(res.recv_x.copy(), cupy.asarray(idx[me]), cupy.asarray(w[me]), res.handle)
    got = bf16_to_f32(comb.combined_x.get())
    valid = kept[me] >= 0
    want = bf16_to_f32(xs[me]) * (w[me] * valid).sum(axis=1, dtype=np.float64).astype(np.float32)[:, None]
    diff = ref.calc_diff(got, want)
    return bool(ok) and diff < 1e-5 and not np.isnan(got).any(), diff


@pytest.fixture
def shrink_buf(group):
    import cupyep
    if ranks(group)[1] < 2:
        pytest.skip("shrink mode needs a peer")
    b = cupyep.LowLatencyBuffer(group, MAX_TOKENS, H, E, enable_shrink=True)
    yield b
    group.comm.Barrier()
    b.destroy()


def test_a_masked_rank_takes_no_part(group, shrink_buf):
    """Every other rank masks the victim before the calls; the victim makes none. Two rounds: the
    flags of the sets the victim never touches stay consistent."""
    me, R = ranks(group)
    victim = R - 1
    if me != victim:
        shrink_buf.update_mask(victim, True)
    results = []
    for it in range(2):
        results.append(_survivor_checks(group, shrink_buf, victim, 60 + it) if me != victim else (True, 0.0))
    mask = shrink_buf.query_mask().get()
    ok = all(r[0] for r in results) and (me == victim or mask.tolist() == [int(r == victim) for r in range(R)])
    assert all_ranks(group.comm, ok), (results, mask)


def test_a_peer_that_stops_answering_is_masked_and_the_call_completes(group, shrink_buf):
    """No mask beforehand: the victim skips the calls, the others' dispatch waits for its flag until the
    timeout, masks it, and finishes; their combine then leaves its experts out. query_mask names it."""
    import cupyep
    me, R = ranks(group)
    victim = R - 1
    ok, detail = True, None
    if me != victim:
        assert not shrink_buf.query_mask().get().any()
        ok, detail = _survivor_checks(group, shrink_buf, victim, 70)
        mask = shrink_buf.query_mask().get()
        ok = ok and mask.tolist() == [int(r == victim) for r in range(R)]
        detail = (detail, mask)
    assert all_ranks(group.comm, ok), detail
    # Without shrink mode the same wait is a CommTimeoutError: the mask calls are refused there.
    plain = cupyep.LowLatencyBuffer(group, MAX_TOKENS, H, E)
    try:
        with pytest.raises(ValueError, match="enable_shrink"):
            plain.update_mask(victim, True)
    finally:
        group.comm.Barrier()
        plain.destroy()


def test_mask_calls_check_their_arguments(group, shrink_buf):
    me, R = ranks(group)
    for bad in (R, -1, True):
        with pytest.raises(ValueError, match="rank"):
            shrink_buf.update_mask(bad, True)
    import cupy
    with pytest.raises(ValueError, match="shape"):
        shrink_buf.query_mask(cupy.zeros(R + 1, np.int32))
    shrink_buf.update_mask(0, True)
    out = cupy.full(R, 7, np.int32)
    assert shrink_buf.query_mask(out) is not None and out.get().tolist() == [1] + [0] * (R - 1)
    shrink_buf.clean_mask()
    assert not shrink_buf.query_mask().get().any()
