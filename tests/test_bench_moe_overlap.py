"""CPU tests of experiments/bench_moe_overlap.py's host side: arguments, the
schedules and their checks, the ideal / pipeline arithmetic, the low-latency
row bookkeeping and FFN (NumPy), and the executors' stream and event wiring
(on stand-in streams, events and buffers that record the order of work)."""
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from cupyep.results import EventHandle
from cupyep.moe import MoEWeights, bf16_bits_to_f32, expert_ffn, padded_expert_ffn

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_moe_overlap", REPO / "experiments" / "bench_moe_overlap.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


B = _load()


# ------------------------------------------------------------- arguments

def test_defaults():
    a = B.build_parser().parse_args([])
    assert a.mode == "both" and a.tokens is None and a.hidden == 7168 and a.experts == 256 and a.topk == 8
    assert a.ffn == [B.DEFAULT_FFN]
    assert a.transport == ["queue", "direct"] and a.comm_sms == [None, 8, 4]
    assert a.ll_ffn == ["batched"] and a.ll_blocks == [None] and a.ll_combines == ["zero_copy"]
    assert a.out.endswith(".jsonl")
    B.check_args(a)
    assert B.tokens_for("normal", a.tokens) == 4096 and B.tokens_for("low_latency", a.tokens) == 128
    assert B.tokens_for("low_latency", 64) == 64
    assert B.modes_of("both") == ("normal", "low_latency") and B.modes_of("normal") == ("normal",)


def test_arguments_parse_and_refuse():
    a = B.build_parser().parse_args(["--mode", "low_latency", "--tokens", "256", "--ffn", "64", "128",
                                     "--comm-sms", "default", "6", "--transport", "direct"])
    assert (a.mode, a.tokens, a.ffn, a.comm_sms, a.transport) == \
        ("low_latency", 256, [64, 128], [None, 6], ["direct"])
    a = B.build_parser().parse_args(["--ll-ffn", "per_expert", "batched", "--ll-blocks", "default", "4"])
    assert a.ll_ffn == ["per_expert", "batched"] and a.ll_blocks == [None, 4]
    for bad in (["--comm-sms", "0"], ["--comm-sms", "many"], ["--mode", "fast"], ["--transport", "nvshmem"],
                ["--ll-ffn", "fused"], ["--ll-blocks", "0"]):
        with pytest.raises(SystemExit):
            B.build_parser().parse_args(bad)
    for bad in (["--tokens", "1"], ["--ffn", "0"], ["--hidden", "100"], ["--topk", "300"], ["--iters", "0"]):
        with pytest.raises(ValueError):
            B.check_args(B.build_parser().parse_args(bad))
    with pytest.raises(ValueError):
        B.tokens_for("decode", None)


def test_comm_sms_problems():
    assert B.comm_sms_problem("queue", None) is None and B.comm_sms_problem("direct", None) is None
    assert B.comm_sms_problem("queue", 8) is None and B.comm_sms_problem("direct", 5) is None
    assert "even" in B.comm_sms_problem("queue", 5) and "even" in B.comm_sms_problem("queue", 1)
    assert B.comm_sms_problem("direct", 0)
    with pytest.raises(ValueError):
        B.comm_sms_problem("ring", 8)


def test_split_tokens():
    assert B.split_tokens(4096) == {"a": slice(0, 2048), "b": slice(2048, 4096)}
    assert B.split_tokens(5) == {"a": slice(0, 3), "b": slice(3, 5)}
    assert B.split_tokens(2) == {"a": slice(0, 1), "b": slice(1, 2)}
    with pytest.raises(ValueError):
        B.split_tokens(1)


# ------------------------------------------------------------- schedules

def test_serial_schedules_run_each_micro_batch_in_turn():
    assert B.schedule("normal", False) == [("dispatch", "a"), ("ffn", "a"), ("combine", "a"),
                                           ("dispatch", "b"), ("ffn", "b"), ("combine", "b")]
    ll = B.schedule("low_latency", False)
    assert ll[:5] == [(op, "a") for op in B.OPS["low_latency"]] and ll[5:] == [(op, "b") for op in B.OPS["low_latency"]]


