"""DeepEP V1's ``Buffer`` on cupyep: the same constructor, calls, defaults,
return tuples and dtypes, on torch tensors.

Each call converts its tensors (no copies; cupyep.deep_ep.tensors), makes
torch's current stream CuPy's for its length, hands it to a cupyep buffer
(:class:`cupyep.Buffer` for normal mode, :class:`cupyep.LowLatencyBuffer`
for low-latency mode) and returns DeepEP's tuple. Normal-mode calls run on
cupyep's communication stream after torch's current stream (or after
``previous_event``); with ``async_finish`` they return an EventOverlap and
torch's stream does not wait. What cupyep cannot honour raises
NotImplementedError naming it (cupyep.deep_ep.gaps); the byte budgets map
onto cupyep's declared sizes as cupyep.deep_ep.budget describes.

Memory: received tensors live in CuPy's memory pool, allocated on the
communication stream (normal mode) or on the stream the call runs on
(low-latency mode), for either value of ``allocate_on_comm_stream``
(docs/deep_ep.md).

Low-latency mode gives DeepEP's packed layout (cupyep.reference.packed_layout):
the dispatch's receive half copies the received rows into new packed tensors
(only the valid rows, once), and the combine reads packed expert outputs in
place.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from . import budget as B
from .bias import add_bias, check_bias, unpack_bias
from .config import Config, default_cupyep_config, to_cupyep, tuned_config
from .events import EventHandle, EventOverlap, event_of, overlap
from .gaps import refuse
from .handles import DispatchHandle, LowLatencyHandle, native_handle
from .routing import rank_routing
from .tensors import current_stream_ptr, to_cupy, to_torch, torch_stream


class Buffer:
    """Expert-parallel communication buffers (DeepEP V1's ``deep_ep.Buffer``).

    Arguments (DeepEP's, in its order):
        group: a ``torch.distributed`` ProcessGroup (its ranks are the EP
            ranks; cupyep's host exchanges run over a gloo group of the same
            ranks, cupyep.deep_ep.comm), or a cupyep.Group; None with ``comm``.
        num_nvl_bytes: the normal-mode buffer within a node (cupyep.Buffer's
            IPC buffer; 0: no normal mode within a node).
        num_rdma_bytes: the low-latency buffer, and with the NVLink bytes the
            normal-mode pools across nodes (cupyep.deep_ep.budget).
        low_latency_mode: enables the low_latency_* calls.
        num_qps_per_rank: DeepEP's RDMA queue pairs per rank (> 0). cupyep
            opens none (IPC within a node, NVSHMEM puts across nodes), so it
            changes nothing here.
        allow_nvlink_for_low_latency_mode: True (cupyep's low-latency kernels
            use NVLink / IPC within a node); False raises NotImplementedError.
        allow_mnnvl: False (DeepEP's default) sets NVSHMEM_DISABLE_MNNVL=1 before
            NVSHMEM starts, as DeepEP does; True leaves NVSHMEM free to reach
            ranks of other nodes over multi-node NVLink where it finds it
            (cupyep's routes across nodes only put through NVSHMEM, whatever
            its transport).
        use_fabric: True raises NotImplementedError.
        enable_shrink: low-latency rank masking (the low_latency_*_mask_buffer
            calls; cupyep.LowLatencyBuffer, enable_shrink).
        explicitly_destroy: as DeepEP, ``destroy()`` needs it. Without it the
            buffers live until the process ends: cupyep frees collective
            memory only in ``destroy()``, never in a destructor.
        comm: an mpi4py communicator, used when ``group`` is None (as DeepEP).

    Keyword-only extensions (not in DeepEP):
        max_tokens, hidden, num_topk: cupyep's declared sizes of normal mode;
            None derives them from the byte budgets (cupyep.deep_ep.budget).
        validate: cupyep's host checks before each call (expert ids, and that
            every rank passes the same shared arguments); off by default, as
            DeepEP makes none.
        timeout_s: cupyep's bound on every wait (a CommTimeoutError names
            the rank and the peer).

    Attributes: rank, group_size, group, num_nvl_bytes, num_rdma_bytes,
    low_latency_mode, explicitly_destroy, enable_shrink (as DeepEP);
    cgroup (the cupyep.Group), normal (the cupyep.Buffer or None),
    low_latency (the cupyep.LowLatencyBuffer of the last low-latency sizes, or None).
    """

    num_sms: int = 20
    _num_sms_set: bool = False  # whether set_num_sms was called (across nodes it sets the buffers' SMs)

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, max_tokens: int | None = None,
                 hidden: int | None = None, num_topk: int | None = None, validate: bool = False,
                 timeout_s: float | None = None) -> None:
        if use_fabric:
            refuse("Buffer(use_fabric=True)")
        if not allow_mnnvl:  # as DeepEP: NVSHMEM reads it when it starts (the first Buffer across nodes)
            os.environ["NVSHMEM_DISABLE_MNNVL"] = "1"
        if not allow_nvlink_for_low_latency_mode and low_latency_mode:
            refuse("Buffer(allow_nvlink_for_low_latency_mode=False)")
        if isinstance(num_qps_per_rank, bool) or not isinstance(num_qps_per_rank, int) or num_qps_per_rank <= 0:
            raise ValueError(f"num_qps_per_rank must be an int > 0, got {num_qps_per_rank!r}")
        if low_latency_mode and num_rdma_bytes <= 0:
            raise ValueError("low_latency_mode needs num_rdma_bytes > 0 (size it with "
                             "Buffer.get_low_latency_rdma_size_hint)")
        self.cgroup, self._own_group, self.group = _make_group(group, comm, timeout_s)
        g = self.cgroup
        self.rank, self.group_size = g.rank, g.world_size
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = bool(low_latency_mode), \
            bool(explicitly_destroy), bool(enable_shrink)
        self.num_qps_per_rank = num_qps_per_rank
        self.validate = bool(validate)
        self.internode = g.num_nodes > 1
        self.low_latency = None
        self._ll_sizes = None
        self._mask = None  # shrink mode: the [R] int32 mask every low-latency buffer of this Buffer uses
        self._ll_staging, self._ll_next = None, 0  # get_next_low_latency_combine_buffer's two packed tensors
        try:
            if not allow_nvlink_for_low_latency_mode and self.internode:
                refuse("Buffer(allow_nvlink_for_low_latency_mode=False)")
            self.plan = B.normal_plan(num_nvl_bytes, num_rdma_bytes, g.world_size if self.internode else g.local_size,
                                      g.num_nodes, max_tokens, hidden, num_topk)
            self.normal = None
            if self.plan is not None:
                from ..normal.buffer import Buffer as NormalBuffer
                extra = dict(num_sms=Buffer.num_sms) if self.internode and Buffer._num_sms_set else {}
                self.normal = NormalBuffer(g, self.plan.num_bytes, max_tokens=self.plan.max_tokens,
                                            hidden=self.plan.hidden, num_topk=self.plan.num_topk,
                                            num_in_flight=B.NUM_IN_FLIGHT, **extra)
        except BaseException:
            if self._own_group:
                g.destroy()
            raise
        self._destroyed = False

    # ------------------------------------------------------------ static
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: cupyep compiles its kernels, FP8 casts included, for the GPU at run time."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs of the normal-mode kernels from now on (even), for every Buffer:
        the default configs of later dispatches (and so of their combines,
        which run on the dispatch's channels) and ``get_dispatch_config`` /
        ``get_combine_config``; across nodes, the buffers made afterwards."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"The SM count must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms
        Buffer._num_sms_set = True

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on torch's current stream (for ``previous_event``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` that cupyep's low-latency buffer needs
        for these sizes (top-k up to 16; cupyep.deep_ep.budget)."""
        return B.low_latency_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """cupyep's tuned dispatch chunk and ring depth for ``num_ranks`` ranks,
        on ``Buffer.num_sms`` SMs."""
        return tuned_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """cupyep's tuned combine chunk and ring depth, on ``Buffer.num_sms`` SMs."""
        return tuned_config(num_ranks, Buffer.num_sms, combine=True)

    # ------------------------------------------------------------ misc
    def get_comm_stream(self):
        """The communication stream of normal mode (else of low-latency mode),
        as a torch stream."""
        import torch
        buf = self.normal or self.low_latency
        if buf is None:
            raise ValueError("this Buffer has no communication stream yet (no normal-mode buffer, and no "
                             "low-latency call so far)")
        return torch.cuda.ExternalStream(buf.comm_stream.ptr)

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        refuse("Buffer.get_local_buffer_tensor")

    # ------------------------------------------------------------ shrink mode (rank masking)
    def _shrink_mask(self, what: str | None = None):
        """The [R] int32 mask of shrink mode (made at first use), or None
        without enable_shrink (ValueError naming ``what`` if given)."""
        if not self.enable_shrink:
            if what is not None:
                raise ValueError(f"Buffer.{what} needs a Buffer made with enable_shrink=True (as DeepEP)")
            return None
        if self._mask is None:
            import cupy
            from ..low_latency.buffer import ranks_of
            with torch_stream():
                self._mask = cupy.zeros(ranks_of(self.cgroup)[1], dtype=np.int32)
        return self._mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Mask (``mask=True``) or unmask ``rank_to_mask`` for the following
        low-latency calls, on torch's current stream: nothing is sent to a
        masked rank nor waited for from it (cupyep.LowLatencyBuffer,
        enable_shrink). Change it between a combine and the next dispatch."""
        m = self._shrink_mask("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, (int, np.integer)) or \
                not 0 <= rank_to_mask < m.shape[0]:
            raise ValueError(f"rank_to_mask must be an int in [0, {m.shape[0]}), got {rank_to_mask!r}")
        with torch_stream():
            m[int(rank_to_mask)] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status):
        """Copy the mask into ``mask_status`` ([R] torch.int, CUDA), on torch's
        current stream: 1 for a masked rank (masked by a call or by a peer that
        timed out)."""
        m = self._shrink_mask("low_latency_query_mask_buffer")
        out = to_cupy(mask_status, "mask_status")
        if out is None or out.dtype != np.int32 or tuple(out.shape) != m.shape:
            raise ValueError(f"mask_status must be a [{m.shape[0]}] torch.int tensor")
        with torch_stream():
            out[...] = m

    def low_latency_clean_mask_buffer(self):
        """Unmask every rank, on torch's current stream."""
        m = self._shrink_mask("low_latency_clean_mask_buffer")
        with torch_stream():
            m.fill(0)

    def destroy(self) -> None:
        """Collective: free the buffers (needs ``explicitly_destroy=True``, as DeepEP)."""
        if not self.explicitly_destroy:
            raise ValueError("`explicitly_destroy` flag must be set")
        if self._destroyed:
            return
        self._destroyed = True
        for buf in (self.normal, self.low_latency):
            if buf is not None:
                buf.destroy()
        self.normal = self.low_latency = self._ll_staging = None
        if self._own_group:
            self.cgroup.destroy()

    # ------------------------------------------------------------ normal mode
    def _normal_buffer(self, what: str):
        if self.normal is None:
            rdma = f", num_rdma_bytes={self.num_rdma_bytes}" if self.internode else ""
            raise ValueError(f"{what}: this Buffer has no normal-mode buffer (made with num_nvl_bytes="
                             f"{self.num_nvl_bytes}{rdma})")
        return self.normal

    @staticmethod
    def _check_allocation(allocate_on_comm_stream: bool, previous_event, async_finish: bool) -> None:
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True (as DeepEP)")

    def _config(self, config, buf, handle, combine: bool, what: str):
        """cupyep's queue config of a call: DeepEP's ``config`` mapped
        (cupyep.deep_ep.config), or for None DeepEP's default,
        ``get_dispatch_config`` / ``get_combine_config`` of the rank count
        (cupyep's tuned chunk and ring depth, the ones the buffer-size hints
        assume), on ``Buffer.num_sms`` SMs capped at this rank's share of the
        GPU, or with a handle on the handle's channels."""
        if self.internode:
            if config is not None:
                refuse(f"Buffer.{what}(config=...) across nodes")
            return None
        R = self.cgroup.local_size
        if config is None:
            num_sms = 2 * handle.num_channels if handle is not None else \
                max(2, min(Buffer.num_sms, buf.sm_budget) // 2 * 2)
            return default_cupyep_config(R, num_sms, combine)
        return to_cupyep(config, R, combine)

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Token counts of this rank's routing.

        Arguments:
            topk_idx: [num_tokens, num_topk] torch.int64 expert ids, -1 for none.
            num_experts: E, divisible by the ranks.
            previous_event, async_finish, allocate_on_comm_stream: as DeepEP.

        Returns:
            num_tokens_per_rank [R] torch.int, num_tokens_per_rdma_rank
            [num_nodes] torch.int (None within a node), num_tokens_per_expert
            [E] torch.int, is_token_in_rank [num_tokens, R] torch.bool, event.
        """
        self._check_allocation(allocate_on_comm_stream, previous_event, async_finish)
        buf = self._normal_buffer("get_dispatch_layout")
        idx = to_cupy(topk_idx, "topk_idx")
        with torch_stream():
            res = buf.get_dispatch_layout(idx, num_experts, previous_event=event_of(previous_event),
                                          async_finish=async_finish, validate=self.validate)
        return (to_torch(res.num_tokens_per_rank), to_torch(res.num_tokens_per_rdma_rank),
                to_torch(res.num_tokens_per_expert), to_torch(res.is_token_in_rank),
                overlap(res.event, async_finish))

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to the ranks of its experts (DeepEP's ``dispatch``).

        Arguments:
            x: [num_tokens, hidden] torch.bfloat16, or a tuple of
                [num_tokens, hidden] torch.float8_e4m3fn and its scales
                [num_tokens, hidden / 128] torch.float (non-contiguous scales,
                such as DeepEP's column-major ones, are copied to row-major first).
            handle: a dispatch's handle: cached dispatch (no top-k, as DeepEP).
            num_tokens_per_rank [R] torch.int, num_tokens_per_rdma_rank,
            is_token_in_rank [num_tokens, R] torch.bool, num_tokens_per_expert
                [E] torch.int: get_dispatch_layout's (needed without a handle;
                num_experts is num_tokens_per_expert's length). Across nodes
                cupyep's notify pass counts them again from topk_idx.
            topk_idx: [num_tokens, num_topk] torch.int64, or None: then (within a
                node, as DeepEP) each token goes to the ranks is_token_in_rank
                names, recv_topk_idx and recv_topk_weights are None, and the
                expert counts are the caller's num_tokens_per_expert
                (cupyep.deep_ep.routing.rank_routing gives cupyep's dispatch a
                top-k of one expert per rank that routes the same rows).
            topk_weights: [num_tokens, num_topk] torch.float or None.
            expert_alignment: round each local expert's count up to a multiple.
            num_worst_tokens: > 0: receive into that many rows without a host
                wait (CUDA-graph capturable); rows past the received count have
                recv_topk_idx -1 and recv_topk_weights 0.
            config: a Config (None: ``get_dispatch_config`` of the rank count on
                ``Buffer.num_sms`` SMs, at most this rank's share of the GPU;
                with a handle, on the handle's channels).
            previous_event, async_finish, allocate_on_comm_stream: as DeepEP.

        Returns:
            recv_x (a tensor, or (tensor, scales) for FP8), recv_topk_idx
            [N, num_topk] torch.int64 local expert ids or -1, recv_topk_weights
            [N, num_topk] torch.float, num_recv_tokens_per_expert_list (E_local
            ints, aligned; [] in worst-token mode), handle, event. A cached
            dispatch returns (recv_x, None, None, None, None, event).
        """
        if handle is not None and (topk_idx is not None or topk_weights is not None):
            raise ValueError("a cached dispatch (handle=...) takes no topk_idx or topk_weights (as DeepEP)")
        if handle is None and any(a is None for a in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)):
            raise ValueError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                             "num_tokens_per_expert (from get_dispatch_layout), as DeepEP")
        by_rank = handle is None and topk_idx is None  # routed by is_token_in_rank alone
        if by_rank:
            if self.internode:
                refuse("Buffer.dispatch(topk_idx=None) across nodes")
            if topk_weights is not None:
                raise ValueError("topk_weights needs topk_idx (as DeepEP)")
            if num_worst_tokens > 0:
                raise ValueError("num_worst_tokens needs topk_idx (as DeepEP: worst-token mode is a forward "
                                 "with top-k)")
        self._check_allocation(allocate_on_comm_stream, previous_event, async_finish)
        buf = self._normal_buffer("dispatch")
        ev = event_of(previous_event)
        if isinstance(x, tuple):
            x, scales = x
            if scales is not None and hasattr(scales, "is_contiguous") and not scales.is_contiguous():
                ev = self._row_major(ev)
                scales = scales.contiguous()
                if ev is not None:  # the call waits for the copy as well as for previous_event
                    ev = EventHandle().event
            rows = (to_cupy(x, "x"), to_cupy(scales, "x_scales"))
        else:
            rows = to_cupy(x, "x")
        fp8 = isinstance(rows, tuple)
        if handle is not None:
            native = native_handle(handle, "dispatch")
            cfg = self._config(config, buf, native, False, "dispatch")
            with torch_stream():
                res = buf.dispatch(rows, handle=native, expert_alignment=expert_alignment,
                                   num_worst_tokens=num_worst_tokens, config=cfg, previous_event=ev,
                                   async_finish=async_finish, validate=self.validate)
            return self._recv_x(res, fp8), None, None, None, None, overlap(res.event, async_finish)
        per_expert = to_cupy(num_tokens_per_expert, "num_tokens_per_expert")
        cfg = self._config(config, buf, None, False, "dispatch")
        in_rank = to_cupy(is_token_in_rank, "is_token_in_rank")
        with torch_stream():
            idx = to_cupy(topk_idx, "topk_idx") if not by_rank else \
                rank_routing(in_rank, int(per_expert.shape[0]))
            res = buf.dispatch(rows, idx, to_cupy(topk_weights, "topk_weights"),
                               num_experts=int(per_expert.shape[0]),
                               num_tokens_per_rank=to_cupy(num_tokens_per_rank, "num_tokens_per_rank"),
                               num_tokens_per_expert=per_expert,
                               is_token_in_rank=in_rank,
                               num_worst_tokens=num_worst_tokens, expert_alignment=expert_alignment, config=cfg,
                               previous_event=ev, async_finish=async_finish, validate=self.validate)
        counts = res.num_recv_tokens_per_expert
        if by_rank:  # DeepEP's dispatch without top-k returns no top-k
            return (self._recv_x(res, fp8), None, None, [] if counts is None else counts,
                    DispatchHandle(res.handle, self.internode), overlap(res.event, async_finish))
        return (self._recv_x(res, fp8), to_torch(res.recv_topk_idx), to_torch(res.recv_topk_weights),
                [] if counts is None else counts, DispatchHandle(res.handle, self.internode),
                overlap(res.event, async_finish))

    @staticmethod
    def _row_major(ev):
        """Before the scales are copied to row-major on torch's current stream:
        that stream first waits for ``previous_event`` (on the device), so that
        an event recorded after the copy orders the call after both."""
        if ev is not None:
            import cupy
            cupy.cuda.runtime.streamWaitEvent(current_stream_ptr(), ev.ptr, 0)
        return ev

    @staticmethod
    def _recv_x(res, fp8: bool):
        if fp8:
            return to_torch(res.recv_x, "fp8"), to_torch(res.recv_x_scales)
        return to_torch(res.recv_x, "bf16")

    def combine(self, x, handle, topk_weights=None, bias=None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Reduce each token's rows from the ranks it was sent to (a plain
        sum, in FP32, in rank order; DeepEP's ``combine``).

        Arguments:
            x: [N, hidden] torch.bfloat16, one row per received row of the dispatch.
            handle: that dispatch's handle.
            topk_weights: [N, num_topk] torch.float to reduce alike, or None.
            bias: None, a [num_tokens, hidden] torch.bfloat16 tensor, or a
                tuple of two (either may be None), added to the combined rows
                in FP32 (cupyep.deep_ep.bias: after cupyep's BF16 rounding, so
                an element may differ from DeepEP's by one BF16 ulp).
            config, previous_event, async_finish, allocate_on_comm_stream: as DeepEP.

        Returns:
            combined_x [num_tokens, hidden] torch.bfloat16, combined_topk_weights
            [num_tokens, num_topk] torch.float or None, event.
        """
        self._check_allocation(allocate_on_comm_stream, previous_event, async_finish)
        buf = self._normal_buffer("combine")
        native = native_handle(handle, "combine")
        cfg = self._config(config, buf, native, True, "combine")
        rows, weights = to_cupy(x, "x"), to_cupy(topk_weights, "topk_weights")
        biases = tuple(to_cupy(b, f"bias_{i}") for i, b in enumerate(unpack_bias(bias)))
        if biases:
            check_bias(biases, native.num_tokens, rows.shape[1])
        with torch_stream():
            res = buf.combine(rows, native, weights, config=cfg, previous_event=event_of(previous_event),
                              async_finish=async_finish)
            event = res.event
            if biases:  # after the combine, where it ran: the communication stream with async_finish
                stream = buf.comm_stream if async_finish and not isinstance(res.combined_x, np.ndarray) else None
                with stream if stream is not None else _nullcontext():
                    add_bias(res.combined_x, biases)
                if stream is not None:
                    event = _record(stream)
        extra = biases if async_finish and biases else None
        return (to_torch(res.combined_x, "bf16"), to_torch(res.combined_topk_weights),
                overlap(event, async_finish, extra))

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """:meth:`dispatch` of a Buffer across nodes (DeepEP calls it from dispatch)."""
        self._require_internode("internode_dispatch")
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """:meth:`combine` of a Buffer across nodes."""
        self._require_internode("internode_combine")
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def _require_internode(self, what: str) -> None:
        if not self.internode:
            raise ValueError(f"{what}: this Buffer's ranks are on one node; call "
                             f"{what.replace('internode_', '')}")

    # ------------------------------------------------------------ low-latency mode
    def _low_latency_buffer(self, what: str, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        """The cupyep.LowLatencyBuffer of these sizes (collective when made:
        every rank makes the same calls with the same sizes, as DeepEP needs)."""
        if not self.low_latency_mode:
            raise ValueError(f"{what} needs a Buffer made with low_latency_mode=True")
        sizes = (int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts))
        if self.low_latency is not None and self._ll_sizes == sizes:
            return self.low_latency
        from ..low_latency.buffer import LowLatencyBuffer, ranks_of
        _, R = ranks_of(self.cgroup)
        max_topk = B.check_low_latency_budget(self.num_rdma_bytes, *sizes[:2], R, sizes[2])
        if self.low_latency is not None:  # new sizes: the old buffer's results go with it (as DeepEP's layout)
            self.low_latency.destroy()
            self.low_latency = self._ll_staging = None
        self.low_latency = LowLatencyBuffer(self.cgroup, *sizes, max_topk=max_topk, mask=self._shrink_mask())
        self._ll_sizes = sizes
        # the dispatch that fills DeepEP's packed layout, loaded here (collectively) rather than within a call
        self.low_latency.load_kernel("dispatch_packed")
        return self.low_latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: make the low-latency buffer of these sizes ready. cupyep's
        low-latency buffer is apart from the normal-mode one and clears the
        next call's signals during each call, so there is nothing to zero; a
        buffer of other sizes is made (outside any CUDA graph capture)."""
        self._low_latency_buffer("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send every (token, expert) pair to the expert's rank (DeepEP's
        ``low_latency_dispatch``).

        Arguments:
            x: [num_tokens, hidden] torch.bfloat16, num_tokens <= num_max_dispatch_tokens_per_rank.
            topk_idx: [num_tokens, num_topk] torch.int64, distinct experts per token or -1.
            num_max_dispatch_tokens_per_rank, num_experts: the same on every rank.
            cumulative_local_expert_recv_stats: [E_local] torch.int, += rows received per local expert.
            dispatch_wait_recv_cost_stats: [R] torch.int64, += nanoseconds waited for each source.
            use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook: as DeepEP.

        Returns:
            recv_x: [E_local, R * T, hidden] torch.bfloat16, or with use_fp8 a
                tuple of [E_local, R * T, hidden] torch.float8_e4m3fn and scales
                [E_local, R * T, hidden / 128] torch.float (use_ue8m0: [E_local,
                R * T, hidden / 512] torch.int, four UE8M0 exponents a word),
                column-major in their last two dims (the transpose of a
                contiguous [E_local, S, R * T] tensor), as DeepEP's. DeepEP's
                packed layout: local expert e's rows are rows [0, recv_count[e]),
                source after source in rank order (handle[1] gives each
                source's range); later rows are unset. New tensors, filled by
                the dispatch's receive half itself (its dispatch_packed kernel;
                the layout: cupyep.reference.packed_layout); with return_recv_hook when
                the hook runs.
            recv_count [E_local] torch.int, handle, event, hook (a callable
            with return_recv_hook, else None).
        """
        if use_ue8m0 and x.shape[1] % 512:
            refuse("Buffer.low_latency_dispatch(use_ue8m0=True) with hidden % 512 != 0")
        ll = self._low_latency_buffer("low_latency_dispatch", num_max_dispatch_tokens_per_rank, x.shape[1],
                                      num_experts)
        rows, idx = to_cupy(x, "x"), to_cupy(topk_idx, "topk_idx")
        stats = to_cupy(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
        waits = to_cupy(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
        with torch_stream():
            # DeepEP's packed results: new arrays the dispatch makes where it runs (the communication
            # stream with async_finish, else torch's) and fills in its receive half (in the hook with
            # return_recv_hook): no launch of their own.
            res = ll.dispatch(rows, idx, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                              cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=waits,
                              async_finish=async_finish, return_recv_hook=return_recv_hook, validate=self.validate,
                              packed_out=True)
            native, event, hook, packed = res.handle, res.event, res.hook, res.packed
        px, pscales, src_info, ranges = packed
        recv_x = (to_torch(px, "fp8"), to_torch(pscales)) if use_fp8 else to_torch(px, "bf16")
        extra = (x, topk_idx, cumulative_local_expert_recv_stats) if async_finish else None
        return (recv_x, to_torch(res.recv_count), LowLatencyHandle(native, src_info, ranges),
                overlap(event, async_finish, extra), _hook(hook))

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Return expert outputs to their tokens and reduce them with the
        weights (DeepEP's ``low_latency_combine``).

        Arguments:
            x: [E_local, R * T, hidden] torch.bfloat16 expert outputs, contiguous,
                in the dispatch's packed layout (expert e's rows [0, recv_count[e]),
                the rows the dispatch returned; other rows are not read). With
                zero_copy the outputs are read from the tensor of
                get_next_low_latency_combine_buffer and x is not read (as DeepEP;
                it may be None).
            topk_idx, topk_weights: [num_tokens, num_topk] torch.int64 / torch.float, as dispatched.
            handle: the dispatch's handle.
            use_logfmt: the rows travel in LogFMT-10 (cupyep.reference.logfmt;
                within a node; across nodes NotImplementedError).
            combine_wait_recv_cost_stats: [R] torch.int64, += nanoseconds waited
                for each expert rank's rows (as the dispatch's statistics).
            zero_copy, async_finish, return_recv_hook: as DeepEP.
            out: [num_tokens, hidden] torch.bfloat16 to write into (returned).

        cupyep's combine reads the packed rows in place (LowLatencyBuffer.combine
        with x_layout="packed": each row from where DeepEP's layout puts it,
        found from the counts the kernel scans anyway) and sends them; nothing
        is copied first. With async_finish it reads x (or, with zero_copy, the
        tensor get_next_low_latency_combine_buffer gave) until the event.

        Returns:
            combined_x [num_tokens, hidden] torch.bfloat16, event, hook.
        """
        if use_logfmt and self.internode:
            refuse("Buffer.low_latency_combine(use_logfmt=True) across nodes")
        native = native_handle(handle, "low_latency_combine")
        ll = self._low_latency_of(native, "low_latency_combine")
        if zero_copy:
            if self._ll_staging is None:
                raise ValueError("low_latency_combine(zero_copy=True) reads the tensor of "
                                 "get_next_low_latency_combine_buffer(handle); call it first and write the expert "
                                 "outputs there")
            rows = self._ll_staging[self._ll_next][0]
            self._ll_next ^= 1  # the next zero-copy combine reads the other tensor (as DeepEP's two buffers)
        elif x is None:
            raise ValueError("low_latency_combine needs x, the [E_local, R * T, hidden] expert outputs in the "
                             "dispatch's packed layout (x may be None only with zero_copy=True)")
        else:
            rows = to_cupy(x, "x")
        with torch_stream():
            res = ll.combine(rows, to_cupy(topk_idx, "topk_idx"), to_cupy(topk_weights, "topk_weights"), native,
                             x_layout="packed", async_finish=async_finish, return_recv_hook=return_recv_hook,
                             out=to_cupy(out, "out"), validate=self.validate, use_logfmt=use_logfmt,
                             combine_wait_recv_cost_stats=to_cupy(combine_wait_recv_cost_stats,
                                                                  "combine_wait_recv_cost_stats"))
        combined = out if out is not None else to_torch(res.combined_x, "bf16")
        extra = (x, topk_idx, topk_weights, combined) if async_finish else None
        return combined, overlap(res.event, async_finish, extra), _hook(res.hook)

    def get_next_low_latency_combine_buffer(self, handle):
        """[E_local, R * T, hidden] torch.bfloat16, contiguous: where to write
        the expert outputs, in the dispatch's packed layout, for the next
        ``low_latency_combine(..., zero_copy=True)``, which reads them in place.
        As DeepEP's, two such tensors alternate: the one given here belongs to
        the next zero-copy combine, the other to the one before, which may
        still be reading it (async_finish). Unlike DeepEP's they are not the
        communication buffer but two tensors per Buffer and sizes (each
        E_local * R * T * hidden * 2 bytes from CuPy's memory pool, made at the
        first call)."""
        native = native_handle(handle, "get_next_low_latency_combine_buffer")
        self._low_latency_of(native, "get_next_low_latency_combine_buffer")
        if self._ll_staging is None:
            El, R = native.layout_count.shape
            from ..arrays import xp_of
            xp = xp_of(native.layout_count)
            with torch_stream():
                pair = [xp.empty((El, R * native.max_tokens, native.hidden), dtype=np.uint16) for _ in range(2)]
            self._ll_staging, self._ll_next = [(a, to_torch(a, "bf16")) for a in pair], 0
        return self._ll_staging[self._ll_next][1]

    def _low_latency_of(self, native, what: str):
        if self.low_latency is None or native.buffer_id != id(self.low_latency):
            raise ValueError(f"{what}: the handle is not of this Buffer's current low-latency buffer (a dispatch "
                             "of other sizes replaced it)")
        return self.low_latency


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


def _record(stream):
    """A CuPy event recorded on ``stream``."""
    import cupy
    ev = cupy.cuda.Event(disable_timing=True)
    ev.record(stream)
    return ev


def _hook(native_hook) -> Optional[Callable[[], None]]:
    """DeepEP's receive hook: runs the receive half on torch's current stream."""
    if native_hook is None:
        return None

    def hook() -> None:
        with torch_stream():
            native_hook()
    return hook


def _make_group(group, comm, timeout_s):
    """(cupyep.Group, whether this Buffer made it, DeepEP's ``group`` attribute)."""
    from ..runtime import DEFAULT_TIMEOUT_S, Group, init
    kw = dict(timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    if isinstance(group, Group):
        return group, False, group
    if group is not None:
        from .comm import torch_comm
        g = init(torch_comm(group), **kw)
        try:
            if g.num_nodes > 1:
                refuse("Buffer(group=<torch.distributed group of several nodes>)")
            _check_torch_device(g)
        except BaseException:
            g.destroy()
            raise
        return g, True, group
    if comm is not None:
        g = init(comm, **kw)
        return g, True, comm
    raise ValueError("Either 'group' or 'comm' must be provided.")


def _check_torch_device(g) -> None:
    """cupyep picks rank i of a host GPU i % devices; torch's current device must be that one."""
    import torch
    if g.device_id is not None and torch.cuda.is_available() and torch.cuda.current_device() != g.device_id:
        raise ValueError(f"rank {g.rank}: torch's current device is {torch.cuda.current_device()} but cupyep "
                         f"uses device {g.device_id} (its rank on the host modulo the devices); call "
                         f"torch.cuda.set_device({g.device_id}) before making the Buffer")
