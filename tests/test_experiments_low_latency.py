"""The "low_latency" GPU study's host side (CPU only): its registration and
knobs, the values it refuses before anything touches a GPU, the runner's
GPU-less path, and the measurement core (cupyep.lab.bench.low_latency) driven by
a fake buffer: which calls each kind's round makes, and the fields of the
records the benchmark and the study write. The fake kernels "take" fixed
durations written into the stamps; nothing is timed."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cupyep.lab import experiments
from cupyep.lab.bench import low_latency as BL
from cupyep.lab.bench import timing as BT
from cupyep.lab.bench import stamps as BS
from cupyep.lab.experiments import config_key, records, worker
from cupyep.lab.experiments import gpu_low_latency as G

REPO = Path(__file__).resolve().parents[1]

# Fields of the benchmark's records, in order (results/ll_combine/send_unroll16.jsonl, 8 ranks on one GPU).
STRICT_FIELDS = ["bench", "ranks", "tokens", "hidden", "topk", "experts", "max_tokens", "buffer_bytes", "num_blocks",
                 "num_waiters", "num_threads", "copy_GBps", "l2_flush", "programmatic_launch", "timing", "kind",
                 "event_median_us", "event_p99_us", "kernel_median_us", "kernel_p99_us", "skew_median_us",
                 "skew_p99_us", "span_median_us", "span_p99_us", "after_last_start_median_us",
                 "after_last_start_p99_us", "n", "bytes_to_peers", "efficiency"]
DEEPEP_FIELDS = ["bench", "ranks", "tokens", "hidden", "topk", "experts", "max_tokens", "buffer_bytes", "num_blocks",
                 "num_waiters", "num_threads", "copy_GBps", "l2_flush", "programmatic_launch", "timing", "kind", "n",
                 "host_gap_ms", "kernel_median_us", "kernel_rank_median_mean_us", "kernel_rank_mean_mean_us",
                 "kernel_rank_medians_us", "bytes_to_peers", "efficiency",
                 # every rank on one GPU: how far apart the ranks' calls ran, and how many at once
                 "skew_median_us", "skew_p99_us", "span_median_us", "span_p99_us", "after_last_start_median_us",
                 "after_last_start_p99_us", "concurrent_ranks_median", "concurrent_ranks_min",
                 "concurrent_ranks_max",
                 # the recorded period's GPU sleep and the slowest host's queueing (Session.period)
                 "period_sleep_us", "host_queue_max_us", "host_behind"]
ONE_GPU_FIELDS = DEEPEP_FIELDS[DEEPEP_FIELDS.index("efficiency") + 1:DEEPEP_FIELDS.index("period_sleep_us")]
FIGURES = {"time_us", "p10_us", "p90_us", "p99_us", "rank_mean_us", "rank_GBps", "efficiency", "copy_GBps"}
# Fake kernel durations in ns per call kind.
DURATION_NS = {"dispatch": 20_000, "dispatch_recv": 6_000, "combine": 30_000, "combine_recv": 9_000}
COPY_BW = 4e12


def _cfg(**kw):
    return {**G.KNOBS, **kw}


# ------------------------------------------------------------ registry ---

def test_low_latency_study_is_registered_and_needs_a_gpu():
    study = experiments.studies.get("low_latency")
    assert study.needs_gpu and study.knobs is G.KNOBS and study.module == "cupyep.lab.experiments.gpu_low_latency"
    assert "low_latency" in [s.name for s in experiments.studies.all_studies()]
    assert G.KNOBS["kind"] in BL.KINDS and G.KNOBS["timing"] in BL.TIMINGS
    assert (G.KNOBS["tokens"], G.KNOBS["hidden"], G.KNOBS["topk"], G.KNOBS["experts"]) == (128, 7168, 8, 256)


def test_grid_expands_with_the_study_defaults():
    configs = experiments.expand({"kind": ["dispatch_fp8", "combine"], "timing": ["strict", "deepep"], "iters": 5},
                                 G.KNOBS)
    assert [(c["kind"], c["timing"]) for c in configs] == [("dispatch_fp8", "strict"), ("dispatch_fp8", "deepep"),
                                                           ("combine", "strict"), ("combine", "deepep")]
    for c in configs:
        assert list(c) == list(G.KNOBS) and c["iters"] == 5
        assert {k: v for k, v in c.items() if k not in ("kind", "timing", "iters")} == \
               {k: v for k, v in G.KNOBS.items() if k not in ("kind", "timing", "iters")}
    assert len(experiments.expand({"kind": list(BL.KINDS)}, G.KNOBS)) == len(BL.KINDS) == 17
    with pytest.raises(ValueError, match="unknown knob 'transport'"):
        experiments.expand({"transport": "queue"}, G.KNOBS)


def test_the_defaults_pass_the_checks_and_size_the_benchmarks_buffer():
    G.check_config(_cfg())
    for kind in BL.KINDS:
        for timing in BL.TIMINGS:
            G.check_config(_cfg(kind=kind, timing=timing))
    args = G.buffer_args(_cfg())
    assert args == {"num_max_dispatch_tokens_per_rank": 128, "hidden": 7168, "num_experts": 256, "max_topk": 16,
                    "num_blocks": None, "num_waiters": None, "num_threads": 512, "programmatic_launch": None}
    assert G.buffer_args(_cfg(tokens=1))["num_max_dispatch_tokens_per_rank"] == 128
    assert G.buffer_args(_cfg(tokens=512))["num_max_dispatch_tokens_per_rank"] == 512
    args = G.buffer_args(_cfg(max_tokens=256, num_blocks=32, num_waiters=8, plain_launch=1, topk=20))
    assert (args["num_max_dispatch_tokens_per_rank"], args["num_blocks"], args["num_waiters"],
            args["programmatic_launch"], args["max_topk"]) == (256, 32, 8, False, 20)


# ---------------------------------------------------- refused values ---

@pytest.mark.parametrize("bad, match", [
    ({"kind": "combine_bf16"}, "kind must be one of"),
    ({"kind": "dispatch_fp8_trace"}, "kind must be one of"),
    ({"timing": "loose"}, "timing must be one of"),
    ({"flush": "all"}, "flush must be one of"),
    ({"routing": "random"}, "routing must be one of"),
    ({"num_threads": 768}, "num_threads must be one of"),
    ({"tokens": 0}, "tokens must be an int >= 1"),
    ({"tokens": 2.5}, "tokens must be an int >= 1"),
    ({"hidden": 7000}, "multiple of 128"),
    ({"topk": 9, "experts": 8}, "topk must be at most"),
    ({"max_tokens": 64}, "max_tokens"),
    ({"num_blocks": 8, "num_waiters": 16}, "num_waiters"),
    ({"num_blocks": -1}, "num_blocks must be an int >= 0"),
    ({"plain_launch": "yes"}, "plain_launch"),
    ({"sleep_us": -1}, "sleep_us"),
    ({"host_gap_ms": "2"}, "host_gap_ms"),
    ({"iters": 0}, "iters must be an int >= 1"),
    ({"seed": True}, "seed must be an int"),
    ({"routing_params": [1]}, "routing_params must be a dict"),
])
def test_bad_values_raise_value_error_before_anything_touches_a_gpu(bad, match):
    cfg = _cfg(**bad)
    with pytest.raises(ValueError, match=match):
        G.check_config(cfg)
    # run() checks first: the group (None here) is never touched, no CuPy call is made.
    with pytest.raises(ValueError, match=match):
        G.run(None, cfg)
    # ... and the sweep records such a configuration as skipped, with the reason.
    status, reason, metrics = worker.call_study(experiments.studies.get("low_latency"), None, cfg)
    assert status == "skipped" and reason.startswith("ValueError: ") and match.split()[0] in reason
    assert metrics is None


def test_sizes_of_the_rank_count_and_routing_parameters_are_refused_on_the_host():
    # A group of attributes only: run() refuses these before it builds a buffer or touches CuPy.
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        G.run(SimpleNamespace(local_size=3, local_rank=0, num_nodes=1), _cfg())
    with pytest.raises(ValueError, match="takes no parameter"):
        G.run(SimpleNamespace(local_size=2, local_rank=0, num_nodes=1), _cfg(routing_params={"s": 1.0}))
    with pytest.raises(ValueError, match="hot_fraction"):
        G.run(SimpleNamespace(local_size=2, local_rank=0, num_nodes=1), _cfg(routing="hot_expert", routing_params={"hot_fraction": 2}))


def test_measure_rejects_bad_kinds_before_anything_runs():
    with pytest.raises(ValueError, match="kind must be one of"):
        BL.measure(None, None, None, "combine_bf16", None, None, None)
    with pytest.raises(ValueError, match="timing must be one of"):
        BL.measure(None, None, None, "combine", None, None, None, timing="both")
    with pytest.raises(ValueError, match="flush must be one of"):
        BL.measure(None, None, None, "combine", None, None, None, flush="cold")
    with pytest.raises(ValueError, match="iters must be an int"):
        BL.measure(None, None, None, "combine", None, None, None, iters=0)
    assert [BL.round_of(k) for k in ("dispatch_fp8", "combine", "dispatch_bf16", "combine_zero_copy_push")] == \
           ["fp8", "fp8", "bf16", "zero_copy_push"]


# ------------------------------------------------------ without a GPU ---

def test_without_a_gpu_the_runner_needs_a_fallback_and_launches_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(experiments, "_has_gpu", lambda: False)

    def no_launch(*a, **k):
        raise AssertionError("nothing may launch without a GPU")
    monkeypatch.setattr(experiments, "_launch", no_launch)
    grid = {"kind": ["dispatch_fp8", "combine"], "iters": 5}
    with pytest.raises(RuntimeError, match="'low_latency' needs a CUDA GPU"):
        experiments.run("low_latency", grid, ranks=8)
    configs = experiments.expand(grid, G.KNOBS)
    committed = tmp_path / "committed.jsonl"
    for cfg, ranks, t in ((configs[1], 8, 31.0), (configs[0], 8, 21.0), (configs[0], 2, 11.0),
                          (experiments.expand({"kind": "combine_pull"}, G.KNOBS)[0], 8, 40.0)):
        records.append(committed, {"study": "low_latency", **cfg, "ranks": ranks, "status": "ok", "time_us": t,
                                   "key": config_key(cfg)})
    records.append(committed, {"study": "normal", "kind": "dispatch_fp8", "ranks": 8, "status": "ok",
                               "key": config_key(configs[0])})
    got = experiments.run("low_latency", grid, ranks=8, fallback=committed)
    assert [(r["kind"], r["time_us"]) for r in got] == [("dispatch_fp8", 21.0), ("combine", 31.0)]
    with pytest.warns(UserWarning, match="records of 1 of the 2 configurations"):
        got = experiments.run("low_latency", grid, ranks=2, fallback=committed)
    assert [r["time_us"] for r in got] == [11.0]
    with pytest.raises(ValueError, match="unknown knob 'transport'"):  # names are checked before the GPU
        experiments.run("low_latency", {"transport": "queue"}, ranks=8, fallback=committed)


def test_cli_without_a_gpu_says_so_and_exits_2(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = tmp_path / "ll.jsonl"
    res = subprocess.run([sys.executable, "-m", "cupyep.lab.experiments", "low_latency", "--ranks", "8", "--out",
                          str(out), "--grid", "kind=dispatch_fp8,combine", "iters=5"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "study 'low_latency' needs a CUDA GPU" in res.stderr and not out.exists()
    listed = subprocess.run([sys.executable, "-m", "cupyep.lab.experiments", "--list"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert "low_latency (needs a GPU)" in listed.stdout and '    host_gap_ms = 2.0' in listed.stdout


# --------------------------------------- the measurement core, faked ---

class FakeComm:
    """R ranks that all hold this rank's values."""

    def __init__(self, ranks):
        self.ranks, self.barriers = ranks, 0

    def allgather(self, value):
        return [value] * self.ranks

    def Barrier(self):
        self.barriers += 1