def test_overlapped_schedules():
    n = B.schedule("normal", True)
    assert n == [("dispatch", "a"), ("ffn", "a"), ("dispatch", "b"), ("combine", "a"), ("ffn", "b"), ("combine", "b")]
    # dispatch B's notify pass waits on the host: FFN A must be enqueued before it
    assert n.index(("ffn", "a")) < n.index(("dispatch", "b"))
    ll = B.schedule("low_latency", True)
    assert ll == [("dispatch_send", "a"), ("dispatch_send", "b"), ("dispatch_recv", "a"), ("ffn", "a"),
                  ("dispatch_recv", "b"), ("combine_send", "a"), ("ffn", "b"), ("combine_recv", "a"),
                  ("combine_send", "b"), ("combine_recv", "b")]
    # B's rows are in flight while FFN A runs, A's combine while FFN B runs
    assert ll.index(("dispatch_send", "b")) < ll.index(("ffn", "a")) < ll.index(("dispatch_recv", "b"))
    assert ll.index(("combine_send", "a")) < ll.index(("ffn", "b")) < ll.index(("combine_recv", "a"))
    for mode in B.MODES:
        for overlapped in (False, True):
            B.check_schedule(mode, B.schedule(mode, overlapped))


def test_check_schedule_refuses():
    good = B.schedule("normal", True)
    for bad in (good[1:],                                   # no dispatch A
                [good[1], good[0]] + good[2:],              # FFN A before its dispatch
                good + [("ffn", "a")],                      # twice
                good[:-1] + [("combine", "c")],             # unknown micro-batch
                good[:-1] + [("dispatch_send", "b")]):      # another mode's op
        with pytest.raises(ValueError):
            B.check_schedule("normal", bad)
    ll = B.schedule("low_latency", True)
    with pytest.raises(ValueError):
        B.check_schedule("low_latency", [s for s in ll if s != ("combine_recv", "b")])
    with pytest.raises(ValueError):
        B.check_schedule("decode", ll)


def test_part_calls():
    n = B.part_calls("normal")
    assert [name for name, _ in n] == ["dispatch_a", "ffn_a", "combine_a", "dispatch_b", "ffn_b", "combine_b"]
    assert all(steps == [(name.split("_")[0], name[-1])] for name, steps in n)
    ll = dict(B.part_calls("low_latency"))
    assert ll["dispatch_b"] == [("dispatch_send", "b"), ("dispatch_recv", "b")]
    assert ll["combine_a"] == [("combine_send", "a"), ("combine_recv", "a")] and ll["ffn_a"] == [("ffn", "a")]
    # the parts of each mode together are its serial schedule
    for mode in B.MODES:
        assert [s for _, steps in B.part_calls(mode) for s in steps] == B.schedule(mode, False)


# ------------------------------------------------------------ arithmetic

PARTS = {"dispatch_a": 1.0, "ffn_a": 5.0, "combine_a": 1.5, "dispatch_b": 2.0, "ffn_b": 4.0, "combine_b": 0.5}


def _durations(parts):
    return {(k.rsplit("_", 1)[0], k[-1]): v for k, v in parts.items()}


def test_ideal_and_lanes():
    assert B.lane_sums(PARTS) == (5.0, 9.0)
    assert B.ideal_us(PARTS) == 9.0
    comm_bound = {**PARTS, "ffn_a": 0.5, "ffn_b": 0.5}
    assert B.ideal_us(comm_bound) == 5.0


def test_simulate():
    d = _durations(PARTS)
    assert B.simulate(B.schedule("normal", False), d) == pytest.approx(sum(PARTS.values()))
    # dispatch A + max(FFN A, dispatch B) + max(combine A, FFN B) + combine B
    assert B.simulate(B.schedule("normal", True), d) == pytest.approx(1.0 + 5.0 + 4.0 + 0.5)
    slow_comm = _durations({**PARTS, "dispatch_b": 7.0, "combine_a": 6.0})
    assert B.simulate(B.schedule("normal", True), slow_comm) == pytest.approx(1.0 + 7.0 + 6.0 + 0.5)
    with pytest.raises(ValueError):
        B.simulate(B.schedule("low_latency", True), {s: 1.0 for s in B.schedule("low_latency", True)})


