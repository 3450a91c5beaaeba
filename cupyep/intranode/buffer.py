"""Normal-mode (high-throughput) expert-parallel communication within a node.

:class:`Buffer` owns one symmetric IPC buffer per rank and runs, on its own
communication stream:

- :meth:`Buffer.get_dispatch_layout`: token counts per rank / expert;
- :meth:`Buffer.dispatch`: notify pass, then the transfer into a compact
  ``recv_x`` ordered by source rank, then source token, over one of two
  transports: ``"queue"`` (ring queues, the default: depth, chunk and SMs are
  its knobs) or ``"direct"`` (senders write straight into the receivers'
  output, which lives in IPC-registered pools; see cupyep.intranode.direct);
- :meth:`Buffer.combine`: the reverse route, reduced in FP32 to BF16.

Every public method validates its inputs (``ValueError`` before any launch),
and every wait is bounded by ``group.timeout_s`` (``CommTimeoutError``).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import jit
from ..arrays import BF16, FP8, as_cupy, carve, check, check_expert_ids, dispatch_rows
from ..calls import traced_call
from ..ipc import SymmetricBuffer
from ..sizes import DEFAULT_HIDDEN, DEFAULT_MAX_TOKENS, DEFAULT_NUM_TOPK, MAX_EXPERTS, DeclaredSizes
from ..slots import DEFAULT_IN_FLIGHT, check_num_in_flight
from ..streams import CommStream
from . import direct as D
from .. import dispatch_layout
from .. import expert_major as EM
from . import kernels as K
from .config import Config, get_combine_config, get_dispatch_config
from .layout import MAX_LOCAL_EXPERTS, buffer_layout, ring_set, size_hint
from .direct_transport import DirectTransport
from ..results import (CombineResult, DispatchHandle, DispatchResult, EventHandle, ExpandTables, LayoutResult,
                       aligned_expert_counts,
                      check_hidden, dispatch_result)

TRANSPORTS = ("queue", "direct")
INT_MAX = 2**31 - 1


class Buffer(DirectTransport):
    """Normal-mode dispatch/combine between the ranks of one node. For a
    group across two or more nodes, ``Buffer(group)`` is a
    cupyep.internode_buffer.TwoHopBuffer: the same calls over the two-hop
    mode (what it carries is in that module).

    Arguments:
        group: from :func:`cupyep.init`; all ranks of the node take part.
        num_bytes: bytes of each rank's ring-queue IPC buffer (default: enough
            for ``hidden``, ``num_topk`` and the default configs; see :meth:`size_hint`).
        max_tokens, hidden, num_topk: the most tokens per rank, channels per
            row and experts per token of any call (cupyep.sizes); a call past
            them raises ValueError naming the argument. The direct transport's
            pools are sized from them.
        num_in_flight: dispatch slots of the direct transport's pools (>= 1):
            the results of the last ``num_in_flight`` direct dispatches are
            valid at once (two micro-batches need 2); an older one raises
            StaleResultError when read.
        num_direct_bytes: bytes of one direct dispatch slot (default:
            cupyep.intranode.direct.default_slot_bytes of the declared sizes:
            R * max_tokens rows, or an expert-major layout of twice the mean
            pairs). Each rank's direct memory, allocated by the first call
            that uses it: num_in_flight slots of this, a combine pool of
            R * max_tokens partial rows, and, for zero-copy combines,
            num_in_flight slots of R * max_tokens rows of ``hidden``.

    The buffer is collective: create, call and destroy it on every rank of
    the node in the same order. Use it as a context manager or call
    :meth:`destroy`.
    """

    def __new__(cls, group, num_bytes: int | None = None, **sizes):
        # A group across nodes gets the two-hop mode's buffer (cupyep.internode_buffer), with these calls.
        if cls is Buffer and getattr(group, "num_nodes", 1) > 1:
            from ..internode_buffer import TwoHopBuffer
            return TwoHopBuffer(group, num_bytes, **sizes)
        return super().__new__(cls)

    def __init__(self, group, num_bytes: int | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 hidden: int = DEFAULT_HIDDEN, num_topk: int = DEFAULT_NUM_TOPK, num_in_flight: int = DEFAULT_IN_FLIGHT,
                 num_direct_bytes: int | None = None):
        import cupy
        self.sizes = DeclaredSizes(max_tokens, hidden, num_topk)
        self.num_in_flight = check_num_in_flight(num_in_flight)
        if num_direct_bytes is not None and (not isinstance(num_direct_bytes, int) or num_direct_bytes < 1):
            raise ValueError(f"num_direct_bytes must be an int >= 1 (or None: from the sizes), got {num_direct_bytes!r}")
        self.num_direct_bytes = num_direct_bytes
        group.require_gpu("cupyep.Buffer")
        if group.num_nodes > 1:
            raise ValueError(f"normal mode within a node needs all {group.world_size} ranks on one node, "
                             f"got {group.num_nodes} nodes")
        self.group = group
        self.num_ranks = group.local_size
        self.rank = group.local_rank
        dev = cupy.cuda.Device()
        self.num_device_sms = dev.attributes["MultiProcessorCount"]
        self.sm_budget = self.num_device_sms // max(1, group.ranks_per_gpu)
        num_bytes = int(num_bytes or max(size_hint(self.num_ranks, self.sizes.hidden, self.sizes.num_topk,
                                                   dispatch_config=self.default_dispatch_config(fp8),
                                                   combine_config=self.default_combine_config())
                                         for fp8 in (False, True)))
        self.layout = buffer_layout(self.num_ranks, num_bytes)
        self.buffer = SymmetricBuffer(group, num_bytes)
        self._calls = CommStream(group)
        self.comm_stream = self._calls.stream
        # Mapped host memory the notify pass writes: [1 + E_local + R * R + 1] (see NotifyArgs), then
        # the fused direct dispatch's status word (HOST_STATUS).
        n_counts = 1 + MAX_LOCAL_EXPERTS + self.num_ranks ** 2 + 2
        self._host_status_index = n_counts - 1
        self._host_counts_ptr = cupy.cuda.runtime.hostAlloc(4 * n_counts, 2)
        import ctypes
        self._host_counts = np.frombuffer((ctypes.c_int32 * n_counts).from_address(self._host_counts_ptr),
                                          dtype=np.int32)
        self._direct: D.DirectPools | None = None  # created by the first direct call (collective)
        # Compile the default specialisations once per node, collectively (so that no rank compiles
        # inside a call while its peers' kernels already wait on it), the expert-major layout's too.
        jit.load(dispatch_layout.layout_spec(), group)
        jit.load(K.notify_spec(self.num_ranks), group)
        jit.load(K.dispatch_spec_for(self.num_ranks, self.default_dispatch_config()), group)
        jit.load(K.combine_spec_for(self.num_ranks, self.default_combine_config()), group)
        jit.load(EM.permute_spec(), group)

    # ------------------------------------------------------------------ config
    def default_dispatch_config(self, fp8: bool = False, handle: DispatchHandle | None = None) -> Config:
        """The tuned dispatch config for this buffer's ranks and SM budget, for
        BF16 or (``fp8``) FP8 rows; with a handle, on the handle's channels."""
        return _on_channels(get_dispatch_config(self.num_ranks, self.sm_budget, fp8), handle)

    def default_combine_config(self, handle: DispatchHandle | None = None) -> Config:
        """The tuned combine config; with a handle, on the handle's channels
        (a combine runs on its dispatch's channels)."""
        return _on_channels(get_combine_config(self.num_ranks, self.sm_budget), handle)

    @staticmethod
    def size_hint(num_ranks: int, hidden: int = 7168, num_topk: int = 16, dispatch_config: Config | None = None,
                  combine_config: Config | None = None) -> int:
        """Bytes per rank a Buffer needs for these sizes and configs."""
        return size_hint(num_ranks, hidden, num_topk, dispatch_config, combine_config)

    def _check_resident(self, fn, cfg: Config, what: str) -> None:
        jit.require_resident(what, jit.max_resident_blocks(fn, cfg.num_threads), cfg.num_sms, cfg.num_threads,
                             self.group.ranks_per_gpu, self.num_device_sms, "num_sms", step=2)

    # ----------------------------------------------------------------- streams
    def _begin(self, previous_event):
        self._calls.begin(previous_event)

    def _end(self, async_finish: bool, keep: tuple = ()) -> EventHandle:
        """cupyep.streams.CommStream.end: ``keep`` are the call's inputs and the
        temporaries its kernels use."""
        return self._calls.end(async_finish, keep)

    # ------------------------------------------------------------------ layout
    def _check_topk_idx(self, topk_idx, num_experts: int, validate: bool):
        import cupy
        topk_idx = check(as_cupy(topk_idx, "topk_idx"), "topk_idx", np.int64, ndim=2)
        if not 0 < num_experts <= MAX_EXPERTS:
            raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the {self.num_ranks} ranks")
        if num_experts // self.num_ranks > MAX_LOCAL_EXPERTS:
            raise ValueError(f"{num_experts // self.num_ranks} experts per rank exceed {MAX_LOCAL_EXPERTS}")
        if validate and not cupy.cuda.get_current_stream().is_capturing():
            check_expert_ids(topk_idx, num_experts)
        return topk_idx

    @traced_call("Buffer.get_dispatch_layout")
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            validate: bool = True) -> LayoutResult:
        """Token counts of this rank's routing.

        Arguments:
            topk_idx: [T, k] int64 expert ids, -1 for none.
            num_experts: E, divisible by the number of ranks.
            validate: check expert ids on the host first (one small sync;
                skipped during graph capture, where the device check reports).

        Returns:
            LayoutResult.
        """
        topk_idx = self._check_topk_idx(topk_idx, num_experts, validate)
        self._begin(previous_event)
        res = self._layout(topk_idx, num_experts)
        res.event = self._end(async_finish, (topk_idx,))
        return res

    def _layout(self, topk_idx, num_experts: int) -> LayoutResult:
        with self.comm_stream:
            counts = dispatch_layout.launch_layout(topk_idx, num_experts, self.num_ranks,
                                                   self.group.guard("intranode_layout"))
        return LayoutResult(*counts)

    # ---------------------------------------------------------------- dispatch
    @traced_call("Buffer.dispatch")
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, x_scales=None, num_experts: int | None = None,
                 handle: DispatchHandle | None = None, num_tokens_per_rank=None, num_tokens_per_expert=None,
                 is_token_in_rank=None, num_worst_tokens: int = 0, expert_alignment: int = 1,
                 config: Config | None = None, previous_event=None, async_finish: bool = False,
                 validate: bool = True, expert_major: bool = False, transport: str | None = None,
                 notify_time_ns=None, queue_occupancy=None, fresh: bool = False) -> DispatchResult:
        """Send each token to every rank owning one of its experts.

        Arguments:
            x: [T, H] uint16 (BF16 bits) or uint8 (FP8 e4m3 bits); H a multiple of 128.
                A tuple (x_fp8, x_scales) is accepted too.
            topk_idx: [T, k] int64 expert ids, -1 for none (required unless ``handle``).
            topk_weights: [T, k] float32 or None.
            x_scales: [T, H / 128] float32, required with FP8 x.
            num_experts: E (required unless ``handle``).
            handle: a previous DispatchHandle of this buffer: skip the notify
                pass and reuse its routing ("cached dispatch").
            num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank: a
                LayoutResult's arrays, to skip recomputing the layout.
            num_worst_tokens: if > 0, size the output for this many rows and
                never wait on the host for counts (CUDA-graph capturable);
                more received rows raise an error, never a silent drop. Rows past
                the received count are padding: recv_topk_idx and recv_src_idx -1,
                recv_topk_weights 0, recv_x and recv_x_scales not written (see
                DispatchResult). With a handle, the handle's mode decides and this
                argument is ignored.
            expert_alignment: round num_recv_tokens_per_expert up to a multiple.
            config: dispatch Config of the queue transport (default: tuned for this
                rank count), or a cupyep.intranode.direct.DirectConfig for the direct one.
            previous_event: EventHandle/cupy Event the communication stream waits for
                (default: the current stream's work so far).
            async_finish: do not make the current stream wait for the result;
                wait on ``result.event`` instead.
            validate: check expert ids on the host (see get_dispatch_layout), and
                that every rank passes the same hidden size, row dtype, top-k,
                weights or none, num_experts, expert-major options, transport,
                cached or not and queue config (a bounded host exchange; a
                difference is a ValueError on every rank naming it).
            expert_major: also lay the received (row, local expert) pairs out in
                per-expert blocks of expert_alignment-aligned size (needs topk_idx):
                fills the result's expert_x, expert_x_scales, expert_offsets and
                expert_src_row and the handle's recv_expert_row, for a grouped GEMM
                and for combine of expert-major outputs. M_cap rows: the exact
                sum(num_recv_tokens_per_expert) after a notify pass that brings the
                counts to the host (on the direct transport also in a cached dispatch
                of such a handle); in worst-token mode and in the queue transport's
                cached dispatch (which does not count this call's topk_idx) the bound
                N * min(k, E_local) + E_local * (expert_alignment - 1), N =
                num_worst_tokens (or the handle's rows), with no host wait (CUDA-graph
                capturable). See cupyep.expert_major.
            transport: "queue" (default) or "direct"; with a handle, the handle's
                (None: that one). Direct: the receive arrays (recv_x, recv_x_scales,
                recv_topk_idx, recv_topk_weights) are views of the next of this
                rank's num_in_flight dispatch slots (DispatchResult's lease says
                which; read after the slot goes to a later dispatch they raise
                StaleResultError); the handle owns its routing and stays valid.
                Direct with expert_major: the senders write the rows straight into
                the expert blocks (views of the slot too) and no rank-major payload
                exists, so recv_x and recv_x_scales are None; a cached call keeps the
                handle's expert_alignment. When some receiver's expert-major rows
                (padding included) do not fit the slot, the rows go rank-major into
                the slot and the expert-major arrays are the result's own
                (result.pooled == cupyep.results.RECEIVE_FIELDS; recv_x is set).
            fresh: the direct transport's receive arrays copied into arrays of
                the caller's own (one more pass over the rows; lease None). The
                rows still land in the next slot first, which the call takes, so
                the result num_in_flight dispatches back goes stale all the
                same. The queue transport's are the caller's own always.
            notify_time_ns: cupy int64 [2] or None (a metric, off by default): a
                call that runs the notify pass adds the pass's device time in
                nanoseconds (%globaltimer in the block that runs it) to [0] and
                1 to [1]; a cached call leaves it alone.
            queue_occupancy: cupy uint64 [3] or None (a metric of the queue
                transport, off by default): every time a receiver polls one of
                its rings it adds the rows it finds waiting there (filled, not yet
                consumed; at most the config's queue_depth) to [0], 1 to [1],
                and raises [2] to that count if larger. [0] / [1] / queue_depth
                is the mean occupancy of the rings as their receivers see them.

        Returns:
            DispatchResult. num_recv_tokens_per_expert is a list of E_local ints
            whenever the counts reach the host: after a notify pass without
            worst-token mode, and in a cached dispatch whose handle came from
            one (the counts of that routing, aligned to this call's
            expert_alignment); None in worst-token mode and for a cached
            dispatch with a worst-token handle.
        """
        import cupy
        x, x_scales = dispatch_rows(x, x_scales)
        T, H = x.shape
        check_hidden(H)
        fp8 = x.dtype == FP8
        R = self.num_ranks
        transport = self._transport(transport, handle)
        if transport == "direct":
            if config is not None and not isinstance(config, D.DirectConfig):
                raise ValueError(f"the direct transport takes a DirectConfig, got {type(config).__name__}")
            cfg = (config or D.DirectConfig()).validate()
        else:
            if isinstance(config, D.DirectConfig):
                raise ValueError("a DirectConfig needs transport='direct'")
            cfg = (config or self.default_dispatch_config(fp8, handle)).validate(R)
        if int(expert_alignment) != expert_alignment or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be an integer >= 1, got {expert_alignment!r}")
        if num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens must be >= 0, got {num_worst_tokens}")

        if handle is not None:
            self._check_handle(handle, T)
            if transport == "queue" and cfg.num_channels != handle.num_channels:
                raise ValueError(f"config has {cfg.num_channels} channels, the handle was made with {handle.num_channels}")
            num_experts = handle.num_experts
            if topk_idx is not None:
                topk_idx = self._check_topk_idx(topk_idx, num_experts, validate=False)
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError("dispatch needs topk_idx and num_experts (or a handle)")
            topk_idx = self._check_topk_idx(topk_idx, num_experts, validate)
        k = topk_idx.shape[1] if topk_idx is not None else 0
        self.sizes.check("Buffer.dispatch", T, H, k if topk_idx is not None else None)
        if num_worst_tokens > R * self.sizes.max_tokens:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} exceeds the {R} x max_tokens="
                             f"{self.sizes.max_tokens} rows a rank can receive")
        if topk_idx is not None and topk_idx.shape[0] != T:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T}")
        topk_weights = as_cupy(topk_weights, "topk_weights")
        if topk_weights is not None:
            if topk_idx is None:
                raise ValueError("topk_weights needs topk_idx")
            check(topk_weights, "topk_weights", np.float32, shape=(T, k))
        if expert_major:
            EM.check_expert_major_request(topk_idx, expert_alignment)
        if notify_time_ns is not None:
            notify_time_ns = check(as_cupy(notify_time_ns, "notify_time_ns"), "notify_time_ns", np.int64, shape=(2,))
        if queue_occupancy is not None:
            if transport == "direct":
                raise ValueError("queue_occupancy is a metric of the queue transport; the direct one has no rings")
            queue_occupancy = check(as_cupy(queue_occupancy, "queue_occupancy"), "queue_occupancy", np.uint64,
                                    shape=(3,))
        if validate:  # what every rank's kernels assume of the others' calls
            queue = cfg if transport == "queue" else None
            self.group.agree("Buffer.dispatch", hidden=H, fp8=fp8, num_topk=k, topk_weights=topk_weights is not None,
                             num_experts=num_experts, expert_major=expert_major, expert_alignment=expert_alignment,
                             direct=transport == "direct", cached=handle is not None,
                             num_channels=queue.num_channels if queue else 0,
                             queue_depth=queue.queue_depth if queue else 0, chunk_size=queue.chunk_size if queue else 0)
        if transport == "direct":
            return self._dispatch_direct(x, x_scales, topk_idx, topk_weights, num_experts, handle,
                                         (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank),
                                         num_worst_tokens, expert_alignment, cfg, previous_event, async_finish,
                                         expert_major, notify_time_ns, fresh)
        rs = ring_set(self.layout, "dispatch", H, k, fp8, cfg)
        dispatch_fn = jit.kernel(K.dispatch_spec_for(R, cfg))
        self._check_resident(dispatch_fn, cfg, "dispatch")
        C = cfg.num_channels

        self._begin(previous_event)
        with self.comm_stream:
            if handle is None:
                routing = self._routing(topk_idx, num_experts, T,
                                        (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank))
                handle = self._notify(T, H, num_experts, *routing, C, expert_alignment, num_worst_tokens,
                                      notify_time_ns=notify_time_ns)
                notified = True
            else:
                notified = False  # cached: expert-major sizes for the bound (this topk_idx is not counted)
            per_expert = aligned_expert_counts(handle.recv_expert_counts, expert_alignment)
            N = handle.num_worst_tokens or handle.num_recv_tokens
            recv_x = cupy.empty((N, H), dtype=x.dtype)
            recv_scales = cupy.empty((N, H // 128), dtype=np.float32) if fp8 else None
            recv_topk_idx = cupy.empty((N, k), dtype=np.int64) if topk_idx is not None else None
            recv_topk_weights = cupy.empty((N, k), dtype=np.float32) if topk_weights is not None else None
            recv_src_idx = handle.recv_src_idx if handle.recv_src_idx is not None else cupy.empty(N, dtype=np.int32)
            if handle.recv_src_idx is None:
                handle = _replace(handle, recv_src_idx=recv_src_idx)
            args = jit.pack(
                K.DISPATCH_ARGS_DTYPE, peers=jit.ptr(self.buffer.peer_ptrs), rs=K.ring_struct(rs), x=jit.ptr(x),
                x_scales=jit.ptr(x_scales), topk_idx=jit.ptr(topk_idx), topk_weights=jit.ptr(topk_weights),
                send_list=jit.ptr(handle.send_list), send_channel_prefix=jit.ptr(handle.send_channel_prefix),
                recv_channel_prefix=jit.ptr(handle.recv_channel_prefix), recv_rank_offset=jit.ptr(handle.recv_rank_offset),
                recv_x=jit.ptr(recv_x), recv_x_scales=jit.ptr(recv_scales), recv_topk_idx=jit.ptr(recv_topk_idx),
                recv_topk_weights=jit.ptr(recv_topk_weights), recv_src_idx=jit.ptr(recv_src_idx),
                queue_occupancy=jit.ptr(queue_occupancy), num_tokens=T,
                num_scales=H // 128 if fp8 else 0, num_topk=k, num_local_experts=num_experts // R, num_channels=C,
                capacity=N, rank=self.rank, guard=self.group.guard("intranode_dispatch"))
            dispatch_fn((2 * C,), (cfg.num_threads,), (args,))
            handle, em = self._with_expert_major(handle, expert_major, per_expert if notified else None, recv_x,
                                                 recv_scales, recv_topk_idx, num_experts, expert_alignment)
        return dispatch_result(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle,
                                self._end(async_finish, (x, x_scales, topk_idx, topk_weights)), em)

    def _transport(self, transport: str | None, handle: DispatchHandle | None) -> str:
        """The transport of a call: the handle's, else ``transport`` (default "queue")."""
        if transport is not None and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if handle is None:
            return transport or "queue"
        if transport is not None and transport != handle.transport:
            raise ValueError(f"the handle was made by the {handle.transport} transport, not {transport!r}")
        return handle.transport

    def _routing(self, topk_idx, num_experts: int, T: int, arrays):
        """(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank) of a
        notified dispatch: the layout kernel's, or the caller's (checked) when
        ``arrays`` holds all three. Runs on the communication stream."""
        per_rank, per_expert, in_rank = arrays
        if per_rank is None or per_expert is None or in_rank is None:
            lay = self._layout(topk_idx, num_experts)
            return lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank
        R = self.num_ranks
        return (check(as_cupy(per_rank, "num_tokens_per_rank"), "num_tokens_per_rank", np.int32, shape=(R,)),
                check(as_cupy(per_expert, "num_tokens_per_expert"), "num_tokens_per_expert", np.int32,
                      shape=(num_experts,)),
                check(as_cupy(in_rank, "is_token_in_rank"), "is_token_in_rank", np.bool_, shape=(T, R)))

    def _with_expert_major(self, handle, expert_major: bool, per_expert, recv_x, recv_scales, recv_topk_idx,
                           num_experts, alignment):
        """(handle, expert-major layout or None) after a dispatch's send, on the
        communication stream: the layout when asked for, and the handle's
        expert-major map set, or cleared (a cached handle's map may not fit
        this routing)."""
        em = self._expert_major(handle, per_expert, recv_x, recv_scales, recv_topk_idx, num_experts,
                                alignment) if expert_major else None
        if em is not None:
            handle = _replace(handle, recv_expert_row=em.recv_expert_row, num_expert_rows=em.num_expert_rows)
        elif handle.recv_expert_row is not None:
            handle = _replace(handle, recv_expert_row=None, num_expert_rows=0)
        return handle, em

    def _expert_major(self, handle, per_expert, recv_x, recv_scales, recv_topk_idx, num_experts, alignment):
        """Expert-major layout of this dispatch's output (on the communication stream).

        per_expert: this call's aligned host counts (exact M_cap), or None (the bound)."""
        R = self.num_ranks
        E_local = num_experts // R
        worst = handle.num_worst_tokens > 0
        m_cap = EM.expert_rows_capacity(per_expert, recv_x.shape[0], recv_topk_idx.shape[1], E_local, alignment)
        num_recv_ptr = handle.recv_rank_offset.data.ptr + 4 * R if worst else 0  # device count: recv_rank_offset[R]
        return EM.build(recv_x, recv_scales, recv_topk_idx, num_recv_ptr, E_local, alignment, m_cap,
                        self.group.guard("intranode_expert_major"), self.num_device_sms)

    def _notify(self, T, H, num_experts, per_rank, per_expert, in_rank, C, alignment, num_worst_tokens,
                transport: str = "queue", notify_time_ns=None):
        """Run the notify kernel on the communication stream and return the
        handle (after a bounded host wait for the counts, unless worst-token mode)."""
        R = self.num_ranks
        args, arrays = self._notify_struct(T, num_experts, per_rank, per_expert, in_rank, C, alignment,
                                           num_worst_tokens, transport, notify_time_ns)
        jit.kernel(K.notify_spec(R))((1,), (K.NOTIFY_THREADS,), (args,), shared_mem=4 * R * (C + 1))
        if num_worst_tokens <= 0:
            import cupy
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(self.comm_stream)
            self.group.wait(ev, "intranode_notify", "host wait for receive counts")
        return self._notify_handle(arrays, T, H, num_experts, C, num_worst_tokens, transport)

    def _notify_struct(self, T, num_experts, per_rank, per_expert, in_rank, C, alignment, num_worst_tokens,
                       transport: str = "queue", notify_time_ns=None):
        """(NotifyArgs, the handle's arrays) of a notify pass; resets the host
        counts' first words (not in worst-token mode, where they never reach
        the host). The direct transport's pass also fills its expert-major
        tables (expand_base [R, E_local + 1], expert_meta [2 E_local + 1])."""
        R = self.num_ranks
        E_local = num_experts // R
        shapes = {"send_head": (T, R), "send_list": (R, max(T, 1)), "send_cp": (R, C + 1), "recv_cp": (R, C + 1),
                  "recv_off": (R + 1,), "rpm": (R, R), "recv_per_expert": (E_local,)}
        if transport == "direct":
            shapes.update(expand_base=(R, E_local + 1), expert_meta=(2 * E_local + 1,))
        arrays = carve(shapes)  # one allocation
        arrays["in_rank"] = in_rank
        if transport == "direct":
            arrays["alignment"] = int(alignment)
        worst = num_worst_tokens > 0
        if not worst:  # the words the host reads first (the kernel writes the counts before them)
            self._host_counts[0] = self._host_counts[self._host_status_index] = -1
        args = jit.pack(
            K.NOTIFY_ARGS_DTYPE, peers=jit.ptr(self.buffer.peer_ptrs), off=K.offsets_struct(self.layout),
            is_token_in_rank=jit.ptr(in_rank), num_tokens_per_rank=jit.ptr(per_rank),
            num_tokens_per_expert=jit.ptr(per_expert), send_head=jit.ptr(arrays["send_head"]),
            send_list=jit.ptr(arrays["send_list"]), send_channel_prefix=jit.ptr(arrays["send_cp"]),
            recv_channel_prefix=jit.ptr(arrays["recv_cp"]), recv_rank_offset=jit.ptr(arrays["recv_off"]),
            rank_prefix_matrix=jit.ptr(arrays["rpm"]), num_recv_tokens_per_expert=jit.ptr(arrays["recv_per_expert"]),
            host_counts=0 if worst else self._host_counts_ptr, expand_base=jit.ptr(arrays.get("expand_base")),
            expert_meta=jit.ptr(arrays.get("expert_meta")), notify_time_ns=jit.ptr(notify_time_ns), num_tokens=T, num_experts=num_experts,
            num_channels=C, expert_alignment=alignment, capacity=num_worst_tokens if worst else INT_MAX,
            rank=self.rank, guard=self.group.guard("intranode_notify"))
        return args, arrays

    def _notify_handle(self, arrays, T, H, num_experts, C, num_worst_tokens, transport) -> DispatchHandle:
        """The handle of a notify pass whose host counts (if any) have arrived."""
        R = self.num_ranks
        E_local = num_experts // R
        if num_worst_tokens > 0:
            n_recv, counts, matrix = -1, None, None
        else:
            n_recv = int(self._host_counts[0])
            counts = tuple(self._host_counts[1:1 + E_local].tolist())  # unaligned
            matrix = self._host_counts[1 + E_local:1 + E_local + R * R].astype(np.int64).reshape(R, R)
        expand = None
        if "expand_base" in arrays:
            most = int(self._host_counts[1 + E_local + R * R]) if num_worst_tokens <= 0 else -1
            expand = ExpandTables(arrays["expand_base"], arrays["expert_meta"], arrays["alignment"], most)
        return DispatchHandle(rank_prefix_matrix=arrays["rpm"], recv_channel_prefix=arrays["recv_cp"],
                              recv_rank_offset=arrays["recv_off"], recv_src_idx=None,
                              is_token_in_rank=arrays["in_rank"], send_head=arrays["send_head"],
                              send_list=arrays["send_list"], send_channel_prefix=arrays["send_cp"],
                              num_recv_tokens=n_recv, num_worst_tokens=num_worst_tokens, num_tokens=T, hidden=H,
                              num_experts=num_experts, num_channels=C, buffer_id=id(self), recv_expert_counts=counts,
                              transport=transport, counts=matrix, expand=expand)

    def _check_handle(self, handle: DispatchHandle, num_tokens: int) -> None:
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        if handle.buffer_id != id(self):
            raise ValueError("handle was made by another Buffer")
        if handle.num_tokens != num_tokens:
            raise ValueError(f"handle was made for {handle.num_tokens} tokens, got {num_tokens}")

    # ----------------------------------------------------------------- combine
    @traced_call("Buffer.combine")
    def combine(self, x, handle: DispatchHandle, topk_weights=None, *, row_weights=None, config: Config | None = None,
                previous_event=None, async_finish: bool = False, pair_weights=None,
                expert_major: bool | None = None, zero_copy: bool = False) -> CombineResult:
        """Send expert outputs back along the dispatch route and reduce them.

        Arguments:
            x: [N, H] uint16 (BF16 bits): one row per received row of the dispatch.
            handle: that dispatch's DispatchHandle.
            topk_weights: [N, k] float32 (e.g. recv_topk_weights) to combine too, or None.
            row_weights: [N] float32: each row is multiplied by its weight in the
                FP32 reduction (None: unweighted sum).
            config: combine Config.
            pair_weights: [N, k] float32 (e.g. recv_topk_weights), only with
                expert-major x: weight of each (row, slot) pair in the reduction.
            expert_major: x holds expert-major rows ([M_cap, H], the layout of
                dispatch(..., expert_major=True)): they are first reduced to one
                BF16 row per received row, row r = BF16(FP32 sum over its local
                slots j, in slot order, of pair_weights[r, j] * x[recv_expert_row[r, j]]),
                then combined as usual. None (default): expert-major exactly when the
                handle has an expert-major map and x has M_cap rows.
            zero_copy: direct transport only: x is this handle's
                :meth:`get_combine_buffer`, where the caller wrote its outputs; each
                token's owner reads the rows there (one pass over the rows instead of
                a push and a read back). Same result, bitwise.

        Returns:
            CombineResult with combined_x [T, H] uint16 (BF16): for every token,
            the FP32 sum over the ranks it visited of weight * row, in rank order.
        """
        import cupy
        if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
            raise ValueError("combine needs a DispatchHandle made by this Buffer")
        x = x_in = check(as_cupy(x, "x"), "x", BF16, ndim=2)
        N = handle.num_worst_tokens or handle.num_recv_tokens
        pair_weights = as_cupy(pair_weights, "pair_weights")
        em = EM.combine_is_expert_major(x.shape[0], N, handle.num_expert_rows, handle.recv_expert_row is not None,
                                        expert_major, pair_weights is not None)
        if em:
            EM.check_pair_weights(pair_weights, N, handle.recv_expert_row.shape[1])
        H = x.shape[1]
        check_hidden(H)
        R, T = self.num_ranks, handle.num_tokens
        topk_weights = as_cupy(topk_weights, "topk_weights")
        k = 0
        if topk_weights is not None:
            check(topk_weights, "topk_weights", np.float32, ndim=2)
            if topk_weights.shape[0] != N:
                raise ValueError(f"topk_weights has {topk_weights.shape[0]} rows, the dispatch received {N}")
            k = topk_weights.shape[1]
        row_weights = as_cupy(row_weights, "row_weights")
        if row_weights is not None:
            check(row_weights, "row_weights", np.float32, shape=(N,))
        self.sizes.check("Buffer.combine", T, H, k or None)
        if zero_copy:
            self._check_zero_copy(x, handle, em, k)
        if handle.transport == "direct":
            if config is not None and not isinstance(config, D.DirectConfig):
                raise ValueError(f"the direct transport takes a DirectConfig, got {type(config).__name__}")
            cfg = (config or D.DirectConfig()).validate()
            fn = jit.kernel(D.combine_spec(R, cfg.num_threads))
            self._check_direct_resident(fn, cfg, "direct combine")
        else:
            if isinstance(config, D.DirectConfig):
                raise ValueError("a DirectConfig needs a handle of the direct transport")
            cfg = (config or self.default_combine_config(handle)).validate(R, combine=True)
            if cfg.num_channels != handle.num_channels:
                raise ValueError(f"combine config has {cfg.num_channels} channels (num_sms={cfg.num_sms}) but the "
                                 f"dispatch used {handle.num_channels}: use num_sms={2 * handle.num_channels}")
            rs = ring_set(self.layout, "combine", H, k, False, cfg)
            fn = jit.kernel(K.combine_spec_for(R, cfg))
            self._check_resident(fn, cfg, "combine")
        self._begin(previous_event)
        with self.comm_stream:
            reduced = None
            if em:  # expert-major outputs -> one row per received row
                num_recv_ptr = handle.recv_rank_offset.data.ptr + 4 * R if handle.num_worst_tokens else 0
                x = reduced = EM.reduce(x, handle.recv_expert_row, pair_weights, num_recv_ptr, self.num_device_sms)
            combined = cupy.empty((T, H), dtype=BF16)
            combined_w = cupy.empty((T, k), dtype=np.float32) if topk_weights is not None else None
            if handle.transport == "direct":
                self._combine_direct(fn, cfg, x, handle, row_weights, topk_weights, combined, combined_w, N,
                                     zero_copy)
        if handle.transport == "direct":  # the caller's stream waits (or not) outside the communication stream
            return CombineResult(combined, combined_w, self._end(async_finish, (x_in, topk_weights, row_weights,
                                                                                 pair_weights)), reduced)
        with self.comm_stream:
            args = jit.pack(
                K.COMBINE_ARGS_DTYPE, peers=jit.ptr(self.buffer.peer_ptrs), rs=K.ring_struct(rs), x=jit.ptr(x),
                row_weights=jit.ptr(row_weights), recv_topk_weights=jit.ptr(topk_weights),
                send_head=jit.ptr(handle.send_head), recv_channel_prefix=jit.ptr(handle.recv_channel_prefix),
                recv_rank_offset=jit.ptr(handle.recv_rank_offset), combined_x=jit.ptr(combined),
                combined_topk_weights=jit.ptr(combined_w), num_tokens=T, num_topk=k, num_channels=cfg.num_channels,
                rank=self.rank, guard=self.group.guard("intranode_combine"))
            fn((2 * cfg.num_channels,), (cfg.num_threads,), (args,))
        return CombineResult(combined, combined_w, self._end(async_finish, (x_in, topk_weights, row_weights,
                                                                             pair_weights)), reduced)

    # ---------------------------------------------------------------- lifetime
    def synchronize(self) -> None:
        """Bounded wait for all work on the communication stream."""
        import cupy
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(self.comm_stream)
        self.group.wait(ev, "intranode", "host wait for the communication stream")

    def destroy(self) -> None:
        """Collective: free the IPC buffer (after all ranks are done with it)."""
        import cupy
        self._calls.release()  # destroy frees the buffers after every rank is done with them (SymmetricBuffer)
        if self._direct is not None:
            self._direct.destroy()
            self._direct = None
        if self.buffer.alive:
            self.buffer.destroy()
        if self._host_counts_ptr:
            self._host_counts = None
            cupy.cuda.runtime.freeHost(self._host_counts_ptr)
            self._host_counts_ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def _on_channels(cfg: Config, handle: DispatchHandle | None) -> Config:
    """``cfg`` with the handle's channels (num_sms = 2 * handle.num_channels), if any."""
    return cfg if handle is None else replace(cfg, num_sms=2 * handle.num_channels)


def _replace(handle: DispatchHandle, **kw) -> DispatchHandle:
    from dataclasses import replace
    return replace(handle, **kw)
