"""cupyep.Buffer across nodes (cupyep.normal.internode) on the CPU: a group of
two or more nodes gets the two-hop buffer; its declared sizes are checked by
every call before anything runs, and its engines are made from them (one
per route, both in one buffer); handles choose their route and are any
live handle of the buffer; results carry their slot's lease (or are fresh
copies); what the two-hop mode does not carry is refused before anything
runs; results map onto DispatchResult / CombineResult, with the per-expert
counts of the received ids; the layout's counts per node. The expert-major
layout runs on the GPU (tests/gpu/test_two_hop_gpu.py: the MoE layer across
nodes)."""
from types import SimpleNamespace

import numpy as np
import pytest

import cupyep
from cupyep.normal import internode_kernels as INTER
from cupyep.errors import StaleResultError
from cupyep.normal.internode_kernels import TwoHopHandle
from cupyep.normal import buffer as BUF
from cupyep.normal.internode import ROUTES, InternodeRoute, tokens_per_node
from cupyep.results import CombineResult, DispatchResult
from cupyep.sizes import DEFAULT_HIDDEN, DEFAULT_MAX_TOKENS, DEFAULT_NUM_TOPK
from cupyep.slots import DEFAULT_IN_FLIGHT, InFlightSlots


class _Group:
    def __init__(self, num_nodes=2, world_size=4, rank=0, others=None):
        self.num_nodes, self.world_size, self.rank = num_nodes, world_size, rank
        self.local_size = world_size // num_nodes
        self.num_sms, self.sm_share = 132, 66
        self.others = others  # the other ranks' rows of the sizes exchange
        self.exchanges = 0
        self.agreements = []  # (call, fields) of every Group.agree

    def agree(self, call, **fields):
        self.agreements.append((call, fields))

    def require_gpu(self, what):
        pass

    def exchange(self, mine, phase):
        self.exchanges += 1
        rows = [mine] + [np.asarray(o, dtype=np.int64) for o in (self.others or [mine] * (self.world_size - 1))]
        return np.stack(rows)


class _Engine:
    """A TwoHopDispatch stand-in: records calls, returns 4 fixed rows in its own slots."""

    def __init__(self, route, num_in_flight=2):
        self.route, self.calls, self.num_sms = route, [], 4
        self.slots = InFlightSlots(num_in_flight, f"fake {route} pool")
        self.recv_topk_idx = np.array([[0, -1], [1, 0], [-1, 1], [0, 0]], dtype=np.int64)

    def dispatch(self, x, topk_idx, topk_weights, x_scales=None, num_worst_tokens=0, validate=True, handle=None,
                 num_experts=None):
        self.calls.append(("dispatch", handle, num_worst_tokens, topk_weights))
        made = handle or TwoHopHandle(owner=id(self), topk_idx=topk_idx, plan={}, delta=None, num_rows=4,
                                      num_worst_tokens=num_worst_tokens, src_rank=None, num_experts=num_experts,
                                      route=self.route)
        lease = self.slots.take("fake dispatch")
        return SimpleNamespace(recv_x=np.full((4, x.shape[1]), lease.slot, np.uint16), recv_x_scales=None,
                               recv_topk_idx=self.recv_topk_idx,
                               recv_topk_weights=None if topk_weights is None else np.ones((4, 2), np.float32),
                               handle=made, lease=lease)

    def combine(self, y, handle, row_weights=None, topk_weights=None):
        self.calls.append(("combine", handle, y, row_weights))
        return ("combined", "combined weights") if topk_weights is not None else "combined"

    def destroy(self):
        self.calls.append(("destroy",))


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Calls:
    """cupyep.streams.CommStream without a GPU: records the ordering requests."""

    def __init__(self, group, stream=None):
        self.stream, self.log = _Stream(), []

    def begin(self, previous_event):
        self.log.append(("begin", previous_event))

    def end(self, async_finish, keep=()):
        self.log.append(("end", async_finish))
        return "event"

    def release(self):
        self.log.append(("release",))


def _check_ids(topk_idx, num_experts):
    if topk_idx.size and (topk_idx.min() < -1 or topk_idx.max() >= num_experts):
        raise ValueError("topk_idx holds expert ids outside the range")


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    """The front without a GPU: NumPy arrays pass as they are, the stream is a recorder."""
    from cupyep import arrays

    monkeypatch.setattr(BUF, "CommStream", _Calls)
    monkeypatch.setattr(arrays, "as_cupy", lambda a, name: a)
    monkeypatch.setattr(BUF, "as_cupy", lambda a, name: a)
    monkeypatch.setattr(BUF, "check_expert_ids", _check_ids)
    monkeypatch.setattr(BUF, "_capturing", lambda: False)


