"""Host side of the two-hop dispatch (cupyep.internode): the notify's state
layout, the network row layout and the hop metric's arithmetic. The plan the
notify kernel computes on the device is checked against
cupyep.reference.internode.two_hop_plan by tests/gpu/test_two_hop_gpu.py."""
import pytest

from cupyep import internode as INTER


@pytest.mark.parametrize("R,K", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_state_slices_cover_the_state_in_the_kernels_order(R, K):
    """cupyep.internode.state_slices lays out, back to back and in
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
    src = (jit.CUDA_SRC / "internode" / "two_hop.cu").read_text()
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
    from cupyep.internode import check_chunk
    with pytest.raises(ValueError, match="rdma_chunk must be an int >= 1"):
        check_chunk("rdma_chunk", value)


def test_chunk_knobs_pass_through():
    import numpy as np
    from cupyep.internode import check_chunk
    assert check_chunk("nvlink_chunk", 1) == 1 and check_chunk("nvlink_chunk", np.int64(64)) == 64


def test_the_notify_shared_memory_fits_a_block():
    """two_hop_notify's dynamic shared memory: int64 counts and slot bases, then
    int32 positions per warp and column; under the 48 KiB default up to 256 ranks."""
    from cupyep.internode import NOTIFY_THREADS, notify_smem
    assert notify_smem(8, 2) == 8 * (8 + 4) + 4 * (NOTIFY_THREADS // 32) * 10
    assert notify_smem(256, 32) < 48 * 1024


@pytest.mark.parametrize("H,k", [(7168, 8), (128, 1), (4096, 9)])
def test_the_direct_routes_staged_row_holds_every_part(H, k):
    """cupyep.internode.direct_row_bytes: the larger of the BF16 and FP8 rows of
    DirectRow (two_hop.cu): payload, scales, k ids, k weights, source, slot,
    each at a 16-byte boundary."""
    a16 = lambda n: -(-n // 16) * 16  # noqa: E731
    rest = a16(8 * k) + a16(4 * k) + 16 + 16
    assert INTER.direct_row_bytes(H, k) == max(2 * H, a16(H + 4 * (H // 128))) + rest
    assert INTER.direct_row_bytes(H, k) % 16 == 0
    from cupyep import jit
    src = (jit.CUDA_SRC / "internode" / "two_hop.cu").read_text()
    assert "r.ids = align16(payload + 4 * (int64_t)num_scales);" in src and "r.bytes = r.slot + 16;" in src
    assert INTER.ROUTES == ("two_hop", "direct")


def test_a_world_too_large_for_one_notify_block_is_refused_by_its_shared_memory():
    from cupyep.internode import DEFAULT_DYNAMIC_SMEM, check_notify_smem, notify_smem
    optin = 227 * 1024  # an H100 / H200 block's opt-in maximum
    assert check_notify_smem(8, 2, optin) == notify_smem(8, 2) <= DEFAULT_DYNAMIC_SMEM
    assert DEFAULT_DYNAMIC_SMEM < check_notify_smem(512, 64, optin) <= optin  # needs the opt-in attribute
    with pytest.raises(ValueError, match="shared memory for 2048 ranks in 256 nodes"):
        check_notify_smem(2048, 256, optin)
