"""The queue route within a node (``transport="queue"``, the default): the
notify pass, then the rows through ring queues in the ranks' IPC buffers
into a compact ``recv_x`` of the caller's own, ordered by source rank, then
source token; the combine back along the same rings, reduced in FP32 to
BF16. Depth, chunk and SMs are its knobs (cupyep.normal.config.Config);
the kernels are in cuda_src/normal/queue_dispatch.cu and queue_combine.cu.

Its results are fresh arrays of every call: nothing it returns is ever
overwritten by a later call.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from .. import jit
from ..arrays import carve
from ..results import CombineResult, DispatchHandle, aligned_expert_counts, dispatch_result, evolve
from . import queue_kernels as K
from .config import Config, get_combine_config, get_dispatch_config
from .direct_kernels import DirectConfig
from .queue_layout import ring_set
from .node import NodeRoute
from .route import CombineCall, DispatchCall


class QueueRoute(NodeRoute):
    """``transport="queue"`` on the ranks of one node (cupyep.normal.node.Node)."""

    transport = name = "queue"
    metrics = frozenset({"notify_time_ns", "queue_occupancy"})

    def __init__(self, node):
        self.node = node
        self._configs: dict = {}  # (kind, the caller's config, fp8, channels) -> validated config
        self._kernels: dict = {}  # (spec, config) -> kernel, its residency checked
        self._plans: dict = {}  # a notified dispatch's call shape -> its _SendPlan
        R = node.num_ranks
        jit.load(K.dispatch_spec_for(R, self.default_dispatch_config()), node.group)
        jit.load(K.combine_spec_for(R, self.default_combine_config()), node.group)

    # ------------------------------------------------------------ config
    def default_dispatch_config(self, fp8: bool = False, handle: DispatchHandle | None = None) -> Config:
        """The tuned dispatch config for the node's ranks and SM budget, for
        BF16 or (``fp8``) FP8 rows; with a handle, on the handle's channels."""
        return _on_channels(get_dispatch_config(self.node.num_ranks, self.node.sm_budget, fp8), handle)

    def default_combine_config(self, handle: DispatchHandle | None = None) -> Config:
        """The tuned combine config; with a handle, on the handle's channels
        (a combine runs on its dispatch's channels)."""
        return _on_channels(get_combine_config(self.node.num_ranks, self.node.sm_budget), handle)

    def dispatch_config(self, config, fp8: bool, handle) -> Config:
        if isinstance(config, DirectConfig):
            raise ValueError("a DirectConfig needs transport='direct'")
        key = ("dispatch", config, fp8, handle.num_channels if handle is not None else None)
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = (config or self.default_dispatch_config(fp8, handle)).validate(self.node.num_ranks)
            if handle is not None and cfg.num_channels != handle.num_channels:
                raise ValueError(f"config has {cfg.num_channels} channels, the handle was made with "
                                 f"{handle.num_channels}")
            self._configs[key] = cfg
        return cfg

    def combine_config(self, config, handle) -> Config:
        if isinstance(config, DirectConfig):
            raise ValueError("a DirectConfig needs a handle of the direct transport")
        key = ("combine", config, handle.num_channels)
        cfg = self._configs.get(key)
        if cfg is not None:
            return cfg
        cfg = (config or self.default_combine_config(handle)).validate(self.node.num_ranks, combine=True)
        if cfg.num_channels != handle.num_channels:
            raise ValueError(f"combine config has {cfg.num_channels} channels (num_sms={cfg.num_sms}) but the "
                             f"dispatch used {handle.num_channels}: use num_sms={2 * handle.num_channels}")
        self._configs[key] = cfg
        return cfg


    def _kernel(self, spec, cfg: Config, what: str):
        fn = self._kernels.get((spec, cfg))
        if fn is None:
            fn = jit.kernel(spec)
            self.node.check_resident(fn, cfg.num_sms, cfg.num_threads, what, step=2)
            self._kernels[spec, cfg] = fn
        return fn

    # ---------------------------------------------------------- dispatch
    def dispatch(self, call: DispatchCall):
        import cupy
        node, cfg = self.node, call.config
        R = node.num_ranks
        T, H, k = call.num_tokens, call.hidden, call.num_topk
        rs = ring_set(node.layout, "dispatch", H, k, call.fp8, cfg)
        fn = self._kernel(K.dispatch_spec_for(R, cfg), cfg, "dispatch")
        handle = call.handle
        notified = handle is None
        weights = call.topk_weights is not None
        if notified:  # layout and notify, then, as soon as the counts arrive, the send; the handle after it
            hints = node.check_hints(call.hints, call.num_experts, T)
            arrays = node.notify_launch(call.topk_idx, call.num_experts, hints, cfg.num_channels,
                                        call.expert_alignment, call.num_worst_tokens,
                                        notify_time_ns=call.notify_time_ns)
            plan = self._send_plan(call, cfg, rs, arrays)
            recv, cap = self._guess_arrays(plan, call) if call.num_worst_tokens <= 0 else (None, 0)
            node.wait_counts(call.num_worst_tokens)  # from here until the send's launch the GPU waits
            N = node.received_rows(call.num_worst_tokens)
            if recv is None or N > cap:
                recv = carve(_recv_shapes(N, H, k, call.fp8, weights, True), dtypes=_recv_dtypes(call.x.dtype))
            p = recv.ptr
            plan.template.launch(fn, plan.num_blocks, cfg.num_threads, 0, cupy.cuda.get_current_stream().ptr,
                                 arrays.base_ptr, call.x.data.ptr, jit.ptr(call.x_scales), call.topk_idx.data.ptr,
                                 jit.ptr(call.topk_weights), p("recv_x"), p("recv_x_scales"), p("recv_topk_idx"),
                                 p("recv_topk_weights"), p("recv_src_idx"), jit.ptr(call.queue_occupancy), N)
            if recv is not None and N < cap:  # views of the received rows (the guess held more)
                for name, shape in _recv_shapes(N, H, k, call.fp8, weights, True).items():
                    recv[name] = recv.view(name, shape)
            plan.rows_seen.append(N)
        else:
            N = handle.num_worst_tokens or handle.num_recv_tokens
            own_src = handle.recv_src_idx is None
            recv = carve(_recv_shapes(N, H, k, call.fp8, weights, own_src), dtypes=_recv_dtypes(call.x.dtype))
            if not own_src:  # a cached call writes the handle's source indices again (the same routing)
                recv["recv_src_idx"] = handle.recv_src_idx
            K.launch_dispatch(fn, cfg, node.buffer, rs, call.x, call.x_scales, call.topk_idx, call.topk_weights,
                              handle, {name: recv.ptr(name) for name in RECV_NAMES}, call.queue_occupancy,
                              call.num_experts // R, N, node.rank, node.group.guard("queue_dispatch"))
        if notified:
            handle = node.notify_handle(arrays, T, H, call.num_experts, cfg.num_channels, call.num_worst_tokens,
                                        "queue")
        if handle.recv_src_idx is None:
            handle = evolve(handle, recv_src_idx=recv["recv_src_idx"])
        # a cached call sizes its expert-major rows for the bound (this topk_idx is not counted)
        per_expert = aligned_expert_counts(handle.recv_expert_counts, call.expert_alignment)
        out = {name: recv.get(name) for name in RECV_NAMES[:4]}
        handle, em = node.with_expert_major(handle, call.expert_major, per_expert if notified else None,
                                            out["recv_x"], out["recv_x_scales"], out["recv_topk_idx"],
                                            call.num_experts, call.expert_alignment)
        return dispatch_result(out["recv_x"], out["recv_x_scales"], out["recv_topk_idx"], out["recv_topk_weights"],
                               per_expert, handle, None, em)

    def _send_plan(self, call: DispatchCall, cfg: Config, rs, arrays) -> "_SendPlan":
        """The send's launch of a notified dispatch of this call's shape,
        made once per shape: its args as a jit.ArgTemplate (checked against a
        full pack when made), and the rows its last calls received
        (:meth:`_guess_arrays`). ``arrays``: the notify pass's Carved."""
        parts = arrays.parts
        key = (call.num_tokens, call.hidden, call.num_topk, call.num_experts, call.fp8, call.topk_weights is not None,
               call.queue_occupancy is not None, call.num_worst_tokens > 0, cfg, id(parts))
        plan = self._plans.get(key)
        if plan is None or plan.parts is not parts:  # (a carve plan is made once per shape; id() alone may recur)
            if len(self._plans) >= jit.MAX_PLANS:  # call shapes that vary per call (T) would grow it
                self._plans.clear()
            node = self.node

            def shape(a):
                return tuple(a.shape) if a is not None else None
            shapes = {"x": call.x.shape, "x_scales": shape(call.x_scales), "topk_idx": call.topk_idx.shape,
                      "topk_weights": shape(call.topk_weights), "queue_occupancy": shape(call.queue_occupancy)}
            template, pack = K.send_template(cfg, node.buffer, rs, parts, shapes, call.num_experts // node.num_ranks,
                                             node.rank, node.group.guard("queue_dispatch"))
            template.check(pack, *(((i + 1) << 36) for i in range(len(K.SEND_SOURCES) - 1)), 12345)
            plan = self._plans[key] = _SendPlan(template, pack, parts, 2 * cfg.num_channels,
                                                collections.deque(maxlen=GUESS_HISTORY))
        return plan

    def _guess_arrays(self, plan: "_SendPlan", call: DispatchCall):
        """(receive arrays, their rows) made before the counts arrive, so that
        no allocation stands between the counts and the send's launch: for
        as many rows as the most that this call shape received in its last
        GUESS_HISTORY calls, plus 1/32 (or (None, 0) on its first call). A
        call that receives more makes exact arrays after its counts; one that
        receives fewer returns views of its rows, whose allocation holds at
        most about 1/32 more rows than the shape's recent most."""
        if not plan.rows_seen:
            return None, 0
        cap = max(plan.rows_seen)
        cap += -(-cap // 32)
        return carve(_recv_shapes(cap, call.hidden, call.num_topk, call.fp8, call.topk_weights is not None, True),
                     dtypes=_recv_dtypes(call.x.dtype)), cap

    # ----------------------------------------------------------- combine
    def combine(self, call: CombineCall):
        import cupy
        node, cfg, handle = self.node, call.config, call.handle
        T, H, k = handle.num_tokens, call.x.shape[1], call.num_topk
        rs = ring_set(node.layout, "combine", H, k, False, cfg)
        fn = self._kernel(K.combine_spec_for(node.num_ranks, cfg), cfg, "combine")
        x = reduced = node.reduce_expert_major(call.x, handle, call.pair_weights) if call.expert_major else None
        x = call.x if x is None else x
        combined = cupy.empty((T, H), dtype=call.x.dtype)
        combined_w = cupy.empty((T, k), dtype=np.float32) if call.topk_weights is not None else None
        K.launch_combine(fn, cfg, node.buffer, rs, x, call.row_weights, call.topk_weights, handle, combined, combined_w,
                         node.rank, node.group.guard("queue_combine"))
        return CombineResult(combined, combined_w, None, reduced)


#: The receive arrays of a queue dispatch, as the kernel's arguments name them.
RECV_NAMES = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx")
#: Notified calls of one shape whose received rows size the next call's arrays (QueueRoute._guess_arrays).
GUESS_HISTORY = 4


class _SendPlan(NamedTuple):
    template: "jit.ArgTemplate"
    pack: object  # the template's packing function (tests compare the two)
    parts: dict  # the notify pass's carve plan the template's offsets are of
    num_blocks: int
    rows_seen: collections.deque


def _recv_shapes(N: int, H: int, k: int, fp8: bool, weights: bool, src: bool) -> dict:
    """{name: shape} of a dispatch's receive arrays (those it carries)."""
    shapes = {"recv_x": (N, H)}
    if fp8:
        shapes["recv_x_scales"] = (N, H // 128)
    if k:
        shapes["recv_topk_idx"] = (N, k)
        if weights:
            shapes["recv_topk_weights"] = (N, k)
    if src:
        shapes["recv_src_idx"] = (N,)
    return shapes


@functools.cache
def _recv_dtypes(x_dtype) -> dict:
    return {"recv_x": x_dtype, "recv_x_scales": np.float32, "recv_topk_idx": np.int64,
            "recv_topk_weights": np.float32}


def _on_channels(cfg: Config, handle: DispatchHandle | None) -> Config:
    """``cfg`` with the handle's channels (num_sms = 2 * handle.num_channels), if any."""
    return cfg if handle is None else replace(cfg, num_sms=2 * handle.num_channels)