class HostStamps(np.ndarray):
    def get(self):
        return np.asarray(self)


def _stamp(st, ns):
    if st is not None:
        st[0], st[1] = 1_000_000, 1_000_000 + ns


class FakeBuffer:
    """Records the calls made and writes fixed durations into their stamps."""

    def __init__(self, hidden, experts=16, max_tokens=8, ranks=1):
        self.hidden, self.num_experts, self.max_tokens, self.num_ranks = hidden, experts, max_tokens, ranks
        self.num_bytes, self.num_blocks, self.num_waiters, self.num_threads = 1 << 20, 4, 4, 512
        self.programmatic_launch = True
        self.max_topk = 16
        self.calls = []
        self.combine_buffer = None

    def dispatch(self, x, topk_idx, *, use_fp8=True, validate=True, kernel_time_ns=None, return_recv_hook=False,
                 topk_weights=None):
        prec = ("fp8" if use_fp8 else "bf16") + ("+w" if topk_weights is not None else "")
        self.calls.append(("dispatch", prec, "hook" if return_recv_hook else "",
                           kernel_time_ns is not None))
        _stamp(kernel_time_ns, DURATION_NS["dispatch"])
        handle = object()

        def hook(kernel_time_ns=None):
            self.calls.append(("dispatch_recv", kernel_time_ns is not None))
            _stamp(kernel_time_ns, DURATION_NS["dispatch_recv"])
        recv = np.zeros((self.num_experts, 2 * self.max_tokens, self.hidden), dtype=np.uint16)
        return SimpleNamespace(recv_x=recv, handle=handle, hook=hook)

    def get_next_combine_buffer(self, handle):
        self.combine_buffer = np.zeros((self.num_experts, 2 * self.max_tokens, self.hidden), dtype=np.uint16)
        self.calls.append(("fill",))
        return self.combine_buffer

    def combine(self, x, topk_idx, topk_weights, handle, *, zero_copy=False, pull=None, kernel_time_ns=None,
                return_recv_hook=False, partial=False, use_logfmt=False):
        how = ("zero_copy" if zero_copy else "partial" if partial else "copy") + ("+logfmt" if use_logfmt else "")
        assert (x is None) == zero_copy
        self.calls.append(("combine", how, {None: "default", True: "pull", False: "push"}[pull],
                           "hook" if return_recv_hook else "", kernel_time_ns is not None))
        _stamp(kernel_time_ns, DURATION_NS["combine"])

        def hook(kernel_time_ns=None):
            self.calls.append(("combine_recv", kernel_time_ns is not None))
            _stamp(kernel_time_ns, DURATION_NS["combine_recv"])
        return SimpleNamespace(hook=hook)

    def synchronize(self):
        pass