def test_summarize():
    s = B.summarize("normal", PARTS, serial_us=14.0, overlapped_us=11.0)
    assert s["speedup"] == pytest.approx(14.0 / 11.0) and s["ideal_us"] == 9.0
    assert (s["comm_us"], s["compute_us"]) == (5.0, 9.0) and s["pipeline_us"] == pytest.approx(10.5)
    assert s["parts"] == PARTS and s["ideal_speedup"] == pytest.approx(14.0 / 9.0)
    assert s["exposed_us"] == pytest.approx(11.0 - 9.0)
    assert B.ffn_sms(132, 8, 4) == 100 and B.ffn_sms(132, 8, 16) == 4 and B.ffn_sms(132, 8, 17) == 0
    ll = B.summarize("low_latency", PARTS, 14.0, 12.0)
    assert "pipeline_us" not in ll and ll["speedup"] == pytest.approx(14.0 / 12.0)


# ------------------------------------------------- low-latency row bookkeeping

def _routing(seed, R, T, E, k):
    rng = np.random.default_rng(seed)
    idx = [np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int64) for _ in range(R)]
    for i in idx:
        i[rng.random(i.shape) < 0.1] = -1
    return idx


def test_local_counts():
    R, T, E, k = 4, 9, 16, 3
    idx = _routing(1, R, T, E, k)
    El = E // R
    for rank in range(R):
        got = B.local_counts(idx, rank, E)
        want = np.array([[sum(int(rank * El + e in row) for row in idx[r]) for r in range(R)] for e in range(El)])
        assert got.shape == (El, R) and np.array_equal(got, want)
    # every (token, expert) pair lands on exactly one rank
    assert sum(int(B.local_counts(idx, r, E).sum()) for r in range(R)) == sum(int((i >= 0).sum()) for i in idx)
    with pytest.raises(ValueError):
        B.local_counts(idx, 0, 15)


def test_expert_rows():
    counts = np.array([[2, 0], [1, 3]])  # E_local 2, R 2
    rows = B.expert_rows(counts, max_tokens=4)  # slots of 8 rows
    # expert 0: source 0's rows 0, 1; expert 1 (rows from 8): source 0's row 0, source 1's rows 4..6
    assert rows.flat.tolist() == [0, 1, 8, 12, 13, 14]
    assert rows.blocks == [(0, 2), (2, 4)]
    # padded blocks of M = 4 rows: expert 0's two rows, then its first slot row (0) as padding
    assert rows.padded.tolist() == [[0, 1, 0, 0], [8, 12, 13, 14]]
    assert rows.unpadded.tolist() == [0, 1, 4, 5, 6, 7]
    assert rows.padded.reshape(-1)[rows.unpadded].tolist() == rows.flat.tolist()
    empty = B.expert_rows(np.zeros((3, 2), np.int64), max_tokens=4)
    assert empty.flat.size == 0 and empty.blocks == [(0, 0), (0, 0), (0, 0)]
    assert empty.padded.tolist() == [[0], [8], [16]] and empty.unpadded.size == 0
    with pytest.raises(ValueError):
        B.expert_rows(np.array([[5, 0], [0, 0]]), max_tokens=4)


def _ll_recv(rng, El, R, max_tokens, H, pad=8):
    """A dispatch-like recv_x: [El, R * max_tokens, H] uint16 rows inside longer messages."""
    base = rng.integers(0, 0x3F80, size=(El, R * max_tokens, H + pad), dtype=np.uint16)
    return base[:, :, :H]


SENTINEL = np.uint16(0x7FC1)  # a NaN: rows the FFN must not touch keep it


def _ffn_case(seed):
    """(counts [El, R], rows, recv_x, weights, out full of SENTINEL) of a small low-latency FFN case."""
    rng = np.random.default_rng(seed)
    R, El, max_tokens, H, F = 2, 3, 4, 128, 16
    counts = np.array([[2, 1], [0, 0], [4, 3]])
    recv_x = _ll_recv(rng, El, R, max_tokens, H)
    out = np.full((El, R * max_tokens, H), SENTINEL, dtype=np.uint16)
    w = MoEWeights.random(0, hidden=H, ffn=F, num_experts=El)
    return counts, B.expert_rows(counts, max_tokens), recv_x, w, out


