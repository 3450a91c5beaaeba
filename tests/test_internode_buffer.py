"""cupyep.Buffer across nodes (cupyep.internode_buffer) on the CPU: a group of
two or more nodes gets the two-hop buffer; its first dispatch sizes the
two-hop mode from every rank's sizes; what the two-hop mode does not carry is
refused before anything runs; results map onto DispatchResult /
CombineResult, with the per-expert counts of the received ids. The
expert-major layout runs on the GPU (tests/gpu/test_two_hop_gpu.py: the MoE
layer across nodes)."""
from types import SimpleNamespace

import numpy as np
import pytest

import cupyep
from cupyep.internode_buffer import TwoHopBuffer
from cupyep.intranode.results import CombineResult, DispatchResult


class _Group:
    def __init__(self, num_nodes=2, world_size=4, rank=0, others=None):
        self.num_nodes, self.world_size, self.rank = num_nodes, world_size, rank
        self.others = others  # the other ranks' [T, H, k, E] rows of the first exchange
        self.exchanges = 0

    def require_gpu(self, what):
        pass

    def exchange(self, mine, phase):
        self.exchanges += 1
        rows = [mine] + [np.asarray(o, dtype=np.int64) for o in (self.others or [mine] * (self.world_size - 1))]
        return np.stack(rows)


class _Engine:
    """A TwoHopDispatch stand-in: records calls, returns fixed rows."""

    def __init__(self, shape):
        self.shape, self.calls = shape, []
        self.recv_topk_idx = np.array([[0, -1], [1, 0], [-1, 1], [0, 0]], dtype=np.int64)

    def dispatch(self, x, topk_idx, topk_weights, x_scales=None, num_worst_tokens=0, validate=True, handle=None):
        self.calls.append(("dispatch", handle, num_worst_tokens))
        return SimpleNamespace(recv_x="rows", recv_x_scales=None, recv_topk_idx=self.recv_topk_idx,
                               recv_topk_weights="w",
                               handle=handle or SimpleNamespace(num_worst_tokens=num_worst_tokens,
                                                                recv_expert_counts=None))

    def combine(self, y, row_weights=None, topk_weights=None):
        self.calls.append(("combine", y, row_weights))
        return ("combined", "combined weights") if topk_weights is not None else "combined"

    def destroy(self):
        self.calls.append(("destroy",))


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Calls:
    """cupyep.intranode.streams.CommStream without a GPU: records the ordering requests."""

    def __init__(self, group):
        self.stream, self.log = _Stream(), []

    def begin(self, previous_event):
        self.log.append(("begin", previous_event))

    def end(self, async_finish, keep=()):
        self.log.append(("end", async_finish))
        return "event"

    def release(self):
        self.log.append(("release",))


@pytest.fixture(autouse=True)
def _no_cuda_streams(monkeypatch):
    from cupyep.intranode import streams
    monkeypatch.setattr(streams, "CommStream", _Calls)


def _buffer(group):
    buf = TwoHopBuffer(group)
    buf.routes = []
    buf._make_engine = lambda *shape: buf.routes.append(shape[4]) or _Engine(shape[:4])
    return buf


def test_a_group_across_nodes_gets_the_two_hop_buffer():
    assert isinstance(cupyep.Buffer(_Group(num_nodes=2)), TwoHopBuffer)
    with pytest.raises(ValueError, match="two or more nodes"):
        TwoHopBuffer(_Group(num_nodes=1))


def test_the_first_dispatch_sizes_the_mode_from_every_rank():
    g = _Group(others=[[7, 256, 2, 8], [3, 256, 2, 8], [5, 256, 2, 8]])
    buf = _buffer(g)
    x = np.zeros((4, 256), np.uint16)
    idx = np.zeros((4, 2), np.int64)
    out = buf.dispatch(x, idx, np.zeros((4, 2), np.float32), num_experts=8, expert_alignment=4)
    assert buf._shape == (7, 256, 2, 8) and buf._engine.shape == (7, 256, 2, 8) and g.exchanges == 1
    assert isinstance(out, DispatchResult) and out.recv_x == "rows" and out.event == "event"
    # E_local = 8 / 4 = 2: expert 0 holds 4 pairs, expert 1 two; rounded up to 4
    assert out.num_recv_tokens_per_expert == [4, 4]
    buf.dispatch(np.zeros((7, 256), np.uint16), np.zeros((7, 2), np.int64), np.zeros((7, 2), np.float32),
                 num_experts=8)
    assert g.exchanges == 1  # the later calls need no host exchange
    with pytest.raises(ValueError, match="at most 7 tokens"):
        buf.dispatch(np.zeros((8, 256), np.uint16), np.zeros((8, 2), np.int64), np.zeros((8, 2), np.float32),
                     num_experts=8)
    with pytest.raises(ValueError, match="hidden=256"):
        buf.dispatch(np.zeros((4, 512), np.uint16), idx, np.zeros((4, 2), np.float32), num_experts=8)


