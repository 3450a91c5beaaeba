"""Host side of the direct transport (cupyep.normal.direct_kernels): pool layouts,
the rows a pool holds, the fixed slot sizes, block counts and config checks; the
kernel constants the layouts rely on."""
import re

import numpy as np
import pytest

from cupyep import jit

from cupyep.normal import direct_kernels as D
from cupyep.normal.buffer import Buffer


@pytest.mark.parametrize("rows,x_bytes,ns,k,idx,w", [
    (1, 256, 0, 8, True, True), (4096 * 8, 14336, 0, 8, True, True), (1000, 7168, 56, 8, True, True),
    (77, 4096, 0, 0, False, False), (5, 4096, 32, 16, True, False), (0, 256, 0, 8, True, True)])
def test_recv_layout_arrays_are_aligned_disjoint_and_in_order(rows, x_bytes, ns, k, idx, w):
    lay = D.recv_layout(rows, x_bytes, ns, k, idx, w)
    arrays = [("x", lay.x, rows * x_bytes), ("x_scales", lay.x_scales, rows * ns * 4),
              ("topk_idx", lay.topk_idx, rows * k * 8), ("topk_weights", lay.topk_weights, rows * k * 4),
              ("src_idx", lay.src_idx, rows * 4)]
    present = [(n, o, b) for n, o, b in arrays if o >= 0]
    assert (lay.x_scales >= 0) == bool(ns) and (lay.topk_idx >= 0) == idx and (lay.topk_weights >= 0) == w
    for (_, o, b), (_, o2, _) in zip(present, present[1:]):
        assert o % D.ALIGN == 0 and o + b <= o2
    assert present[-1][1] + present[-1][2] <= lay.end and lay.end % D.ALIGN == 0
    s = lay.struct()
    assert s.dtype == D.RECV_LAYOUT_DTYPE and int(s["rows"]) == rows and int(s["x_bytes"]) == x_bytes


def test_recv_layout_rejects_rows_that_are_not_16_byte_words():
    with pytest.raises(ValueError, match="multiple of 16"):
        D.recv_layout(4, 100, 0, 8, True, True)


@pytest.mark.parametrize("nbytes", [1 << 20, 5 << 20, 123456789, 4096 * 8 * 14400])
@pytest.mark.parametrize("shape", [(14336, 0, 8, True, True), (7168, 56, 8, True, True), (4096, 0, 0, False, False)])
def test_rows_that_fit_is_the_most_that_fit(nbytes, shape):
    rows = D.rows_that_fit(nbytes, *shape)
    assert D.recv_layout(rows, *shape).end <= nbytes
    assert D.recv_layout(rows + 1, *shape).end > nbytes


@pytest.mark.parametrize("nbytes,hidden,k", [(1 << 20, 2048, 8), (7 << 22, 7168, 8), (1 << 24, 7168, 0)])
def test_combine_layout_and_rows_that_fit(nbytes, hidden, k):
    rows = D.combine_rows_that_fit(nbytes, hidden, k)
    px, pm, end = D.combine_layout(rows, hidden, k)
    assert px == 0 and pm >= rows * hidden * 2 and pm % D.ALIGN == 0 and end <= nbytes
    assert end >= pm + rows * (1 + k) * 4
    assert D.combine_layout(rows + 1, hidden, k)[2] > nbytes


def test_default_slot_holds_the_rank_major_worst_case_and_twice_the_mean_pairs():
    from cupyep.sizes import DeclaredSizes
    sizes = DeclaredSizes(max_tokens=4096, hidden=7168, num_topk=8)
    slot = D.default_slot_bytes(8, sizes)
    for shape in ((14336, 0, 8, True, True), (7168, 56, 8, True, True)):
        assert D.rows_that_fit(slot, *shape) >= 8 * 4096
    m = D.expert_rows_that_fit(slot, 8 * 4096, 14336, 0, 8, True)
    assert m >= 2 * 4096 * 8 and slot % D.ALIGN == 0


@pytest.mark.parametrize("nbytes,rows", [(1 << 20, 10), (64 << 20, 4096), (300 << 20, 21504), (4096, 100)])
def test_expert_rows_that_fit_is_the_most_that_fit(nbytes, rows):
    shape = (14336, 0, 8, True, True)
    m = D.expert_rows_that_fit(nbytes, rows, 14336, 0, 8, True)
    if m:
        assert D.recv_layout(rows, *shape, expert_rows=m).end <= nbytes
    assert D.recv_layout(rows, *shape, expert_rows=m + 1).end > nbytes