def test_ll_expert_ffn_matches_per_expert_blocks():
    counts, rows, recv_x, w, out = _ffn_case(2)
    (El, R), max_tokens = counts.shape, recv_x.shape[1] // counts.shape[1]
    got = B.ll_expert_ffn(recv_x, rows, w.w1, w.w2, out)
    assert got is out
    for e in range(El):
        valid = np.concatenate([r * max_tokens + np.arange(counts[e, r]) for r in range(R)]).astype(int)
        if valid.size:
            want = expert_ffn(recv_x[e, valid], [(0, valid.size)], w.w1[e:e + 1], w.w2[e:e + 1])
            assert np.array_equal(out[e, valid], want)
        stale = np.setdiff1d(np.arange(R * max_tokens), valid)
        assert (out[e, stale] == SENTINEL).all()
    # wrong counts put other rows through the FFN: caught
    wrong = B.expert_rows(np.array([[1, 2], [0, 0], [4, 3]]), max_tokens)
    out2 = np.full_like(out, SENTINEL)
    B.ll_expert_ffn(recv_x, wrong, w.w1, w.w2, out2)
    assert not np.array_equal(out2, out)


def test_batched_ll_expert_ffn_matches_the_per_expert_one():
    """The padded batched FFN writes the same rows as the per-expert one (their
    float32 matmuls may sum in another order: within one BF16 step), and
    touches no other row."""
    _, rows, recv_x, w, out = _ffn_case(5)
    want = B.ll_expert_ffn(recv_x, rows, w.w1, w.w2, out.copy())
    got = B.ll_expert_ffn(recv_x, rows, w.w1, w.w2, out.copy(), batched=True)
    assert np.array_equal(got == SENTINEL, want == SENTINEL)
    assert np.allclose(bf16_bits_to_f32(got), bf16_bits_to_f32(want), rtol=2 ** -7, atol=0, equal_nan=True)
    # a padding row differs from a real one: wrong padding positions would be caught
    wrong = B.ExpertRows(rows.flat, rows.blocks, rows.padded, rows.unpadded[::-1].copy())
    bad = B.ll_expert_ffn(recv_x, wrong, w.w1, w.w2, out.copy(), batched=True)
    assert not np.array_equal(bad, got)


def test_padded_expert_ffn_rows_and_shapes():
    rng = np.random.default_rng(6)
    El, M, H, F = 2, 3, 128, 8
    w = MoEWeights.random(1, hidden=H, ffn=F, num_experts=El)
    x = rng.integers(0, 0x3F80, size=(El, M, H), dtype=np.uint16)
    y = padded_expert_ffn(x, w.w1, w.w2)
    assert y.shape == (El, M, H) and y.dtype == np.uint16
    for e in range(El):
        one = expert_ffn(x[e], [(0, M)], w.w1[e:e + 1], w.w2[e:e + 1])
        assert np.allclose(bf16_bits_to_f32(y[e]), bf16_bits_to_f32(one), rtol=2 ** -7, atol=0)
    for bad in ((x[0], w.w1, w.w2), (x, w.w1[:1], w.w2), (x[:, :, :64], w.w1, w.w2), (x, w.w1, w.w2[:, :4])):
        with pytest.raises(ValueError):
            padded_expert_ffn(*bad)


def test_ll_expert_ffn_refuses_layouts():
    rng = np.random.default_rng(3)
    recv_x = _ll_recv(rng, 2, 2, 2, 128)
    rows = B.expert_rows(np.array([[1, 1], [1, 0]]), 2)
    w = MoEWeights.random(0, hidden=128, ffn=8, num_experts=2)
    with pytest.raises(ValueError):  # out not C-contiguous
        B.ll_expert_ffn(recv_x, rows, w.w1, w.w2, np.zeros((2, 4, 256), np.uint16)[:, :, :128])
    with pytest.raises(ValueError):  # out of another shape
        B.ll_expert_ffn(recv_x, rows, w.w1, w.w2, np.zeros((2, 3, 128), np.uint16))
    with pytest.raises(ValueError):  # gaps between experts
        B.ll_expert_ffn(recv_x[:, :3], rows, w.w1, w.w2, np.zeros((2, 3, 128), np.uint16))


