"""cupyep.deep_ep on the CPU: DeepEP V1's public API mirrored call by call,
the gaps that raise, the byte-budget mapping, DeepEP's configs, the
torch.distributed communicator (driven by an in-process stand-in of the
transport, and by torch's gloo when torch is installed), and the host logic
of every call (return tuples, handles, events) over stand-in cupyep buffers.

The GPU side is tests/gpu/test_deep_ep_gpu.py.
"""
import inspect
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Queue

import numpy as np
import pytest

from deep_ep_stubs import stub_tensors

from cupyep import deep_ep
from cupyep.deep_ep import budget as B
from cupyep.deep_ep import handles as handles_module
from cupyep.reference import packed_layout as packing
from cupyep.deep_ep.config import Config, from_cupyep, to_cupyep, tuned_config
from cupyep.deep_ep.events import EventHandle, EventOverlap, event_of, overlap
from cupyep.deep_ep.gaps import GAPS

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = inspect.Parameter.empty

# DeepEP V1's public Python API (deepseek-ai/DeepEP at 567632d, deep_ep/buffer.py,
# deep_ep/utils.py and the pybind module), written down as data:
# call -> (static?, [(parameter, default or REQUIRED), ...] in order, without self).
DEEPEP_V1 = {
    "Buffer.__init__": (False, [("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                                ("low_latency_mode", False), ("num_qps_per_rank", 24),
                                ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                                ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False),
                                ("comm", None)]),
    "Buffer.destroy": (False, []),
    "Buffer.is_sm90_compiled": (True, []),
    "Buffer.set_num_sms": (True, [("new_num_sms", REQUIRED)]),
    "Buffer.capture": (True, []),
    "Buffer.get_low_latency_rdma_size_hint": (True, [("num_max_dispatch_tokens_per_rank", REQUIRED),
                                                     ("hidden", REQUIRED), ("num_ranks", REQUIRED),
                                                     ("num_experts", REQUIRED)]),
    "Buffer.get_comm_stream": (False, []),
    "Buffer.get_local_buffer_tensor": (False, [("dtype", REQUIRED), ("size", None), ("offset", 0),
                                               ("use_rdma_buffer", False)]),
    "Buffer.get_dispatch_config": (True, [("num_ranks", REQUIRED)]),
    "Buffer.get_combine_config": (True, [("num_ranks", REQUIRED)]),
    "Buffer.get_dispatch_layout": (False, [("topk_idx", REQUIRED), ("num_experts", REQUIRED),
                                           ("previous_event", None), ("async_finish", False),
                                           ("allocate_on_comm_stream", False)]),
    "Buffer.dispatch": (False, [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                                ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                                ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                                ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                                ("previous_event", None), ("async_finish", False),
                                ("allocate_on_comm_stream", False)]),
    "Buffer.combine": (False, [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None),
                               ("config", None), ("previous_event", None), ("async_finish", False),
                               ("allocate_on_comm_stream", False)]),
    "Buffer.clean_low_latency_buffer": (False, [("num_max_dispatch_tokens_per_rank", REQUIRED),
                                                ("hidden", REQUIRED), ("num_experts", REQUIRED)]),
    "Buffer.low_latency_dispatch": (False, [("x", REQUIRED), ("topk_idx", REQUIRED),
                                            ("num_max_dispatch_tokens_per_rank", REQUIRED),
                                            ("num_experts", REQUIRED), ("cumulative_local_expert_recv_stats", None),
                                            ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                                            ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                                            ("return_recv_hook", False)]),
    "Buffer.low_latency_combine": (False, [("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED),
                                           ("handle", REQUIRED), ("use_logfmt", False), ("zero_copy", False),
                                           ("async_finish", False), ("return_recv_hook", False), ("out", None),
                                           ("combine_wait_recv_cost_stats", None)]),
    "Buffer.low_latency_update_mask_buffer": (False, [("rank_to_mask", REQUIRED), ("mask", False)]),
    "Buffer.low_latency_query_mask_buffer": (False, [("mask_status", REQUIRED)]),
    "Buffer.low_latency_clean_mask_buffer": (False, []),
    "Buffer.get_next_low_latency_combine_buffer": (False, [("handle", REQUIRED)]),
    "Config.__init__": (False, [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                                ("num_max_nvl_chunked_recv_tokens", 256), ("num_max_rdma_chunked_send_tokens", 6),
                                ("num_max_rdma_chunked_recv_tokens", 256)]),
    "Config.get_nvl_buffer_size_hint": (False, [("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)]),
    "Config.get_rdma_buffer_size_hint": (False, [("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)]),
    "EventOverlap.__init__": (False, [("event", None), ("extra_tensors", None)]),
    "EventOverlap.current_stream_wait": (False, []),
    "EventOverlap.__enter__": (False, []),
    "EventOverlap.__exit__": (False, [("exc_type", REQUIRED), ("exc_val", REQUIRED), ("exc_tb", REQUIRED)]),
    "EventHandle.__init__": (False, []),
    "EventHandle.current_stream_wait": (False, []),
}
# The internode forms take the same arguments as dispatch / combine.
DEEPEP_V1["Buffer.internode_dispatch"] = DEEPEP_V1["Buffer.dispatch"]
DEEPEP_V1["Buffer.internode_combine"] = DEEPEP_V1["Buffer.combine"]
DEEPEP_MODULE_NAMES = ("Buffer", "Config", "EventOverlap", "topk_idx_t")


def _lookup(call: str):
    cls_name, meth = call.split(".")
    cls = getattr(deep_ep, cls_name)
    return cls, meth, inspect.getattr_static(cls, meth)


@pytest.mark.parametrize("call", sorted(DEEPEP_V1))
def test_every_deepep_call_has_its_parameters_in_order_with_its_defaults(call):
    static, params = DEEPEP_V1[call]
    cls, meth, raw = _lookup(call)
    assert isinstance(raw, staticmethod) == static, f"{call}: static {static} in DeepEP"
    sig = inspect.signature(getattr(cls, meth))
    got = [p for p in sig.parameters.values() if p.name != "self"]
    positional = [p for p in got if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [(p.name, p.default) for p in positional] == params, call
    # Anything cupyep adds is keyword-only, after DeepEP's parameters.
    assert all(p.kind == p.KEYWORD_ONLY for p in got[len(positional):]), call


def test_the_module_exports_deepeps_names_without_importing_torch():
    for name in DEEPEP_MODULE_NAMES:
        assert name in deep_ep.__all__
    assert deep_ep.Buffer.num_sms == 20  # DeepEP's class attribute
    code = "import sys; from cupyep import deep_ep; print('torch' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_topk_idx_t_is_torch_int64():
    torch = pytest.importorskip("torch", reason="torch is not installed here; topk_idx_t is torch.int64")
    assert deep_ep.topk_idx_t is torch.int64


# ------------------------------------------------------------------ gaps
@pytest.mark.parametrize("kwargs,gap", [
    (dict(use_fabric=True), "Buffer(use_fabric=True)"),
    (dict(low_latency_mode=True, num_rdma_bytes=1, allow_nvlink_for_low_latency_mode=False),
     "Buffer(allow_nvlink_for_low_latency_mode=False)"),
])
def test_constructor_gaps_raise_before_anything_is_made(kwargs, gap):
    with pytest.raises(NotImplementedError, match=r"not supported") as err:
        deep_ep.Buffer(None, **kwargs)
    assert gap in str(err.value)


def test_constructor_checks_its_arguments_as_deepep():
    with pytest.raises(ValueError, match="Either 'group' or 'comm'"):
        deep_ep.Buffer(None)
    with pytest.raises(ValueError, match="num_qps_per_rank"):
        deep_ep.Buffer(None, num_qps_per_rank=0)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        deep_ep.Buffer(None, low_latency_mode=True)


# Stand-ins for cupyep's buffers, results and arrays: NumPy arrays take the
# place of CuPy arrays and torch tensors (the conversions are identities here).
@dataclass
class _Native:
    event: object = "native-event"


class _Layout(_Native):
    def __init__(self, T, R, E):
        super().__init__()
        self.num_tokens_per_rank = np.zeros(R, np.int32)
        self.num_tokens_per_rdma_rank = None
        self.num_tokens_per_expert = np.zeros(E, np.int32)
        self.is_token_in_rank = np.zeros((T, R), bool)


class _NativeHandle:
    def __init__(self, T=4, R=2, C=3, N=5):
        self.num_tokens, self.num_channels = T, C
        self.rank_prefix_matrix = np.arange(R * R, dtype=np.int32).reshape(R, R)
        self.send_channel_prefix = np.arange(R * (C + 1), dtype=np.int32).reshape(R, C + 1)
        self.recv_channel_prefix = 100 + np.arange(R * (C + 1), dtype=np.int32).reshape(R, C + 1)
        self.recv_src_idx = np.arange(N, dtype=np.int32)
        self.is_token_in_rank = np.ones((T, R), bool)
        self.send_head = np.full((T, R), -1, np.int32)


class _NormalStandIn:
    """Records each call's arguments and returns results shaped like cupyep's."""

    sm_budget = 16  # this rank's share of the GPU's SMs

    def __init__(self, worst=False):
        self.calls, self.worst = [], worst

    def default_dispatch_config(self, fp8=False, handle=None):
        from cupyep.normal.config import get_dispatch_config
        return get_dispatch_config(2, 66, fp8)

    def default_combine_config(self, handle=None):
        from cupyep.normal.config import get_combine_config
        return get_combine_config(2, 66)

    def get_dispatch_layout(self, topk_idx, num_experts, **kw):
        self.calls.append(("layout", kw))
        return _Layout(topk_idx.shape[0], 2, num_experts)

    def dispatch(self, x, topk_idx=None, topk_weights=None, **kw):
        self.calls.append(("dispatch", kw))
        fp8 = isinstance(x, tuple)
        rows = x[0] if fp8 else x
        from cupyep.results import DispatchResult
        return DispatchResult(recv_x=rows, recv_x_scales=x[1] if fp8 else None, recv_topk_idx=topk_idx,
                              recv_topk_weights=topk_weights,
                              num_recv_tokens_per_expert=None if self.worst else [3, 4],
                              handle=kw.get("handle") or _NativeHandle(), event="native-event")

    def combine(self, x, handle, topk_weights=None, **kw):
        self.calls.append(("combine", kw))
        from cupyep.results import CombineResult
        return CombineResult(combined_x=x[:handle.num_tokens], combined_topk_weights=topk_weights, event="ev")


@pytest.fixture
def host_buffer(monkeypatch):
    """A deep_ep.Buffer over the stand-in normal buffer, within one node of 2 ranks."""
    stub_tensors(monkeypatch)
    monkeypatch.setattr(deep_ep.Buffer, "num_sms", 20)
    monkeypatch.setattr(deep_ep.Buffer, "_num_sms_set", False)
    b = deep_ep.Buffer.__new__(deep_ep.Buffer)

    class _Group:
        local_size, world_size, rank, num_nodes = 2, 2, 0, 1
    b.cgroup, b.internode, b.validate, b.normal = _Group(), False, False, _NormalStandIn()
    b.low_latency, b._ll_sizes, b.low_latency_mode, b.num_nvl_bytes = None, None, True, 1 << 20
    b._ll_staging = None
    return b


@pytest.mark.parametrize("call,args,kwargs,gap", [
    ("get_local_buffer_tensor", (None,), {}, "Buffer.get_local_buffer_tensor"),
    ("low_latency_dispatch", (np.zeros((2, 640), np.uint16), None, 8, 16), dict(use_ue8m0=True, round_scale=True),
     "Buffer.low_latency_dispatch(use_ue8m0=True) with hidden % 512 != 0"),
])
def test_call_gaps_raise_naming_what(host_buffer, call, args, kwargs, gap):
    with pytest.raises(NotImplementedError) as err:
        getattr(host_buffer, call)(*args, **kwargs)
    assert gap in str(err.value) and GAPS[gap] in str(err.value)
    assert not host_buffer.normal.calls  # nothing reached cupyep


def test_configs_across_nodes_raise(host_buffer):
    host_buffer.internode = True
    with pytest.raises(NotImplementedError, match=r"config=\.\.\.\) across nodes"):
        host_buffer.combine(np.zeros((2, 128)), _NativeHandle(), config=Config())


def test_every_gap_is_in_the_docs():
    doc = (ROOT / "docs" / "deep_ep.md").read_text()
    missing = [g for g in GAPS if g not in doc]
    assert not missing, f"docs/deep_ep.md does not list {missing}"


def test_every_deepep_call_is_in_the_docs():
    doc = (ROOT / "docs" / "deep_ep.md").read_text()
    for call, (_, params) in DEEPEP_V1.items():
        name = call.split(".")[1]
        if name in ("__enter__", "__exit__"):
            continue
        assert (call.split(".")[0] if name == "__init__" else name) in doc, call
        for p, _ in params:
            assert re.search(rf"\b{p}\b", doc), f"{call}: parameter {p} is not in docs/deep_ep.md"


# ------------------------------------------------------------------ host logic of the calls
def test_dispatch_and_combine_return_deepeps_tuples(host_buffer):
    b = host_buffer
    idx = np.zeros((4, 2), np.int64)
    lay = b.get_dispatch_layout(idx, 8)
    assert len(lay) == 5 and lay[1] is None and lay[4].event is None  # no event without async_finish
    x = np.zeros((4, 128), np.uint16)
    out = b.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                     topk_idx=idx, topk_weights=np.ones((4, 2), np.float32), expert_alignment=4,
                     async_finish=True)
    recv_x, recv_idx, recv_w, counts, handle, event = out
    assert recv_x is x and recv_idx is idx and counts == [3, 4]
    assert isinstance(handle, handles_module.DispatchHandle) and len(handle) == 6
    assert event.event.event == "native-event"
    kw = b.normal.calls[-1][1]
    assert kw["num_experts"] == 8 and kw["expert_alignment"] == 4
    # DeepEP's default config: get_dispatch_config on Buffer.num_sms (20), capped at the rank's 16 SMs.
    want = deep_ep.Buffer.get_dispatch_config(2)
    cfg = kw["config"]
    assert (cfg.num_sms, cfg.chunk_size, cfg.queue_depth) == (16, want.num_max_nvl_chunked_send_tokens,
                                                               want.num_max_nvl_chunked_recv_tokens)
    # Cached dispatch: DeepEP's (recv_x, None, None, None, None, event).
    cached = b.dispatch((x.view(np.uint8)[:, :128], np.ones((4, 1), np.float32)), handle=handle)
    assert isinstance(cached[0], tuple) and cached[1:5] == (None, None, None, None)
    assert b.normal.calls[-1][1]["handle"] is handle.native
    assert b.normal.calls[-1][1]["config"].num_sms == 2 * handle.native.num_channels  # the handle's channels
    combined, combined_w, ev = b.combine(x, handle, topk_weights=recv_w)
    assert combined.shape == (4, 128) and ev.event is None
    cfg, want = b.normal.calls[-1][1]["config"], deep_ep.Buffer.get_combine_config(2)
    assert (cfg.num_sms, cfg.chunk_size) == (6, want.num_max_nvl_chunked_send_tokens)


def test_worst_token_dispatch_gives_an_empty_list(host_buffer):
    b = host_buffer
    b.normal.worst = True
    idx = np.zeros((4, 2), np.int64)
    out = b.dispatch(np.zeros((4, 128), np.uint16), num_tokens_per_rank=np.zeros(2, np.int32),
                     is_token_in_rank=np.zeros((4, 2), bool), num_tokens_per_expert=np.zeros(8, np.int32),
                     topk_idx=idx, num_worst_tokens=8)
    assert out[3] == [] and b.normal.calls[-1][1]["num_worst_tokens"] == 8


def test_dispatch_argument_checks_of_deepep(host_buffer):
    b = host_buffer
    x, idx = np.zeros((4, 128), np.uint16), np.zeros((4, 2), np.int64)
    with pytest.raises(ValueError, match="needs num_tokens_per_rank"):
        b.dispatch(x, topk_idx=idx)
    with pytest.raises(ValueError, match="takes no topk_idx"):
        b.dispatch(x, handle=_NativeHandle(), topk_idx=idx)
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        b.get_dispatch_layout(idx, 8, allocate_on_comm_stream=True)
    b.normal = None
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        b.get_dispatch_layout(idx, 8)


def test_configs_map_onto_cupyeps(host_buffer):
    b = host_buffer
    h = _NativeHandle()
    b.combine(np.zeros((5, 128), np.uint16), h, config=Config(24, 4, 64))
    cfg = b.normal.calls[-1][1]["config"]
    assert (cfg.num_sms, cfg.chunk_size, cfg.queue_depth) == (24, 4, 64)
    # set_num_sms makes the default config of a dispatch use that many SMs (within the rank's share).
    deep_ep.Buffer.set_num_sms(12)
    assert deep_ep.Buffer.get_dispatch_config(2).num_sms == 12
    idx = np.zeros((4, 2), np.int64)
    b.dispatch(np.zeros((4, 128), np.uint16), num_tokens_per_rank=np.zeros(2, np.int32),
               is_token_in_rank=np.zeros((4, 2), bool), num_tokens_per_expert=np.zeros(8, np.int32), topk_idx=idx)
    assert b.normal.calls[-1][1]["config"].num_sms == 12
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(7)


def test_handle_entries_are_deepeps(monkeypatch):
    monkeypatch.setattr(handles_module, "to_torch", lambda a, view=None: a)
    n = _NativeHandle(T=4, R=2, C=3, N=5)
    h = handles_module.DispatchHandle(n)
    assert len(h) == 6 and len(h[:]) == 6
    assert h[0] is n.rank_prefix_matrix and h[3] is n.recv_src_idx and h[4] is n.is_token_in_rank
    assert h[1].shape == (2, 3) and np.array_equal(h[1], n.send_channel_prefix[:, 1:])  # inclusive prefix ends
    assert np.array_equal(h[2], n.recv_channel_prefix[:, :-1])  # first row of each (source, channel)
    assert h[-1] is n.send_head
    with pytest.raises(IndexError):
        h[6]
    inter = handles_module.DispatchHandle(n, internode=True)
    assert len(inter) == 10 and inter[0] is n.is_token_in_rank and inter[7] is n.recv_src_idx
    with pytest.raises(NotImplementedError, match="rdma_channel_prefix_matrix"):
        inter[1]


def test_low_latency_layout_range_packs_begin_and_count():
    counts = np.array([[3, 0, 7], [1, 2, 0]], np.int32)
    packed = packing.layout_range(counts)
    assert packed.dtype == np.int64 and packed.shape == (2, 3)
    assert np.array_equal(packed & (2 ** 32 - 1), counts)
    assert np.array_equal(packed >> 32, [[0, 3, 3], [0, 1, 3]])  # DeepEP's packed begins, sources in rank order


@dataclass
class _LLHandle:
    layout_count: object
    recv_src: object
    max_tokens: int = 8
    capacity: int = 8
    hidden: int = 512
    num_experts: int = 4
    num_tokens: int = 3
    buffer_id: int = 0


class _LowLatencyStandIn:
    num_local_experts, num_ranks, max_tokens, hidden = 2, 2, 8, 512

    def __init__(self):
        self.calls, self.hooks = [], []

    def dispatch(self, x, topk_idx, **kw):
        self.calls.append(("dispatch", kw))
        from cupyep.low_latency.results import LowLatencyDispatchResult
        h = _LLHandle(np.ones((2, 2), np.int32), np.zeros((2, 16), np.int32), buffer_id=id(self))
        hook = (lambda: self.hooks.append("recv")) if kw["return_recv_hook"] else None
        fp8 = kw["use_fp8"]
        recv = np.zeros((2, 16, 512), np.uint8 if fp8 else np.uint16)
        scales = np.zeros((2, 16, 4), np.uint8 if kw["use_ue8m0"] else np.float32) if fp8 else None
        assert kw["packed_out"] is True  # the adapter has cupyep's dispatch make DeepEP's packed outputs
        packed = packing.packed_outputs_for(2, 2, 8, 512, fp8, kw["use_ue8m0"], np)
        return LowLatencyDispatchResult(recv, scales, np.zeros(2, np.int32), h,
                                        "ev" if kw["async_finish"] else None, hook, packed)

    def combine(self, x, topk_idx, topk_weights, handle, **kw):
        self.calls.append(("combine", dict(kw, x=x)))
        from cupyep.low_latency.results import LowLatencyCombineResult
        return LowLatencyCombineResult(np.zeros((3, 512), np.uint16), None, None)


def test_low_latency_calls_return_deepeps_tuples(host_buffer):
    b = host_buffer
    ll = b.low_latency = _LowLatencyStandIn()
    b._ll_sizes = (8, 512, 4)
    x, idx = np.zeros((3, 512), np.uint16), np.zeros((3, 2), np.int64)
    recv_x, count, handle, event, hook = b.low_latency_dispatch(x, idx, 8, 4, return_recv_hook=True,
                                                                use_fp8=False)
    assert recv_x.dtype == np.uint16 and event.event is None and not ll.hooks
    hook()
    assert ll.hooks == ["recv"]
    assert len(handle) == 5 and handle[2:] == (8, 512, 4)
    (fp8, scales), *_ = b.low_latency_dispatch(x, idx, 8, 4, round_scale=True, use_ue8m0=True)
    assert fp8.dtype == np.uint8 and scales.dtype == np.int32 and scales.shape == (2, 16, 1)  # 4 exponents a word
    out = np.empty((3, 512), np.uint16)
    with pytest.raises(ValueError, match="get_next_low_latency_combine_buffer"):
        b.low_latency_combine(None, idx, np.ones((3, 2), np.float32), handle, zero_copy=True)
    staging = b.get_next_low_latency_combine_buffer(handle)
    assert staging.shape == (2, 16, 512) and staging.dtype == np.uint16
    assert b.get_next_low_latency_combine_buffer(handle) is staging
    combined, ev, no_hook = b.low_latency_combine(None, idx, np.ones((3, 2), np.float32), handle, out=out,
                                                  zero_copy=True)
    # cupyep's combine reads the staging tensor in place, in DeepEP's packed layout
    kw = ll.calls[-1][1]
    assert combined is out and no_hook is None and kw["x"] is staging and kw["x_layout"] == "packed"
    assert "zero_copy" not in kw and "pull" not in kw  # cupyep's defaults: its own buffer is not involved
    # the next zero-copy combine gets the other tensor (as DeepEP's two buffers), then the first again
    other = b.get_next_low_latency_combine_buffer(handle)
    assert other is not staging and other.shape == staging.shape
    b.low_latency_combine(None, idx, np.ones((3, 2), np.float32), handle, zero_copy=True)
    assert ll.calls[-1][1]["x"] is other and b.get_next_low_latency_combine_buffer(handle) is staging
    y = np.zeros((2, 16, 512), np.uint16)
    b.low_latency_combine(y, idx, np.ones((3, 2), np.float32), handle)
    assert ll.calls[-1][1]["x"] is y and ll.calls[-1][1]["x_layout"] == "packed"
    assert ll.calls[-1][1]["combine_wait_recv_cost_stats"] is None
    waits = np.zeros(2, np.int64)
    b.low_latency_combine(y, idx, np.ones((3, 2), np.float32), handle, combine_wait_recv_cost_stats=waits)
    assert ll.calls[-1][1]["combine_wait_recv_cost_stats"] is waits  # handed to cupyep's combine
    assert ll.calls[-1][1]["use_logfmt"] is False
    b.low_latency_combine(y, idx, np.ones((3, 2), np.float32), handle, use_logfmt=True)
    assert ll.calls[-1][1]["use_logfmt"] is True  # cupyep's LogFMT-10 combine
    b.internode, calls = True, len(ll.calls)
    with pytest.raises(NotImplementedError, match="across nodes"):
        b.low_latency_combine(y, idx, np.ones((3, 2), np.float32), handle, use_logfmt=True)
    assert len(ll.calls) == calls
    b.internode = False
    with pytest.raises(ValueError, match="low_latency_mode"):
        b.low_latency_mode = False
        b.low_latency_dispatch(x, idx, 16, 4)


# ------------------------------------------------------------------ events
class _Ev:
    def __init__(self):
        self.waits = 0

    def current_stream_wait(self):
        self.waits += 1


def test_event_overlap_waits_as_deepeps():
    e = _Ev()
    with EventOverlap(e) as o:
        assert o.event is e and e.waits == 0
    assert e.waits == 1
    EventOverlap(e).current_stream_wait()
    assert e.waits == 2
    with pytest.raises(ValueError, match="no event"):
        EventOverlap().current_stream_wait()
    with EventOverlap():  # nothing to wait for
        pass


def test_previous_event_and_returned_events():
    assert event_of(None) is None
    assert event_of(EventOverlap(EventHandle(event="cupy-event"))) == "cupy-event"
    with pytest.raises(ValueError, match="capture"):
        event_of(EventOverlap(None))
    assert overlap("ev", False).event is None
    assert overlap("ev", True, ("t",)).event.event == "ev" and overlap("ev", True, ("t",)).extra_tensors == ("t",)


# ------------------------------------------------------------------ configs
def test_config_checks_and_rounds_as_deepep():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (20, 6, 256)
    assert c.num_max_rdma_chunked_recv_tokens == 258  # 256 rounded up to a multiple of the send chunk 6
    with pytest.raises(ValueError):
        Config(20, 8, 8)  # send must be < recv
    with pytest.raises(ValueError):
        Config(20, 6, 256, 8, 8)  # rdma send must be <= recv / 2
    assert Config(20, 6, 256) == Config() and Config(24) != Config()


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_deepeps_configs_run_on_cupyeps_kernels(num_ranks):
    from cupyep.normal.config import get_combine_config, get_dispatch_config
    for cfg, combine in ((Config(20, 6, 256), False), (Config(20, 4, 256), True),
                         (deep_ep.Buffer.get_dispatch_config(num_ranks), False),
                         (deep_ep.Buffer.get_combine_config(num_ranks), True)):
        c = to_cupyep(cfg, num_ranks, combine).validate(num_ranks, combine=combine)
        assert (c.num_sms, c.chunk_size, c.queue_depth) == (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens,
                                                             cfg.num_max_nvl_chunked_recv_tokens)
    tuned = get_dispatch_config(num_ranks)
    d = tuned_config(num_ranks, 20)
    assert (d.num_sms, d.num_max_nvl_chunked_send_tokens, d.num_max_nvl_chunked_recv_tokens) == \
        (20, tuned.chunk_size, tuned.queue_depth)
    assert from_cupyep(get_combine_config(num_ranks)).num_max_nvl_chunked_send_tokens == \
        get_combine_config(num_ranks).chunk_size


def test_nvl_size_hint_fits_the_rings_of_its_config():
    from cupyep.normal.queue_layout import buffer_layout, ring_set
    for R in (2, 4, 8):
        cfg = Config(20, 6, 256)
        n = cfg.get_nvl_buffer_size_hint(7168 * 2, R)
        layout = buffer_layout(R, n)
        for fp8 in (False, True):
            ring_set(layout, "dispatch", 7168, 8, fp8, to_cupyep(cfg, R))  # raises when it does not fit
        ring_set(layout, "combine", 7168, 8, False, to_cupyep(cfg, R, combine=True))
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0  # one node of 8: no network buffer


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_a_budget_sized_as_deepep_users_do_fits_the_default_configs(num_ranks):
    """num_nvl_bytes = the largest hint of get_dispatch_config / get_combine_config
    (how DeepEP's users size it) holds the rings of the calls with config=None."""
    from cupyep.normal.queue_layout import buffer_layout, ring_set
    d, c = deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)
    n = max(cfg.get_nvl_buffer_size_hint(7168 * 2, num_ranks) for cfg in (d, c))
    layout = buffer_layout(num_ranks, n)
    for fp8 in (False, True):
        ring_set(layout, "dispatch", 7168, 8, fp8, to_cupyep(d, num_ranks))
    ring_set(layout, "combine", 7168, 8, False, to_cupyep(c, num_ranks, combine=True))


# ------------------------------------------------------------------ byte budgets
def test_nvl_bytes_are_the_ipc_buffer_and_derive_caps_that_never_refuse_a_fitting_row():
    from cupyep.normal.queue_layout import buffer_layout, combine_slot, dispatch_slot
    nbytes, R = 50 << 20, 8
    plan = B.normal_plan(nbytes, 0, R, 1)
    assert plan.num_bytes == nbytes and plan.derived == ("max_tokens", "hidden", "num_topk")
    region = buffer_layout(R, nbytes).region_bytes
    per_peer = region // R

    def fits(h):
        return max(dispatch_slot(h, 1, False)[1], combine_slot(h, 1)[1]) <= per_peer
    assert fits(plan.hidden) and not fits(plan.hidden + 128)
    assert plan.num_topk == B.DEEPEP_MAX_TOPK and plan.max_tokens * R <= B.INT32_MAX
    given = B.normal_plan(nbytes, 0, R, 1, max_tokens=4096, hidden=7168, num_topk=8)
    assert (given.max_tokens, given.hidden, given.num_topk, given.derived) == (4096, 7168, 8, ())
    assert B.normal_plan(0, 123, R, 1) is None  # no NVLink bytes: no normal mode within a node
    with pytest.raises(ValueError, match="header"):
        B.normal_plan(1024, 0, R, 1)


def test_bytes_across_nodes_bound_the_receive_pools():
    from cupyep.normal.internode_kernels import receive_layout
    R, nvl, rdma = 16, 1 << 28, 3 << 28
    plan = B.normal_plan(nvl, rdma, R, 2, hidden=4096, num_topk=8)
    assert plan.num_bytes is None and plan.derived == ("max_tokens",)

    def pools(t):
        return B.NUM_IN_FLIGHT * receive_layout(R * t, 4096, 8)[1]
    assert pools(plan.max_tokens) <= nvl + rdma < pools(plan.max_tokens + 1)
    with pytest.raises(ValueError, match="one token per rank"):
        B.normal_plan(1000, 0, R, 2)
    assert B.normal_plan(0, 1 << 30, R, 2) is None  # no NVLink bytes: low-latency mode only, as DeepEP


def test_low_latency_bytes_are_cupyeps_buffer_and_the_hint_fits():
    from cupyep.low_latency.buffer import LowLatencyBuffer
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint == LowLatencyBuffer.size_hint(8, 128, 7168, 256, max_topk=16)
    assert B.check_low_latency_budget(hint, 128, 7168, 8, 256) == 16
    with pytest.raises(ValueError, match="get_low_latency_rdma_size_hint"):
        B.check_low_latency_budget(hint - 1, 128, 7168, 8, 256)
    with pytest.raises(ValueError):
        deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7000, 8, 256)  # not a multiple of 128


# ------------------------------------------------------------------ the torch.distributed communicator
class _World:
    """The shared state of one stand-in process group (threads as ranks)."""

    registry: dict = {}
    lock = threading.Lock()

    def __init__(self, n):
        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=30)
        self.queues: dict = {}
        self.qlock = threading.Lock()

    def queue(self, src, dst, tag):
        with self.qlock:
            return self.queues.setdefault((src, dst, tag), Queue())


class _Work:
    def __init__(self, poll):
        self.poll, self.finished = poll, False

    def is_completed(self):
        self.finished = self.finished or self.poll()
        return self.finished


class _StandInBackend:
    """The methods of cupyep.deep_ep.comm.TorchBackend over threads of one process."""

    def __init__(self, world, rank, key):
        self.world, self.r, self.key, self.splits = world, rank, key, 0

    def rank(self):
        return self.r

    def size(self):
        return self.world.n

    def all_gather_object(self, obj):
        self.world.slots[self.r] = obj
        self.world.barrier.wait()
        out = list(self.world.slots)
        self.world.barrier.wait()
        return out

    def broadcast_object(self, obj, root):
        return self.all_gather_object(obj)[root]

    def barrier(self):
        self.world.barrier.wait()

    def subgroup(self, members):
        self.splits += 1
        key = (self.key, self.splits, tuple(members))
        with _World.lock:
            world = _World.registry.setdefault(key, _World(len(members)))
        return _StandInBackend(world, members.index(self.r), key)

    def isend(self, array, dest, tag):
        self.world.queue(self.r, dest, tag).put(np.array(array, copy=True))
        return _Work(lambda: True)

    def irecv(self, array, source, tag):
        q = self.world.queue(source, self.r, tag)

        def poll():
            try:
                array[...] = q.get_nowait()
                return True
            except Empty:
                return False
        return _Work(poll)

    @staticmethod
    def done(work):
        return work.is_completed()

    @staticmethod
    def cancel(work):
        work.finished = True


def _run_ranks(n, body):
    """Run ``body(comm)`` on n threads, one stand-in rank each; their results in rank order."""
    from cupyep.deep_ep.comm import TorchComm
    world, key = _World(n), object()
    results, errors = [None] * n, []

    def run(r):
        try:
            results[r] = body(TorchComm(_StandInBackend(world, r, key)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((r, exc))
            world.barrier.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0][1]
    return results


def test_the_communicator_serves_cupyeps_runtime(monkeypatch):
    """cupyep.init over the stand-in: ranks, emulated nodes, host exchanges."""
    import cupyep.runtime as RT
    monkeypatch.setattr(RT, "gpu_count", lambda: 0)

    def body(comm):
        g = RT.init(comm, ranks_per_node=2, timeout_s=20)
        got = g.exchange(np.array([g.rank, 10 * g.rank], np.int64), "test exchange")
        g.agree("test call", hidden=7168, fp8=True)
        ok = g.comm.allreduce(g.local_rank < 2, op=RT_MPI().LAND)
        lo = g.comm.allreduce(g.rank, op=RT_MPI().MIN)
        g.node_comm.Barrier()
        out = (g.rank, g.world_size, g.node, g.num_nodes, g.local_rank, g.local_size, got.tolist(), ok, lo,
               g.node_comm.allgather(g.rank), g.comm.bcast(g.rank * 3, root=1), g.comm.gather(g.rank, root=0))
        g.destroy()
        return out

    res = _run_ranks(4, body)
    for r, (rank, size, node, nodes, local, local_size, got, ok, lo, node_ranks, b, gathered) in enumerate(res):
        assert (rank, size, node, nodes, local, local_size) == (r, 4, r // 2, 2, r % 2, 2)
        assert got == [[s, 10 * s] for s in range(4)] and ok and lo == 0
        assert node_ranks == [2 * (r // 2), 2 * (r // 2) + 1] and b == 3
        assert gathered == ([0, 1, 2, 3] if r == 0 else None)


def RT_MPI():
    from mpi4py import MPI
    return MPI


def test_ranks_that_disagree_get_a_valueerror_on_every_rank(monkeypatch):
    import cupyep.runtime as RT
    monkeypatch.setattr(RT, "gpu_count", lambda: 0)

    def body(comm):
        g = RT.init(comm, timeout_s=20)
        try:
            g.agree("test call", hidden=7168 if g.rank else 4096)
        except ValueError as exc:
            return str(exc)
        finally:
            g.destroy()
        return None

    msgs = _run_ranks(3, body)
    assert all(m and "disagree on hidden" in m and "rank 0: 4096" in m for m in msgs)


def test_calls_the_communicator_does_not_serve_raise_naming_them():
    from mpi4py import MPI
    from cupyep.deep_ep.comm import TorchComm
    from cupyep.runtime import COMM_METHODS, _as_intracomm
    comm = TorchComm(None)
    assert _as_intracomm(comm) is comm and all(callable(getattr(comm, m)) for m in COMM_METHODS)
    with pytest.raises(TypeError, match="got object, which lacks Get_rank"):
        _as_intracomm(object())
    for name in ("Allreduce", "Alltoall", "Send", "Create_group"):
        with pytest.raises(NotImplementedError, match=name):
            getattr(comm, name)

    def body(c):
        for call in (lambda: c.allreduce(1, op=MPI.BAND), lambda: c.Split_type(MPI.COMM_TYPE_SHARED + 1),
                     lambda: c.Split(MPI.UNDEFINED), lambda: c.Irecv(np.zeros(1), MPI.ANY_SOURCE, 1),
                     lambda: c.Isend([1, 2], 0, 1)):
            with pytest.raises(NotImplementedError):
                call()
        return True
    assert _run_ranks(2, body) == [True, True]


def test_split_orders_by_key_then_rank():
    def body(c):
        sub = c.Split(color=c.Get_rank() % 2, key=-c.Get_rank())
        return sub.Get_rank(), sub.Get_size(), sub.allgather(c.Get_rank())

    res = _run_ranks(4, body)
    assert res[0] == (1, 2, [2, 0]) and res[2] == (0, 2, [2, 0]) and res[3] == (0, 2, [3, 1])


def test_the_torch_backend_over_gloo(tmp_path):
    """The real transport: two processes on gloo, cupyep.init without GPUs."""
    pytest.importorskip("torch", reason="torch is not installed here; the stand-in tests above cover the logic")
    script = tmp_path / "gloo_ranks.py"
    script.write_text(
        "import sys, numpy as np, torch.distributed as dist, torch.multiprocessing as mp\n"
        "def run(rank, path):\n"
        "    dist.init_process_group('gloo', init_method='file://' + path, rank=rank, world_size=2)\n"
        "    import cupyep.runtime as RT\n"
        "    RT.gpu_count = lambda: 0\n"
        "    from cupyep.deep_ep.comm import torch_comm\n"
        "    g = RT.init(torch_comm(dist.group.WORLD), timeout_s=20)\n"
        "    got = g.exchange(np.array([g.rank], np.int64), 'gloo exchange')\n"
        "    assert got.ravel().tolist() == [0, 1], got\n"
        "    g.agree('gloo', hidden=7168)\n"
        "    assert (g.local_size, g.num_nodes) == (2, 1)\n"
        "    g.destroy()\n"
        "    dist.destroy_process_group()\n"
        "if __name__ == '__main__':\n"
        "    mp.spawn(run, args=(sys.argv[1],), nprocs=2)\n")
    import os
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                                     if os.environ.get("PYTHONPATH") else [])))
    subprocess.run([sys.executable, str(script), str(tmp_path / "rendezvous")], cwd=ROOT, env=env, check=True,
                   timeout=120)


def test_the_adapter_results_readme_shows_what_the_table_command_prints():
    """results/deep_ep_adapter/README.md holds what `bench_deep_ep_adapter.py --table / --summary / --pieces`
    print of its committed files."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    d = repo / "results" / "deep_ep_adapter"
    readme = (d / "README.md").read_text()
    for files in (["adapter_2ranks.json", "adapter_8ranks.json"],
                  ["adapter_2ranks_before_config_cache.json", "adapter_8ranks_before_config_cache.json"]):
        out = subprocess.run([sys.executable, str(repo / "experiments" / "bench_deep_ep_adapter.py"), "--table",
                              *[str(d / f) for f in files]], capture_output=True, text=True, check=True).stdout
        assert out.strip() in readme
    bench = str(repo / "experiments" / "bench_deep_ep_adapter.py")
    for mode, files in (("--summary", [f"interleaved_{r}ranks_{i}.json" for r in (1, 2, 8) for i in (1, 2, 3)]),
                        ("--summary", [f"interleaved_{r}ranks_before_{i}.json" for r in (2, 8) for i in (1, 2, 3)]),
                        ("--table", ["split_2ranks.json", "split_8ranks.json"]),
                        ("--pieces", [f"pieces_{r}ranks.json" for r in (1, 2, 8)])):
        out = subprocess.run([sys.executable, bench, mode, *[str(d / f) for f in files]], capture_output=True,
                             text=True, check=True).stdout
        assert out.strip() in readme, (mode, files)


def test_combine_adds_deepeps_bias_in_fp32_and_rounds_once_more(host_buffer):
    """bias: one tensor or a tuple of two (either None), added in FP32 after the reduction and rounded to
    nearest even; the wrong shape or dtype is a ValueError before the combine runs."""
    from cupyep.testing import bf16_to_f32, f32_to_bf16
    b = host_buffer
    rng = np.random.default_rng(5)
    handle = handles_module.DispatchHandle(_NativeHandle(T=4), False)
    x = f32_to_bf16(rng.standard_normal((5, 128)).astype(np.float32))
    b0, b1 = (f32_to_bf16(rng.standard_normal((4, 128)).astype(np.float32)) for _ in range(2))
    for bias, terms in ((b0, [b0]), ((b0, b1), [b0, b1]), ((None, b1), [b1]), ((None, None), [])):
        out, _, _ = b.combine(x.copy(), handle, bias=bias)
        want = f32_to_bf16(bf16_to_f32(x[:4]) + sum((bf16_to_f32(t) for t in terms), np.zeros((4, 128), np.float32)))
        assert np.array_equal(out, want)
    calls = len(b.normal.calls)
    for bad in (b0[:3], b0.astype(np.float32), (b0, b1, b0)):
        with pytest.raises(ValueError, match="bias"):
            b.combine(x.copy(), handle, bias=bad)
    assert len(b.normal.calls) == calls  # refused before the combine


def test_a_dispatch_without_topk_goes_to_the_ranks_of_is_token_in_rank(host_buffer):
    """DeepEP's dispatch without top-k: cupyep's dispatch gets one expert per rank that routes exactly the
    rows of is_token_in_rank, the caller's expert counts, and the call returns no top-k."""
    from cupyep.deep_ep.routing import rank_routing
    b = host_buffer
    in_rank = np.array([[True, False], [True, True], [False, False], [False, True]])
    per_rank, per_expert = in_rank.sum(0).astype(np.int32), np.array([1, 1, 0, 0, 1, 0, 0, 1], np.int32)
    x = np.zeros((4, 128), np.uint16)
    recv_x, recv_idx, recv_w, counts, handle, _ = b.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    assert recv_x is x and recv_idx is None and recv_w is None and counts == [3, 4]
    assert isinstance(handle, handles_module.DispatchHandle)
    kw = b.normal.calls[-1][1]
    assert kw["num_experts"] == 8 and kw["is_token_in_rank"] is in_rank and kw["num_tokens_per_expert"] is per_expert
    want = np.array([[0, -1], [0, 4], [-1, -1], [-1, 4]])
    assert np.array_equal(rank_routing(in_rank, 8), want) and rank_routing(in_rank, 8).dtype == np.int64
    with pytest.raises(ValueError, match="multiple"):
        rank_routing(in_rank, 7)
    calls = len(b.normal.calls)
    with pytest.raises(ValueError, match="topk_weights needs topk_idx"):
        b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                   topk_weights=np.ones((4, 2), np.float32))
    with pytest.raises(ValueError, match="num_worst_tokens needs topk_idx"):
        b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                   num_worst_tokens=8)
    b.internode = True
    with pytest.raises(NotImplementedError, match="across nodes"):
        b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    assert len(b.normal.calls) == calls  # nothing reached cupyep


def test_the_mask_calls_need_shrink_mode_and_check_their_arguments(host_buffer):
    """Without enable_shrink the mask calls are a ValueError naming the flag (DeepEP asserts it); with it,
    a rank out of range or a mask_status of the wrong shape is a ValueError."""
    b = host_buffer
    b.enable_shrink = False
    for call, args in (("low_latency_update_mask_buffer", (1, True)),
                       ("low_latency_query_mask_buffer", (np.zeros(2, np.int32),)),
                       ("low_latency_clean_mask_buffer", ())):
        with pytest.raises(ValueError, match="enable_shrink=True"):
            getattr(b, call)(*args)
    b.enable_shrink, b._mask = True, np.zeros(2, np.int32)  # the stand-in's mask (a device array on the GPU)
    b.low_latency_update_mask_buffer(1, True)
    status = np.full(2, 7, np.int32)
    b.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 1]
    b.low_latency_update_mask_buffer(1)  # DeepEP's default mask=False unmasks
    b.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0]
    b.low_latency_update_mask_buffer(0, True)
    b.low_latency_clean_mask_buffer()
    b.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0]
    for bad in (2, -1, True, 1.0):
        with pytest.raises(ValueError, match="rank_to_mask"):
            b.low_latency_update_mask_buffer(bad, True)
    with pytest.raises(ValueError, match="mask_status"):
        b.low_latency_query_mask_buffer(np.zeros(3, np.int32))


def test_allow_mnnvl_sets_nvshmems_switch_as_deepep(monkeypatch):
    """allow_mnnvl=False (the default) sets NVSHMEM_DISABLE_MNNVL=1 before anything starts; True leaves it."""
    monkeypatch.setenv("NVSHMEM_DISABLE_MNNVL", "unset")  # so that the test's end restores the variable
    monkeypatch.delenv("NVSHMEM_DISABLE_MNNVL")
    with pytest.raises(ValueError, match="num_rdma_bytes"):  # stops right after the flags, before any group
        deep_ep.Buffer(None, allow_mnnvl=True, low_latency_mode=True)
    assert "NVSHMEM_DISABLE_MNNVL" not in os.environ
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        deep_ep.Buffer(None, low_latency_mode=True)
    assert os.environ["NVSHMEM_DISABLE_MNNVL"] == "1"
