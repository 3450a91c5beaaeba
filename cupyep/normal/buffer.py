"""The normal-mode (high-throughput) :class:`Buffer`: one front over every
route, within a node and across nodes.

The front checks each call once, before anything is launched (a
``ValueError`` naming the argument), begins it on the buffer's
communication stream, hands it to the route its ``transport`` (or its
handle) names, and ends it with the call's event (cupyep.streams). The
routes (cupyep.normal.route) keep DeepEP's contract: every dispatch returns
results and a handle that stay valid until the caller drops them; combine
and cached dispatch take any live handle, any number of times, in any
order; where results live in pool memory (the direct routes, across nodes),
a result whose slot a later dispatch took raises StaleResultError when read.
Every wait is bounded by ``group.timeout_s`` (CommTimeoutError).
"""
from __future__ import annotations

import numpy as np

from .. import sm_partition
from ..arrays import BF16, as_cupy, check, check_expert_ids, dispatch_rows
from ..launcher.calls import traced_call
from ..results import CombineResult, DispatchHandle, DispatchResult, LayoutResult, check_hidden
from ..sizes import DEFAULT_HIDDEN, DEFAULT_MAX_TOKENS, DEFAULT_NUM_TOPK, MAX_EXPERTS, DeclaredSizes
from ..slots import DEFAULT_IN_FLIGHT, check_num_in_flight
from ..streams import CommStream
from . import expert_major as EM
from .config import Config
from .queue_layout import MAX_LOCAL_EXPERTS, size_hint
from .route import TRANSPORTS, CombineCall, DispatchCall, Route