# ----------------------------------------- executors on recording stand-ins

class _Log:
    """Streams as sequences of nodes (ops, event records, event waits); a node
    follows the one before it on its stream and a wait follows the event's
    latest record. ``before(a, b)``: op a happens before op b."""

    def __init__(self):
        self.nodes = []  # (stream, kind, payload)
        self.current = None

    def add(self, stream, kind, payload):
        self.nodes.append((stream, kind, payload))

    def op_index(self, name):
        hits = [i for i, (_, kind, p) in enumerate(self.nodes) if kind == "op" and p == name]
        assert len(hits) == 1, (name, hits)
        return hits[0]

    def deps(self, i):
        stream, kind, payload = self.nodes[i]
        out = [j for j in range(i - 1, -1, -1) if self.nodes[j][0] is stream][:1]
        if kind == "wait":
            rec = [j for j in range(i - 1, -1, -1) if self.nodes[j][1] == "record" and self.nodes[j][2] is payload]
            assert rec, "wait on an event never recorded"
            out.append(rec[0])
        return out

    def before(self, a, b):
        target, todo, seen = self.op_index(a), [self.op_index(b)], set()
        while todo:
            i = todo.pop()
            for j in self.deps(i):
                if j == target:
                    return True
                if j not in seen:
                    seen.add(j)
                    todo.append(j)
        return False

    def ops(self):
        return [p for _, kind, p in self.nodes if kind == "op"]


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, ev):
        self.log.add(self, "wait", ev)


def _fake_cupy(log):
    class Event:
        def __init__(self, disable_timing=False):
            pass

        def record(self, stream=None):
            log.add(stream or log.current, "record", self)

    return types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, get_current_stream=lambda: log.current))


class _FakeBuffer:
    """Buffer's stream semantics: the communication stream waits for previous_event
    (default: the current stream so far), runs the op, records the result's event;
    without async_finish the current stream waits for it."""

    def __init__(self, log, cupy, name):
        self.log, self.cupy, self.name = log, cupy, name
        self.comm_stream = _Stream(log, f"comm {name}")

    def _begin(self, previous_event):
        if previous_event is None:
            previous_event = self.cupy.cuda.Event()
            previous_event.record(self.log.current)
        self.comm_stream.wait_event(previous_event.event if isinstance(previous_event, EventHandle)
                                    else previous_event)

    def _end(self, async_finish):
        ev = self.cupy.cuda.Event()
        ev.record(self.comm_stream)
        if not async_finish:
            self.log.current.wait_event(ev)
        return EventHandle(ev)

    def dispatch(self, x, topk_idx, topk_weights, *, previous_event=None, async_finish=False, **kw):
        assert kw["validate"] is False and kw["expert_major"] is True  # a host check would sync the compute stream
        self._begin(previous_event)
        self.log.add(self.comm_stream, "op", f"dispatch {x}")
        return types.SimpleNamespace(expert_x=x, num_recv_tokens_per_expert=[1], recv_topk_weights=None,
                                     handle=types.SimpleNamespace(recv_expert_counts=(1,)),
                                     event=self._end(async_finish))

    def combine(self, y, handle, *, previous_event=None, async_finish=False, **kw):
        self._begin(previous_event)
        self.log.add(self.comm_stream, "op", f"combine {y}")
        return types.SimpleNamespace(combined_x=y, event=self._end(async_finish))


def _normal_runner(monkeypatch):
    log = _Log()
    cupy = _fake_cupy(log)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    log.current = _Stream(log, "compute")
    mbs = {m: B.MicroBatch(m, None, None, _FakeBuffer(log, cupy, m)) for m in B.MICRO_BATCHES}

    def ffn(x, blocks, w1, w2):
        assert blocks == [(0, 1)]
        log.add(log.current, "op", f"ffn {x}")
        return x

    return log, B.NormalRunner(mbs, 8, "queue", None, None, 1, None, None, ffn)


