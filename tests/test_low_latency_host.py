"""CPU tests of low-latency mode's host side: the two-set buffer layout, size
checks, the dispatch kernel's shared-memory plan, the kernel argument structs
(against cuda_src/low_latency/args.cuh), the kernel specialisations and the
wait-site names of the device error slot. Nothing here needs a GPU except
LowLatencyHandle.layout_begin, which skips without one."""

import re
from pathlib import Path

import numpy as np
import pytest

from cupyep import errors, jit

from cupyep.errors import KERNELS, CommTimeoutError, ERROR_SLOT_DTYPE, error_from_slot, kernel_id
from cupyep.low_latency import kernels as K
from cupyep.low_latency import layout as L
from cupyep.low_latency.results import LowLatencyHandle
from cstructs import assert_mirrors, c_layout, c_structs, strip_comments

ARGS_CUH = jit.CUDA_SRC / "low_latency" / "args.cuh"

# (num_ranks, max_tokens, hidden, num_experts, max_topk)
SIZES = [
    (1, 1, 128, 1, 1),
    (2, 3, 128, 2, 2),
    (3, 7, 384, 9, 5),
    (5, 17, 640, 15, 16),
    (4, 33, 256, 64, 255),
    (8, 1, 128, 8, 3),
    (8, 128, 7168, 256, 8),
    (8, 128, 7168, 256, 16),
    (2, 256, 4096, 32, 6),
]
SIZE_IDS = [f"R{r}_M{m}_H{h}_E{e}_K{k}" for r, m, h, e, k in SIZES]


# ------------------------------------------------------------------ layout ---