def test_the_first_dispatch_picks_the_route_and_keeps_it():
    """transport="direct" makes the direct route's engine; a buffer keeps its
    first dispatch's route, and a call with the other raises before launch."""
    x, idx, w = np.zeros((4, 256), np.uint16), np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32)
    direct = _buffer(_Group())
    direct.dispatch(x, idx, w, num_experts=8, transport="direct")
    assert direct.routes == ["direct"] and direct._route == "direct"
    with pytest.raises(ValueError, match="runs the direct route"):
        direct.dispatch(x, idx, w, num_experts=8)
    two_hop = _buffer(_Group())
    two_hop.dispatch(x, idx, w, num_experts=8, transport="queue")
    assert two_hop.routes == ["two_hop"]
    with pytest.raises(ValueError, match="make another cupyep.Buffer for the direct route"):
        two_hop.dispatch(x, idx, w, num_experts=8, transport="direct")
    assert len(two_hop._engine.calls) == 1  # the refused call launched nothing


def test_ranks_that_disagree_on_the_sizes_raise():
    g = _Group(others=[[4, 256, 2, 8], [4, 128, 2, 8], [4, 256, 2, 8]])
    with pytest.raises(ValueError, match="differ between ranks"):
        _buffer(g).dispatch(np.zeros((4, 256), np.uint16), np.zeros((4, 2), np.int64),
                            np.zeros((4, 2), np.float32), num_experts=8)


def test_worst_token_and_cached_calls_pass_through():
    buf = _buffer(_Group())
    x, idx, w = np.zeros((4, 256), np.uint16), np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32)
    out = buf.dispatch(x, idx, w, num_experts=8, num_worst_tokens=16)
    assert out.num_recv_tokens_per_expert is None and buf._engine.calls[-1] == ("dispatch", None, 16)
    again = buf.dispatch(x, topk_weights=w, handle=out.handle)
    assert buf._engine.calls[-1][1] is out.handle and again.num_recv_tokens_per_expert is None
    comb = buf.combine("y", again.handle, row_weights="rw")
    assert isinstance(comb, CombineResult) and comb.combined_x == "combined" and comb.combined_topk_weights is None
    assert buf._engine.calls[-1] == ("combine", "y", "rw")
    comb = buf.combine("y", again.handle, topk_weights="w")
    assert (comb.combined_x, comb.combined_topk_weights) == ("combined", "combined weights")
    buf.destroy()
    assert buf._engine is None


@pytest.mark.parametrize("kw", [{"config": object()}, {"transport": "ring"}, {"notify_time_ns": object()},
                                {"queue_occupancy": object()}, {"expert_alignment": 0}])
def test_what_the_two_hop_dispatch_does_not_carry_is_refused(kw):
    buf = _buffer(_Group())
    with pytest.raises(ValueError):
        buf.dispatch(np.zeros((4, 256), np.uint16), np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32),
                     num_experts=8, **kw)
    assert buf._engine is None  # nothing was made or launched


@pytest.mark.parametrize("kw,match", [({"config": object()}, "across nodes"),
                                      ({"zero_copy": True}, "across nodes"),
                                      ({"pair_weights": np.ones(4)}, "expert-major"),
                                      ({"expert_major": True}, "expert_major=True")])
def test_what_the_two_hop_combine_does_not_carry_is_refused(kw, match):
    """Also: pair_weights or expert_major=True after a rank-major dispatch."""
    buf = _buffer(_Group())
    out = buf.dispatch(np.zeros((4, 256), np.uint16), np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32),
                       num_experts=8)
    with pytest.raises(ValueError, match=match):
        buf.combine(np.zeros((4, 256), np.uint16), out.handle, **kw)
    assert buf._engine.calls[-1][0] == "dispatch"  # no combine ran


def test_the_handle_carries_the_per_expert_counts_for_the_moe_layer():
    buf = _buffer(_Group())
    out = buf.dispatch(np.zeros((4, 256), np.uint16), np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32),
                       num_experts=8, expert_alignment=8)
    assert out.handle.recv_expert_counts == (4, 2) and out.num_recv_tokens_per_expert == [8, 8]


def test_calls_are_ordered_on_the_communication_stream():
    buf = _buffer(_Group())
    x, idx, w = np.zeros((4, 256), np.uint16), np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32)
    out = buf.dispatch(x, idx, w, num_experts=8, previous_event="ev0", async_finish=True)
    comb = buf.combine(x, out.handle, previous_event=out.event)
    assert buf._calls.log == [("begin", "ev0"), ("end", True), ("begin", "event"), ("end", False)]
    assert out.event == comb.event == "event"
    buf.destroy()
    assert buf._calls.log[-1] == ("release",)
