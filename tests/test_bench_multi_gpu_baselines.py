"""CPU tests of the host side of experiments/bench_multi_gpu_baselines.py: the
all-to-all split sizes of a dispatch, the P2P copy schedules, the refusal of
ranks that share a GPU, argument parsing and the summary record. No timing."""
import importlib.util
import itertools
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import cupyep
from cupyep.testing import global_routing

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "bench_multi_gpu_baselines.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_multi_gpu_baselines", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


B = _load()


# ------------------------------------------------------------ split sizes ---

def _numpy_splits(idx, E):
    """rows s -> d counted directly: tokens of s with any valid expert on d."""
    R = len(idx)
    per = E // R
    S = np.zeros((R, R), dtype=np.int64)
    for s in range(R):
        for d in range(R):
            hit = (idx[s] >= 0) & (idx[s] // per == d)
            S[s, d] = int(hit.any(axis=1).sum())
    return S


@pytest.mark.parametrize("R", [2, 4, 8])
def test_split_matrix_matches_a_direct_count(R):
    idx, _ = global_routing(0, [512] * R, 256, 8)
    S = B.dispatch_split_matrix(idx, 256)
    assert S.shape == (R, R) and S.dtype == np.int64
    np.testing.assert_array_equal(S, _numpy_splits(idx, 256))
    # deduplicated per rank: at most one row per token and destination, at least one per routed token
    assert (S <= 512).all()
    routed = [int((i >= 0).any(axis=1).sum()) for i in idx]
    assert (S.sum(axis=1) >= routed).all() and (S.sum(axis=1) <= np.minimum(8, R) * 512).all()


def test_split_matrix_of_a_hand_routing():
    # 2 ranks, 4 experts (2 per rank), top-2
    idx = [np.array([[0, 1], [0, 2], [-1, 3], [-1, -1]]),   # rank 0: token 0 -> r0 once; 1 -> r0, r1; 2 -> r1
           np.array([[3, 2], [1, -1]])]                      # rank 1: token 0 -> r1 once; 1 -> r0
    np.testing.assert_array_equal(B.dispatch_split_matrix(idx, 4), [[2, 2], [1, 1]])


def test_all_to_all_splits_are_each_others_transpose():
    idx, _ = global_routing(3, [256] * 4, 64, 6)
    S = B.dispatch_split_matrix(idx, 64)
    for me in range(4):
        d_in, d_out = B.all_to_all_splits(S, me, "dispatch")
        c_in, c_out = B.all_to_all_splits(S, me, "combine")
        assert d_in == S[me].tolist() and d_out == S[:, me].tolist()
        assert (c_in, c_out) == (d_out, d_in)
        assert all(type(v) is int for v in d_in + d_out)
    # what s sends d is what d expects from s
    for s, d in itertools.product(range(4), repeat=2):
        assert B.all_to_all_splits(S, s, "dispatch")[0][d] == B.all_to_all_splits(S, d, "dispatch")[1][s]
    with pytest.raises(ValueError, match="direction"):
        B.all_to_all_splits(S, 0, "both")


def test_remote_share_leaves_out_the_diagonal():
    assert B.remote_share(np.array([[1, 3], [2, 4]])) == pytest.approx(5 / 10)
    assert B.remote_share(np.zeros((2, 2), dtype=np.int64)) == 0.0


def test_block_codes_are_distinct_and_exact_in_bf16():
    for R in (2, 4, 8, 16):
        for me in range(R):  # a block from the wrong source, or meant for another rank, shows
            assert len({B.block_code(s, me, R) for s in range(R)}) == R
            assert len({B.block_code(me, d, R) for d in range(R)}) == R
        codes = {B.block_code(s, d, R) for s in range(R) for d in range(R)}
        assert min(codes) >= 1 and max(codes) <= 256  # integers up to 256 are exact in BF16
    assert len({B.block_code(s, d, 8) for s in range(8) for d in range(8)}) == 64


# ------------------------------------------------------------ P2P schedules ---

def _check_regions(copies, nbytes):
    """No two copies write the same receiver bytes or read the same sender bytes; all inside the buffers."""
    for key, off in (("dst", "dst_offset"), ("src", "src_offset")):
        by = {}
        for c in copies:
            by.setdefault(getattr(c, key), []).append((getattr(c, off), getattr(c, off) + c.nbytes))
        for spans in by.values():
            spans.sort()
            assert spans[0][0] >= 0 and spans[-1][1] <= nbytes
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("R", [2, 3, 4, 8])
def test_uni_every_ordered_pair_alone(R):
    ms = B.p2p_measurements("p2p_uni", R, 1 << 20)
    assert sorted((m.label["src"], m.label["dst"]) for m in ms) == \
        [(s, d) for s in range(R) for d in range(R) if s != d]
    for m in ms:
        (c,) = m.copies
        assert (c.src, c.dst) == (m.label["src"], m.label["dst"]) and c.nbytes == 1 << 20
        assert m.senders == [c.src] and m.of_rank(c.dst) == [] and m.into_rank(c.dst) == [c]


def test_ring_pairs():
    assert B.uni_pairs(4, "ring") == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert B.uni_pairs(2, "ring") == [(0, 1), (1, 0)]
    assert B.bi_pairs(4, "ring") == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert B.bi_pairs(2, "ring") == [(0, 1)]
    with pytest.raises(ValueError, match="pairs"):
        B.uni_pairs(4, "star")


@pytest.mark.parametrize("R", [2, 4, 8])
def test_bi_both_directions_of_every_pair(R):
    ms = B.p2p_measurements("p2p_bi", R, 4096)
    assert len(ms) == R * (R - 1) // 2
    for m in ms:
        a, b = map(int, m.label["pair"].split("-"))
        assert a < b and {(c.src, c.dst) for c in m.copies} == {(a, b), (b, a)}
        assert m.bytes_per_sender() == 4096
        _check_regions(m.copies, 4096)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_ring_every_rank_sends_once_and_receives_once(R):
    ms = B.p2p_measurements("p2p_ring", R, 4096)
    assert [m.label["shift"] for m in ms] == list(range(1, R))
    for m in ms:
        s = m.label["shift"]
        assert sorted(c.src for c in m.copies) == list(range(R))
        assert sorted(c.dst for c in m.copies) == list(range(R))
        assert all(c.dst == (c.src + s) % R for c in m.copies)
    assert [m.label["shift"] for m in B.p2p_measurements("p2p_ring", 8, 4096, shifts=[1, 9, 4])] == [1, 4]
    with pytest.raises(ValueError, match="itself"):
        B.p2p_measurements("p2p_ring", 4, 4096, shifts=[4])


@pytest.mark.parametrize("R", [2, 3, 4, 8])
def test_all_pairs_sends_a_share_to_every_peer(R):
    n = (1 << 30) + 100
    (m,) = B.p2p_measurements("p2p_all_pairs", R, n)
    chunk = m.label["bytes_per_peer"]
    assert chunk % B.ALIGN == 0 and chunk * (R - 1) <= n and chunk * (R - 1) > n - R * B.ALIGN
    assert sorted((c.src, c.dst) for c in m.copies) == [(s, d) for s in range(R) for d in range(R) if s != d]
    assert all(c.nbytes == chunk for c in m.copies)
    assert m.bytes_per_sender() == chunk * (R - 1)
    _check_regions(m.copies, n)
    # a sender starts with its next rank (the ranks spread over the receivers)
    assert all(m.of_rank(r)[0].dst == (r + 1) % R for r in range(R))


def test_sender_slots_fill_the_receivers():
    for R in (2, 5, 8):
        for d in range(R):
            assert sorted(B.sender_slot(s, d) for s in range(R) if s != d) == list(range(R - 1))
    with pytest.raises(ValueError):
        B.sender_slot(3, 3)


def test_bad_p2p_inputs():
    with pytest.raises(ValueError, match="2 or more"):
        B.p2p_measurements("p2p_uni", 1, 4096)
    with pytest.raises(ValueError, match="kind"):
        B.p2p_measurements("p2p_star", 4, 4096)
    with pytest.raises(ValueError, match="aligned"):
        B.p2p_measurements("p2p_uni", 4, 100)
    with pytest.raises(ValueError, match="share"):
        B.all_pairs_chunk(B.ALIGN * 3, 8)


def test_plan_builds_every_kind_in_order():
    args = B.parse_args(["--bytes", "65536", "--pairs", "ring"])
    kinds = [m.kind for m in B.p2p_plan(args, 4)]
    assert kinds == ["p2p_uni"] * 4 + ["p2p_bi"] * 4 + ["p2p_ring"] * 3 + ["p2p_all_pairs"]
    with pytest.raises(ValueError):
        B.p2p_plan(B.parse_args(["--shifts", "4"]), 4)  # raised before any GPU work


# ------------------------------------------------------------ refusal ---

def test_placement_one_rank_per_gpu_is_accepted():
    assert B.placement_problem(8, 1, 8, 1) is None
    assert B.placement_problem(2, 1, 8, 1) is None


@pytest.mark.parametrize("facts,words", [
    ((8, 1, 1, 8), ["2 or more GPUs", "this node has 1 GPU"]),
    ((1, 1, 1, 1), ["2 or more GPUs"]),
    ((8, 1, 4, 2), ["one rank per GPU", "8 ranks on 4 GPUs", "2 on one GPU", "python -m cupyep.launcher -n G"]),
    ((1, 1, 8, 1), ["2 or more ranks", "got 1"]),
    ((16, 2, 8, 1), ["one node", "2 nodes"]),
])
def test_placement_problem_says_what_is_needed(facts, words):
    msg = B.placement_problem(*facts)
    assert msg and msg.startswith("experiments/bench_multi_gpu_baselines.py needs")
    for w in words:
        assert w in msg, (w, msg)


def test_main_refuses_shared_gpus_before_any_gpu_work(monkeypatch, capsys):
    group = types.SimpleNamespace(rank=0, world_size=8, local_size=8, num_nodes=1, num_devices=1,
                                  ranks_per_gpu=8, destroyed=False)
    group.destroy = lambda: setattr(group, "destroyed", True)
    monkeypatch.setattr(B, "require_gpu", lambda script: None)
    monkeypatch.setattr(cupyep, "init", lambda **kw: group)
    monkeypatch.setattr(B, "p2p_plan", lambda *a: pytest.fail("measured after refusing"))
    with pytest.raises(SystemExit) as e:
        B.main(["--out", "unused.jsonl"])
    assert e.value.code == 2 and group.destroyed
    assert "needs one rank per GPU on 2 or more GPUs" in capsys.readouterr().err


# ------------------------------------------------------------ arguments ---

def test_defaults_are_the_issue_shape():
    a = B.parse_args([])
    assert (a.tokens, a.hidden, a.experts, a.topk, a.seed) == (4096, 7168, 256, 8, 0)
    assert a.bytes == 1 << 30 and a.parts == list(B.PARTS) and a.engines == list(B.ENGINES)
    assert a.kinds == list(B.P2P_KINDS) and a.pairs == "all" and a.shifts is None
    assert a.out == "results/multi_gpu/baselines.jsonl"


def test_arguments_are_parsed():
    a = B.parse_args(["--parts", "nccl", "--engines", "kernel", "--bytes", "4096", "--shifts", "1", "2",
                      "--tokens", "128", "--iters", "5", "--p2p-iters", "7", "--blocks", "64"])
    assert a.parts == ["nccl"] and a.engines == ["kernel"] and a.bytes == 4096 and a.shifts == [1, 2]
    assert (a.tokens, a.iters, a.p2p_iters, a.blocks) == (128, 5, 7, 64)


@pytest.mark.parametrize("argv", [["--bytes", "100"], ["--hidden", "7"], ["--topk", "9", "--experts", "8"],
                                  ["--parts", "gloo"], ["--iters", "0"], ["--engines", "dma"],
                                  ["--shifts", "0"], ["--blocks", "0"], ["--warmup", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        B.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


# ------------------------------------------------------------ summary ---

def _rec(kind, **kw):
    return {"bench": B.BENCH, "kind": kind, **kw}


def test_summary_speedups_and_fractions():
    recs = [_rec("p2p_uni", engine="kernel", GBps=400.0), _rec("p2p_uni", engine="kernel", GBps=300.0),
            _rec("p2p_uni", engine="kernel", GBps=350.0), _rec("p2p_uni", engine="copy_engine", GBps=380.0),
            _rec("p2p_all_pairs", engine="copy_engine", GBps=500.0),
            _rec("p2p_all_pairs", engine="kernel", GBps=320.0),
            _rec("nccl_all_to_all_dispatch", time_us=1000.0, rank_GBps=160.0, remote_rank_GBps=140.0),
            _rec("nccl_all_to_all_combine", time_us=1200.0, rank_GBps=130.0, remote_rank_GBps=110.0),
            _rec("cupyep_dispatch_bf16_direct", time_us=500.0, rank_GBps=288.0, remote_rank_GBps=250.0),
            _rec("cupyep_combine_bf16_direct", time_us=800.0, rank_GBps=200.0, remote_rank_GBps=180.0),
            _rec("nccl_all_to_all_dispatch", time_us=1.0, skipped="not this one"),
            {"bench": "normal", "kind": "cupyep_dispatch_bf16_direct", "time_us": 1.0}]
    s = B.summarize(recs)
    assert s["kind"] == "summary" and s["bench"] == B.BENCH
    assert s["p2p_uni_kernel_GBps_median"] == 350.0 and s["p2p_uni_kernel_GBps_min"] == 300.0
    assert s["p2p_uni_kernel_GBps_max"] == 400.0 and s["p2p_uni_copy_engine_GBps_median"] == 380.0
    assert s["p2p_ref"] == "p2p_all_pairs/kernel" and s["p2p_ref_GBps"] == 320.0  # the SMs' copy, not the CEs'
    assert s["speedup_over_nccl_dispatch"] == pytest.approx(2.0)
    assert s["speedup_over_nccl_combine"] == pytest.approx(1.5)
    assert s["p2p_fraction_direct_dispatch"] == pytest.approx(0.9) and s["meets_target_dispatch"] is True
    assert s["p2p_fraction_direct_combine"] == pytest.approx(0.625) and s["meets_target_combine"] is False
    assert s["p2p_fraction_remote_nccl_dispatch"] == pytest.approx(140 / 320)
    assert all(not isinstance(v, (list, dict)) for v in s.values())  # flat: the writer echoes all of it


def test_summary_without_parts_says_none():
    s = B.summarize([_rec("p2p_all_pairs", engine="copy_engine", GBps=500.0),
                     _rec("nccl_all_to_all_dispatch", skipped="torch is not importable")])
    assert s["p2p_ref"] == "p2p_all_pairs/copy_engine" and s["p2p_ref_GBps"] == 500.0
    assert s["speedup_over_nccl_dispatch"] is None and s["meets_target_dispatch"] is None
    assert s["p2p_fraction_nccl_dispatch"] is None
    assert B.summarize([])["p2p_ref"] is None


def test_torch_problem_is_a_reason_not_a_crash(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_torch(name, *a, **kw):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert B.torch_problem().startswith("torch is not importable (ImportError")