def test_default_num_sms_is_bounded_by_rows_and_budget():
    warps = D.THREADS // 32
    assert D.default_num_sms(16, 4096 * 8) == 16
    assert D.default_num_sms(66, 1) == 1 and D.default_num_sms(66, 0) == 1
    assert D.default_num_sms(66, 5 * warps + 1) == 6


def test_direct_config_validation():
    assert D.DirectConfig().validate().num_threads == D.THREADS
    with pytest.raises(ValueError, match="num_sms"):
        D.DirectConfig(num_sms=-1).validate()
    with pytest.raises(ValueError, match="num_threads"):
        D.DirectConfig(num_threads=100).validate()


def test_bulk_stages_are_validated_and_sized():
    cfg = D.DirectConfig(bulk_stage_bytes=4096).validate()
    assert cfg.bulk_shared_bytes() == 2 * 4096 * (D.THREADS // 32)
    assert D.DirectConfig(bulk_stage_bytes=0).bulk_shared_bytes() == 0
    # The default: BULK_STAGE_BYTES (less where it would not fit) for calls of few blocks, else warp copies.
    assert D.DirectConfig(num_sms=D.BULK_MAX_BLOCKS).bulk_stage() == D.BULK_STAGE_BYTES
    assert D.DirectConfig(num_sms=D.BULK_MAX_BLOCKS + 1).bulk_stage() == 0
    assert D.DirectConfig().bulk_stage() == 0  # blocks from the shape: decided by resolved()
    assert D.DirectConfig().resolved(sm_budget=6).bulk_stage_bytes == D.BULK_STAGE_BYTES
    assert D.DirectConfig().resolved(sm_budget=66).bulk_stage_bytes == 0
    assert D.DirectConfig(num_sms=4).resolved(sm_budget=66).bulk_stage_bytes == D.BULK_STAGE_BYTES
    assert D.DirectConfig(bulk_stage_bytes=0, num_sms=4).resolved(66).bulk_stage_bytes == 0
    assert D.DirectConfig(num_sms=4, num_threads=1024).validate().bulk_stage() == 3632
    assert D.DirectConfig(num_sms=4, num_threads=1024).bulk_shared_bytes() <= D.MAX_SHARED_BYTES
    with pytest.raises(ValueError, match="multiple of 16"):
        D.DirectConfig(bulk_stage_bytes=1000).validate()
    with pytest.raises(ValueError, match="multiple of 16"):
        D.DirectConfig(bulk_stage_bytes=-16).validate()
    with pytest.raises(ValueError, match="use bulk_stage_bytes <= 7264"):
        D.DirectConfig(bulk_stage_bytes=8192).validate()  # 16 warps x 2 stages x 8 KiB > 227 KiB
    D.DirectConfig(bulk_stage_bytes=7264).validate()
    # The fused kernel's shared memory holds its notify block's counts or, later, the stages.
    assert D.fused_shared_bytes(8, 256, 4, False, 512, 0) == 4 * (8 * 5 + 8 + 256)
    assert D.fused_shared_bytes(8, 256, 4, False, 512, cfg.bulk_shared_bytes()) == cfg.bulk_shared_bytes()


def test_combine_words_are_validated_per_rank_count_and_name_their_kernel():
    from types import SimpleNamespace

    from cupyep.normal.direct import DirectRoute
    assert [D.combine_words(r) for r in (1, 2, 3, 4, 8)] == [8, 8, 4, 4, 2]
    assert D.combine_words(2, 8) == 8
    assert [D.max_combine_words(r) for r in (1, 2, 3, 4, 8)] == [8, 8, 4, 4, 2]
    # the default keeps the names (and CuPy's disk cache) of the kernels compiled before the knob
    assert D.combine_spec(8).name == "direct_combine_ranks_8_threads_512"
    assert D.combine_spec(8).kernels == ("cupyep::normal::direct_combine<8, 512, 2>",)
    assert D.combine_spec(8, 512, 2) is D.combine_spec(8)
    assert D.combine_spec(2).kernels == ("cupyep::normal::direct_combine<2, 512, 8>",)
    assert D.combine_spec(2, 512, 4).name == "direct_combine_ranks_2_threads_512_words_4"
    assert D.combine_spec(2, 512, 4).kernels == ("cupyep::normal::direct_combine<2, 512, 4>",)
    checked = {s.name for s in D.kernel_specs()}
    assert {"direct_combine_ranks_2_threads_512", "direct_combine_ranks_2_threads_512_words_4",
            "direct_combine_ranks_8_threads_512"} <= checked
    with pytest.raises(ValueError, match="combine_words must be one of"):
        D.DirectConfig(combine_words=3).validate()
    route = object.__new__(DirectRoute)
    route._configs, route._budgets, route.measured = {}, {}, False
    for R, words, ok in ((2, 8, True), (4, 8, False), (8, 2, True), (8, 4, False)):
        route.node = SimpleNamespace(num_ranks=R, sm_budget=132 // R)
        route._configs, route._budgets = {}, {}
        cfg = D.DirectConfig(combine_words=words)
        if ok:
            assert route.dispatch_config(cfg, False, None).combine_words == words
        else:
            with pytest.raises(ValueError, match=r"at most 16 fit its registers: use combine_words <= "):
                route.dispatch_config(cfg, False, None)


def test_notify_channels_fill_the_notify_block():
    for r in range(1, 9):
        assert 1 <= D.notify_channels(r) and r * D.notify_channels(r) <= 32


class _Route:
    def __init__(self, transport):
        self.transport = transport

    def owns(self, handle):
        return handle == self.transport


def test_transport_choice():
    """The front picks the route a call's transport names (default queue), or
    its handle's; a transport that contradicts the handle, an unknown one and
    a foreign handle raise."""
    buf = object.__new__(Buffer)
    buf.routes = {t: _Route(t) for t in ("queue", "direct")}
    assert buf._route(None, None) is buf.routes["queue"]
    assert buf._route("direct", None) is buf.routes["direct"]
    assert buf._route(None, "direct") is buf.routes["direct"]
    with pytest.raises(ValueError, match="transport must be one of"):
        buf._route("nvshmem", None)
    with pytest.raises(ValueError, match="made by the direct transport, not 'queue'"):
        buf._route("queue", "direct")
    with pytest.raises(ValueError, match="live handle of this Buffer"):
        buf._route(None, "elsewhere")


def test_kernel_constants_match_the_host():
    src = (jit.CUDA_SRC / "normal" / "direct_args.cuh").read_text()
    assert int(re.search(r"kDirectSyncStride = (\d+)", src).group(1)) == D.SYNC_STRIDE
    assert int(re.search(r"kStateHeader = (\d+)", src).group(1)) == D.STATE_HEADER
    kernel = (jit.CUDA_SRC / "normal" / "direct.cu").read_text()
    assert "direct_dispatch(DirectDispatchArgs" in kernel and "direct_combine(DirectCombineArgs" in kernel
    assert all(s.source == "normal/direct.cu" for s in D.kernel_specs()[:-1])
    assert D.kernel_specs()[-1].source == "normal/direct_positions.cu"
    # 1 to 8 ranks x (dispatch, fused, combine), the combine with 8 row words in flight at 1 and 2 ranks (the
    # most their registers hold; 4 at 3-4 ranks and 2 above are the defaults) and the position pass
    assert len(D.kernel_specs()) == 27
    assert any("direct_dispatch_fused(DirectFusedArgs" in line for line in kernel.splitlines())
    assert D.SYNC_DTYPE.itemsize == 40 and np.dtype(D.DISPATCH_ARGS_DTYPE).itemsize > 0
    assert int(re.search(r"kMaxInPlaceRanks = (\d+)", src).group(1)) == D.MAX_IN_PLACE_RANKS
    assert D.X_PEERS_DTYPE.itemsize == 8 * D.MAX_IN_PLACE_RANKS


def _pools(num_in_flight=2, max_tokens=512, hidden=1024, num_topk=8, ranks=4, slot_bytes=None):
    """DirectPools without a GPU: the host-side sizing and layouts only."""
    from cupyep.sizes import DeclaredSizes
    from cupyep.slots import InFlightSlots
    pools = D.DirectPools.__new__(D.DirectPools)
    sizes = DeclaredSizes(max_tokens, hidden, num_topk)
    pools.num_ranks, pools.sizes, pools.max_rows, pools._layouts = ranks, sizes, ranks * max_tokens, {}
    pools.slot_bytes = slot_bytes or D.default_slot_bytes(ranks, sizes)
    pools.zero_copy_bytes = D.zero_copy_layout(pools.max_rows, hidden, pools.max_rows)[2]
    pools.combine_bytes = D.combine_layout(pools.max_rows, hidden, num_topk)[2]
    pools.slots = InFlightSlots(num_in_flight, "test pool")
    return pools


def test_slot_layouts_are_the_same_layout_shifted_by_whole_slots():
    pools = _pools(num_in_flight=3)
    shape = (2048, 0, 8, True, True)
    base = pools.recv_layout(shape, 0)
    assert base == D.recv_layout(D.rows_that_fit(pools.slot_bytes, *shape), *shape)
    assert base.rows >= pools.max_rows
    for slot in (1, 2):
        lay = pools.recv_layout(shape, slot)
        off = slot * pools.slot_bytes
        assert (lay.x, lay.topk_idx, lay.topk_weights, lay.src_idx) == (base.x + off, base.topk_idx + off,
                                                                        base.topk_weights + off, base.src_idx + off)
        assert lay.x_scales == -1 and lay.rows == base.rows and lay.end == base.end + off
        assert lay.end <= (slot + 1) * pools.slot_bytes  # inside its own slot
    em = pools.expand_layout(shape, 2)
    assert em.x == -1 and em.rows == pools.max_rows and em.em_rows >= 2 * 512 * 8
    assert em.em_x >= 2 * pools.slot_bytes and em.end <= 3 * pools.slot_bytes
    assert D.recv_layout(pools.max_rows, *shape, expert_rows=em.em_rows + 1).end > pools.slot_bytes  # the most


def test_fixed_combine_and_zero_copy_layouts_hold_the_declared_rows():
    pools = _pools()
    px, pm, rows = pools.combine_layout(1024, 8)
    assert rows >= pools.max_rows and (px, pm) == D.combine_layout(rows, 1024, 8)[:2]
    assert pools.combine_layout(512, 4)[2] >= rows  # a smaller call fits more
    z0, m0, r0 = pools.zero_copy_layout(1024, 0)
    z1, m1, r1 = pools.zero_copy_layout(1024, 1)
    assert r0 == r1 == pools.max_rows and (z1 - z0, m1 - m0) == (pools.zero_copy_bytes,) * 2
    assert D.zero_copy_layout(pools.max_rows, 1024, pools.max_rows)[2] <= pools.zero_copy_bytes


@pytest.mark.parametrize("rows,m,x_bytes,ns,k", [(1, 8, 256, 0, 8), (21504, 32768, 14336, 0, 8),
                                                 (1000, 4000, 7168, 56, 8), (0, 0, 256, 0, 8), (5, 200, 4096, 32, 16)])
def test_expert_major_recv_layout_has_no_rank_major_payload(rows, m, x_bytes, ns, k):
    """Expert-major layouts: no rank-major x / scales; after src_idx the
    expert rows, their scales, their source rows and the pair map, aligned,
    disjoint, in that order."""
    lay = D.recv_layout(rows, x_bytes, ns, k, True, True, expert_rows=m)
    assert lay.x == -1 and lay.x_scales == -1 and lay.em_rows == m and lay.rows == rows
    arrays = [("topk_idx", lay.topk_idx, rows * k * 8), ("topk_weights", lay.topk_weights, rows * k * 4),
              ("src_idx", lay.src_idx, rows * 4), ("em_x", lay.em_x, m * x_bytes),
              ("em_x_scales", lay.em_x_scales, m * ns * 4), ("em_src_row", lay.em_src_row, m * 4),
              ("em_recv_row", lay.em_recv_row, rows * k * 4)]
    present = [(n, o, b) for n, o, b in arrays if o >= 0]
    assert (lay.em_x_scales >= 0) == bool(ns)
    for (_, o, b), (_, o2, _) in zip(present, present[1:]):
        assert o % D.ALIGN == 0 and o + b <= o2
    assert present[-1][1] + present[-1][2] <= lay.end
    s = lay.struct()
    assert int(s["em_rows"]) == m and int(s["em_x"]) == lay.em_x and int(s["x"]) == -1
    plain = D.recv_layout(rows, x_bytes, ns, k, True, True)
    assert plain.em_x == -1 and int(plain.struct()["em_x"]) == -1


def test_position_pass_warps_fit_the_block_and_shared_memory():
    assert D.hist_warps(256, 512) == 16 and D.hist_warps(256, 256) == 8
    assert D.hist_warps(4096, 512) == 3 and D.hist_warps(100000, 512) == 1
    for e in (8, 64, 256, 1024, 8192):
        for threads in (64, 512, 1024):
            w = D.hist_warps(e, threads)
            assert 1 <= w <= threads // 32 and (w == 1 or w * e <= D.HIST_INTS)