def _buffer(group=None, **sizes):
    buf = cupyep.Buffer(group or _Group(), **sizes)
    buf.made = []
    buf._shared.new_engine = lambda route: buf.made.append(route) or _Engine(route, buf.num_in_flight)
    return buf


def _engines(buf) -> dict:
    """{route name: its engine} of the engines the buffer's calls made."""
    return {r.name: r._engine for r in buf.routes.values() if r._engine is not None}


def _call(T=4, H=256, k=2):
    return np.zeros((T, H), np.uint16), np.zeros((T, k), np.int64), np.zeros((T, k), np.float32)


def test_a_group_across_nodes_gets_the_routes_across_nodes():
    buf = cupyep.Buffer(_Group(num_nodes=2))
    assert all(isinstance(r, InternodeRoute) for r in buf.routes.values())
    assert {t: r.name for t, r in buf.routes.items()} == ROUTES == {"queue": "two_hop", "direct": "direct"}
    with pytest.raises(ValueError, match="num_direct_bytes"):
        cupyep.Buffer(_Group(num_nodes=2), num_direct_bytes=1 << 20)
    with pytest.raises(ValueError, match="on_partition"):  # before any partition is made
        cupyep.Buffer(_Group(num_nodes=2), on_partition=True)
    assert not buf.on_partition


def test_across_nodes_the_routes_stay_on_the_full_gpu_under_sm_share(monkeypatch):
    from cupyep import sm_partition
    monkeypatch.setenv(sm_partition.ENV_VAR, "1")
    assert not cupyep.Buffer(_Group(num_nodes=2)).on_partition


def test_the_engines_are_made_from_the_declared_sizes(monkeypatch):
    """One TwoHopDispatch per route, made from the constructor's sizes (not
    the first call's), collectively at the route's first call, after one
    host exchange that compares every rank's declared sizes."""
    made = []
    monkeypatch.setattr(INTER, "TwoHopDispatch", lambda *a, **kw: made.append((a[1:], kw)) or _Engine(kw["route"]))
    g = _Group()
    buf = cupyep.Buffer(g, max_tokens=64, hidden=512, num_topk=4, num_in_flight=3)
    x, idx, w = _call(T=2, H=256, k=2)
    buf.dispatch(x, idx, w, num_experts=8)
    buf.dispatch(x, idx, w, num_experts=8)
    assert made == [((64, 512, 4), {"route": "two_hop", "num_in_flight": 3, "num_sms": 0})] and g.exchanges == 1
    buf.dispatch(x, idx, w, num_experts=8, transport="direct")
    assert made[1] == ((64, 512, 4), {"route": "direct", "num_in_flight": 3, "num_sms": 0}) and g.exchanges == 2
    cupyep.Buffer(_Group())._shared.new_engine("two_hop")
    assert made[2] == ((DEFAULT_MAX_TOKENS, DEFAULT_HIDDEN, DEFAULT_NUM_TOPK),
                       {"route": "two_hop", "num_in_flight": DEFAULT_IN_FLIGHT, "num_sms": 0})  # the defaults
    few = cupyep.Buffer(_Group(), num_sms=4)  # the communication kernels' blocks per rank, as within a node
    assert few.sm_budget == 4 and cupyep.Buffer(_Group()).sm_budget == 66
    few.dispatch(x, idx, w, num_experts=8)
    assert made[3][1] == {"route": "two_hop", "num_in_flight": DEFAULT_IN_FLIGHT, "num_sms": 4}


def test_a_validated_dispatch_has_the_ranks_agree_on_what_they_share(monkeypatch):
    """validate=True (the default): before the engine runs, every rank
    compares the arguments the kernels assume are shared (Group.agree);
    validate=False skips that exchange."""
    monkeypatch.setattr(INTER, "TwoHopDispatch", lambda *a, **kw: _Engine(kw["route"]))
    g = _Group()
    buf = cupyep.Buffer(g, max_tokens=64, hidden=512, num_topk=4)
    x, idx, w = _call(T=2, H=256, k=2)
    buf.dispatch(x, idx, w, num_experts=8, transport="direct")
    assert g.agreements == [("Buffer.dispatch", {"hidden": 256, "fp8": False, "num_topk": 2, "topk_weights": True,
                                                 "num_experts": 8, "expert_major": False, "expert_alignment": 1,
                                                 "direct": True, "cached": False, "num_channels": 0,
                                                 "queue_depth": 0, "chunk_size": 0})]
    buf.dispatch(x, idx, w, num_experts=8, validate=False)
    assert len(g.agreements) == 1