def test_normal_overlapped_wiring(monkeypatch):
    log, runner = _normal_runner(monkeypatch)
    log.add(log.current, "op", "barrier")
    runner.run(B.schedule("normal", True), {})
    log.add(log.current, "op", "end")
    hb = log.before
    assert hb("barrier", "dispatch a") and hb("dispatch a", "ffn a") and hb("dispatch a", "dispatch b")
    # FFN A and dispatch B overlap; so do combine A and FFN B
    assert not hb("ffn a", "dispatch b") and not hb("dispatch b", "ffn a")
    assert not hb("combine a", "ffn b") and not hb("ffn b", "combine a")
    # a combine after its FFN and after the communication step before it; FFN B after its dispatch
    assert hb("ffn a", "combine a") and hb("dispatch b", "combine a") and hb("dispatch b", "ffn b")
    assert hb("ffn b", "combine b") and hb("combine a", "combine b")
    assert all(hb(op, "end") for op in ("combine a", "combine b", "ffn b"))
    # host order: FFN A is enqueued before dispatch B (whose notify waits on the host)
    assert log.ops().index("ffn a") < log.ops().index("dispatch b")


def test_normal_serial_wiring(monkeypatch):
    log, runner = _normal_runner(monkeypatch)
    log.add(log.current, "op", "barrier")
    runner.run(B.schedule("normal", False), {})
    log.add(log.current, "op", "end")
    chain = ["barrier", "dispatch a", "ffn a", "combine a", "dispatch b", "ffn b", "combine b", "end"]
    assert all(log.before(a, b) for a, b in zip(chain, chain[1:]))


def test_normal_parts_wait_for_their_own_barrier(monkeypatch):
    log, runner = _normal_runner(monkeypatch)
    state = {}
    for k, (name, steps) in enumerate(B.part_calls("normal")):
        log.add(log.current, "op", f"barrier {k}")
        runner.run(steps, state)
        log.add(log.current, "op", f"end {k}")
        op = " ".join(name.split("_"))
        assert log.before(f"barrier {k}", op) and log.before(op, f"end {k}")
    assert set(state) == {"d", "y", "c"} and set(state["c"]) == {"a", "b"}


def test_wiring_check_can_fail(monkeypatch):
    """The default previous_event (the current stream so far) would put dispatch B behind FFN A."""
    log, runner = _normal_runner(monkeypatch)
    mb = runner.mbs["b"]
    real = mb.buf.dispatch
    mb.buf.dispatch = lambda *a, previous_event=None, **kw: real(*a, previous_event=None, **kw)
    runner.run(B.schedule("normal", True), {})
    assert log.before("ffn a", "dispatch b")


class _FakeLowLatency:
    """LowLatencyBuffer's hook rule: one pending receive hook per buffer."""

    def __init__(self, log, name, recv_x):
        self.log, self.name, self.recv_x, self.pending = log, name, recv_x, None

    def _send(self, what):
        if self.pending is not None:
            raise ValueError(f"{self.name}: the receive hook of the previous call has not run yet")
        self.log.add(self.log.current, "op", f"{what}_send {self.name}")

        def hook():
            self.pending = None
            self.log.add(self.log.current, "op", f"{what}_recv {self.name}")
        self.pending = hook
        return hook

    def dispatch(self, x, topk_idx, *, use_fp8=True, validate=True, return_recv_hook=False):
        assert not use_fp8 and not validate and return_recv_hook
        return types.SimpleNamespace(recv_x=self.recv_x, handle=self.name, hook=self._send("dispatch"))

    def get_next_combine_buffer(self, handle):
        assert handle == self.name
        if getattr(self, "combine_buffer", None) is None:
            self.combine_buffer = np.zeros_like(self.recv_x)
        return self.combine_buffer

    def combine(self, y, topk_idx, topk_weights, handle, *, zero_copy=False, return_recv_hook=False):
        assert return_recv_hook and handle == self.name
        assert y is None or not zero_copy  # zero-copy: the combine reads its own buffer, x is None
        return types.SimpleNamespace(combined_x=self.combine_buffer if zero_copy else y, hook=self._send("combine"))


