"""CPU tests of cupyep's host-side logic: configs, the buffer layout, input
checks, the device error slot, run-time compilation bookkeeping, kernel
argument structs (against the C structs in cuda_src/), timing statistics and
the test payloads. Nothing here touches a GPU."""

import re
import shutil
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupyep import barrier, errors, jit, nvcc, testing

from cupyep.normal import layout as dispatch_layout
from cupyep.arrays import BF16, FP8, as_cupy, check
from cupyep.lab.bench.stamps import concurrent_ranks, cross_rank, trace_marks
from cupyep.lab.bench.timing import Timing
from cupyep.errors import (ERROR_SLOT_DTYPE, KERNEL_NAMES, KERNELS, CommTimeoutError, CupyepError,
                           error_from_slot, kernel_id)
from cupyep.normal import config as cfgmod
from cupyep.normal import internode_kernels as INTER
from cupyep import nvshmem as NV

from cupyep.normal import direct_kernels as D
from cupyep.normal import queue_kernels as K
from cupyep.normal import node_kernels as NK
from cupyep.normal import queue_layout as L
from cupyep.low_latency import kernels as LLK
from cupyep.normal.config import (COUNTER_STRIDE, MAX_CHANNELS, Config, get_combine_config,
                                     get_dispatch_config)
from cstructs import assert_mirrors, c_layout, c_structs

REPO = Path(__file__).resolve().parents[1]
RANKS = range(1, 9)


# ------------------------------------------------------------------ Config ---

def test_config_defaults_and_channels():
    c = Config()
    assert (c.num_sms, c.chunk_size, c.queue_depth, c.num_threads) == (24, 8, 32, 512)
    assert c.num_channels == 12
    assert Config(num_sms=2).num_channels == 1
    assert c.validate(8) is c  # returns itself for chaining


@pytest.mark.parametrize("num_sms", [0, 1, 3, 25, 2 * MAX_CHANNELS + 2, -2])
def test_validate_rejects_odd_or_out_of_range_num_sms(num_sms):
    with pytest.raises(ValueError, match=rf"num_sms must be even and in \[2, {2 * MAX_CHANNELS}\], got {num_sms}"):
        Config(num_sms=num_sms).validate(2)


@pytest.mark.parametrize("num_sms", [2, 24, 2 * MAX_CHANNELS])
def test_validate_accepts_even_num_sms(num_sms):
    Config(num_sms=num_sms).validate(2)


@pytest.mark.parametrize("num_threads", [0, 16, 100, 1056])
def test_validate_rejects_bad_num_threads(num_threads):
    with pytest.raises(ValueError, match=f"num_threads must be a multiple of 32 in \\[32, 1024\\], got {num_threads}"):
        Config(num_threads=num_threads).validate(1)


def test_validate_rejects_fewer_warps_than_ranks():
    with pytest.raises(ValueError, match="num_threads=64 gives 2 warps, fewer than the 4 ranks"):
        Config(num_threads=64, queue_depth=32).validate(4)
    with pytest.raises(ValueError, match="gives 7 warps, fewer than the 8 ranks"):
        Config(num_threads=224).validate(8)
    Config(num_threads=256).validate(8)  # one warp per rank is enough
    Config(num_threads=64).validate(2)


def test_validate_named_barrier_limit():
    # More than 15 ranks only with one warp per rank.
    with pytest.raises(ValueError, match="15 named barriers"):
        Config(num_threads=1024).validate(16)
    Config(num_threads=512).validate(16)
    Config(num_threads=1024).validate(15)


def test_validate_rejects_queue_shallower_than_chunk():
    with pytest.raises(ValueError, match=r"queue_depth \(7\) must be >= chunk_size \(8\)"):
        Config(chunk_size=8, queue_depth=7).validate(2)
    Config(chunk_size=8, queue_depth=8).validate(2)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        Config(chunk_size=0, queue_depth=8).validate(2)


def test_validate_combine_depth_rule():
    # 512 threads = 16 warps: combine needs depth >= 16 + chunk.
    c = Config(num_threads=512, chunk_size=8, queue_depth=23)
    assert c.validate(2) is c  # fine for dispatch
    with pytest.raises(ValueError, match=r"combine queue_depth \(23\) must be >= warps per block \(16\) \+ "
                                         r"chunk_size \(8\) = 24"):
        c.validate(2, combine=True)
    replace(c, queue_depth=24).validate(2, combine=True)
    with pytest.raises(ValueError, match="= 36"):
        Config(num_threads=1024, chunk_size=4, queue_depth=35).validate(8, combine=True)


@pytest.mark.parametrize("l2_hints", [-1, 3, True + 2])
def test_validate_rejects_bad_l2_hints(l2_hints):
    with pytest.raises(ValueError, match="l2_hints must be one of"):
        Config(l2_hints=l2_hints).validate(2)


def test_default_tables():
    assert get_dispatch_config(2) == Config(num_sms=48, chunk_size=8, queue_depth=32, l2_hints=2)
    assert get_dispatch_config(4) == Config(num_sms=32, chunk_size=2, queue_depth=8, l2_hints=2)
    assert get_dispatch_config(8) == Config(num_sms=16, chunk_size=2, queue_depth=8, l2_hints=2)
    assert get_combine_config(2) == Config(num_sms=48, chunk_size=4, queue_depth=32, l2_hints=2)
    assert get_combine_config(8) == Config(num_sms=16, chunk_size=4, queue_depth=32)
    # Between keys: the next larger key; below the smallest: the smallest.
    assert get_dispatch_config(3) == get_dispatch_config(4)
    assert get_dispatch_config(5) == get_dispatch_config(8)
    assert get_dispatch_config(1) == get_dispatch_config(2)
    assert get_combine_config(6) == get_combine_config(8)


@pytest.mark.parametrize("num_ranks", list(RANKS) + [12, 16, 24, 32])
def test_default_configs_are_valid(num_ranks):
    get_dispatch_config(num_ranks).validate(num_ranks)
    get_combine_config(num_ranks).validate(num_ranks, combine=True)
    for budget in (2, 3, 7, 16, 33, 132):
        d = get_dispatch_config(num_ranks, sm_budget=budget).validate(num_ranks)
        c = get_combine_config(num_ranks, sm_budget=budget).validate(num_ranks, combine=True)
        assert d.num_sms <= max(budget, 2) and c.num_sms <= max(budget, 2)


def test_more_ranks_than_warps_raise_num_threads():
    # Beyond the largest key the 8-rank entry is reused with one warp per rank.
    d = get_dispatch_config(20)
    assert d.num_threads == 32 * 20 and d.num_sms == 16
    assert get_dispatch_config(16).num_threads == 512  # 16 warps already