def test_calls_smaller_than_declared_pass_and_larger_ones_raise_before_launch():
    """A 4-token warm-up does not freeze the buffer: a 1024-token call with
    fewer channels and experts per token follows; a call past a declared
    size is a ValueError naming the size and the constructor argument,
    raised before anything is made or launched."""
    buf = _buffer(max_tokens=1024, hidden=7168, num_topk=8)
    buf.dispatch(*_call(T=4, H=256, k=2), num_experts=8)
    buf.dispatch(*_call(T=1024, H=7168, k=2), num_experts=8)
    assert len(_engines(buf)["two_hop"].calls) == 2
    for (T, H, k), name in (((1025, 256, 2), "max_tokens=1024"), ((4, 7296, 2), "hidden=7168"),
                            ((4, 256, 9), "num_topk=8")):
        with pytest.raises(ValueError, match=f"Buffer.dispatch: .*{name}; make the buffer with"):
            buf.dispatch(*_call(T, H, k), num_experts=8)
        with pytest.raises(ValueError, match=name):
            buf.dispatch(*_call(T, H, k), num_experts=8, transport="direct")
    assert len(_engines(buf)["two_hop"].calls) == 2 and "direct" not in _engines(buf)
    small = _buffer(max_tokens=8, hidden=128, num_topk=2)
    with pytest.raises(ValueError, match="max_tokens=8"):
        small.dispatch(*_call(T=9, H=128, k=2), num_experts=8)
    assert _engines(small) == {}


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"hidden": 100}, {"num_topk": -1}, {"num_in_flight": 0},
                                {"num_in_flight": 1.5}])