def _ll_runner(zero_copy=False):
    log = _Log()
    log.current = _Stream(log, "compute")
    rng = np.random.default_rng(4)
    R, El, max_tokens, H, F = 2, 2, 3, 128, 8
    w = MoEWeights.random(1, hidden=H, ffn=F, num_experts=El)
    mbs = {}
    for m in B.MICRO_BATCHES:
        counts = rng.integers(0, max_tokens + 1, size=(El, R))
        mbs[m] = B.MicroBatch(m, None, None, _FakeLowLatency(log, m, _ll_recv(rng, El, R, max_tokens, H)),
                              rows=B.expert_rows(counts, max_tokens),
                              y_full=np.zeros((El, R * max_tokens, H), np.uint16))

    def ffn(x, blocks, w1, w2):
        log.add(log.current, "op", f"ffn {len(x)}")
        return expert_ffn(x, blocks, w1, w2)

    return log, B.LowLatencyRunner(mbs, w.w1, w.w2, ffn, zero_copy=zero_copy), w


@pytest.mark.parametrize("zero_copy", [False, True])
def test_low_latency_runner_order_and_hooks(zero_copy):
    log, runner, w = _ll_runner(zero_copy)
    state = runner.run(B.schedule("low_latency", True), {})
    names = [f"{op} {m}" if op != "ffn" else "ffn" for op, m in B.schedule("low_latency", True)]
    assert [o if not o.startswith("ffn") else "ffn" for o in log.ops()] == names
    for m, mb in runner.mbs.items():
        # zero-copy: the FFN wrote into the buffer the combine reads, and the caller's array is untouched
        y = mb.buf.combine_buffer if zero_copy else mb.y_full
        assert state["c"][m].combined_x is y
        want = np.zeros_like(mb.y_full)
        B.ll_expert_ffn(mb.buf.recv_x, mb.rows, w.w1, w.w2, want)
        assert np.array_equal(y, want)
        assert zero_copy == (not mb.y_full.any())


def test_low_latency_runner_batched_ffn():
    """The runner's batched FFN (padded blocks) writes what ll_expert_ffn(batched=True) does."""
    log, per_expert, w = _ll_runner(zero_copy=True)
    runner = B.LowLatencyRunner(per_expert.mbs, w.w1, w.w2, None, zero_copy=True, batched=True)
    state = runner.run(B.schedule("low_latency", True), {})
    for m, mb in runner.mbs.items():
        want = np.zeros_like(mb.y_full)
        B.ll_expert_ffn(mb.buf.recv_x, mb.rows, w.w1, w.w2, want, batched=True)
        assert state["c"][m].combined_x is mb.buf.combine_buffer and np.array_equal(mb.buf.combine_buffer, want)


def test_low_latency_hook_rule_refuses_a_second_send():
    log, runner, _ = _ll_runner()
    runner.run([("dispatch_send", "a"), ("dispatch_send", "b")], {})  # two buffers: fine
    with pytest.raises(ValueError):  # a second send on A's buffer before A's receive half
        runner.run([("combine_send", "a")], {"d": {"a": types.SimpleNamespace(handle="a")}, "y": {"a": None}})


class _Gathered:
    """A communicator stand-in whose allgather returns fixed per-rank values."""

    def __init__(self, values):
        self.values = values

    def allgather(self, _mine):
        return list(self.values)


def test_a_refusal_counts_only_when_every_rank_agrees():
    assert B.agreed_refusal(_Gathered([None, None]), None) is None
    assert B.agreed_refusal(_Gathered(["too big", "too big"]), "too big") == "too big"
    with pytest.raises(RuntimeError, match=r"ranks \[1\] only.*rank 1: pool too small"):
        B.agreed_refusal(_Gathered([None, "pool too small"]), None)


def test_normal_arms_pair_each_transport_with_its_combines():
    bench = B
    from types import SimpleNamespace
    has = {"queue": False, "direct": True}
    args = SimpleNamespace(transport=["queue", "direct"], comm_sms=[None, 8], combines=["default", "push"])
    arms = bench.normal_arms(args, has)
    # the queue route has one combine (its default is the push); the direct one both, zero-copy first
    assert arms == [("queue", None, False), ("queue", 8, False), ("direct", None, True), ("direct", None, False),
                    ("direct", 8, True), ("direct", 8, False)]
    args.combines = ["default"]
    assert bench.normal_arms(args, has) == [("queue", None, False), ("queue", 8, False), ("direct", None, True),
                                            ("direct", 8, True)]
    assert bench.normal_arms(args, {"queue": False, "direct": False})[-1] == ("direct", 8, False)  # across nodes