@pytest.mark.parametrize("getter", [get_dispatch_config, get_combine_config])
def test_sm_budget_caps_num_sms(getter):
    full = getter(2).num_sms
    assert full == 48
    assert getter(2, sm_budget=None).num_sms == 48
    assert getter(2, sm_budget=100).num_sms == 48  # budget above the default: unchanged
    assert getter(2, sm_budget=48).num_sms == 48
    assert getter(2, sm_budget=33).num_sms == 32   # rounded down to even
    assert getter(2, sm_budget=32).num_sms == 32
    assert getter(2, sm_budget=3).num_sms == 2
    assert getter(2, sm_budget=1).num_sms == 2     # never below 2
    assert getter(2, sm_budget=0).num_sms == 2
    assert getter(8, sm_budget=132 // 8).num_sms == 16
    assert getter(8, sm_budget=132 // 16).num_sms == 8
    # Only num_sms changes.
    capped = getter(4, sm_budget=10)
    assert replace(capped, num_sms=getter(4).num_sms) == getter(4)


def test_combine_depth_bump():
    # 32 ranks: 1024 threads = 32 warps, chunk 4 -> depth 36 > the table's 32.
    c = get_combine_config(32)
    assert (c.num_threads, c.chunk_size, c.queue_depth) == (1024, 4, 36)
    c.validate(32, combine=True)
    assert get_dispatch_config(32).queue_depth == get_dispatch_config(8).queue_depth  # dispatch has no such rule
    # No bump when the table depth suffices.
    assert get_combine_config(8).queue_depth == 32


def test_combine_depth_bump_with_patched_table(monkeypatch):
    monkeypatch.setitem(cfgmod._COMBINE, 4, Config(num_sms=8, chunk_size=8, queue_depth=10, num_threads=512))
    c = get_combine_config(4)
    assert c.queue_depth == 16 + 8 and c.chunk_size == 8 and c.num_sms == 8
    c.validate(4, combine=True)
    # Budget capping and the bump compose.
    assert get_combine_config(4, sm_budget=5) == Config(num_sms=4, chunk_size=8, queue_depth=24, num_threads=512)


# ------------------------------------------------------------------ layout ---

def _regions(lay):
    R = lay.num_ranks
    return [
        ("barrier", lay.barrier, barrier.barrier_region_bytes(R)),
        ("counters", lay.counters, 4 * MAX_CHANNELS * R * COUNTER_STRIDE),
        ("notify", lay.notify, R * lay.notify_row_ints * 4),
        ("dispatch", lay.dispatch_region, lay.region_bytes),
        ("combine", lay.combine_region, lay.region_bytes),
    ]


@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("extra", [0, 1, 127, 12345])
def test_buffer_layout_regions_disjoint_and_aligned(num_ranks, extra):
    nbytes = L.size_hint(num_ranks, hidden=1024, num_topk=8) + extra
    lay = L.buffer_layout(num_ranks, nbytes)
    regions = _regions(lay)
    for name, off, size in regions:
        assert off % L.ALIGN == 0, (name, off)
        assert size > 0, name
    assert lay.region_bytes % L.ALIGN == 0
    spans = sorted((off, off + size, name) for name, off, size in regions)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, f"{a} overlaps {b}"
    assert spans[-1][1] <= nbytes
    assert lay.dispatch_region == L.header_bytes(num_ranks)
    # The two ring regions take all but < 2 * ALIGN bytes after the header.
    assert nbytes - lay.combine_region - lay.region_bytes < 2 * L.ALIGN + L.ALIGN
    assert lay.notify_row_ints % 4 == 0
    assert lay.notify_row_ints >= num_ranks + L.MAX_LOCAL_EXPERTS + MAX_CHANNELS


@pytest.mark.parametrize("num_ranks", [1, 4, 8])
def test_counter_arrays_disjoint_inside_counter_region(num_ranks):
    lay = L.buffer_layout(num_ranks, L.size_hint(num_ranks))
    step = MAX_CHANNELS * num_ranks * COUNTER_STRIDE
    offs = [lay.counter(i) for i in range(4)]
    assert offs == [lay.counters + i * step for i in range(4)]
    assert offs[0] >= barrier.barrier_region_bytes(num_ranks)
    assert offs[3] + step == lay.notify


def test_buffer_layout_too_small():
    head = L.header_bytes(4)
    with pytest.raises(ValueError, match=f"smaller than the {head}-byte header for 4 ranks"):
        L.buffer_layout(4, head)
    with pytest.raises(ValueError, match="header"):
        L.buffer_layout(4, head + 2 * L.ALIGN - 1)
    assert L.buffer_layout(4, head + 2 * L.ALIGN).region_bytes == L.ALIGN


def test_slot_sizes():
    # Metadata is padded to 16 bytes, whole slots to 128-byte lines.
    assert L.dispatch_meta_bytes(8, 0) == 80                      # 4 * (1 + 16) = 68 -> 80
    assert L.dispatch_meta_bytes(8, 56) == 304                    # 4 * (1 + 16 + 56) = 292 -> 304
    assert L.combine_meta_bytes(8) == 48                          # 4 * 9 = 36 -> 48
    assert L.dispatch_slot(7168, 8, False) == (14336, 14464)      # 14336 + 80 -> 113 lines
    assert L.dispatch_slot(7168, 8, True) == (7168, 7552)         # 7168 + 304 -> 59 lines
    assert L.combine_slot(7168, 8) == (14336, 14464)              # 14336 + 48 -> 113 lines
    for hidden in (128, 256, 2048, 7168):
        for k in (1, 2, 5, 8, 16):
            for fp8 in (False, True):
                x, slot = L.dispatch_slot(hidden, k, fp8)
                assert x == (hidden if fp8 else 2 * hidden)
                meta = L.dispatch_meta_bytes(k, hidden // 128 if fp8 else 0)
                assert meta % 16 == 0 and meta >= 4 * (1 + 2 * k + (hidden // 128 if fp8 else 0))
                assert slot % L.ALIGN == 0 and 0 <= slot - (x + meta) < L.ALIGN
            x, slot = L.combine_slot(hidden, k)
            meta = L.combine_meta_bytes(k)
            assert x == 2 * hidden and meta % 16 == 0 and meta >= 4 * (1 + k)
            assert slot % L.ALIGN == 0 and 0 <= slot - (x + meta) < L.ALIGN


@pytest.mark.parametrize("num_ranks", range(2, 9))
@pytest.mark.parametrize("hidden,num_topk", [(7168, 16), (4096, 8), (2048, 6)])
def test_size_hint_fits_defaults(num_ranks, hidden, num_topk):
    dc, cc = get_dispatch_config(num_ranks), get_combine_config(num_ranks)
    nbytes = L.size_hint(num_ranks, hidden, num_topk)
    assert nbytes == L.size_hint(num_ranks, hidden, num_topk, dc, cc)
    lay = L.buffer_layout(num_ranks, nbytes)
    sets = [L.ring_set(lay, "dispatch", hidden, num_topk, fp8, dc) for fp8 in (False, True)]
    sets.append(L.ring_set(lay, "combine", hidden, num_topk, False, cc))
    for rs in sets[:2]:
        assert lay.dispatch_region <= rs.offset and rs.offset + rs.nbytes <= lay.combine_region
    comb = sets[2]
    assert lay.combine_region == comb.offset and comb.offset + comb.nbytes <= nbytes
    # Smaller calls fit too.
    L.ring_set(lay, "dispatch", hidden // 2, num_topk // 2, False, dc)
    # size_hint is not wasteful: the larger ring set nearly fills its region.
    need = max(rs.nbytes for rs in sets)
    assert lay.region_bytes - need < 2 * L.ALIGN


def test_size_hint_tracks_configs():
    deep = Config(num_sms=32, chunk_size=8, queue_depth=128)
    assert L.size_hint(4, 4096, 8, deep, deep) > L.size_hint(4, 4096, 8)
    lay = L.buffer_layout(4, L.size_hint(4, 4096, 8))
    with pytest.raises(ValueError):
        L.ring_set(lay, "dispatch", 4096, 8, False, deep)
    lay = L.buffer_layout(4, L.size_hint(4, 4096, 8, deep, deep))
    L.ring_set(lay, "dispatch", 4096, 8, False, deep)
    L.ring_set(lay, "combine", 4096, 8, False, deep)
    # Each kind sized by its own config: a deep combine with a shallow dispatch.
    small = Config(num_sms=2, chunk_size=1, queue_depth=1)
    lay = L.buffer_layout(4, L.size_hint(4, 4096, 8, small, deep))
    assert L.ring_set(lay, "combine", 4096, 8, False, deep).nbytes > L.ring_set(
        lay, "dispatch", 4096, 8, False, small).nbytes
    lay = L.buffer_layout(4, L.size_hint(4, 4096, 8, deep, small))
    L.ring_set(lay, "dispatch", 4096, 8, False, deep)
    L.ring_set(lay, "dispatch", 4096, 8, True, deep)


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_ring_set_too_big_names_needed_size(kind):
    cfg = get_dispatch_config(4) if kind == "dispatch" else get_combine_config(4)
    hidden, k = 7168, 8
    slot = (L.dispatch_slot if kind == "dispatch" else lambda h, kk, _: L.combine_slot(h, kk))(hidden, k, False)[1]
    need = L.ring_bytes(4, slot, cfg)
    lay = L.buffer_layout(4, L.header_bytes(4) + 2 * (need - L.ALIGN))
    assert lay.region_bytes < need
    with pytest.raises(ValueError) as info:
        L.ring_set(lay, kind, hidden, k, False, cfg)
    msg = str(info.value)
    assert msg.startswith(f"{kind} rings need {need} bytes")
    assert f"holds {lay.region_bytes}" in msg
    hint = int(re.search(r"num_bytes >= (\d+)", msg).group(1))
    assert hint == L.size_hint(4, hidden, k, cfg, cfg)
    # The suggested size does fit.
    L.ring_set(L.buffer_layout(4, hint), kind, hidden, k, False, cfg)
    # One more ALIGN of region and it fits exactly.
    exact = L.buffer_layout(4, L.header_bytes(4) + 2 * need)
    assert exact.region_bytes == need
    assert L.ring_set(exact, kind, hidden, k, False, cfg).nbytes == need


def test_ring_set_fields():
    cfg = Config(num_sms=8, chunk_size=4, queue_depth=16)
    lay = L.buffer_layout(4, 64 << 20)
    rs = L.ring_set(lay, "dispatch", 1024, 4, True, cfg)
    assert (rs.x_bytes, rs.slot_bytes) == L.dispatch_slot(1024, 4, True)
    assert (rs.depth, rs.chunk, rs.num_channels, rs.num_ranks) == (16, 4, 4, 4)
    assert rs.nbytes == 4 * 4 * 16 * rs.slot_bytes == L.ring_bytes(4, rs.slot_bytes, cfg)
    assert rs.offset == lay.dispatch_region
    rc = L.ring_set(lay, "combine", 1024, 4, False, cfg)
    assert rc.offset == lay.combine_region and rc.x_bytes == 2048


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_counters_fixed_whatever_the_call(num_ranks):
    lay = L.buffer_layout(num_ranks, 256 << 20)
    seen = {"dispatch": set(), "combine": set()}
    for hidden in (128, 2048, 7168):
        for k in (1, 8):
            for fp8 in (False, True):
                for cfg in (Config(), get_dispatch_config(num_ranks), Config(num_sms=4, chunk_size=2, queue_depth=64)):
                    for kind in seen:
                        rs = L.ring_set(lay, kind, hidden, k, fp8, cfg)
                        seen[kind].add((rs.counter_tail, rs.counter_head, rs.offset))
    assert seen["dispatch"] == {(lay.counter(0), lay.counter(1), lay.dispatch_region)}
    assert seen["combine"] == {(lay.counter(2), lay.counter(3), lay.combine_region)}


def test_offsets_and_ring_structs_mirror_layout():
    lay = L.buffer_layout(4, L.size_hint(4))
    off = NK.offsets_struct(lay)
    assert off["barrier"] == lay.barrier and off["notify"] == lay.notify
    assert off["notify_row_ints"] == lay.notify_row_ints
    assert [int(off[n]) for n in ("dispatch_tail", "dispatch_head", "combine_tail", "combine_head")] == \
        [lay.counter(i) for i in range(4)]
    assert (off["dispatch_ring"], off["combine_ring"]) == (lay.dispatch_region, lay.combine_region)
    rs = L.ring_set(lay, "combine", 7168, 16, False, get_combine_config(4))
    s = K.ring_struct(rs)
    assert [int(s[n]) for n in ("ring", "counter_tail", "counter_head", "slot_bytes", "x_bytes", "depth", "chunk")] \
        == [rs.offset, rs.counter_tail, rs.counter_head, rs.slot_bytes, rs.x_bytes, rs.depth, rs.chunk]


# ------------------------------------------------------------------ arrays ---

def test_check_passes_and_returns_the_array():
    a = np.zeros((3, 4), np.uint16)
    assert check(a, "x", BF16, shape=(3, 4)) is a
    assert check(a, "x", BF16, shape=(None, 4), ndim=2) is a
    assert check(np.zeros(5, np.uint8), "y", FP8, shape=(None,)) is not None
    assert check(a[:, ::2], "x", contiguous=False).shape == (3, 2)


def test_check_dtype_error_names_array_and_dtypes():
    with pytest.raises(ValueError, match="^topk_idx must have dtype int64, got int32$"):
        check(np.zeros((2, 4), np.int32), "topk_idx", np.int64)
    with pytest.raises(ValueError, match="^x must have dtype uint16, got float32$"):
        check(np.zeros((2, 4), np.float32), "x", BF16)


def test_check_shape_errors_name_array_and_shapes():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"^topk_weights must have shape \[\*, 4\], got \[2, 3\]$"):
        check(a, "topk_weights", shape=(None, 4))
    with pytest.raises(ValueError, match=r"^w must have shape \[2\], got \[2, 3\]$"):
        check(a, "w", shape=(2,))
    with pytest.raises(ValueError, match=r"^w must have shape \[5, 3\], got \[2, 3\]$"):
        check(a, "w", shape=(5, 3))
    with pytest.raises(ValueError, match=r"^x must be 1-D, got shape \(2, 3\)$"):
        check(a, "x", ndim=1)


def test_check_contiguity():
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="^x_scales must be C-contiguous$"):
        check(a[:, ::2], "x_scales")
    with pytest.raises(ValueError, match="C-contiguous"):
        check(a.T, "x_scales")


@pytest.mark.parametrize("value", [np.zeros((2, 2), np.float32), [1, 2, 3], 3.0])
def test_as_cupy_rejects_host_data(value):
    with pytest.raises(TypeError):
        as_cupy(value, "x")


def test_as_cupy_error_names_the_argument():
    with pytest.raises(TypeError, match="^recv_x must be a CuPy array .* got list$"):
        as_cupy([1.0], "recv_x")
    assert as_cupy(None, "x") is None


# ------------------------------------------------------------------ errors ---

def _slot(**fields):
    a = np.zeros(1, ERROR_SLOT_DTYPE)
    for k, v in fields.items():
        a[0][k] = v
    return a[0]


def test_error_from_slot_names_everything():
    slot = _slot(flag=1, kernel=kernel_id("queue_dispatch"), rank=3, peer=1, phase=1, block=7,
                 value=5, expected=9)
    err = error_from_slot(slot, 2.5, rank_of_peer=lambda p: 8 + p)
    assert isinstance(err, CommTimeoutError) and isinstance(err, CupyepError) and isinstance(err, RuntimeError)
    assert err.kernel == "queue_dispatch"
    assert err.phase == "dispatch queue data (receiver waits for sender tail)"
    assert (err.rank, err.peer, err.value, err.expected, err.timeout_s) == (3, 9, 5, 9, 2.5)
    msg = str(err)
    assert msg.startswith("queue_dispatch: timeout in phase 'dispatch queue data (receiver waits for sender "
                          "tail)': rank 3 waited for peer rank 9 for more than 2.5 s (counter 5, expected 9); "
                          "block 7.")
    assert "destroy the buffer" in msg


def test_error_from_slot_default_peer_mapping_and_no_peer():
    err = error_from_slot(_slot(flag=1, kernel=kernel_id("barrier"), rank=2, peer=6, phase=0), 1.0)
    assert (err.kernel, err.phase, err.peer) == ("barrier", "barrier arrival", 6)
    err = error_from_slot(_slot(flag=1, kernel=kernel_id("notify"), rank=0, peer=-1, phase=1,
                                value=-3, expected=4), 10.0, rank_of_peer=lambda p: 100 + p)
    assert err.peer is None and err.phase == "notify counts"
    assert "waited for" not in str(err) and "rank 0" in str(err) and "(counter -3, expected 4)" in str(err)


def test_error_from_slot_unknown_kernel_and_phase():
    err = error_from_slot(_slot(flag=1, kernel=99, phase=0, peer=0), 1.0)
    assert err.kernel == "kernel#99" and err.phase == "phase#0"
    err = error_from_slot(_slot(flag=1, kernel=kernel_id("queue_combine"), phase=5), 1.0)
    assert err.kernel == "queue_combine" and err.phase == "phase#5"
    err = error_from_slot(_slot(flag=1, kernel=-1, phase=-1), 1.0)
    assert err.kernel == "kernel#-1" and err.phase == "phase#-1"


def test_kernel_ids():
    assert KERNEL_NAMES == tuple(KERNELS)
    assert [kernel_id(n) for n in KERNEL_NAMES] == list(range(len(KERNEL_NAMES)))
    assert KERNEL_NAMES[0] == "barrier"
    with pytest.raises(ValueError):
        kernel_id("no_such_kernel")


def test_error_slot_dtype():
    assert ERROR_SLOT_DTYPE.itemsize == 40
    assert ERROR_SLOT_DTYPE.names == ("flag", "kernel", "rank", "peer", "phase", "block", "value", "expected")
    assert [ERROR_SLOT_DTYPE.fields[n][1] for n in ERROR_SLOT_DTYPE.names] == [0, 4, 8, 12, 16, 20, 24, 32]


# -------------------------------------------------- C structs vs dtypes ---

MIRRORS = [
    (errors.ERROR_SLOT_DTYPE, "ErrorSlot"),
    (errors.GUARD_DTYPE, "Guard"),
    (barrier.BARRIER_ARGS_DTYPE, "BarrierArgs"),
    (barrier.WORLD_BARRIER_ARGS_DTYPE, "WorldBarrierArgs"),
    (NK.OFFSETS_DTYPE, "BufferOffsets"),
    (K.RING_DTYPE, "RingShape"),
    (dispatch_layout.LAYOUT_ARGS_DTYPE, "LayoutArgs"),
    (NK.NOTIFY_ARGS_DTYPE, "NotifyArgs"),
    (K.DISPATCH_ARGS_DTYPE, "DispatchArgs"),
    (K.COMBINE_ARGS_DTYPE, "CombineArgs"),
    (D.SYNC_DTYPE, "DirectSync"),
    (D.X_PEERS_DTYPE, "DirectXPeers"),
    (D.RECV_LAYOUT_DTYPE, "DirectRecvLayout"),
    (D.DISPATCH_ARGS_DTYPE, "DirectDispatchArgs"),
    (D.COMBINE_ARGS_DTYPE, "DirectCombineArgs"),
    (D.FUSED_ARGS_DTYPE, "DirectFusedArgs"),
    (LLK.SET_DTYPE, "low_latency::SetOffsets"),
    (LLK.CALL_DTYPE, "low_latency::CallArgs"),
    (LLK.DISPATCH_ARGS_DTYPE, "low_latency::DispatchArgs"),
    (LLK.COMBINE_ARGS_DTYPE, "low_latency::CombineArgs"),
    (NV.put_signal_args_dtype(), "PutSignalArgs"),
    (NV.get_item_dtype(), "GetItem"),
    (NV.get_rows_args_dtype(), "GetRowsArgs"),
    (INTER.NOTIFY_ARGS_DTYPE, "TwoHopNotifyArgs"),
    (INTER.ARGS_DTYPE, "TwoHopDispatchArgs"),
    (INTER.COMBINE_ARGS_DTYPE, "TwoHopCombineArgs"),
]


@pytest.mark.parametrize("dtype,cname", MIRRORS, ids=[c for _, c in MIRRORS])
def test_dtype_mirrors_c_struct(dtype, cname):
    assert_mirrors(dtype, cname, c_structs())


def test_c_struct_parser_sees_the_error_slot():
    # Guards the parser itself: ErrorSlot as written in timeout.cuh.
    structs = c_structs()
    assert [f for f, *_ in structs["ErrorSlot"]] == list(ERROR_SLOT_DTYPE.names)
    assert c_layout("ErrorSlot", structs)[0] == 40
    assert c_layout("Guard", structs)[0] == 24
    assert structs["BufferOffsets"][3:7] == [(n, "int64_t", False) for n in
                                              ("dispatch_tail", "dispatch_head", "combine_tail", "combine_head")]


def test_mirror_check_catches_a_swapped_field():
    structs = c_structs()
    swapped = np.dtype([("slot", np.uint64), ("timeout_ns", np.uint64), ("rank", np.int32),
                        ("kernel", np.int32)], align=True)
    with pytest.raises(AssertionError, match="names/order"):
        assert_mirrors(swapped, "Guard", structs)
    narrow = np.dtype([("slot", np.uint64), ("timeout_ns", np.uint32), ("kernel", np.int32),
                       ("rank", np.int32)], align=True)
    with pytest.raises(AssertionError):
        assert_mirrors(narrow, "Guard", structs)


def _walk(dtype, base=0):
    for name in dtype.names:
        ftype, off = dtype.fields[name][:2]
        yield name, ftype, base + off
        if ftype.names:
            yield from _walk(ftype, base + off)


@pytest.mark.parametrize("dtype,cname", MIRRORS, ids=[c for _, c in MIRRORS])
def test_struct_dtype_natural_alignment(dtype, cname):
    offs = [dtype.fields[n][1] for n in dtype.names]
    assert offs == sorted(offs) and len(set(offs)) == len(offs)
    for name, ftype, off in _walk(dtype):
        if ftype.names:
            assert off % 8 == 0, name
        else:
            assert off % ftype.itemsize == 0, (name, off, ftype)
            if ftype in (np.dtype(np.uint64), np.dtype(np.int64)):
                assert off % 8 == 0, name
    assert dtype.itemsize % 8 == 0


def test_guard_dtype():
    g = errors.GUARD_DTYPE
    assert g.itemsize == 24
    assert [g.fields[n][1] for n in g.names] == [0, 8, 16, 20]
    assert NK.NOTIFY_ARGS_DTYPE.fields["guard"][1] % 8 == 0


def test_struct_dtype_pads_like_c():
    d = jit.struct_dtype([("a", np.int32), ("b", np.int64), ("c", np.int32)])
    assert [d.fields[n][1] for n in d.names] == [0, 8, 16] and d.itemsize == 24


def test_pack_sets_fields_and_zeroes_the_rest():
    v = jit.pack(errors.GUARD_DTYPE, timeout_ns=5, rank=3)
    assert isinstance(v, np.void) and v.dtype == errors.GUARD_DTYPE
    assert (int(v["slot"]), int(v["timeout_ns"]), int(v["kernel"]), int(v["rank"])) == (0, 5, 0, 3)
    raw = np.frombuffer(v.tobytes(), np.uint8)
    assert raw[8] == 5 and raw[20] == 3 and raw.sum() == 8
    nested = jit.pack(barrier.BARRIER_ARGS_DTYPE, offset=128, guard=v)
    assert int(nested["guard"]["rank"]) == 3 and int(nested["offset"]) == 128


def test_pack_writes_every_field_where_numpy_puts_it():
    """The generated packer against NumPy's own structured assignment, on
    the largest argument struct (nested structs, padding, every width)."""
    from cupyep.normal import direct_kernels as D
    dt = D.FUSED_ARGS_DTYPE
    want = np.zeros((), dt)
    rng = np.random.default_rng(0)
    values = {}
    for name in dt.names:
        ft = dt.fields[name][0]
        if ft.fields:
            sub = np.zeros((), ft)
            for n in ft.names:
                if ft.fields[n][0].fields:
                    continue
                sub[n] = rng.integers(1, 1 << 20)
            want[name] = sub
            values[name] = sub[()]
        else:
            want[name] = values[name] = int(rng.integers(1, 1 << 30))
    got = jit.pack(dt, **values)
    assert got.tobytes() == want.tobytes()
    assert jit.pack(dt, host_status=7, dispatch=want["dispatch"].tobytes())["dispatch"].tobytes() == \
        want["dispatch"].tobytes()  # a nested struct given as its bytes
    with pytest.raises(ValueError, match="no field"):
        jit.pack(dt, not_a_field=1)


def test_evolve_is_dataclasses_replace_on_frozen_handles():
    import dataclasses
    from cupyep.results import DispatchHandle, evolve
    fields = {f.name: None for f in dataclasses.fields(DispatchHandle) if f.default is dataclasses.MISSING}
    h = DispatchHandle(**{**fields, "num_recv_tokens": 3, "num_tokens": 4})
    e = evolve(h, num_recv_tokens=5)
    assert e == dataclasses.replace(h, num_recv_tokens=5) and h.num_recv_tokens == 3 and type(e) is DispatchHandle
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.num_tokens = 1
    with pytest.raises(TypeError, match="no field"):
        evolve(h, not_a_field=1)


class _Mem:
    """A device pointer's stand-in (MemoryPointer's ptr and + offset)."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __add__(self, off):
        return _Mem(self.ptr + off)


class _Arr:
    def __init__(self, ptr):
        self.data = _Mem(ptr)


def _carved(names=("rpm", "recv_cp", "recv_off", "in_rank", "send_head", "send_list", "send_cp", "src_idx")):
    from cupyep.arrays import Carved
    plan = {name: (64 * i, (4,), np.dtype(np.int32)) for i, name in enumerate(names)}
    return Carved(_Arr(4096), plan)


def test_carved_arrays_have_addresses_without_views_and_set_entries_win():
    c = _carved(("a", "b"))
    assert (c.ptr("a"), c.ptr("b"), c.ptr("absent")) == (4096, 4160, 0)
    assert "a" in c and "absent" not in c and c.get("absent", 7) == 7
    mine = _Arr(9000)
    c["b"] = mine  # the caller's array instead of its carved part
    assert c.ptr("b") == 9000 and c["b"] is mine
    c["alignment"] = 128  # any value
    assert c["alignment"] == 128
    with pytest.raises(KeyError):
        c["absent"]


def test_a_carved_handle_reads_its_routing_arrays_from_the_allocation():
    import dataclasses
    from cupyep.results import CARVED_FIELDS, DispatchHandle, carved_handle, evolve
    c = _carved()
    c["in_rank"] = _Arr(7000)  # the caller's is_token_in_rank
    h = carved_handle(c, num_recv_tokens=3, num_worst_tokens=0, num_tokens=4, hidden=128, num_experts=8,
                      num_channels=1, buffer_id=1, transport="direct")
    assert type(h) is DispatchHandle and h.lease is None and h.recv_expert_row is None and h.num_recv_tokens == 3
    assert {name: h.array_ptr(name) for name in CARVED_FIELDS} == {name: c.ptr(key) for name, key in
                                                                  CARVED_FIELDS.items()}
    assert h.array_ptr("is_token_in_rank") == 7000 and h.is_token_in_rank is c["in_rank"]
    e = evolve(h, lease="slot")  # a copy keeps the allocation, and its arrays unviewed
    assert e.lease == "slot" and e.array_ptr("send_head") == c.ptr("send_head") and h.lease is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.num_tokens = 1
    with pytest.raises(AttributeError):
        h.not_a_field
    q = carved_handle(_carved(("rpm", "recv_cp", "recv_off", "in_rank", "send_head", "send_list", "send_cp")),
                      num_recv_tokens=3, num_worst_tokens=0, num_tokens=4, hidden=128, num_experts=8, num_channels=1,
                      buffer_id=1)
    assert q.recv_src_idx is None and q.array_ptr("recv_src_idx") == 0  # not carved: the route sets its own


# --------------------------------------------------------------------- jit ---

def test_kernel_spec_options():
    spec = jit.KernelSpec(name="t", source="runtime/runtime.cu", kernels=("k",), defines=(("FOO", 3), ("BAR", 0)))
    opts = spec.options()
    assert "-std=c++17" in opts
    assert f"-I{jit.CUDA_SRC}" in opts
    assert f"-DCUPYEP_SOURCE_HASH=0x{jit.source_hash()[:16]}" in opts
    assert opts[-2:] == ("-DFOO=3", "-DBAR=0")
    assert (jit.CUDA_SRC / "common" / "timeout.cuh").is_file()
    assert jit.CUDA_SRC.resolve() == (REPO / "cuda_src").resolve()
    assert re.fullmatch(r"[0-9a-f]{64}", jit.source_hash())


@pytest.fixture
def src_copy(tmp_path, monkeypatch):
    original = jit.source_hash()
    copy = tmp_path / "cuda_src"
    shutil.copytree(jit.CUDA_SRC, copy)
    monkeypatch.setattr(nvcc, "CUDA_SRC", copy)
    jit.source_hash.cache_clear()
    yield copy, original
    jit.source_hash.cache_clear()


def _rehash():
    jit.source_hash.cache_clear()
    return jit.source_hash()


def test_source_hash_follows_the_sources(src_copy):
    copy, original = src_copy
    spec = jit.KernelSpec(name="t", source="runtime/runtime.cu", kernels=("k",))
    assert jit.source_hash() == original  # depends on relative paths and contents only
    opts0 = spec.options()
    assert f"-I{copy}" in opts0
    header = copy / "common" / "timeout.cuh"
    text = header.read_text()
    header.write_text(text + "\n// edited\n")
    assert jit.source_hash() == original  # cached until cleared
    edited = _rehash()
    assert edited != original
    assert spec.options() != opts0 and f"-DCUPYEP_SOURCE_HASH=0x{edited[:16]}" in spec.options()
    header.write_text(text)
    assert _rehash() == original
    (copy / "notes.txt").write_text("not a source")  # non-source files do not count
    assert _rehash() == original
    (copy / "common" / "extra.cuh").write_text("#pragma once\n")  # new header counts
    assert _rehash() != original
    (copy / "common" / "extra.cuh").unlink()
    (copy / "common" / "ptx.cuh").rename(copy / "common" / "ptx2.cuh")  # a rename counts
    assert _rehash() != original


def test_all_specs():
    specs = jit.all_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    for r in RANKS:
        assert f"notify_ranks_{r}" in names
        for t in (512, 768):
            for l2 in (0, 1, 2):
                assert f"queue_dispatch_ranks_{r}_threads_{t}_l2_{l2}" in names
                assert f"queue_combine_ranks_{r}_threads_{t}_l2_{l2}" in names
    assert {"runtime", "bench_copy", "fp8_cast", "layout"} <= set(names)
    by_name = {s.name: s for s in specs}
    assert by_name["queue_dispatch_ranks_3_threads_768_l2_2"].kernels == ("cupyep::normal::queue_dispatch<3, 768, 2>",)
    assert by_name["queue_combine_ranks_8_threads_512_l2_0"].kernels == ("cupyep::normal::queue_combine<8, 512, 0>",)
    for s in specs:
        assert (jit.CUDA_SRC / s.source).is_file(), s
        assert s.kernels and all(k.startswith("cupyep::") for k in s.kernels)
        hash(s)  # frozen: usable as a cache key


def test_all_specs_rejects_duplicates(monkeypatch):
    monkeypatch.setattr(jit, "SPEC_MODULES", jit.SPEC_MODULES + ("cupyep.barrier",))
    with pytest.raises(ValueError, match=r"duplicate kernel spec names: \['runtime', 'shmem_world_barrier'\]"):
        jit.all_specs()


def test_thread_choices_cover_default_configs():
    for r in RANKS:
        assert get_dispatch_config(r).num_threads in K.THREAD_CHOICES
        assert get_combine_config(r).num_threads in K.THREAD_CHOICES


def test_wheel_ships_every_package_and_kernel_source():
    """pyproject lists every Python package under cupyep/, and its package-data
    glob (one folder deep) reaches every kernel source, so a non-editable
    install has all of them."""
    import tomllib
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "cupyep").rglob("__init__.py")}
    assert found <= listed, f"missing from pyproject packages: {sorted(found - listed)}"
    assert conf["package-dir"]["cupyep.cuda_src"] == "cuda_src"
    globs = conf["package-data"]["cupyep.cuda_src"]
    sources = [p.relative_to(jit.CUDA_SRC) for p in jit.CUDA_SRC.rglob("*") if p.suffix in (".cu", ".cuh")]
    assert sources and all(any(s.match(g) and len(s.parts) == len(Path(g).parts) for g in globs) for s in sources)


# ------------------------------------------------------------------ timing ---

def test_timing_from_samples():
    t = Timing.from_samples([3.0, 1.0, 2.0, 4.0, 100.0])
    assert (t.median_s, t.mean_s, t.min_s, t.max_s, t.n) == (3.0, 22.0, 1.0, 100.0, 5)
    assert t.p99_s == pytest.approx(4.0 + 0.96 * 96.0)  # linear interpolation
    assert isinstance(t.n, int) and all(isinstance(v, float) for v in (t.median_s, t.mean_s, t.p99_s))
    assert t.p10_s == pytest.approx(1.0 + 0.4 * 1.0) and t.p90_s == pytest.approx(4.0 + 0.6 * 96.0)
    one = Timing.from_samples([2e-6])
    assert one == Timing(2e-6, 2e-6, 2e-6, 2e-6, 2e-6, 1, 2e-6, 2e-6)
    even = Timing.from_samples(np.array([1.0, 2.0, 3.0, 4.0]))
    assert even.median_s == 2.5 and even.n == 4


def test_timing_as_us():
    us = Timing.from_samples([1e-6, 3e-6]).as_us()
    assert set(us) == {"median_us", "mean_us", "p99_us", "min_us", "max_us", "n", "p10_us", "p90_us"}
    assert us["n"] == 2
    assert us["median_us"] == pytest.approx(2.0) and us["max_us"] == pytest.approx(3.0)
    assert us["min_us"] == pytest.approx(1.0)


def test_cross_rank_stamps():
    # 2 ranks, 3 calls: rank 1 starts 5 us late in call 0, 1 us late in calls 1 and 2.
    k = np.array([[[0, 10_000], [100_000, 108_000], [200_000, 209_000]],
                  [[5_000, 12_000], [101_000, 110_000], [201_000, 207_000]]], dtype=np.int64)
    c = cross_rank(k)
    assert c["skew"]["median_us"] == pytest.approx(1.0)
    assert c["span"]["median_us"] == pytest.approx(10.0)          # 12, 10, 9
    assert c["after_last_start"]["median_us"] == pytest.approx(8.0)  # 7, 9, 8
    assert c["skew"]["p99_us"] == pytest.approx(1.0 + 0.98 * 4.0)
    with pytest.raises(ValueError):
        cross_rank(k[..., :1])


def test_concurrent_ranks_counts_overlapping_kernels():
    # 3 ranks, 2 calls. Call 0: ranks 0 and 1 overlap, rank 2 runs after both (1 + 2 + 2 ... per rank:
    # rank 0 -> {0, 1}, rank 1 -> {0, 1}, rank 2 -> {2}: mean 5 / 3). Call 1: all three overlap (3).
    k = np.array([[[0, 10], [100, 120]],
                  [[5, 15], [105, 125]],
                  [[20, 30], [110, 130]]], dtype=np.int64)
    c = concurrent_ranks(k)
    assert c["min"] == pytest.approx(5 / 3) and c["max"] == pytest.approx(3.0)
    assert c["median"] == pytest.approx((5 / 3 + 3) / 2)
    with pytest.raises(ValueError):
        concurrent_ranks(k[0])


def test_deepep_record_adds_cross_rank_fields_on_one_gpu():
    from types import SimpleNamespace

    from cupyep.lab.bench.low_latency import deepep_record
    from cupyep.lab.bench.stamps import kernel_seconds
    mine = np.array([[0, 10_000], [100_000, 108_000]], dtype=np.int64)   # rank 0: 10 us, 8 us
    peer = np.array([[20_000, 26_000], [101_000, 111_000]], dtype=np.int64)  # rank 1: 6 us, 10 us
    dur = kernel_seconds(peer)

    def comm(with_stamps):  # rank 0's view: its own contribution, then rank 1's
        theirs = (float(np.median(dur)), float(np.mean(dur)), 1, peer if with_stamps else None)
        return SimpleNamespace(allgather=lambda own: [own, theirs])
    rec = deepep_record(comm(True), {"bench": "low_latency"}, "k", mine, 1, None, 2.0, one_gpu=True)
    assert rec["kernel_median_us"] == pytest.approx(9.0)           # the slower rank's median
    assert rec["skew_median_us"] == pytest.approx((20 + 1) / 2)   # 20 us, then 1 us
    assert rec["concurrent_ranks_min"] == pytest.approx(1.0)      # call 0: apart
    assert rec["concurrent_ranks_max"] == pytest.approx(2.0)      # call 1: together
    plain = deepep_record(comm(False), {}, "k", mine, 1, None, 2.0)
    assert "skew_median_us" not in plain and "concurrent_ranks_median" not in plain


def test_trace_marks():
    names = ("start", "sent", "end")
    t = np.zeros((2, 2, 3, 4), dtype=np.int64)   # [R, n, G, M]
    for call in range(2):
        base = 1_000_000 * (call + 1)
        # rank 0 starts at base, its blocks finish sending at +2/+3 us; rank 1 starts 1 us later.
        t[0, call, :, 0] = base + np.array([0, 100, 200])
        t[1, call, :, 0] = base + 1000
        t[0, call, :, 1] = base + np.array([2000, 3000, 2500])
        t[1, call, :, 1] = base + 4000 + 1000 * call
        t[:, call, :, 2] = base + 6000
    m = trace_marks(t, names)
    assert m["start"] == {"first_rank_us": pytest.approx(0.2), "last_rank_us": pytest.approx(1.0)}
    assert m["sent"]["first_rank_us"] == pytest.approx(3.0)
    assert m["sent"]["last_rank_us"] == pytest.approx(4.5)      # median of 4 and 5
    assert m["end"] == {"first_rank_us": pytest.approx(6.0), "last_rank_us": pytest.approx(6.0)}
    t[..., 2] = 0                                                 # a mark nobody reached is left out
    assert set(trace_marks(t, names)) == {"start", "sent"}
    with pytest.raises(ValueError):
        trace_marks(t[0], names)


# ----------------------------------------------------------------- testing ---

def test_payload_bf16_deterministic_and_bounded():
    a = testing.payload_bf16(2, np.arange(64), 512)
    assert a.dtype == np.uint16 and a.shape == (64, 512)
    assert np.array_equal(a, testing.payload_bf16(2, list(range(64)), 512))
    f = testing.bf16_to_f32(a)
    assert np.isfinite(f).all() and (np.abs(f) < 1).all()
    assert (f < 0).any() and (f > 0).any()
    assert np.array_equal(f, a.view(ml_dtypes.bfloat16).astype(np.float32))
    assert testing.payload_bf16(0, [], 128).shape == (0, 128)


def test_payload_bf16_is_a_function_of_rank_token_column():
    full = testing.payload_bf16(1, np.arange(100), 256)
    picked = testing.payload_bf16(1, [57, 3, 57], 256)
    assert np.array_equal(picked, full[[57, 3, 57]])
    assert np.array_equal(testing.payload_bf16(1, [9], 128)[0], full[9, :128])  # columns independent of hidden


def test_payload_bf16_differs_across_ranks_tokens_columns():
    tokens, hidden = np.arange(32), 256
    per_rank = [testing.payload_bf16(r, tokens, hidden) for r in range(8)]
    for r in range(8):
        for s in range(r + 1, 8):
            assert (per_rank[r] != per_rank[s]).mean() > 0.95, (r, s)
    a = per_rank[0]
    for i in range(len(tokens)):
        for j in range(i + 1, len(tokens)):
            assert (a[i] != a[j]).mean() > 0.95, (i, j)
    # A misplaced column is caught: neighbouring columns differ almost everywhere.
    assert (a[:, 1:] != a[:, :-1]).mean() > 0.95
    assert len(np.unique(a)) > a.size // 2


def test_bf16_round_trip_every_non_nan_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = testing.bf16_to_f32(bits)
    assert f.dtype == np.float32
    keep = ~np.isnan(f)
    assert np.array_equal(testing.f32_to_bf16(f[keep]), bits[keep])
    assert testing.bf16_to_f32(np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80], np.uint16)).tolist() == \
        [1.0, -2.0, 0.0, -0.0, float("inf")]


def test_f32_to_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.0, 3.0], np.float32)
    assert testing.f32_to_bf16(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC000, 0x4040]
    rng = np.random.default_rng(0)
    v = rng.standard_normal(10000).astype(np.float32)
    back = testing.bf16_to_f32(testing.f32_to_bf16(v))
    assert np.all(np.abs(back - v) <= np.abs(v) * 2 ** -8)
    assert testing.f32_to_bf16(v).dtype == np.uint16


def test_ptr():
    class Arr:
        class data:
            ptr = 0xABC0
    assert jit.ptr(None) == 0 and jit.ptr(Arr()) == 0xABC0


def test_require_resident():
    jit.require_resident("x", per_sm=1, blocks=16, num_threads=512, ranks_per_gpu=8, num_sms=132, knob="num_sms")
    with pytest.raises(ValueError, match=r"dispatch: 8 ranks x num_sms=18 blocks of 512 threads cannot all be "
                                         r"resident on 132 SMs \(1 such blocks per SM\).*Use num_sms <= 16"):
        jit.require_resident("dispatch", 1, 18, 512, 8, 132, "num_sms", step=2)
    with pytest.raises(ValueError, match="Use num_blocks <= 0"):
        jit.require_resident("ll", 0, 1, 1024, 2, 132, "num_blocks")
    # Room for one block that does not wait: 8 x 16 + 4 fit, 8 x 16 + 5 do not.
    jit.require_resident("ll", 1, 16, 512, 8, 132, "num_waiters", spare=4)
    with pytest.raises(ValueError, match="Use num_waiters <= 15"):
        jit.require_resident("ll", 1, 16, 512, 8, 132, "num_waiters", spare=5)


def test_kernel_seconds_of_stamps():
    from cupyep.lab.bench.stamps import kernel_seconds
    st = np.array([[[1000, 4000], [0, 2500]]], dtype=np.int64)
    assert np.allclose(kernel_seconds(st), [[3e-6, 2.5e-6]])
    with pytest.raises(ValueError, match="dimension of 2"):
        kernel_seconds(np.zeros((3, 3), dtype=np.int64))


def test_kernels_across_nodes_report_global_peers():
    """An internode kernel's peer is an NVSHMEM PE (a global rank): the
    node-local mapping that other kernels' peers go through is not applied."""
    from cupyep.errors import error_from_slot, kernel_id
    base = lambda p: 4 + p  # noqa: E731  (rank 5 of nodes of 4)
    local = error_from_slot(_slot(flag=1, kernel=kernel_id("barrier"), rank=5, peer=2, phase=0), 1.0, base)
    glob = error_from_slot(_slot(flag=1, kernel=kernel_id("two_hop_dispatch"), rank=5, peer=2, phase=0),
                           1.0, base)
    assert local.peer == 6 and glob.peer == 2 and "network" in glob.phase
    for kernel, phase in (("shmem_world_barrier", 0), ("low_latency_dispatch_internode", 2),
                          ("low_latency_combine_internode", 1)):
        err = error_from_slot(_slot(flag=1, kernel=kernel_id(kernel), rank=5, peer=2, phase=phase), 1.0, base)
        assert err.peer == 2 and err.kernel == kernel, kernel


def test_the_two_hop_dispatch_refuses_nodes_wider_than_its_masks_before_any_gpu_work():
    """A rail peer keeps a network row's destinations in its node as one
    32-bit mask: more ranks per node is a ValueError before anything is made."""
    from types import SimpleNamespace
    wide = SimpleNamespace(num_nodes=2, world_size=2 * (INTER.MAX_RANKS_PER_NODE + 1),
                           local_size=INTER.MAX_RANKS_PER_NODE + 1, rank=0)
    with pytest.raises(ValueError, match=f"at most {INTER.MAX_RANKS_PER_NODE} ranks per node"):
        INTER.TwoHopDispatch(wide, max_tokens=16, hidden=128, num_topk=2, num_experts=2 * wide.world_size)
    one_node = SimpleNamespace(num_nodes=1, world_size=8, local_size=8, rank=0)
    with pytest.raises(ValueError, match="at least two nodes"):
        INTER.TwoHopDispatch(one_node, max_tokens=16, hidden=128, num_topk=2, num_experts=16)


def test_stamps_compare_across_ranks_only_when_every_rank_is_on_one_gpu():
    """Emulated nodes on one GPU share its timer; ranks of one real node per
    host (one rank per GPU) do not, even when each host has one rank."""
    from types import SimpleNamespace

    from cupyep.lab.bench.stamps import one_timer
    assert one_timer(SimpleNamespace(world_size=8, local_size=4, ranks_per_gpu=8))  # 2 x 4 emulated, one GPU
    assert not one_timer(SimpleNamespace(world_size=2, local_size=1, ranks_per_gpu=1))  # two hosts, a GPU each
    assert not one_timer(SimpleNamespace(world_size=8, local_size=8, ranks_per_gpu=1))  # one host, 8 GPUs


@pytest.mark.parametrize("num_sms,capped,per_gpu,share,co_resident", [
    (132, False, 8, 16, 8),   # 8 ranks share the GPU's SMs; all their blocks count on 132 SMs
    (16, True, 8, 16, 1),     # capped at 12.5 %: the context sees 16 SMs, its own
    (132, False, 1, 132, 1),  # a GPU per rank
])
def test_a_rank_s_sm_share_and_residency_follow_its_cap(num_sms, capped, per_gpu, share, co_resident):
    from cupyep.runtime import Group
    g = Group(comm=None, rank=0, world_size=per_gpu, node=0, num_nodes=1, local_rank=0, local_size=per_gpu,
              node_comm=None, device_id=0, num_devices=1, ranks_per_gpu=per_gpu, shares_gpu=per_gpu > 1,
              num_sms=num_sms, sm_capped=capped)
    assert (g.sm_share, g.co_resident_ranks) == (share, co_resident)
    # the residency check a kernel makes with them: the default grid (one block per SM) fits, one more does not
    jit.require_resident("k", 1, g.sm_share, 128, g.co_resident_ranks, g.num_sms, "num_sms")
    if capped or per_gpu == 1:
        with pytest.raises(ValueError, match="deadlock"):
            jit.require_resident("k", 1, g.sm_share + 1, 128, g.co_resident_ranks, g.num_sms, "num_sms")


# ------------------------------------------------------------------ torch tensors, without torch
class _FakeTorch:
    """A stand-in ``torch`` module: the dtypes cupyep maps, as plain objects."""

    def __init__(self):
        for name in ("bfloat16", "float8_e4m3fn", "float32", "int64", "int32", "bool", "uint8", "int16",
                     "float16", "float64", "int8"):
            setattr(self, name, f"torch.{name}")


def _fake_tensor_class():
    class Tensor:  # what torch_view reads of a tensor
        def __init__(self, dtype, cuda=True, cached=None):
            self.dtype, self.is_cuda, self.device = dtype, cuda, "cuda:0" if cuda else "cpu"
            self.shape = (2, 3)
            if cached is not None:
                self._cupyep_array = cached

        def data_ptr(self):
            return 4096

    Tensor.__module__ = "torch"
    return Tensor


@pytest.fixture
def fake_torch(monkeypatch):
    import sys
    from cupyep import arrays
    monkeypatch.setitem(sys.modules, "torch", _FakeTorch())
    monkeypatch.setattr(arrays, "_TORCH_DTYPES", {})
    return _fake_tensor_class()


def test_a_torch_tensor_is_viewed_by_torch_view_and_errors_name_the_argument(fake_torch):
    Tensor = fake_torch
    with pytest.raises(TypeError, match="^recv_x must be on a CUDA device, got a tensor on cpu$"):
        as_cupy(Tensor("torch.float32", cuda=False), "recv_x")
    with pytest.raises(TypeError, match="^x must be a CUDA torch tensor .* got Tensor torch.complex64$"):
        as_cupy(Tensor("torch.complex64"), "x")


def test_a_tensor_that_carries_its_array_gets_it_back_while_it_is_unchanged(fake_torch):
    from types import SimpleNamespace
    Tensor = fake_torch
    arr = SimpleNamespace(data=SimpleNamespace(ptr=4096), shape=(2, 3))
    assert as_cupy(Tensor("torch.float32", cached=arr), "x") is arr
    moved = SimpleNamespace(data=SimpleNamespace(ptr=8192), shape=(2, 3))  # the tensor's memory changed
    with pytest.raises(TypeError, match="CUDA device"):  # so it is viewed anew (here: refused as host data)
        as_cupy(Tensor("torch.float32", cuda=False, cached=moved), "x")


def test_the_layout_refuses_parts_carved_out_of_order():
    from cupyep.arrays import Carved
    from cupyep.normal.layout import launch_layout_into
    plan = {name: (64 * i, (4,), np.dtype(np.int32)) for i, name in enumerate(("per_expert", "per_rank", "in_rank"))}
    with pytest.raises(ValueError, match="one after another"):  # before any CUDA call
        launch_layout_into(np.zeros((2, 1), np.int64), 4, 2, None, Carved(_Arr(4096), plan))


def test_expert_counts_on_the_host_ignore_empty_and_out_of_range_slots():
    from cupyep.arrays import expert_counts
    ids = np.array([[0, 3, -1], [3, 3, 9], [-2, 1, 3]])
    got = expert_counts(ids, 4)
    assert got.dtype == np.int64 and got.tolist() == [1, 1, 0, 4]
    assert expert_counts(ids[:0], 4).tolist() == [0, 0, 0, 0]