class Buffer:
    """Normal-mode dispatch and combine over the ranks of a group: one node
    (the queue and direct routes over IPC) or several (the two-hop and
    direct routes over NVSHMEM; cupyep.normal.internode).

    Arguments:
        group: from :func:`cupyep.init`; every rank takes part.
        num_bytes: within a node, bytes of each rank's IPC buffer (its notify
            region and the queue route's rings; default: enough for
            ``hidden``, ``num_topk`` and the default configs, see
            :meth:`size_hint`). Not used across nodes.
        max_tokens, hidden, num_topk: the most tokens per rank, channels per
            row and experts per token of any call (cupyep.sizes); a call past
            them raises ValueError naming the argument. The pools of the
            direct routes and of the routes across nodes are sized from them.
        num_in_flight: dispatch slots of every pooled route (>= 1): the
            results of its last ``num_in_flight`` dispatches are valid at once
            (two micro-batches need 2); an older one raises StaleResultError
            when read.
        num_direct_bytes: within a node, bytes of one direct dispatch slot
            (default: cupyep.normal.direct_kernels.default_slot_bytes of the
            declared sizes: R * max_tokens rows, or an expert-major layout of
            twice the mean pairs). Each rank's direct memory, allocated by the
            first call that uses it: num_in_flight slots of this, a combine
            pool of R * max_tokens partial rows, and, for zero-copy combines,
            num_in_flight slots of R * max_tokens rows of ``hidden``. Each
            direct handle owns its routing, a slot's rows of source indices
            among it (4 bytes a row: 128 KiB at 8 ranks x 4096 tokens).
        num_sms: the SMs (blocks) this rank's communication kernels use by
            default: 0 is its share of the GPU (``Group.sm_share``), and on
            the direct route within a node the measured default of each kind
            of call where one exists for this GPU and rank layout and is
            smaller (the fewest blocks within 5 % of the best time,
            cupyep.sm_defaults); fewer leave the rest to compute beside them. Within a node a config's
            own num_sms still wins for its call; across nodes every rank must
            give the same value (the routes' blocks pair up across ranks).
        on_partition: run this rank's communication kernels on its SM
            partition (cupyep.sm_partition, a stream of their own there),
            within a node: needed where ranks sharing a GPU compute on their
            partitions beside the communication (MoELayer's
            ``compute_stream``), since kernels of other ranks on the full GPU
            can hold every SM of a partition while they wait for its rank.
            The SM budget is then at most the partition's SMs, and a
            residency check counts this rank's blocks alone. None (default):
            when the launcher asked for partitions (``--sm-share``) and ranks
            share the GPU, within a node. Across nodes the NVSHMEM routes run
            on the full GPU (True is a ValueError there): a partitioned
            compute beside them keeps the hazard, which the kernels'
            timeouts bound (CommTimeoutError).

    Attributes:
        routes: {transport: Route}: the route that carries each transport here.
        num_device_sms: the SMs this rank's communication kernels can run on
            (the GPU's, or its partition's); sm_budget: the SMs they use by
            default (``num_sms``, else its share of them).
        on_partition: whether they run on this rank's SM partition.

    The buffer is collective: create, call and destroy it on every rank in
    the same order. Use it as a context manager or call :meth:`destroy`.
    """

    def __init__(self, group, num_bytes: int | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 hidden: int = DEFAULT_HIDDEN, num_topk: int = DEFAULT_NUM_TOPK, num_in_flight: int = DEFAULT_IN_FLIGHT,
                 num_direct_bytes: int | None = None, num_sms: int = 0, on_partition: bool | None = None):
        self.sizes = DeclaredSizes(max_tokens, hidden, num_topk)
        self.num_in_flight = check_num_in_flight(num_in_flight)
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 0:
            raise ValueError(f"num_sms must be an int >= 0 (0: the rank's share of the SMs), got {num_sms!r}")
        if num_direct_bytes is not None and (not isinstance(num_direct_bytes, int) or num_direct_bytes < 1):
            raise ValueError(f"num_direct_bytes must be an int >= 1 (or None: from the sizes), got {num_direct_bytes!r}")
        group.require_gpu("cupyep.Buffer")
        self.group = group
        self.internode = group.num_nodes > 1
        self.on_partition = not self.internode and sm_partition.in_use(group) if on_partition is None \
            else bool(on_partition)
        part_stream = None
        if self.on_partition:
            if self.internode:
                raise ValueError("on_partition runs the routes within a node on an SM partition; across nodes the "
                                 "NVSHMEM routes run on the full GPU")
            part_stream, part_sms = sm_partition.partition_stream(group, "communication")
        self._calls = CommStream(group, part_stream)
        self.comm_stream = self._calls.stream
        if self.internode:
            if num_direct_bytes is not None:
                raise ValueError("num_direct_bytes sizes the direct route within a node; across nodes the pools "
                                 "are sized from the declared sizes")
            from .internode import Internode, InternodeRoute
            self.num_ranks, self.rank = group.world_size, group.rank
            self._shared = Internode(group, self.sizes, self.num_in_flight, self.comm_stream, num_sms)
            self.num_device_sms, self.sm_budget = group.num_sms, num_sms or group.sm_share
            self.routes: dict[str, Route] = {t: InternodeRoute(self._shared, t) for t in TRANSPORTS}
        else:
            from .direct import DirectRoute
            from .node import Node
            from .queue import QueueRoute
            from .queue_layout import default_num_bytes
            import cupy
            self.num_ranks, self.rank = group.local_size, group.local_rank
            if self.on_partition:  # the partition's SMs, this rank's alone
                self.num_device_sms, resident_ranks = part_sms, 1
                self.sm_budget = num_sms or min(group.sm_share, part_sms)
            else:  # seen by this rank; its use
                self.num_device_sms, resident_ranks = group.num_sms, group.co_resident_ranks
                self.sm_budget = num_sms or group.sm_share
            num_bytes = int(num_bytes or default_num_bytes(self.num_ranks, self.sizes, self.sm_budget))
            self._shared = Node(group, num_bytes, self.comm_stream, id(self), self.num_device_sms, self.sm_budget,
                                resident_ranks)
            self.routes = {"queue": QueueRoute(self._shared),
                           "direct": DirectRoute(self._shared, self.sizes, self.num_in_flight, num_direct_bytes,
                                                 measured=not num_sms)}

    # ------------------------------------------------------------ config
    def default_dispatch_config(self, fp8: bool = False, handle: DispatchHandle | None = None) -> Config:
        """The queue route's tuned dispatch config for this node's ranks and SM
        budget, for BF16 or (``fp8``) FP8 rows; with a handle, on its channels."""
        return self._queue_route("default_dispatch_config").default_dispatch_config(fp8, handle)

    def default_combine_config(self, handle: DispatchHandle | None = None) -> Config:
        """The queue route's tuned combine config; with a handle, on its channels."""
        return self._queue_route("default_combine_config").default_combine_config(handle)

    def _queue_route(self, what: str):
        if self.internode:
            raise ValueError(f"{what}: the queue configs are of the queue route within a node; across nodes the "
                             f"routes take no config")
        return self.routes["queue"]

    @staticmethod
    def size_hint(num_ranks: int, hidden: int = 7168, num_topk: int = 16, dispatch_config: Config | None = None,
                  combine_config: Config | None = None) -> int:
        """Bytes per rank of the IPC buffer within a node for these sizes and configs."""
        return size_hint(num_ranks, hidden, num_topk, dispatch_config, combine_config)

    # ------------------------------------------------------------ checks
    def _route(self, transport: str | None, handle) -> Route:
        """The route of a call: the handle's (``transport`` must agree), else
        ``transport``'s (default "queue")."""
        if transport is not None and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if handle is None:
            return self.routes[transport or "queue"]
        for route in self.routes.values():
            if route.owns(handle):
                if transport is not None and transport != route.transport:
                    raise ValueError(f"the handle was made by the {route.transport} transport, not {transport!r}")
                return route
        raise ValueError(f"handle must be a live handle of this Buffer, got {type(handle).__name__}"
                         + (" of another Buffer" if hasattr(handle, "num_tokens") else ""))

    def _check_topk_idx(self, topk_idx, num_experts, validate: bool):
        topk_idx = check(as_cupy(topk_idx, "topk_idx"), "topk_idx", np.int64, ndim=2)
        if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or \
                not 0 < num_experts <= MAX_EXPERTS:
            raise ValueError(f"num_experts must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the {self.num_ranks} ranks")
        if num_experts // self.num_ranks > MAX_LOCAL_EXPERTS:
            raise ValueError(f"{num_experts // self.num_ranks} experts per rank exceed {MAX_LOCAL_EXPERTS}")
        if validate and not _capturing():
            check_expert_ids(topk_idx, num_experts)
        return topk_idx

    # ------------------------------------------------------------ layout
    @traced_call("Buffer.get_dispatch_layout")
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            validate: bool = True) -> LayoutResult:
        """Token counts of this rank's routing (no communication).

        Arguments:
            topk_idx: [T, k] int64 expert ids, -1 for none; T <= max_tokens, k <= num_topk.
            num_experts: E, divisible by the number of ranks.
            validate: check expert ids on the host first (one small sync;
                skipped during graph capture, where the device check reports).

        Returns:
            LayoutResult: num_tokens_per_rank [R] int32, num_tokens_per_expert
            [E] int32, is_token_in_rank [T, R] bool, and across nodes
            num_tokens_per_rdma_rank [num_nodes] int32 (the tokens with an
            expert on each node; None within a node); its event.
        """
        topk_idx = self._check_topk_idx(topk_idx, num_experts, validate)
        self.sizes.check("Buffer.get_dispatch_layout", topk_idx.shape[0], None, topk_idx.shape[1])
        self._calls.begin(previous_event)
        with self.comm_stream:
            res = self.routes["queue"].layout(topk_idx, int(num_experts))
        res.event = self._calls.end(async_finish, (topk_idx,))
        return res

    # ---------------------------------------------------------- dispatch
    @traced_call("Buffer.dispatch")
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, x_scales=None, num_experts: int | None = None,
                 handle=None, num_tokens_per_rank=None, num_tokens_per_expert=None, is_token_in_rank=None,
                 num_worst_tokens: int = 0, expert_alignment: int = 1, config=None, previous_event=None,
                 async_finish: bool = False, validate: bool = True, expert_major: bool = False,
                 transport: str | None = None, notify_time_ns=None, queue_occupancy=None, kernel_time_ns=None,
                 fresh: bool = False) -> DispatchResult:
        """Send each token to every rank owning one of its experts.

        Arguments:
            x: [T, H] uint16 (BF16 bits) or uint8 (FP8 e4m3 bits); H a multiple of 128.
                A tuple (x_fp8, x_scales) is accepted too.
            topk_idx: [T, k] int64 expert ids, -1 for none (required unless ``handle``).
            topk_weights: [T, k] float32 or None.
            x_scales: [T, H / 128] float32, required with FP8 x.
            num_experts: E (required unless ``handle``).
            handle: a live handle of this buffer: skip the notify pass and
                reuse its routing ("cached dispatch"; it needs only x and its
                scales). It runs on the handle's route.
            num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank: a
                LayoutResult's arrays, to skip recomputing the layout (within
                a node; across nodes the notify pass lays the tokens out).
            num_worst_tokens: if > 0, size the output for this many rows and
                never wait on the host for counts (CUDA-graph capturable);
                more received rows raise an error, never a silent drop. Rows past
                the received count are padding: recv_topk_idx and recv_src_idx -1,
                recv_topk_weights 0, recv_x and recv_x_scales not written (see
                DispatchResult). With a handle, the handle's mode decides.
            expert_alignment: round num_recv_tokens_per_expert up to a multiple.
            config: the queue route's Config within a node (default: tuned for
                this rank count), or a cupyep.normal.direct_kernels.DirectConfig
                for the direct one; none across nodes.
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
                per-expert blocks of expert_alignment-aligned size: fills the
                result's expert_x, expert_x_scales, expert_offsets and
                expert_src_row and the handle's expert-major map, for a grouped
                GEMM and for combine of expert-major outputs (cupyep.normal.expert_major).
                Within a node it needs topk_idx, also in a cached call.
            transport: "queue" (default) or "direct" (cupyep.normal.route says
                which route carries each here); with a handle, the handle's.
                The queue route within a node returns arrays of the caller's
                own; the others return views of the next of the route's
                num_in_flight pool slots (the result's lease; read after the
                slot goes to a later dispatch they raise StaleResultError),
                and the handle owns its routing and stays valid.
            fresh: a pooled route's receive arrays copied into arrays of the
                caller's own (one more pass over the rows; lease None).
            notify_time_ns: cupy int64 [2] or None (a metric within a node): a
                call that runs the notify pass adds the pass's device time in
                nanoseconds to [0] and 1 to [1]; a cached call leaves it alone.
            queue_occupancy: cupy uint64 [3] or None (a metric of the queue
                route): every time a receiver polls one of its rings it adds
                the rows it finds waiting there to [0], 1 to [1], and raises
                [2] to that count if larger.
            kernel_time_ns: cupy int64 [2] or None (a metric of the direct
                route): the send kernel (the fused kernel when fused) lowers
                [0] to its first block's start and raises [1] to its last
                block's end, %globaltimer ns (start from
                cupyep.lab.bench.stamps.new_kernel_stamps).

        Returns:
            DispatchResult. num_recv_tokens_per_expert is a list of E_local ints
            whenever the counts reach the host (after a notify pass without
            worst-token mode, and in a cached dispatch whose handle came from
            one, aligned to this call's expert_alignment); None otherwise.
        """
        x, x_scales = dispatch_rows(x, x_scales)
        T, H = x.shape
        check_hidden(H)
        fp8 = x_scales is not None
        route = self._route(transport, handle)
        cfg = route.dispatch_config(config, fp8, handle)
        if isinstance(expert_alignment, bool) or int(expert_alignment) != expert_alignment or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be an integer >= 1, got {expert_alignment!r}")
        expert_alignment = int(expert_alignment)
        if num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens must be >= 0, got {num_worst_tokens}")
        if handle is not None:
            if handle.num_tokens != T:
                raise ValueError(f"handle was made for {handle.num_tokens} tokens, got {T}")
            num_experts = handle.num_experts
            if topk_idx is not None:
                topk_idx = self._check_topk_idx(topk_idx, num_experts, validate=False)
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError("dispatch needs topk_idx and num_experts (or a handle)")
            topk_idx = self._check_topk_idx(topk_idx, num_experts, validate)
            num_experts = int(num_experts)
        k = topk_idx.shape[1] if topk_idx is not None else getattr(handle, "num_topk", 0)
        self.sizes.check("Buffer.dispatch", T, H, k or None)
        if num_worst_tokens > self.num_ranks * self.sizes.max_tokens:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} exceeds the {self.num_ranks} x max_tokens="
                             f"{self.sizes.max_tokens} rows a rank can receive")
        if topk_idx is not None and topk_idx.shape[0] != T:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T}")
        topk_weights = as_cupy(topk_weights, "topk_weights")
        if topk_weights is not None:
            if topk_idx is None and (handle is None or not self.internode):
                raise ValueError("topk_weights needs topk_idx")
            check(topk_weights, "topk_weights", np.float32, shape=(T, k))
        if expert_major and not self.internode:  # within a node the layout is built from recv_topk_idx
            EM.check_expert_major_request(topk_idx, expert_alignment)
        for name, value in (("notify_time_ns", notify_time_ns), ("queue_occupancy", queue_occupancy),
                            ("kernel_time_ns", kernel_time_ns)):
            _check_metric(route, name, value)
        if notify_time_ns is not None:
            notify_time_ns = check(as_cupy(notify_time_ns, "notify_time_ns"), "notify_time_ns", np.int64, shape=(2,))
        kernel_time_ns = _kernel_time(kernel_time_ns)
        if queue_occupancy is not None:
            queue_occupancy = check(as_cupy(queue_occupancy, "queue_occupancy"), "queue_occupancy", np.uint64,
                                    shape=(3,))
        if validate:  # what every rank's kernels assume of the others' calls
            queue = cfg if isinstance(cfg, Config) else None
            self.group.agree("Buffer.dispatch", hidden=H, fp8=fp8, num_topk=k, topk_weights=topk_weights is not None,
                             num_experts=num_experts, expert_major=expert_major, expert_alignment=expert_alignment,
                             direct=route.transport == "direct", cached=handle is not None,
                             num_channels=queue.num_channels if queue else 0,
                             queue_depth=queue.queue_depth if queue else 0, chunk_size=queue.chunk_size if queue else 0)
        call = DispatchCall(x, x_scales, topk_idx, topk_weights, num_experts, handle,
                            (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank), int(num_worst_tokens),
                            expert_alignment, cfg, bool(expert_major), fresh, validate, notify_time_ns, queue_occupancy,
                            kernel_time_ns)
        self._calls.begin(previous_event)
        with self.comm_stream:
            result = route.dispatch(call)
        result.event = self._calls.end(async_finish, (x, x_scales, topk_idx, topk_weights, *call.keep))
        return result

    # ----------------------------------------------------------- combine
    @traced_call("Buffer.combine")
    def combine(self, x, handle, topk_weights=None, *, row_weights=None, config=None, previous_event=None,
                async_finish: bool = False, pair_weights=None, expert_major: bool | None = None,
                zero_copy: bool = False, kernel_time_ns=None) -> CombineResult:
        """Send expert outputs back along the dispatch route and reduce them.

        Arguments:
            x: [N, H] uint16 (BF16 bits): one row per received row of the dispatch.
            handle: that dispatch's handle (any live handle of this buffer).
            topk_weights: [N, k] float32 (e.g. recv_topk_weights) to combine too, or None.
            row_weights: [N] float32: each row is multiplied by its weight in the
                FP32 reduction (None: unweighted sum).
            config: the route's config (as dispatch's; within a node the queue
                combine runs on its dispatch's channels).
            pair_weights: [N, k] float32 (e.g. recv_topk_weights), only with
                expert-major x: weight of each (row, slot) pair in the reduction.
            expert_major: x holds expert-major rows ([M_cap, H], the layout of
                dispatch(..., expert_major=True)): they are first reduced to one
                BF16 row per received row, row r = BF16(FP32 sum over its local
                slots j, in slot order, of pair_weights[r, j] * x[recv_expert_row[r, j]]),
                then combined as usual. None (default): expert-major exactly when the
                handle has an expert-major map and x has M_cap rows.
            zero_copy: the direct route within a node only: x is this handle's
                :meth:`get_combine_buffer`, where the caller wrote its outputs;
                each token's owner reads the rows there (one pass over the rows
                instead of a push and a read back). Same result, bitwise. With
                expert-major x, x is the experts' outputs as usual and their
                reduce writes the handle's buffer (which the caller leaves alone).
            kernel_time_ns: cupy int64 [2] or None (a metric of the direct
                route): the combine kernel's first block start and last block
                end, as in :meth:`dispatch`.

        Returns:
            CombineResult with combined_x [T, H] uint16 (BF16): for every token,
            the FP32 sum over the ranks it visited of weight * row, in rank order.
        """
        route = self._route(None, handle)
        x = check(as_cupy(x, "x"), "x", BF16, ndim=2)
        N = route.received_rows(handle)
        H = x.shape[1]
        check_hidden(H)
        self.sizes.check("Buffer.combine", handle.num_tokens, H)
        pair_weights = as_cupy(pair_weights, "pair_weights")
        m_cap, em_slots = route.expert_rows(handle)
        em = EM.combine_is_expert_major(x.shape[0], N, m_cap, em_slots > 0, expert_major, pair_weights is not None)
        if em:
            EM.check_pair_weights(pair_weights, N, em_slots)
        topk_weights = as_cupy(topk_weights, "topk_weights")
        if topk_weights is not None:
            check(topk_weights, "topk_weights", np.float32, ndim=2)
            if topk_weights.shape[0] != N:
                raise ValueError(f"topk_weights has {topk_weights.shape[0]} rows, the dispatch received {N}")
            self.sizes.check("Buffer.combine", handle.num_tokens, H, topk_weights.shape[1])
        row_weights = as_cupy(row_weights, "row_weights")
        if row_weights is not None:
            check(row_weights, "row_weights", np.float32, shape=(N,))
        if zero_copy and not route.zero_copy:
            raise ValueError(f"zero_copy needs a handle of the direct transport within a node, not of the "
                             f"{route.name} route")
        _check_metric(route, "kernel_time_ns", kernel_time_ns)
        kernel_time_ns = _kernel_time(kernel_time_ns)
        cfg = route.combine_config(config, handle)
        call = CombineCall(x, handle, topk_weights, row_weights, pair_weights, em, bool(zero_copy), cfg,
                           kernel_time_ns)
        route.check_combine(call)
        self._calls.begin(previous_event)
        with self.comm_stream:
            result = route.combine(call)
        result.event = self._calls.end(async_finish, (x, topk_weights, row_weights, pair_weights, *call.keep))
        return result

    @traced_call("Buffer.get_combine_buffer")
    def get_combine_buffer(self, handle, hidden: int | None = None):
        """Where to write the expert outputs of a direct dispatch for a
        zero-copy combine (``combine(buf, handle, zero_copy=True)``).

        The buffer is this rank's part of the zero-copy slot of the handle's
        dispatch slot: write it after that dispatch and combine it before the
        slot goes to a later dispatch (num_in_flight dispatches later; then
        this raises StaleResultError). Collective at its first call (the
        zero-copy pool is allocated).

        Returns:
            cupy [N, H] uint16 (BF16 bits), N the handle's received rows (or
            num_worst_tokens), H ``hidden`` (default: the dispatch's).
        """
        route = self._route(None, handle)
        if not route.zero_copy:
            raise ValueError(f"a zero-copy combine needs a handle of the direct transport within a node, not of "
                             f"the {route.name} route")
        H = int(hidden or handle.hidden)
        check_hidden(H)
        self.sizes.check("Buffer.get_combine_buffer", handle.num_tokens, H)
        return route.get_combine_buffer(handle, H)

    # ---------------------------------------------------------- lifetime
    def synchronize(self) -> None:
        """Bounded wait for all work on the communication stream."""
        import cupy
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(self.comm_stream)
        self.group.wait(ev, "buffer", "host wait for the communication stream")

    def destroy(self) -> None:
        """Collective: free the routes' memory (after every rank is done with it)."""
        self._calls.release()
        for route in self.routes.values():
            route.destroy()
        self._shared.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (nothing may wait for the device then)."""
    import cupy
    return cupy.cuda.get_current_stream().is_capturing()


def _check_metric(route, name: str, value) -> None:
    """ValueError when a metric array is given to a route that does not fill it."""
    if value is not None and name not in route.metrics:
        raise ValueError(f"{name} is a metric the {route.name} route does not fill")


def _kernel_time(kernel_time_ns):
    """The kernel_time_ns metric checked: cupy int64 [2], or None."""
    if kernel_time_ns is None:
        return None
    return check(as_cupy(kernel_time_ns, "kernel_time_ns"), "kernel_time_ns", np.int64, shape=(2,))