def _ceil128(n):
    return -(-n // 128) * 128


def _documented_sizes(R, M, H, E, K):
    """Region sizes in bytes, from the formulas of layout.py's docstring (K = max_topk)."""
    El = E // R
    rows = El * R * M
    return {
        "dispatch_count": 4 * El * R,
        "dispatch_flag": 4 * R,
        "combine_flag": 4 * R,
        "recv_x": rows * (2 * H + 16),     # BF16 messages: row, then a 16-byte tag
        "combine_send": rows * 2 * H,
        "combine_recv": R * M * min(K, El) * 2 * H,  # [R][M * min(K, El)][H] BF16
        "remote_signal": 4 * R * 8,          # [4][R] uint64
        "stage": 0,                          # within one node (staged=False)
    }


DOC_ORDER = ("dispatch_count", "dispatch_flag", "combine_flag", "recv_x", "combine_send", "combine_recv",
             "remote_signal", "stage")


@pytest.mark.parametrize("H", [128, 384, 640, 4096, 7168])
def test_message_layout(H):
    ns = H // 128
    pad16 = lambda n: -(-n // 16) * 16
    assert L.message_layout(H, fp8=False) == (2 * H, 2 * H, 2 * H + 16)
    assert L.message_layout(H, fp8=True) == (H, H + pad16(4 * ns), H + pad16(4 * ns) + 16)
    assert L.message_layout(H, fp8=True, ue8m0=True) == (H, H + pad16(ns), H + pad16(ns) + 16)
    for m in (L.message_layout(H, False), L.message_layout(H, True), L.message_layout(H, True, True)):
        # Every part 16-byte aligned (int4 stores), the BF16 message the largest (sizes recv_x).
        assert m.scales % 16 == 0 and m.tag % 16 == 0 and m.nbytes == m.tag + L.TAG_BYTES
        assert m.nbytes <= L.message_layout(H, False).nbytes
    # The device mirror computes the same (args.cuh message_layout).
    src = strip_comments(ARGS_CUH.read_text())
    assert "fp8 ? ((hidden / 128) * (ue8m0 ? 1 : 4) + 15) / 16 * 16 : 0" in src
    assert "return {payload, payload + scales, payload + scales + 16};" in src


def test_the_layout_across_nodes_stages_every_message():
    """Across nodes each set holds [4][R] uint64 signals and a staging area of
    M * max_topk BF16 messages (one per (token, slot)); within a node the
    staging area is empty. The staged messages follow the dispatch's data copy,
    the signals alternate with the flags."""
    R, M, H, E, k = 8, 128, 7168, 256, 8
    one, across = L.low_latency_layout(R, M, H, E, k), L.low_latency_layout(R, M, H, E, k, staged=True)
    for s in one.sets:
        assert s.stage - s.remote_signal == L._align(4 * R * 8) and s.end == s.stage
    for s in across.sets:
        assert s.end - s.stage == L._align(M * k * L.message_layout(H, False).nbytes)
    assert across.nbytes - one.nbytes == 2 * L._align(M * k * L.message_layout(H, False).nbytes)
    assert "stage" in L.DATA_FIELDS["dispatch"] and "remote_signal" in L.FLAG_FIELDS
    c = L.call_offsets(across, 1, 0, 1)
    assert c.stage == across.sets[0].stage and c.remote_signal == across.sets[1].remote_signal
    assert L.size_hint(R, M, H, E, k, staged=True) == across.nbytes


def test_the_kernels_across_nodes_are_an_nvshmem_build():
    from cupyep.errors import GLOBAL_PEER_KERNELS, KERNELS
    for t in K.THREAD_CHOICES:
        for spec in (K.dispatch_spec(t, True), K.combine_spec(t, True)):
            assert spec.nvshmem and ("CUPYEP_LL_NVSHMEM", 1) in spec.defines and spec.name.endswith("_nvshmem")
        assert not K.dispatch_spec(t).nvshmem and not K.dispatch_spec(t).defines
    assert {s.name for s in K.kernel_specs()} >= {K.dispatch_spec(512, True).name, K.combine_spec(512, True).name}
    # Across nodes the kernels name peers by world rank, with the wait sites of args.cuh.
    assert {"low_latency_dispatch_internode", "low_latency_combine_internode"} <= GLOBAL_PEER_KERNELS
    assert len(KERNELS["low_latency_dispatch_internode"]) == 5 and len(KERNELS["low_latency_combine_internode"]) == 2
    src = strip_comments(ARGS_CUH.read_text())
    for name, phase in (("kWaitRemoteCounts", 2), ("kWaitRemoteRows", 3), ("kWaitRemoteReturn", 1)):
        assert f"constexpr int {name} = {phase};" in src
    # The region-capacity report follows each build's waits, and both builds' names say what it is.
    assert "constexpr int kRegionCapacity = 4;" in src and "constexpr int kRegionCapacity = 2;" in src
    assert KERNELS["low_latency_dispatch_internode"][4] == KERNELS["low_latency_dispatch"][2]
    assert "region capacity" in KERNELS["low_latency_dispatch"][2]


def test_return_rows():
    # A token sends at most min(max_topk, El) rows to one rank.
    assert L.return_rows(128, 8, 32) == 1024 and L.return_rows(128, 8, 4) == 512 and L.return_rows(3, 1, 9) == 3


def test_fields_in_documented_order():
    assert L.FIELDS == DOC_ORDER
    assert tuple(L.SetLayout.__dataclass_fields__) == DOC_ORDER + ("end",)
    assert L.ALIGN == 128
    # The docstring lists the regions in the same order.
    doc = [line.split()[0] for line in L.__doc__.splitlines()
           if line.strip() and line.startswith("    ") and line.split()[0] in DOC_ORDER]
    assert tuple(doc) == DOC_ORDER


@pytest.mark.parametrize("R,M,H,E,K", SIZES, ids=SIZE_IDS)
def test_layout_regions_aligned_ordered_exact(R, M, H, E, K):
    lay = L.low_latency_layout(R, M, H, E, K)
    sizes = _documented_sizes(R, M, H, E, K)
    assert (lay.num_ranks, lay.max_tokens, lay.hidden, lay.num_experts, lay.max_topk) == (R, M, H, E, K)
    assert lay.num_local_experts == E // R and lay.slots == R * M
    assert len(lay.sets) == 2
    assert lay.sets[0].dispatch_count == 0
    for s in lay.sets:
        starts = [getattr(s, n) for n in DOC_ORDER]
        for name, start in zip(DOC_ORDER, starts):
            assert start % 128 == 0, f"{name} starts at {start}"
        assert s.end % 128 == 0
        # Documented order, each region exactly its size padded to 128 bytes.
        bounds = starts + [s.end]
        for name, start, nxt in zip(DOC_ORDER, bounds, bounds[1:]):
            assert start + sizes[name] <= nxt, f"{name} overlaps the next region"
            assert nxt == _ceil128(start + sizes[name]), f"{name}: {nxt - start} bytes, needs {sizes[name]}"
        assert s.end - s.dispatch_count == sum(_ceil128(v) for v in sizes.values())
    assert lay.sets[1].dispatch_count == lay.sets[0].end
    # The sets are identical up to the shift.
    shift = lay.sets[0].end
    for name in DOC_ORDER + ("end",):
        assert getattr(lay.sets[1], name) - getattr(lay.sets[0], name) == shift, name
    assert lay.nbytes == lay.sets[1].end == 2 * shift
    assert L.size_hint(R, M, H, E, K) == lay.nbytes


@pytest.mark.parametrize("R,M,H,E,K", SIZES, ids=SIZE_IDS)
def test_layout_regions_never_overlap(R, M, H, E, K):
    lay = L.low_latency_layout(R, M, H, E, K)
    sizes = _documented_sizes(R, M, H, E, K)
    spans = sorted((getattr(s, n), getattr(s, n) + sizes[n], f"set{i}.{n}")
                   for i, s in enumerate(lay.sets) for n in DOC_ORDER)
    assert len(spans) == 2 * len(DOC_ORDER)
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        assert a1 <= b0, f"{an} [{a0}, {a1}) overlaps {bn} [{b0}, {b1})"
    assert spans[0][0] == 0 and spans[-1][1] <= lay.nbytes


@pytest.mark.parametrize("R,M,H,E,K", SIZES, ids=SIZE_IDS)
def test_buffer_views_fit_their_regions(R, M, H, E, K):
    # The views buffer.py and the kernels take (widest dtype each may use) stay inside their region.
    lay = L.low_latency_layout(R, M, H, E, K)
    El, slots = E // R, R * M
    views = {
        # every kind of message: its last row's tag ends inside
        "recv_x": max(El * slots * m.nbytes for m in (L.message_layout(H, False), L.message_layout(H, True),
                                                       L.message_layout(H, True, True))),
        "combine_send": El * slots * H * 2,
        "combine_recv": R * L.return_rows(M, K, El) * H * 2,  # row r * return_rows + i
        "dispatch_count": El * R * 4,
        "dispatch_flag": R * 4,
        "combine_flag": R * 4,
        "remote_signal": 4 * R * 8,
        "stage": 0,
    }
    staged = dict(views, stage=M * K * max(m.nbytes for m in (L.message_layout(H, False), L.message_layout(H, True),
                                                              L.message_layout(H, True, True))))
    for lay, v in ((lay, views), (L.low_latency_layout(R, M, H, E, K, staged=True), staged)):
        for s in lay.sets:
            bounds = [getattr(s, n) for n in DOC_ORDER] + [s.end]
            for name, start, nxt in zip(DOC_ORDER, bounds, bounds[1:]):
                assert start + v[name] <= nxt, name


def test_layout_deepseek_decode_numbers():
    R, M, H, E, K = 8, 128, 7168, 256, 16
    El = E // R                      # 32 local experts
    rows = El * R * M                # 32768 rows per set
    per_set = (_ceil128(4 * El * R) + 2 * 128  # counts and two flag arrays, each padded to 128
               + rows * (2 * H + 16) + rows * 2 * H + R * M * K * 2 * H
               + 256)  # the [4][R] uint64 signals of the ranks of other nodes
    lay = L.low_latency_layout(R, M, H, E)  # max_topk defaults to 16
    assert lay.max_topk == K
    assert lay.sets[0].end == per_set
    assert lay.nbytes == 2 * per_set == 2_349_861_888
    assert 2.3e9 < lay.nbytes < 2.4e9
    s = lay.sets[0]
    assert (s.dispatch_count, s.dispatch_flag, s.combine_flag, s.recv_x) == (0, 1024, 1152, 1280)
    assert s.combine_send - s.recv_x == rows * (2 * H + 16) == 470_286_336
    assert s.combine_recv - s.combine_send == rows * 2 * H
    assert s.remote_signal - s.combine_recv == R * M * K * 2 * H == 234_881_024
    assert s.end - s.remote_signal == 256 and s.stage == s.end
    # Top-8 needs half the combine receive rows.
    assert L.size_hint(R, M, H, E, 8) == lay.nbytes - 2 * R * M * 8 * 2 * H
    from cupyep.low_latency import LowLatencyBuffer
    assert LowLatencyBuffer.size_hint(R, M, H, E) == lay.nbytes
    assert LowLatencyBuffer.size_hint(R, M, H, E, 8) == L.size_hint(R, M, H, E, 8)


def test_layout_grows_with_every_size():
    base = L.size_hint(4, 16, 256, 16, 4)
    assert L.size_hint(4, 17, 256, 16, 4) > base
    assert L.size_hint(4, 16, 384, 16, 4) > base
    assert L.size_hint(4, 16, 256, 20, 4) > base
    # One less top-k slot: R * M fewer BF16 combine rows per set; beyond El (4) more slots add nothing.
    assert L.size_hint(4, 16, 256, 16, 3) == base - 2 * 4 * 16 * 256 * 2
    assert L.size_hint(4, 16, 256, 16, 5) == base
    # Dispatch rows per set are E * M whatever R; combine rows R * M * min(K, E / R): equal here; the
    # [4][R] uint64 signals take 256 bytes per set at 8 ranks instead of 128.
    assert L.size_hint(8, 16, 256, 16, 4) == base + 2 * 128
    assert L.size_hint(64, 16, 256, 64, 4) > L.size_hint(4, 16, 256, 64, 4)  # 4 * 64 bytes of flags > 128


@pytest.mark.parametrize("args,pattern", [
    ((2, 8, 100, 4), r"hidden size must be a positive multiple of 128, got 100"),
    ((2, 8, 129, 4), r"hidden size must be a positive multiple of 128, got 129"),
    ((2, 8, 0, 4), r"hidden size must be a positive multiple of 128, got 0"),
    ((2, 8, -128, 4), r"hidden size must be a positive multiple of 128, got -128"),
    ((2, 0, 128, 4), r"num_max_dispatch_tokens_per_rank must be a positive int, got 0"),
    ((2, -3, 128, 4), r"num_max_dispatch_tokens_per_rank must be a positive int, got -3"),
    ((2, 1.5, 128, 4), r"num_max_dispatch_tokens_per_rank must be a positive int, got 1\.5"),
    ((2, 8.0, 128, 4), r"num_max_dispatch_tokens_per_rank must be a positive int, got 8\.0"),
    ((2, "8", 128, 4), r"num_max_dispatch_tokens_per_rank must be a positive int, got '8'"),
    ((8, 8, 128, 12), r"num_experts=12 must be a positive multiple of the 8 ranks"),
    ((3, 8, 128, 10), r"num_experts=10 must be a positive multiple of the 3 ranks"),
    ((8, 8, 128, 4), r"num_experts=4 must be a positive multiple of the 8 ranks"),
    ((2, 8, 128, 0), r"num_experts=0 must be a positive multiple of the 2 ranks"),
    ((0, 8, 128, 4), r"num_ranks must be >= 1, got 0"),
    ((2, 8, 128, 4, 0), r"max_topk must be an int in \[1, 255\], got 0"),
    ((2, 8, 128, 4, 256), r"max_topk must be an int in \[1, 255\], got 256"),
    ((2, 8, 128, 4, 2.0), r"max_topk must be an int in \[1, 255\], got 2\.0"),
], ids=["hidden100", "hidden129", "hidden0", "hidden_neg", "tokens0", "tokens_neg", "tokens_float",
        "tokens_float_whole", "tokens_str", "experts_indivisible", "experts_indivisible3", "experts_lt_ranks",
        "experts0", "ranks0", "topk0", "topk256", "topk_float"])
def test_bad_sizes_raise_informative_value_errors(args, pattern):
    # argument order: (num_ranks, max_tokens, hidden, num_experts[, max_topk])
    for fn in (L.check_sizes, L.low_latency_layout, L.size_hint):
        with pytest.raises(ValueError, match=pattern):
            fn(*args)


def test_smallest_sizes_accepted():
    assert L.check_sizes(1, 1, 128, 1) is None
    assert L.check_sizes(1, 1, 128, 1, L.MAX_TOPK) is None and L.MAX_TOPK == 255  # recv_slot is one byte
    lay = L.low_latency_layout(4, 1, 128, 4)
    assert lay.num_local_experts == 1 and lay.slots == 4


# ------------------------------------------------------ dispatch shared mem ---

SMEM_CASES = [(t, b, k, e)
              for t in (1, 7, 128, 512)
              for b in (1, 24, 132)
              for k in (1, 8, 32)
              for e in (8, 64, 256, 1024, 2048)]


def _fixed_bytes(T, blocks, k, E):
    """The masks are added per word; this is total, seg [E] + own_e, own_pos [Tb][k]."""
    Tb = -(-T // blocks)
    return 4 * (2 * E + 2 * Tb * k)


def test_dispatch_smem_plan():
    fits = raises = windows = 0
    for T, blocks, k, E in SMEM_CASES:
        case = (T, blocks, k, E)
        fixed = _fixed_bytes(T, blocks, k, E)
        if fixed + 4 * E > K.SMEM_BUDGET:
            raises += 1
            with pytest.raises(ValueError, match="shared memory"):
                K.dispatch_smem(T, blocks, k, E)
            continue
        fits += 1
        words, nbytes = K.dispatch_smem(T, blocks, k, E)
        assert isinstance(words, int) and isinstance(nbytes, int), case
        assert 1 <= words <= -(-T // 32), case
        assert nbytes == fixed + 4 * E * words <= K.SMEM_BUDGET, case
        # As many words as fit: all T in one window, or one more word would overflow.
        assert words == -(-T // 32) or nbytes + 4 * E > K.SMEM_BUDGET, case
        windows += words < -(-T // 32)
    assert fits > 50 and raises > 0 and windows > 0  # every branch exercised


def test_dispatch_smem_examples():
    # Decode: 128 tokens over 16 blocks (8 per block), top-8, 256 experts: one window of 4 words.
    assert K.dispatch_smem(128, 16, 8, 256) == (4, 4 * (2 * 256 + 2 * 8 * 8) + 4 * 256 * 4)
    # One token: one word per expert.
    assert K.dispatch_smem(1, 16, 8, 256) == (1, 4 * (2 * 256 + 2 * 8) + 4 * 256)
    # 4096 tokens, 2048 experts: windows of 3 words (96 tokens) fit next to the fixed part.
    words, nbytes = K.dispatch_smem(4096, 132, 8, 2048)
    assert words == (K.SMEM_BUDGET - 4 * (2 * 2048 + 2 * 32 * 8)) // (4 * 2048) == 3
    assert nbytes == 4 * (2 * 2048 + 2 * 32 * 8 + 3 * 2048)
    assert K.SMEM_BUDGET < 48 * 1024


@pytest.mark.parametrize("T,blocks,k", [(1, 1, 1), (128, 132, 8), (256, 24, 8), (64, 8, 32), (128, 8, 32)])
def test_dispatch_smem_more_experts_fewer_words(T, blocks, k):
    # Window words never grow with E; with few experts the whole T fits in one window.
    prev = None
    for E in range(8, 8200, 8):
        try:
            words, _ = K.dispatch_smem(T, blocks, k, E)
        except ValueError:
            break
        if prev is not None:
            assert words <= prev, (E, words, prev)
        prev = words
    assert K.dispatch_smem(T, blocks, k, 8)[0] == -(-T // 32)


def test_dispatch_smem_raises_when_one_word_does_not_fit():
    with pytest.raises(ValueError, match=r"16384 experts.*budget is 47104"):
        K.dispatch_smem(128, 132, 8, 16384)
    # Too many tokens per block for top-32 even with few experts.
    with pytest.raises(ValueError, match=r"top-32 and 1024 tokens per block"):
        K.dispatch_smem(1024, 1, 32, 8)
    # At the edge (T=2, one block, top-1: Tb = 2): one word needs 4 * (3E + 4) <= 47104, E <= 3924.
    assert 4 * (3 * 3924 + 4) <= K.SMEM_BUDGET < 4 * (3 * 3925 + 4)
    assert K.dispatch_smem(2, 1, 1, 3924) == (1, 4 * (3 * 3924 + 4))
    with pytest.raises(ValueError, match="3925 experts"):
        K.dispatch_smem(2, 1, 1, 3925)


def test_check_peer_atomics():
    asked = []

    def links(a, b):
        asked.append((a, b))
        return {a, b} != {0, 2}  # GPUs 0 and 2: a PCIe link without peer atomics

    K.check_peer_atomics([0, 0, 0, 0], links)           # one GPU under MPS: nothing to ask
    assert asked == []
    K.check_peer_atomics([0, 1, 0, 1], links)
    assert sorted(asked) == [(0, 1), (1, 0)]
    with pytest.raises(RuntimeError, match=r"\(0, 2\), \(2, 0\)"):
        K.check_peer_atomics([0, 1, 2, 3], links)


def test_check_blocks():
    assert K.check_blocks(None, 16) == 16 and K.check_blocks(np.int64(48), 16) == 48
    assert K.check_blocks(K.MAX_BLOCKS, 16) == K.MAX_BLOCKS
    for bad in (0, -1, K.MAX_BLOCKS + 1, True, 4.0, "8"):
        with pytest.raises(ValueError, match="num_blocks"):
            K.check_blocks(bad, 16)


def test_check_waiters():
    assert K.check_waiters(None, 16) == 16
    assert K.check_waiters(8, 64) == 8 and K.check_waiters(np.int64(3), 4) == 3
    assert K.check_waiters(1, 64) == 1         # the send side never waits: one waiter is enough
    for bad in (65, 0, -1, True, 8.0, "8"):
        with pytest.raises(ValueError, match="num_waiters"):
            K.check_waiters(bad, 64)


def test_dispatch_smem_with_weights_adds_a_row_per_rank():
    # total [E + R], seg [E], own_e / own_pos / own_rpos [Tb][k], masks [E + R][words]
    assert K.dispatch_smem(128, 16, 8, 256, 8) == (4, 4 * (256 + 264 + 3 * 8 * 8) + 4 * 264 * 4)
    assert K.dispatch_smem(128, 16, 8, 256, 0) == K.dispatch_smem(128, 16, 8, 256)
    for T, blocks, k, E, R in [(1, 1, 1, 8, 8), (128, 24, 8, 256, 8), (4096, 132, 8, 2048, 64)]:
        words, nbytes = K.dispatch_smem(T, blocks, k, E, R)
        assert nbytes <= K.SMEM_BUDGET and words >= 1
        assert words <= K.dispatch_smem(T, blocks, k, E)[0]


def test_combine_smem():
    assert K.combine_smem(256) == 4 * (3 * 256 + 1)  # counts [E], prefix [E + 1], colprefix [E]
    assert K.combine_smem(1) == 16


# ------------------------------------------------- C structs vs dtypes ---

def test_struct_parser_reads_args_cuh():
    structs = c_structs()
    SET, CALL, DISPATCH, COMBINE = ("low_latency::" + n
                                    for n in ("SetOffsets", "CallArgs", "DispatchArgs", "CombineArgs"))
    assert [f for f, *_ in structs[SET]] == list(L.FIELDS)
    assert all(t == "int64_t" and not p for _, t, p in structs[SET])
    assert structs[CALL][:3] == [("peers", "void", True), ("cur", "SetOffsets", False), ("next", "SetOffsets", False)]
    for name in (DISPATCH, COMBINE):  # the shared part first, then the kernel's own fields
        assert structs[name][:2] == [("c", "CallArgs", False), ("x", "int4", True)]
    assert structs["Guard"] == [("slot", "ErrorSlot", True), ("timeout_ns", "uint64_t", False),
                                ("kernel", "int", False), ("rank", "int", False)]
    assert c_layout(SET, structs)[:2] == (8 * len(L.FIELDS), 8)
    assert c_layout("Guard", structs)[:2] == (24, 8)
    size, align, fields = c_layout(CALL, structs)
    offs = {f: off for f, off, *_ in fields}
    assert align == 8 and size % 8 == 0
    assert (offs["peers"], offs["cur"], offs["next"]) == (0, 8, 8 + 8 * len(L.FIELDS))
    assert structs[CALL][-1] == ("guard", "Guard", False)
    assert offs["guard"] % 8 == 0 and size == offs["guard"] + 24
    for name in (DISPATCH, COMBINE):
        assert c_layout(name, structs)[2][1][1] == size  # x right after the shared part
    # The dtypes mirror these structs: tests/test_host_logic.py::test_dtype_mirrors_c_struct.


def test_nested_dtypes_are_the_shared_ones():
    for d in (K.DISPATCH_ARGS_DTYPE, K.COMBINE_ARGS_DTYPE):
        assert d.fields["c"][0] == K.CALL_DTYPE
    assert K.CALL_DTYPE.fields["cur"][0] == K.SET_DTYPE and K.CALL_DTYPE.fields["next"][0] == K.SET_DTYPE
    assert K.CALL_DTYPE.fields["guard"][0] == errors.GUARD_DTYPE
    assert K.SET_DTYPE.names == L.FIELDS
    assert K.SET_DTYPE.itemsize == 8 * len(L.FIELDS)


def test_mirror_check_can_fail():
    structs = c_structs()
    swapped = jit.struct_dtype([(n, np.int64) for n in ("dispatch_flag", "dispatch_count") + L.FIELDS[2:]])
    with pytest.raises(AssertionError, match="names/order"):
        assert_mirrors(swapped, "low_latency::SetOffsets", structs)
    narrow = jit.struct_dtype([("slot", np.uint64), ("timeout_ns", np.uint32), ("kernel", np.int32),
                               ("rank", np.int32)])
    with pytest.raises(AssertionError):
        assert_mirrors(narrow, "Guard", structs)
    # A dtype missing the trailing guard has the wrong field list.
    short = jit.struct_dtype([(n, K.CALL_DTYPE.fields[n][0]) for n in K.CALL_DTYPE.names[:-1]])
    with pytest.raises(AssertionError):
        assert_mirrors(short, "low_latency::CallArgs", structs)


def test_set_struct_packs_offsets_in_order():
    lay = L.low_latency_layout(3, 7, 384, 9)
    for s in lay.sets:
        v = K.set_struct(s)
        assert v.dtype == K.SET_DTYPE
        raw = np.frombuffer(v.tobytes(), np.int64)
        assert raw.tolist() == [getattr(s, n) for n in L.FIELDS]
    c = jit.pack(K.CALL_DTYPE, cur=K.set_struct(lay.sets[0]), next=K.set_struct(lay.sets[1]),
                 phases=K.PHASE_SEND | K.PHASE_RECV)
    a = jit.pack(K.DISPATCH_ARGS_DTYPE, c=c, mask_words=5)
    assert int(a["c"]["next"]["dispatch_count"]) == lay.sets[0].end
    assert int(a["c"]["cur"]["combine_recv"]) == lay.sets[0].combine_recv
    assert int(a["mask_words"]) == 5 and int(a["c"]["phases"]) == 3


def _constexprs(path):
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"constexpr\s+int\s+(\w+)\s*=\s*(-?\d+)\s*;", strip_comments(path.read_text()))}


def test_constants_match_args_cuh():
    c = _constexprs(ARGS_CUH)
    assert c["kPhaseSend"] == K.PHASE_SEND == 1
    assert c["kPhaseRecv"] == K.PHASE_RECV == 2
    assert c["kChunkElems"] == K.CHUNK_ELEMS
    assert K.DEFAULT_THREADS in K.THREAD_CHOICES
    enum = re.search(r"enum\s+Mark\s*\{([^}]*)\}", strip_comments(ARGS_CUH.read_text())).group(1)
    marks = dict((n, int(v)) for n, v in re.findall(r"(\w+)\s*=\s*(\d+)", enum))
    assert marks.pop("kNumMarks") == K.NUM_TRACE_SLOTS
    names = [re.sub(r"(?<!^)(?=[A-Z])", "_", n[len("kMark"):]).lower() for n in sorted(marks, key=marks.get)]
    assert tuple(names) == K.TRACE_MARKS and sorted(marks.values()) == list(range(len(K.TRACE_MARKS)))
    assert len(K.TRACE_MARKS) <= K.NUM_TRACE_SLOTS
    assert all(t % 32 == 0 and 32 <= t <= 1024 for t in K.THREAD_CHOICES)


# ------------------------------------------------------- kernel specs ---

def test_kernel_specs():
    specs = K.kernel_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    # dispatch, combine and the packing dispatch within a node and across nodes, the LogFMT, partial and
    # partial LogFMT combines
    # ... each in the plain build and in shrink mode's
    assert len(specs) == 2 * 9 * len(K.THREAD_CHOICES)
    for s in specs:
        assert (jit.CUDA_SRC / s.source).is_file(), s
        assert len(s.kernels) == 1 and s.kernels[0].startswith("cupyep::low_latency::")
        hash(s)
    for t in K.THREAD_CHOICES:
        plain = [s for s in specs if ("CUPYEP_LL_SHRINK", 1) not in s.defines]
        d = [s for s in plain if not s.nvshmem and s.source == "low_latency/dispatch.cu"
             and s.kernels == (f"cupyep::low_latency::dispatch<{t}>",)]
        c = [s for s in plain if not s.nvshmem and s.source == "low_latency/combine.cu"
             and s.kernels == (f"cupyep::low_latency::combine<{t}>",)]
        assert len(d) == 1 and len(c) == 1, t
        assert d[0] == K.dispatch_spec(t) and c[0] == K.combine_spec(t)
        lf = [s for s in plain if s.kernels == (f"cupyep::low_latency::combine_logfmt<{t}>",)]
        assert lf == [K.combine_logfmt_spec(t)] and not lf[0].nvshmem and lf[0].source == "low_latency/combine.cu"
        pc = [s for s in plain if s.kernels == (f"cupyep::low_latency::combine_partial<{t}>",)]
        assert pc == [K.combine_partial_spec(t)] and not pc[0].nvshmem and pc[0].source == "low_latency/combine.cu"
        pl = [s for s in plain if s.kernels == (f"cupyep::low_latency::combine_partial_logfmt<{t}>",)]
        assert pl == [K.combine_partial_logfmt_spec(t)] and not pl[0].nvshmem
        pk = [s for s in plain if s.kernels == (f"cupyep::low_latency::dispatch_packed<{t}>",)]
        assert sorted(pk, key=lambda s: s.nvshmem) == [K.dispatch_packed_spec(t), K.dispatch_packed_spec(t, True)]
        assert d[0].name == f"low_latency_dispatch_threads_{t}"
        assert c[0].name == f"low_latency_combine_threads_{t}"
    assert K.dispatch_spec() == K.dispatch_spec(K.DEFAULT_THREADS)


def test_shrink_mode_has_its_own_build():
    """Each kernel also in the build that reads the mask (CUPYEP_LL_SHRINK), with
    its own name and the same template; the plain build compiles the mask out."""
    specs = {s.name: s for s in K.kernel_specs()}
    for t in K.THREAD_CHOICES:
        for plain, shrink in [(f(t), f(t, shrink=True)) for f in (K.dispatch_spec, K.combine_spec,
                                                                  K.dispatch_packed_spec, K.combine_logfmt_spec,
                                                                  K.combine_partial_spec, K.combine_partial_logfmt_spec)] + \
                [(K.dispatch_spec(t, True), K.dispatch_spec(t, True, True)),
                 (K.combine_spec(t, True), K.combine_spec(t, True, True))]:
            assert ("CUPYEP_LL_SHRINK", 1) not in plain.defines
            assert shrink.defines == plain.defines + (("CUPYEP_LL_SHRINK", 1),)
            assert shrink.name == plain.name + "_shrink" and shrink.kernels == plain.kernels
            assert shrink.nvshmem == plain.nvshmem and specs[shrink.name] == shrink and specs[plain.name] == plain
    src = strip_comments((jit.CUDA_SRC / "low_latency" / "sync.cuh").read_text())
    # Every test of the mask goes through shrinking(), which is false at compile time in the plain build.
    assert re.search(r"#ifdef CUPYEP_LL_SHRINK\s+constexpr bool kShrink = true;\s+#else\s+constexpr bool kShrink = false;",
                     src)
    assert re.search(r"bool shrinking\(const CallArgs& c\)\s*\{\s*return kShrink && c\.mask != nullptr;", src)
    for name in ("sync.cuh", "dispatch.cu", "combine.cu"):
        text = strip_comments((jit.CUDA_SRC / "low_latency" / name).read_text())
        assert not re.search(r"mask\s*!=\s*nullptr", text.replace("return kShrink && c.mask != nullptr", "")), name


@pytest.mark.parametrize("source,kernel,args", [("dispatch.cu", "dispatch", "DispatchArgs"),
                                                ("combine.cu", "combine", "CombineArgs")])
def test_kernel_templates_exist_in_sources(source, kernel, args):
    text = strip_comments((jit.CUDA_SRC / "low_latency" / source).read_text())
    assert re.search(r"namespace\s+cupyep\s*\{\s*namespace\s+low_latency\s*\{", text)
    pattern = (rf"template\s*<\s*int\s+\w+\s*>\s*__global__\s+void\s+"
               rf"(?:__launch_bounds__\s*\([^)]*\)\s*)?{kernel}\s*\(\s*{args}\s+\w+\s*\)")
    assert re.search(pattern, text), f"{source}: no template kernel {kernel}({args})"


def test_low_latency_specs_registered():
    assert "cupyep.low_latency.kernels" in jit.SPEC_MODULES
    names = {s.name for s in jit.all_specs()}
    assert {s.name for s in K.kernel_specs()} <= names


# -------------------------------------------------------- error phases ---

def test_error_phases_match_wait_sites():
    c = _constexprs(ARGS_CUH)
    assert (c["kWaitPeerFlag"], c["kBadExpertId"]) == (0, 1)
    assert len(KERNELS["low_latency_dispatch"]) == 3 and "expert id" in KERNELS["low_latency_dispatch"][1]
    assert "region capacity" in KERNELS["low_latency_dispatch"][2]
    assert len(KERNELS["low_latency_combine"]) == 1
    for kernel in ("low_latency_dispatch", "low_latency_combine"):
        assert "flag" in KERNELS[kernel][c["kWaitPeerFlag"]], kernel
    # The wait sites of sync.cuh: a peer's flag within the node, and across nodes a source's counts, then its
    # messages (through wait_peer_geq: a bounded wait_geq, or in shrink mode a wait that masks the peer); the
    # combine's across nodes is in combine.cu. The send side never waits.
    sync = strip_comments((jit.CUDA_SRC / "low_latency" / "sync.cuh").read_text())
    assert re.search(r"wait_until\((?:(?!wait_until).)*?kWaitPeerFlag, r\)", sync, re.S)
    assert len(re.findall(r"\bwait_(until|geq)\(", sync)) == 2  # the flag's wait, and wait_peer_geq's bounded one
    assert "wait_unless_masked(c, p," in sync and "atomicExch(c.mask + r, 1)" in sync
    assert re.search(r"wait_peer_geq\([^;]*kWaitRemoteCounts, r\)", sync)
    assert re.search(r"wait_peer_geq\([^;]*kWaitRemoteRows, r\)", sync)
    combine = strip_comments((jit.CUDA_SRC / "low_latency" / "combine.cu").read_text())
    assert not re.findall(r"\bwait_(until|geq)\(", combine)
    assert combine.count("wait_peer_geq(") == 2 and combine.count("kWaitRemoteReturn, r)") == 2
    dispatch = strip_comments((jit.CUDA_SRC / "low_latency" / "dispatch.cu").read_text())
    assert re.search(r"report_error\([^;]*kErrorBadInput, kBadExpertId", dispatch)


def test_error_from_slot_low_latency_phase_names():
    slot = np.zeros(1, ERROR_SLOT_DTYPE)[0]
    for field, value in dict(flag=1, kernel=kernel_id("low_latency_combine"), rank=2, peer=5, phase=0).items():
        slot[field] = value
    err = error_from_slot(slot, 1.0)
    assert isinstance(err, CommTimeoutError)
    assert err.kernel == "low_latency_combine" and err.phase == KERNELS["low_latency_combine"][0]
    assert err.peer == 5 and "combine flag" in str(err)
    slot["kernel"], slot["phase"], slot["peer"] = kernel_id("low_latency_dispatch"), 0, -1
    err = error_from_slot(slot, 1.0)
    assert err.phase == KERNELS["low_latency_dispatch"][0] and err.peer is None


# ----------------------------------------------------- handle (GPU only) ---

def test_handle_layout_begin():
    cupy = pytest.importorskip("cupy")
    from cupyep.runtime import gpu_count
    if gpu_count() == 0:
        pytest.skip("no CUDA GPU")
    El, R, M, C = 3, 4, 16, 5
    h = LowLatencyHandle(layout_count=cupy.zeros((El, R), dtype=np.int32), recv_src=None, recv_slot=None,
                         combine_pos=None, slot_pos=None,
                         num_tokens=5, num_topk=2, hidden=128, num_experts=El * R, max_tokens=M, capacity=C,
                         set_index=0, call=1, buffer_id=0)
    begin = cupy.asnumpy(h.layout_begin)
    assert begin.shape == (El, R) and begin.dtype == np.int32
    assert (begin == np.arange(R, dtype=np.int32) * C).all()  # regions of `capacity` rows


@pytest.mark.parametrize("flag,cls", [(1, "CommTimeoutError"), (3, "DeviceCapacityError"), (4, "DeviceInputError")])
def test_error_kind_picks_the_exception(flag, cls):
    from cupyep import errors

    slot = np.zeros(1, ERROR_SLOT_DTYPE)[0]
    slot["flag"], slot["kernel"], slot["phase"], slot["peer"] = flag, kernel_id("low_latency_dispatch"), 2, -1
    slot["value"], slot["expected"] = 300, 256
    err = error_from_slot(slot, 1.0)
    assert type(err).__name__ == cls and isinstance(err, errors.DeviceError)
    assert isinstance(err, CommTimeoutError) == (flag == 1)
    text = str(err)
    assert (("timeout" in text) == (flag == 1)) and "(counter 300, expected 256)" in text


# --- call schedule: which signals and which data copy each call uses ----------

def test_schedule_decode_loop_reuses_one_copy_per_kind():
    from cupyep.low_latency.layout import CallSchedule
    s = CallSchedule()
    got = [s.take(k) for k in ("dispatch", "combine") * 3]
    assert [g[0] for g in got] == [0, 1, 0, 1, 0, 1]   # signals alternate with every call
    assert [g[1] for g in got] == [0] * 6              # data: one copy per kind
    assert [g[2] for g in got] == [1, 2, 3, 4, 5, 6]


def test_schedule_switches_copy_for_back_to_back_calls_of_one_kind():
    from cupyep.low_latency.layout import CallSchedule
    s = CallSchedule()
    kinds = ["dispatch", "dispatch", "combine", "combine", "dispatch", "combine", "combine", "combine"]
    regions = []
    for k in kinds:
        assert s.peek(k) == (s.region[k] ^ 1 if s.last_kind == k else s.region[k])
        regions.append(s.take(k)[1])
    assert regions == [0, 1, 0, 1, 1, 1, 0, 1]


def test_schedule_never_reuses_a_copy_in_the_next_call():
    # What the pulling zero-copy combine relies on: peers read a rank's combine copy during
    # a combine, and that copy is written again only for a combine at least two calls
    # later. The call in between completes only once every rank has flagged it, which each
    # rank does after finishing the earlier combine, so no peer still reads the copy.
    from cupyep.low_latency.layout import CallSchedule
    rng = np.random.default_rng(7)
    for _ in range(200):
        s, last_use = CallSchedule(), {}
        kinds = [str(k) for k in rng.choice(["dispatch", "combine"], size=int(rng.integers(1, 30)))]
        for i, k in enumerate(kinds):
            region = s.take(k)[1]
            assert last_use.get((k, region), -2) < i - 1, (kinds, i)
            last_use[(k, region)] = i


def test_schedule_knows_when_a_dispatch_was_overwritten():
    from cupyep.low_latency.layout import CallSchedule
    s = CallSchedule()
    _, r1, c1 = s.take("dispatch")
    _, r2, c2 = s.take("dispatch")         # the other copy: the first dispatch still holds
    assert s.holds("dispatch", r1, c1) and s.holds("dispatch", r2, c2)
    s.take("combine")
    _, r3, c3 = s.take("dispatch")         # after a combine: reuses the second dispatch's copy
    assert r3 == r2 and not s.holds("dispatch", r2, c2) and s.holds("dispatch", r1, c1)
    with pytest.raises(ValueError, match="call kind"):
        s.peek("notify")


def test_call_offsets_mix_signals_and_data_of_two_sets():
    from cupyep.low_latency.layout import DATA_FIELDS, FIELDS, FLAG_FIELDS, call_offsets
    lay = L.low_latency_layout(4, 16, 256, 16, 8)
    off = call_offsets(lay, 1, 0, 1)
    for n in FLAG_FIELDS:
        assert getattr(off, n) == getattr(lay.sets[1], n)
    for n in DATA_FIELDS["dispatch"]:
        assert getattr(off, n) == getattr(lay.sets[0], n)
    for n in DATA_FIELDS["combine"]:
        assert getattr(off, n) == getattr(lay.sets[1], n)
    assert set(FLAG_FIELDS) | set(DATA_FIELDS["dispatch"]) | set(DATA_FIELDS["combine"]) == set(FIELDS)


def test_ablation_bits_mirror_the_kernel_constants():
    src = (Path(jit.CUDA_SRC) / "low_latency" / "args.cuh").read_text()
    consts = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"constexpr int kAblate(\w+) = (\d+);", src)}
    assert consts == K.ABLATIONS
    assert K.ablation_bits([]) == 0 and K.ablation_bits(["rows", "scales"]) == 5
    with pytest.raises(ValueError, match="unknown ablation"):
        K.ablation_bits(["flags"])