@pytest.fixture
def fake_gpu(monkeypatch):
    """timing.timed_rounds / gpu_sleep and stamps.new_kernel_stamps without CUDA."""
    def new_kernel_stamps(n):
        st = np.zeros((n, 2), dtype=np.int64).view(HostStamps)
        st[:, 0] = np.iinfo(np.int64).max
        return st

    def timed_rounds(calls, iters, warmup=10, flush="write", sleep_us=400.0, before=None):
        assert flush in BT.FLUSH_MODES
        stamps = [new_kernel_stamps(warmup + iters) for _ in calls]
        for i in range(warmup + iters):
            for call, st in zip(calls, stamps):
                before()
                call(i, st[i])
        return [(BT.Timing.from_samples([50e-6] * iters), st[warmup:].get()) for st in stamps]

    monkeypatch.setattr(BS, "new_kernel_stamps", new_kernel_stamps)
    monkeypatch.setattr(BT, "timed_rounds", timed_rounds)
    monkeypatch.setattr(BT, "gpu_sleep", lambda us: None)


def _session(ranks=4, hidden=256, tokens=6, topk=3, copy_bw=COPY_BW, **kw):
    group = SimpleNamespace(comm=FakeComm(ranks), local_size=ranks, world_size=ranks, ranks_per_gpu=ranks)
    buf = FakeBuffer(hidden, ranks=ranks)
    idx = np.tile(np.arange(topk, dtype=np.int64), (tokens, 1))
    idx[0, 0] = -1  # one empty slot: tokens * topk - 1 pairs
    barrier = SimpleNamespace(n=0)

    def bar():
        barrier.n += 1
    s = BL.Session(group, buf, bar, np.zeros((tokens, hidden), dtype=np.uint16), idx,
                   np.ones((tokens, topk), dtype=np.float32), copy_bw, **kw)
    buf.calls.clear()
    return s, buf, barrier