def test_bad_declared_sizes_raise_when_the_buffer_is_made(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        cupyep.Buffer(_Group(), **kw)


def test_ranks_that_declared_different_sizes_raise_at_the_first_call():
    g = _Group(others=[[64, 256, 4, 2, 0], [64, 256, 8, 2, 0], [64, 256, 4, 2, 0]])
    buf = _buffer(g, max_tokens=64, hidden=256, num_topk=4, num_in_flight=2)
    with pytest.raises(ValueError, match="different sizes"):
        buf.dispatch(*_call(), num_experts=8)
    assert _engines(buf) == {}
    g = _Group(others=[[64, 256, 4, 2, 4], [64, 256, 4, 2, 8], [64, 256, 4, 2, 4]])  # num_sms differs
    buf = _buffer(g, max_tokens=64, hidden=256, num_topk=4, num_in_flight=2, num_sms=4)
    with pytest.raises(ValueError, match=r"different sizes.*num_sms"):
        buf.dispatch(*_call(), num_experts=8)


@pytest.mark.parametrize("transport,route", [(None, "two_hop"), ("queue", "two_hop"), ("direct", "direct")])
def test_the_transport_picks_the_route(transport, route):
    buf = _buffer()
    out = buf.dispatch(*_call(), num_experts=8, transport=transport)
    assert buf.made == [route] and out.handle.route == route
    with pytest.raises(ValueError, match="transport must be one of"):
        buf.dispatch(*_call(), num_experts=8, transport="two_hop")


def test_both_routes_run_in_one_buffer_and_handles_keep_theirs():
    """A buffer carries both routes (an engine each); a cached dispatch and a
    combine run on their handle's route; a transport that contradicts the
    handle, an unknown transport and a handle of another buffer raise
    before launch."""
    buf = _buffer()
    two_hop = buf.dispatch(*_call(), num_experts=8)
    direct = buf.dispatch(*_call(), num_experts=8, transport="direct")
    assert buf.made == ["two_hop", "direct"]
    eng = _engines(buf)
    buf.dispatch(np.zeros((4, 256), np.uint16), handle=direct.handle)
    assert eng["direct"].calls[-1][0] == "dispatch" and len(eng["two_hop"].calls) == 1
    buf.combine(np.zeros((4, 256), np.uint16), two_hop.handle)
    assert eng["two_hop"].calls[-1][:2] == ("combine", two_hop.handle)
    buf.dispatch(np.zeros((4, 256), np.uint16), handle=direct.handle, transport="direct")
    with pytest.raises(ValueError, match="made by the direct transport, not 'queue'"):
        buf.dispatch(np.zeros((4, 256), np.uint16), handle=direct.handle, transport="queue")
    with pytest.raises(ValueError, match="transport"):
        buf.dispatch(*_call(), num_experts=8, transport="ring")
    other = _buffer().dispatch(*_call(), num_experts=8)
    with pytest.raises(ValueError, match="live handle of this Buffer"):
        buf.dispatch(np.zeros((4, 256), np.uint16), handle=other.handle)
    with pytest.raises(ValueError, match="live handle of this Buffer"):
        buf.combine(np.zeros((4, 256), np.uint16), other.handle)
    calls = {r: len(e.calls) for r, e in eng.items()}
    buf.destroy()
    assert [e.calls[-1] for e in eng.values()] == [("destroy",)] * 2 and _engines(buf) == {}
    assert calls == {"two_hop": 2, "direct": 3}


def test_any_live_handle_is_combined_any_number_of_times_in_any_order():
    buf = _buffer()
    first = buf.dispatch(*_call(), num_experts=8)
    second = buf.dispatch(*_call(), num_experts=8)
    for h in (second.handle, first.handle, first.handle):
        comb = buf.combine(np.zeros((4, 256), np.uint16), h)
        assert comb.combined_x == "combined" and _engines(buf)["two_hop"].calls[-1][1] is h


def test_results_carry_their_slots_lease_and_fresh_results_none():
    """A result's receive arrays live in a slot of its route's pool: reading
    them after num_in_flight later dispatches of that route is a
    StaleResultError, and a dispatch of the other route does not count.
    fresh=True gives copies of the caller's own, never stale."""
    buf = _buffer(num_in_flight=2)
    a = buf.dispatch(*_call(), num_experts=8)
    fresh = buf.dispatch(*_call(), num_experts=8, fresh=True)
    assert a.lease.slot == 0 and fresh.lease is None
    buf.dispatch(*_call(), num_experts=8, transport="direct")
    assert not a.stale and int(a.recv_x[0, 0]) == 0
    buf.dispatch(*_call(), num_experts=8)  # slot 0 again
    assert a.stale and not fresh.stale and int(fresh.recv_x[0, 0]) == 1
    with pytest.raises(StaleResultError, match="recv_x"):
        a.recv_x
    assert a.handle.num_rows == 4  # the handle stays usable
    buf.combine(np.zeros((4, 256), np.uint16), a.handle)


def test_a_dispatch_without_topk_weights_and_a_cached_one_with_only_x():
    buf = _buffer()
    x, idx, _ = _call()
    out = buf.dispatch(x, idx, num_experts=8)
    assert out.recv_topk_weights is None and _engines(buf)["two_hop"].calls[-1][3] is None
    again = buf.dispatch(x, handle=out.handle)
    assert again.recv_topk_weights is None and _engines(buf)["two_hop"].calls[-1][1] is out.handle
    assert again.num_recv_tokens_per_expert == out.num_recv_tokens_per_expert == [4, 2]


def test_worst_token_and_cached_calls_pass_through():
    buf = _buffer()
    x, idx, w = _call()
    out = buf.dispatch(x, idx, w, num_experts=8, num_worst_tokens=16)
    assert out.num_recv_tokens_per_expert is None and _engines(buf)["two_hop"].calls[-1][:3] == ("dispatch", None, 16)
    again = buf.dispatch(x, topk_weights=w, handle=out.handle)
    assert _engines(buf)["two_hop"].calls[-1][1] is out.handle and again.num_recv_tokens_per_expert is None
    y = np.zeros((4, 256), np.uint16)
    rw = np.ones(4, np.float32)
    comb = buf.combine(y, again.handle, row_weights=rw)
    assert isinstance(comb, CombineResult) and comb.combined_x == "combined" and comb.combined_topk_weights is None
    call = _engines(buf)["two_hop"].calls[-1]
    assert call[:2] == ("combine", again.handle) and call[2] is y and call[3] is rw
    comb = buf.combine(y, again.handle, topk_weights=np.ones((4, 2), np.float32))
    assert (comb.combined_x, comb.combined_topk_weights) == ("combined", "combined weights")
    buf.destroy()
    assert _engines(buf) == {}


@pytest.mark.parametrize("kw", [{"config": object()}, {"transport": "ring"}, {"notify_time_ns": object()},
                                {"queue_occupancy": object()}, {"expert_alignment": 0}, {"num_experts": 6},
                                {"num_experts": 0}])
def test_what_the_two_hop_dispatch_does_not_carry_is_refused(kw):
    buf = _buffer()
    with pytest.raises(ValueError):
        buf.dispatch(*_call(), **{"num_experts": 8, **kw})
    assert _engines(buf) == {}  # nothing was made or launched


@pytest.mark.parametrize("kw,match", [({"config": object()}, "across nodes"),
                                      ({"zero_copy": True}, "zero_copy needs a handle of the direct transport within a node"),
                                      ({"pair_weights": np.ones(4)}, "expert-major"),
                                      ({"expert_major": True}, "expert_major=True")])
def test_what_the_two_hop_combine_does_not_carry_is_refused(kw, match):
    """Also: pair_weights or expert_major=True after a rank-major dispatch."""
    buf = _buffer()
    out = buf.dispatch(*_call(), num_experts=8)
    with pytest.raises(ValueError, match=match):
        buf.combine(np.zeros((4, 256), np.uint16), out.handle, **kw)
    assert _engines(buf)["two_hop"].calls[-1][0] == "dispatch"  # no combine ran


def test_the_handle_carries_the_per_expert_counts_for_the_moe_layer():
    buf = _buffer()
    out = buf.dispatch(*_call(), num_experts=8, expert_alignment=8)
    assert isinstance(out, DispatchResult) and out.event == "event"
    # E_local = 8 / 4 = 2: expert 0 holds 4 pairs, expert 1 two; rounded up to 8
    assert out.handle.recv_expert_counts == (4, 2) and out.num_recv_tokens_per_expert == [8, 8]
    assert out.handle.expert_map is None


def test_calls_are_ordered_on_the_communication_stream():
    buf = _buffer()
    x, idx, w = _call()
    out = buf.dispatch(x, idx, w, num_experts=8, previous_event="ev0", async_finish=True)
    comb = buf.combine(x, out.handle, previous_event=out.event)
    assert buf._calls.log == [("begin", "ev0"), ("end", True), ("begin", "event"), ("end", False)]
    assert out.event == comb.event == "event"
    buf.destroy()
    assert buf._calls.log[-1] == ("release",)


@pytest.mark.parametrize("R,K", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_the_layouts_counts_per_node_are_the_references(R, K):
    """num_tokens_per_rdma_rank: the tokens with an expert on each node, from
    is_token_in_rank, as cupyep.reference's layout counts them per node."""
    from cupyep.reference.layout import get_dispatch_layout
    from cupyep.testing import global_routing
    E = 4 * R
    idx, _ = global_routing(3, [50] * R, E, 4)
    for i in idx + [np.zeros((0, 4), np.int64), np.full((3, 4), -1, np.int64)]:
        want = get_dispatch_layout(i, E, R, K)
        got = tokens_per_node(want.is_token_in_rank, K)
        assert got.dtype == np.int32 and np.array_equal(got, want.num_tokens_per_node)


def test_the_layout_and_the_combine_check_their_input_before_launch():
    buf = _buffer(max_tokens=8, num_topk=4)
    with pytest.raises(ValueError, match="Buffer.get_dispatch_layout: 9 tokens.*max_tokens=8"):
        buf.get_dispatch_layout(np.zeros((9, 2), np.int64), 8)
    with pytest.raises(ValueError, match="num_topk=4"):
        buf.get_dispatch_layout(np.zeros((2, 5), np.int64), 8)
    with pytest.raises(ValueError, match="divisible by the 4 ranks"):
        buf.get_dispatch_layout(np.zeros((2, 2), np.int64), 6)
    with pytest.raises(ValueError, match="2-D"):
        buf.get_dispatch_layout(np.zeros(4, np.int64), 8)
    assert buf._calls.log == []  # nothing was enqueued
    out = buf.dispatch(*_call(T=2, H=256, k=2), num_experts=8)
    with pytest.raises(ValueError, match="Buffer.combine: 7296 channels per row.*hidden=7168"):
        buf.combine(np.zeros((4, 7296), np.uint16), out.handle)
    assert _engines(buf)["two_hop"].calls[-1][0] == "dispatch"
