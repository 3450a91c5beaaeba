"""The normal-mode Buffer front on the CPU (cupyep.normal.buffer): every bad
input is a ValueError naming what is wrong, raised before any route runs;
a good call reaches the route its transport or handle names, with the
arguments checked once. The routes are stand-ins that record their calls."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from cupyep.normal import buffer as BUF
from cupyep.normal.config import Config
from cupyep.normal.direct_kernels import DirectConfig
from cupyep.normal.route import Route
from cupyep.results import CombineResult, DispatchHandle, DispatchResult
from cupyep.sizes import DeclaredSizes

R, E, T, H, K = 2, 8, 16, 256, 2


class _Route(Route):
    def __init__(self, transport, buf_id, metrics=()):
        self.transport = self.name = transport
        self.metrics = frozenset(metrics)
        self.zero_copy = transport == "direct"
        self.buf_id, self.calls = buf_id, []

    def dispatch_config(self, config, fp8, handle):
        return config

    def combine_config(self, config, handle):
        return config

    def owns(self, handle):
        return isinstance(handle, DispatchHandle) and handle.buffer_id == self.buf_id and \
            handle.transport == self.transport

    def expert_rows(self, handle):
        return (handle.num_expert_rows, 2) if handle.recv_expert_row is not None else (0, 0)

    def layout(self, topk_idx, num_experts):
        self.calls.append(("layout", topk_idx.shape))
        return SimpleNamespace(event=None)

    def dispatch(self, call):
        self.calls.append(("dispatch", call))
        return DispatchResult(None, None, None, None, None, None)

    def combine(self, call):
        self.calls.append(("combine", call))
        return CombineResult(None, None, None)


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Calls:
    def begin(self, previous_event):
        pass

    def end(self, async_finish, keep=()):
        return "event"


class _Group:
    def __init__(self):
        self.agreed = []

    def agree(self, call, **fields):
        self.agreed.append(fields)


@pytest.fixture
def buf(monkeypatch):
    from cupyep import arrays
    monkeypatch.setattr(arrays, "as_cupy", lambda a, name: a)
    monkeypatch.setattr(BUF, "as_cupy", lambda a, name: a)
    monkeypatch.setattr(BUF, "check_expert_ids", lambda idx, e: None if idx.size == 0 or
                        (idx.min() >= -1 and idx.max() < e) else (_ for _ in ()).throw(ValueError("expert ids")))
    monkeypatch.setattr(BUF, "_capturing", lambda: False)
    b = object.__new__(BUF.Buffer)
    b.num_ranks, b.rank, b.internode = R, 0, False
    b.sizes = DeclaredSizes(max_tokens=T, hidden=H, num_topk=K)
    b.group, b._calls, b.comm_stream = _Group(), _Calls(), _Stream()
    b.routes = {"queue": _Route("queue", id(b), {"notify_time_ns", "queue_occupancy"}),
                "direct": _Route("direct", id(b), {"notify_time_ns", "kernel_time_ns"})}
    return b


def _inputs(T_=T, H_=H, k=K, dtype=np.uint16):
    x = np.zeros((T_, H_), dtype)
    idx = np.tile(np.arange(k, dtype=np.int64), (T_, 1))
    return x, idx, np.ones((T_, k), np.float32)


def _handle(b, transport="queue", N=10, expert_map=False):
    return DispatchHandle(rank_prefix_matrix=None, recv_channel_prefix=None, recv_rank_offset=None,
                          recv_src_idx=None, is_token_in_rank=None, send_head=None, send_list=None,
                          send_channel_prefix=None, num_recv_tokens=N, num_worst_tokens=0, num_tokens=T, hidden=H,
                          num_experts=E, num_channels=1, buffer_id=id(b), transport=transport,
                          recv_expert_row=np.zeros((N, 2), np.int32) if expert_map else None,
                          num_expert_rows=12 if expert_map else 0)


def test_a_good_dispatch_reaches_its_route_checked_once(buf):
    x, idx, w = _inputs()
    buf.dispatch(x, idx, w, num_experts=E, transport="direct", expert_alignment=4)
    (kind, call), = buf.routes["direct"].calls
    assert kind == "dispatch" and call.num_experts == E and call.expert_alignment == 4 and call.num_topk == K
    assert not buf.routes["queue"].calls
    assert buf.group.agreed[-1]["direct"] and buf.group.agreed[-1]["num_topk"] == K
    buf.dispatch(x, idx, w, num_experts=E, validate=False)
    assert buf.routes["queue"].calls[-1][0] == "dispatch" and len(buf.group.agreed) == 1


@pytest.mark.parametrize("change,match", [
    (dict(x=np.zeros((T, H), np.float32)), "x must be uint16"),
    (dict(x=np.zeros(H, np.uint16)), "x must be 2-D"),
    (dict(x=np.zeros((T, 200), np.uint16)), "multiple of 128"),
    (dict(x=np.zeros((T, H), np.uint8)), "scales"),
    (dict(topk_idx=np.zeros((T, K), np.int32)), "topk_idx must have dtype int64"),
    (dict(topk_idx=np.zeros((T + 1, K), np.int64)), "max_tokens|rows"),
    (dict(topk_idx=np.full((T, K), E, np.int64)), "expert ids"),
    (dict(num_experts=7), "not divisible by the 2 ranks"),
    (dict(num_experts=0), "num_experts must be an int in"),
    (dict(x=np.zeros((T + 1, H), np.uint16), topk_idx=np.zeros((T + 1, K), np.int64),
          topk_weights=np.ones((T + 1, K), np.float32)), "max_tokens=16"),
    (dict(x=np.zeros((T, H + 128), np.uint16)), "hidden=256"),
    (dict(topk_idx=np.zeros((T, K + 1), np.int64), topk_weights=np.ones((T, K + 1), np.float32)), "num_topk=2"),
    (dict(topk_weights=np.ones((T, K), np.float64)), "topk_weights must have dtype float32"),
    (dict(topk_weights=np.ones((T, K + 1), np.float32)), r"topk_weights must have shape \[16, 2\]"),
    (dict(num_worst_tokens=-1), "num_worst_tokens must be >= 0"),
    (dict(num_worst_tokens=R * T + 1), "exceeds the 2 x max_tokens"),
    (dict(expert_alignment=0), "expert_alignment must be an integer >= 1"),
    (dict(expert_alignment=1.5), "expert_alignment must be an integer >= 1"),
    (dict(transport="nvlink"), "transport must be one of"),
    (dict(transport="direct", queue_occupancy=np.zeros(3, np.uint64)), "queue_occupancy is a metric the direct"),
    (dict(notify_time_ns=np.zeros(3, np.int64)), r"notify_time_ns must have shape \[2\]"),
    (dict(kernel_time_ns=np.zeros(2, np.int64)), "kernel_time_ns is a metric the queue"),
    (dict(transport="direct", kernel_time_ns=np.zeros(3, np.int64)), r"kernel_time_ns must have shape \[2\]"),
    (dict(transport="direct", kernel_time_ns=np.zeros(2, np.int32)), "kernel_time_ns must have dtype int64"),
    (dict(topk_idx=None), "dispatch needs topk_idx and num_experts"),
])
def test_bad_dispatch_input_raises_before_any_route_runs(buf, change, match):
    x, idx, w = _inputs()
    args = {"x": x, "topk_idx": idx, "topk_weights": w, "num_experts": E, **change}
    with pytest.raises(ValueError, match=match):
        buf.dispatch(args.pop("x"), args.pop("topk_idx"), args.pop("topk_weights"), **args)
    assert not any(r.calls for r in buf.routes.values())


def test_a_handle_picks_its_route_and_a_foreign_one_is_refused(buf):
    x, idx, w = _inputs()
    buf.dispatch(x, handle=_handle(buf, "direct"))
    assert buf.routes["direct"].calls[-1][1].handle is not None
    with pytest.raises(ValueError, match="made by the direct transport, not 'queue'"):
        buf.dispatch(x, handle=_handle(buf, "direct"), transport="queue")
    stranger = replace(_handle(buf), buffer_id=-1)  # another buffer's
    with pytest.raises(ValueError, match="live handle of this Buffer"):
        buf.dispatch(x, handle=stranger)
    with pytest.raises(ValueError, match="handle was made for 16 tokens"):
        buf.dispatch(np.zeros((T - 1, H), np.uint16), handle=_handle(buf))


@pytest.mark.parametrize("change,match", [
    (dict(x=np.zeros((9, H), np.uint16)), "x has 9 rows, the dispatch received 10"),
    (dict(x=np.zeros((10, H), np.float32)), "x must have dtype uint16"),
    (dict(topk_weights=np.ones((9, 2), np.float32)), "topk_weights has 9 rows"),
    (dict(row_weights=np.ones(9, np.float32)), r"row_weights must have shape \[10\]"),
    (dict(pair_weights=np.ones((10, 2), np.float32)), "pair_weights weight expert-major rows"),
    (dict(expert_major=True), "expert_major=True needs a handle"),
    (dict(zero_copy=True), "zero_copy needs a handle of the direct transport"),
    (dict(kernel_time_ns=np.zeros(2, np.int64)), "kernel_time_ns is a metric the queue"),
    (dict(x=np.zeros((10, H + 128), np.uint16)), "hidden=256"),
])
def test_bad_combine_input_raises_before_any_route_runs(buf, change, match):
    args = {"x": np.zeros((10, H), np.uint16), **change}
    with pytest.raises(ValueError, match=match):
        buf.combine(args.pop("x"), _handle(buf), **args)
    assert not any(r.calls for r in buf.routes.values())


def test_an_expert_major_combine_is_recognised_from_the_row_count(buf):
    h = _handle(buf, expert_map=True)
    buf.combine(np.zeros((12, H), np.uint16), h, pair_weights=np.ones((10, 2), np.float32))
    (kind, call), = buf.routes["queue"].calls
    assert kind == "combine" and call.expert_major and call.pair_weights.shape == (10, 2)
    buf.combine(np.zeros((10, H), np.uint16), h)  # rank-major rows of the same handle
    assert not buf.routes["queue"].calls[-1][1].expert_major


def test_the_layout_checks_its_input_and_the_declared_sizes(buf):
    with pytest.raises(ValueError, match="max_tokens=16"):
        buf.get_dispatch_layout(np.zeros((T + 1, K), np.int64), E)
    with pytest.raises(ValueError, match="not divisible"):
        buf.get_dispatch_layout(np.zeros((T, K), np.int64), 5)
    buf.get_dispatch_layout(np.zeros((T, K), np.int64), E)
    assert buf.routes["queue"].calls == [("layout", (T, K))]


def test_configs_of_the_other_transport_are_refused_by_the_real_routes():
    from cupyep.normal.direct import DirectRoute
    from cupyep.normal.queue import QueueRoute
    node = SimpleNamespace(num_ranks=R, sm_budget=66)
    q, d = object.__new__(QueueRoute), object.__new__(DirectRoute)
    q.node = d.node = node
    q._configs, d._configs = {}, {}  # what __init__ makes (the validated configs, per caller's config)
    d._budgets, d.measured = {}, False
    with pytest.raises(ValueError, match="DirectConfig needs transport='direct'"):
        q.dispatch_config(DirectConfig(), False, None)
    with pytest.raises(ValueError, match="takes a DirectConfig"):
        d.dispatch_config(Config(), False, None)
    assert isinstance(d.dispatch_config(None, False, None), DirectConfig)
    assert d.dispatch_config(None, False, None) is d.dispatch_config(None, False, None)  # validated once
    with pytest.raises(ValueError, match="takes a DirectConfig"):  # refused again, not served from the cache
        d.dispatch_config(Config(), False, None)