# Per kind: the calls of one round (dispatch: precision, hook; combine: source, pull, hook; stamped or not).
ROUND_CALLS = {
    "dispatch_fp8": [("dispatch", "fp8", "", True), ("combine", "copy", "default", "", True)],
    "combine": [("dispatch", "fp8", "", True), ("combine", "copy", "default", "", True)],
    "dispatch_bf16": [("dispatch", "bf16", "", True), ("combine", "copy", "default", "", True)],
    "combine_pull": [("dispatch", "fp8", "", True), ("combine", "copy", "pull", "", True)],
    "combine_zero_copy": [("dispatch", "fp8", "", True), ("combine", "zero_copy", "pull", "", True)],
    "combine_zero_copy_push": [("dispatch", "fp8", "", True), ("combine", "zero_copy", "push", "", True)],
    "dispatch_fp8_send_half": [("dispatch", "fp8", "hook", True), ("dispatch_recv", True),
                               ("combine", "copy", "default", "hook", True), ("combine_recv", True)],
}
for _k in BL.HOOK_KINDS[1:]:
    ROUND_CALLS[_k] = ROUND_CALLS["dispatch_fp8_send_half"]
ROUND_CALLS["combine_partial"] = [("dispatch", "fp8+w", "", True), ("combine", "partial", "default", "", True)]
for _k in BL.ROUNDS["hook_partial"]:
    ROUND_CALLS[_k] = [("dispatch", "fp8+w", "hook", True), ("dispatch_recv", True),
                       ("combine", "partial", "default", "hook", True), ("combine_recv", True)]
