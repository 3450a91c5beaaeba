"""Host side of the two-hop dispatch (cupyep.normal.internode_kernels): the notify's state
layout, the network row layout, the hop metric's arithmetic, the receive
pool's slots and heap reservation, a handle's metadata block and the
barrier between two combines. The plan the
notify kernel computes on the device is checked against
cupyep.reference.internode.two_hop_plan by tests/gpu/test_two_hop_gpu.py."""
import numpy as np
import pytest

from cupyep.normal import internode_kernels as INTER


@pytest.mark.parametrize("R,K", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_state_slices_cover_the_state_in_the_kernels_order(R, K):
    """cupyep.normal.internode_kernels.state_slices lays out, back to back and in
    two_hop.cu's order, the two_hop_state_words(R, N) words of the notify's
    state: calls done, the latest notify's verdict, then the cumulative
    targets."""
    sl = INTER.state_slices(R, K)
    N = R // K
    assert list(sl) == ["calls", "ok", "net_total", "arrived_total", "combine_total", "combine_net_total",
                        "combine_rank_total"]
    sizes = [sl[k].stop - sl[k].start for k in sl]
    assert sizes == [1, 1, N, R, 1 + K, N, R]
    assert list(sl)[-3:] == list(INTER.COMBINE_TARGETS)  # the weights' pass copies this tail's layout
    assert all(sl[a].stop == sl[b].start for a, b in zip(list(sl), list(sl)[1:]))
    assert sl["combine_rank_total"].stop == INTER.state_words(R, K) == 2 + N + R + 1 + K + N + R


def test_the_kernels_state_size_is_the_hosts():
    from cupyep import jit

    src = (jit.CUDA_SRC / "normal" / "internode.cu").read_text()
    assert "two_hop_state_words(int R, int K) { return 2 + R / K + R + 1 + K + R / K + R; }" in src
    assert "constexpr int kNotifyOk = 1;" in src


def test_network_row_layout():
    assert INTER.row_stride(7168, 8, 4) == 14512  # 14336 payload + 168 metadata, rounded up to 16
    assert INTER.row_stride(128, 1, 3) % 16 == 0 and INTER.row_stride(128, 1, 3) >= 256 + 8 * 6
    # FP8: 7168 bytes + 168 metadata + 56 scales x 4 bytes = 7560, rounded up to 16; never longer than BF16.
    assert INTER.row_stride(7168, 8, 4, fp8=True) == 7568
    assert all(INTER.row_stride(h, k, K, fp8=True) <= INTER.row_stride(h, k, K)
               for h in (128, 2048, 7168) for k in (1, 8, 16) for K in (1, 2, 8))


def test_hop_times_are_differences_of_the_stamps_and_none_where_unwritten():
    assert INTER.hop_times_us([1000, 4000, 9000, 10000], INTER.DISPATCH_HOPS) == {
        "network": 3.0, "forward": 5.0, "total": 9.0}
    assert INTER.hop_times_us([1000, 4000, 9000, 10000], INTER.COMBINE_HOPS) == {
        "node": 3.0, "network": 5.0, "reduce": 1.0, "total": 9.0}
    unset = INTER.hop_times_us(list(INTER.HOP_STAMPS_INIT), INTER.DISPATCH_HOPS)
    assert unset == {"network": None, "forward": None, "total": None}
    with pytest.raises(ValueError):
        INTER.hop_times_us([1, 2, 3], INTER.DISPATCH_HOPS)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4", None])
def test_a_chunk_knob_is_an_int_of_at_least_one(value):
    from cupyep.normal.internode_kernels import check_chunk
    with pytest.raises(ValueError, match="rdma_chunk must be an int >= 1"):
        check_chunk("rdma_chunk", value)


def test_chunk_knobs_pass_through():
    import numpy as np
    from cupyep.normal.internode_kernels import check_chunk
    assert check_chunk("nvlink_chunk", 1) == 1 and check_chunk("nvlink_chunk", np.int64(64)) == 64


def test_the_notify_shared_memory_fits_a_block():
    """two_hop_notify's dynamic shared memory: int64 counts and slot bases, then
    int32 positions per warp and column; under the 48 KiB default up to 256 ranks."""
    from cupyep.normal.internode_kernels import NOTIFY_THREADS, notify_smem
    assert notify_smem(8, 2) == 8 * (8 + 4) + 4 * (NOTIFY_THREADS // 32) * 10
    assert notify_smem(256, 32) < 48 * 1024


@pytest.mark.parametrize("H,k", [(7168, 8), (128, 1), (4096, 9)])
def test_the_direct_routes_staged_row_holds_every_part(H, k):
    """cupyep.normal.internode_kernels.direct_row_bytes: the larger of the BF16 and FP8 rows of
    DirectRow (two_hop.cu): payload, scales, k ids, k weights, source, slot,
    each at a 16-byte boundary."""
    a16 = lambda n: -(-n // 16) * 16  # noqa: E731
    rest = a16(8 * k) + a16(4 * k) + 16 + 16
    assert INTER.direct_row_bytes(H, k) == max(2 * H, a16(H + 4 * (H // 128))) + rest
    assert INTER.direct_row_bytes(H, k) % 16 == 0
    from cupyep import jit

    src = (jit.CUDA_SRC / "normal" / "internode.cu").read_text()
    assert "r.ids = align16(payload + 4 * (int64_t)num_scales);" in src and "r.bytes = r.slot + 16;" in src
    assert INTER.ROUTES == ("two_hop", "direct")


def test_a_world_too_large_for_one_notify_block_is_refused_by_its_shared_memory():
    from cupyep.normal.internode_kernels import DEFAULT_DYNAMIC_SMEM, check_notify_smem, notify_smem
    optin = 227 * 1024  # an H100 / H200 block's opt-in maximum
    assert check_notify_smem(8, 2, optin) == notify_smem(8, 2) <= DEFAULT_DYNAMIC_SMEM
    assert DEFAULT_DYNAMIC_SMEM < check_notify_smem(512, 64, optin) <= optin  # needs the opt-in attribute
    with pytest.raises(ValueError, match="shared memory for 2048 ranks in 256 nodes"):
        check_notify_smem(2048, 256, optin)


@pytest.mark.parametrize("rows,H,k", [(8 * 256, 7168, 8), (3, 128, 1), (100, 2048, 9)])
def test_the_receive_pool_slot_holds_every_array_at_its_boundary(rows, H, k):
    """cupyep.normal.internode_kernels.receive_layout: recv_x (BF16 bytes, the larger), the ids,
    weights, sources, network slots and FP8 scales of ``rows`` rows, back to back
    at 256-byte boundaries; the slot's bytes end after the last."""
    lay, slot_bytes = INTER.receive_layout(rows, H, k)
    sizes = {"x": rows * H * 2, "idx": rows * k * 8, "w": rows * k * 4, "src": rows * 4, "slot": rows * 8,
             "scales": rows * (H // 128) * 4}
    names = list(lay)
    assert names == list(sizes) and lay["x"] == 0 and slot_bytes % 256 == 0
    assert all(off % 256 == 0 for off in lay.values())
    ends = [lay[n] + sizes[n] for n in names]
    assert all(e <= lay[b] for e, b in zip(ends, names[1:])) and ends[-1] <= slot_bytes < ends[-1] + 256


def test_every_rank_takes_the_same_slot_and_the_slots_do_not_overlap():
    """Dispatches take slots round-robin (cupyep.slots.InFlightSlots): ranks
    making the same calls in the same order pick the same slot each time,
    which the direct route needs (a sender puts into the receiver's slot at
    its own offsets). Slot s's arrays are slot 0's shifted by s * slot bytes."""
    from cupyep.slots import InFlightSlots
    lay, slot_bytes = INTER.receive_layout(64, 256, 2)
    ranks = [InFlightSlots(3, "pool") for _ in range(4)]
    for call in range(7):
        picked = {s.take("TwoHopDispatch.dispatch").slot for s in ranks}
        assert picked == {call % 3}
    regions = [INTER.slot_layout(lay, s, slot_bytes) for s in range(3)]
    assert regions[0] == lay and all(regions[s]["x"] == s * slot_bytes for s in range(3))
    assert all(regions[s]["scales"] < regions[s + 1]["x"] for s in range(2))


@pytest.mark.parametrize("route", ["two_hop", "direct"])
def test_the_heap_reservation_counts_the_pool_slots_where_the_pool_is_on_the_heap(route):
    """cupyep.normal.internode_kernels.heap_table: on the direct route the receive pool (its
    num_in_flight slots) is on the NVSHMEM heap and reserved with the rest; on
    the two-hop route it is IPC memory, not on the heap."""
    R, K, T, H, k, slots = 8, 4, 64, 512, 4, 3
    _, slot_bytes = INTER.receive_layout(R * T, H, k)
    heap = INTER.heap_table(route, R, K, T, H, k, slots * slot_bytes)
    assert heap["net_rows"] == (R // K - 1) * T * INTER.row_stride(H, k, K) and heap["barrier"] == 8 * R
    assert heap.get("pool") == (slots * slot_bytes if route == "direct" else None)
    assert ("direct_stage" in heap) == (route == "direct")


@pytest.mark.parametrize("H,k,K,fp8", [(256, 2, 2, False), (128, 3, 4, True), (512, 1, 1, False)])
def test_a_handles_metadata_block_is_what_the_combine_reads(H, k, K, fp8):
    """The handle's copy of its network rows' metadata: the block
    cupyep.normal.internode_kernels.meta_block names in the network buffer (rows of
    row_stride bytes, the words after the payload), copied C-contiguous, is
    [rows, 1 + 2k + K] int64 of each row's source token, k ids, k weights and
    K positions, which the combine reads with row_stride 8 * (1 + 2k + K) and
    meta_offset 0."""
    rows, payload = 5, H if fp8 else 2 * H
    stride = INTER.row_stride(H, k, K, fp8)
    W = INTER.meta_words(k, K)
    net = np.zeros(rows * stride + 64, np.uint8)
    want = np.arange(rows * W, dtype=np.int64).reshape(rows, W) + 100
    for q in range(rows):  # as two_hop_dispatch stages a row: payload, then the words
        net[q * stride + payload:q * stride + payload + 8 * W] = want[q].view(np.uint8)
    offset, shape, strides = INTER.meta_block(rows, payload, stride, k, K)
    got = np.ndarray(shape, np.int64, buffer=net, offset=offset, strides=strides).copy()
    assert got.flags.c_contiguous and np.array_equal(got, want) and got.strides[0] == 8 * W
    from cupyep import jit

    src = (jit.CUDA_SRC / "normal" / "internode.cu").read_text()
    assert "a.net_rows + q * a.row_stride + a.meta_offset" in src  # the combine's row q of the block
    assert "const int64_t* pos = meta + 1 + 2 * a.num_topk;" in src  # its positions, after t, ids, weights


class _Barrier:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


def test_a_combine_that_may_follow_a_combine_waits_at_the_world_barrier():
    """TwoHopDispatch._order: a dispatch's notify pass is the barrier between
    calls; two combines in a row have none, so the second waits at a GPU
    barrier over every rank first. A captured combine always waits (what a
    replay follows is unknown), and so does the first eager combine after a
    captured call, unless a dispatch came between."""
    eng = object.__new__(INTER.TwoHopDispatch)
    eng.barrier, eng._previous = _Barrier(), None
    calls = [("combine", False), ("dispatch", False), ("combine", False), ("combine", False), ("combine", False),
             ("dispatch", False), ("dispatch", False), ("combine", False),
             ("dispatch", True), ("combine", True), ("combine", False),  # a graph, then an eager combine
             ("dispatch", True), ("dispatch", False), ("combine", False)]
    seen = []
    for kind, capturing in calls:
        before = eng.barrier.calls
        eng._order(kind, capturing)
        seen.append(eng.barrier.calls - before)
    assert seen == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert INTER.combine_needs_barrier("combine") and not INTER.combine_needs_barrier("dispatch")
    assert not INTER.combine_needs_barrier(None) and INTER.combine_needs_barrier("dispatch", capturing=True)


@pytest.mark.parametrize("value,ok", [(8, True), (np.int64(16), True), (6, False), (0, False), (True, False),
                                      (8.0, False)])
def test_num_experts_is_an_int_the_ranks_divide(value, ok):
    if ok:
        assert INTER.check_num_experts(value, 4) == int(value)
    else:
        with pytest.raises(ValueError, match="num_experts"):
            INTER.check_num_experts(value, 4)