ROUND_CALLS["combine_logfmt"] = [("dispatch", "fp8", "", True), ("combine", "copy+logfmt", "default", "", True)]
ROUND_CALLS["combine_partial_logfmt"] = [("dispatch", "fp8+w", "", True),
                                         ("combine", "partial+logfmt", "default", "", True)]
for _k in BL.ROUNDS["hook_partial_logfmt"]:
    ROUND_CALLS[_k] = [("dispatch", "fp8+w", "hook", True), ("dispatch_recv", True),
                       ("combine", "partial+logfmt", "default", "hook", True), ("combine_recv", True)]


@pytest.mark.parametrize("kind", BL.KINDS)
def test_each_kind_is_timed_in_its_decode_order_round_on_the_strict_boundary(kind, fake_gpu):
    s, buf, barrier = _session()
    rec = s.measure(kind, "strict", iters=5)
    calls = buf.calls
    if kind.startswith("combine_zero_copy"):  # the zero-copy buffer is filled by an untimed dispatch first
        assert calls[:2] == [("dispatch", "fp8", "", False), ("fill",)]
        calls = calls[2:]
    per_round = ROUND_CALLS[kind]
    assert len(calls) == (BL.WARMUP + 5) * len(per_round)
    assert calls == per_round * (BL.WARMUP + 5)
    assert barrier.n == len(calls)  # every call alone behind the GPU barrier
    assert list(rec)[:len(STRICT_FIELDS)] == STRICT_FIELDS and set(rec) == set(STRICT_FIELDS) | FIGURES
    ns = DURATION_NS["dispatch_recv" if kind == "dispatch_fp8_recv_half" else "combine_recv"
                     if kind.endswith("_recv_half") else "dispatch" if kind.startswith("dispatch") else "combine"]
    assert rec["kind"] == kind and rec["timing"] == "strict" and rec["n"] == 5
    assert rec["kernel_median_us"] == pytest.approx(ns / 1e3) == rec["time_us"]
    assert rec["p10_us"] == rec["p90_us"] == rec["p99_us"] == rec["rank_mean_us"] == rec["time_us"]
    assert rec["event_median_us"] == pytest.approx(50.0) and rec["skew_median_us"] == 0.0
    pairs = 6 * 3 - 1
    if kind.startswith("combine_partial"):  # one row per (token, expert rank): 6 tokens on the one rank
        pairs = 6
    row = {"dispatch_fp8": 256 + 2 * 4 + 5, "dispatch_fp8_send_half": 256 + 2 * 4 + 5,
           "dispatch_bf16": 2 * 256 + 5}.get(kind, 2 * 256)
    if "logfmt" in kind:  # two groups of 128: (lo, hi) float32 and 160 bytes of codes each, padded to 16
        row = (2 * 8 + 2 * 160 + 15) // 16 * 16
    if kind.endswith("_recv_half"):
        row = 0
    assert rec["bytes_to_peers"] == 4 * pairs * row
    assert rec["rank_GBps"] == pytest.approx(pairs * row / (ns * 1e-9) / 1e9)
    assert rec["efficiency"] == pytest.approx(2 * 4 * pairs * row / COPY_BW / (ns * 1e-9))
    assert rec["copy_GBps"] == COPY_BW / 1e9


@pytest.mark.parametrize("kind", ["dispatch_fp8", "combine", "dispatch_bf16", "combine_zero_copy",
                                  "combine_recv_half", "combine_partial", "combine_partial_send_half",
                                  "combine_logfmt", "combine_partial_logfmt", "combine_partial_logfmt_recv_half"])
def test_deepep_boundary_runs_a_warm_up_and_a_recorded_period_back_to_back(kind, fake_gpu):
    s, buf, barrier = _session()
    rec = s.measure(kind, "deepep", iters=7, host_gap_ms=0.0)
    calls = buf.calls[2:] if kind.startswith("combine_zero_copy") else buf.calls
    per = len(ROUND_CALLS[kind])
    assert len(calls) == 2 * 7 * per and barrier.n == 2  # one GPU barrier per period, none between calls
    assert [c[-1] for c in calls[:7 * per]] == [False] * (7 * per)  # the warm-up period is not stamped
    assert [c[:-1] for c in calls] == [c[:-1] for c in ROUND_CALLS[kind]] * 14
    assert list(rec)[:len(DEEPEP_FIELDS)] == DEEPEP_FIELDS and set(rec) == set(DEEPEP_FIELDS) | FIGURES
    assert rec["timing"] == "deepep" and rec["n"] == 7 and rec["kernel_rank_medians_us"] == [rec["time_us"]] * 4
    assert rec["kernel_median_us"] == rec["time_us"] == rec["kernel_rank_median_mean_us"]


def test_deepep_period_sleeps_past_the_slowest_hosts_queueing(fake_gpu, monkeypatch):
    # Each call takes 1 ms of host time on a fake clock; the sleep asked for (sleep_us * n) is 0.1 ms.
    s, buf, _ = _session(sleep_us=10.0)
    clock = {"t": 0.0}
    monkeypatch.setattr(BL.time, "perf_counter", lambda: clock["t"])
    slept = []
    monkeypatch.setattr(BT, "gpu_sleep", slept.append)

    def body(st):
        clock["t"] += 1e-3
    s.period(body, (), 10)
    assert slept == [pytest.approx(100.0), pytest.approx(2 * 10_000.0)]  # warm-up: as asked; recorded: 2 x 10 ms
    assert s.last_period == {"period_sleep_us": pytest.approx(20_000.0), "host_queue_max_us": pytest.approx(10_000.0),
                             "host_behind": False}
    clock["t"] = 0.0
    s.period(lambda st: clock.__setitem__("t", clock["t"] + (1e-3 if st("k") is None else 5e-3)), ("k",), 10)
    assert s.last_period["host_behind"] and s.last_period["host_queue_max_us"] == pytest.approx(50_000.0)
    # Hook mode: the host gap between the halves is measured, so the sleep stays as asked.
    slept.clear()
    s.period(body, (), 10, queue_ahead=False)
    assert slept == [pytest.approx(100.0)] * 2 and s.last_period["host_behind"] is None
    s.records("hook", "deepep", 3, 0.0)
    assert slept[-1] == pytest.approx(30.0)


def test_benchmark_rounds_write_the_benchmarks_records_in_order(fake_gpu):
    s, buf, _ = _session(flush="pages", sleep_us=0.0)
    kinds = [r["kind"] for name in ("fp8", "bf16", "pull", "zero_copy", "zero_copy_push")
             for r in s.records(name, "strict", 3)]
    assert kinds == ["dispatch_fp8", "combine", "dispatch_bf16", "combine_pull", "combine_zero_copy",
                     "combine_zero_copy_push"]
    deepep = s.records("fp8", "deepep", 3, 0.0) + s.records("hook", "deepep", 3, 0.0)
    assert [r["kind"] for r in deepep] == ["dispatch_fp8", "combine", *BL.HOOK_KINDS]
    for r in deepep:
        assert list(r) == DEEPEP_FIELDS and r["l2_flush"] == "pages"
    strict = s.records("hook", "strict", 3)
    assert [r["kind"] for r in strict] == list(BL.HOOK_KINDS) and all(list(r) == STRICT_FIELDS for r in strict)
    # Ranks on several GPUs: no cross-rank stamp figures.
    s.group.ranks_per_gpu = 1
    assert "skew_median_us" not in s.records("fp8", "strict", 3)[0]
    assert list(s.records("fp8", "deepep", 3, 0.0)[0]) == [f for f in DEEPEP_FIELDS if f not in ONE_GPU_FIELDS]
    with pytest.raises(ValueError, match="round must be one of"):
        s.records("fp16", "strict", 3)


def test_study_metrics_are_recordable(fake_gpu):
    s, buf, _ = _session()
    cfg = _cfg(kind="combine", iters=5)
    metrics = G.metrics_of(s.measure("combine", "strict", 5), buf, 1.25)
    assert not set(metrics) & (set(G.KNOBS) | set(worker.RECORD_FIELDS))
    assert metrics["buffer_config"] == {"max_tokens": 8, "max_topk": 16, "num_blocks": 4, "num_waiters": 4,
                                        "num_threads": 512, "programmatic_launch": True, "buffer_bytes": 1 << 20}
    rec = worker.build_record(experiments.studies.get("low_latency"), cfg, 4, [("ok", None, metrics)], "r", 0,
                              "t", 1.0, {})
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["time_us"] == pytest.approx(30.0) and rec["kind"] == "combine" and rec["imbalance_factor"] == 1.25
    json.dumps(rec, allow_nan=False)
