"""Low-latency dispatch and combine between the ranks of one node, or across nodes.

:class:`LowLatencyBuffer` owns a symmetric IPC buffer of two sets (see
:mod:`cupyep.low_latency.layout`). Signals alternate between the sets with
every call; data regions follow :class:`~cupyep.low_latency.layout.CallSchedule`,
so results of a dispatch stay valid until the next dispatch. Across nodes
(``group.num_nodes > 1``) the buffer is on the NVSHMEM symmetric heap, every
rank of the world takes part, and ranks of other nodes are reached by
NVSHMEM puts with signals (the CUPYEP_LL_NVSHMEM build of the kernels,
``cuda_src/low_latency/args.cuh``); the calls are the same. Kernels run on the caller's
current stream (or on a communication stream with ``async_finish``), never
wait on the host, and can be captured in CUDA graphs. Every wait on a peer is
bounded by ``group.timeout_s`` and reported as ``CommTimeoutError`` (in shrink
mode the peer is masked instead, ``enable_shrink``).
"""
from __future__ import annotations

import numpy as np

from .. import driver, jit
from ..arrays import BF16, as_cupy, carve, check, expert_counts, routing_range, to_host
from ..launcher.calls import traced_call
from ..ipc import SymmetricBuffer
from ..results import EventHandle
from . import kernels as K
from ..reference.packed_layout import packed_payload
from .layout import CallSchedule, call_offsets, check_capacity, check_sizes, low_latency_layout, message_layout
from .results import LowLatencyCombineResult, LowLatencyDispatchResult, LowLatencyHandle


def ranks_of(group) -> tuple[int, int]:
    """(this rank, number of ranks) of a low-latency buffer on ``group``: the
    node's local rank and size, or with ranks on several nodes the world rank
    and size (every rank of the world takes part)."""
    if group.num_nodes > 1:
        return group.rank, group.world_size
    return group.local_rank, group.local_size


def _time_ptr(kernel_time_ns) -> int:
    t = as_cupy(kernel_time_ns, "kernel_time_ns")
    if t is not None:
        check(t, "kernel_time_ns", np.int64, shape=(2,))
    return jit.ptr(t)


class LowLatencyBuffer:
    """Low-latency mode buffer.

    Arguments:
        group: from :func:`cupyep.init`; every rank of the node takes part, or
            with ranks on several nodes every rank of the world (needs
            nvshmem4py; the same number of ranks on every node).
        num_max_dispatch_tokens_per_rank: most tokens any rank dispatches per call.
        hidden: hidden size (multiple of 128) every call uses.
        num_experts: E, divisible by the number of ranks.
        max_topk: largest top-k any call uses (sizes the combine receive region).
        num_blocks: blocks that send. Default: this rank's share of the GPU's
            SMs, or less where a measured default exists for this GPU, rank
            layout and num_max_dispatch_tokens_per_rank: the most, over the
            dispatch and the combine, of the fewest blocks within 5 % of each
            one's best time (cupyep.sm_defaults).
        num_waiters: how many of them also wait for the peers and receive (default:
            all of them); the rest exit once their rows are out. The waiters of all
            ranks sharing a GPU must be resident together (checked), so with
            num_waiters below num_blocks a call may use more blocks than its share.
        num_threads: threads per block, one of kernels.THREAD_CHOICES.
        programmatic_launch: launch every kernel as a programmatic dependent of
            the work ahead of it in the stream (cupyep.driver): its blocks are
            resident, waiting on the GPU, when that work ends, instead of being
            launched then; most of all when the kernel ahead calls
            ``griddepcontrol.launch_dependents`` early (GpuBarrier does).
            Default (None): wherever the GPU supports it (compute capability
            9.0 on); False launches plainly. Attribute of the same name.
        capacity: rows of each (local expert, source) region (default
            num_max_dispatch_tokens_per_rank, the worst case: every token of a
            source to one expert). Fewer let a buffer fit where the worst case
            does not (``layout.capacity_for(factor, ...)`` sizes it from a
            capacity factor over the mean load); a dispatch whose routing puts
            more rows in one region raises (validate=True: a ValueError on
            every rank before launch; else the kernel's DeviceCapacityError,
            with no row past the region written). cupyep.low_latency.overflow
            splits such a call into micro-batches or falls back to normal mode.
        enable_shrink: keep a mask of ranks ([R] int32 on the device; DeepEP's
            shrink mode). Nothing is sent to a masked rank and nothing is
            waited for from one: the dispatch drops the rows of its experts and
            receives none from it, the combine leaves out the slots of its
            experts. A peer that does not answer within ``group.timeout_s`` is
            masked by the waiting kernel instead of raising CommTimeoutError;
            :meth:`query_mask` tells who. The results over the remaining ranks
            are the reference with the masked ranks' experts (and tokens)
            dropped. Change the mask between a combine and the next dispatch,
            never between a dispatch and the combine of its handle.
        mask: an [R] int32 device array to use as the mask (shrink mode with a
            mask that outlives this buffer, shared with a later one), or None.

    Collective: create, call and destroy it on every rank in the same order.

    Attribute ``ablate`` (default 0), for profiling only: kernels.ablation_bits
    of parts of the work the following calls skip (row payloads, source tags,
    FP8 scales), so that their cost can be timed; the protocol still runs, the
    results are wrong. Set it on every rank alike.
    """

    def __init__(self, group, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, *,
                 max_topk: int = 16, num_blocks: int | None = None, num_waiters: int | None = None,
                 num_threads: int = K.DEFAULT_THREADS, programmatic_launch: bool | None = None,
                 capacity: int | None = None, enable_shrink: bool = False, mask=None):
        import cupy
        group.require_gpu("cupyep.LowLatencyBuffer")
        # Across nodes every rank of the world takes part: ranks of my node by stores, the others by NVSHMEM puts.
        self.across_nodes = group.num_nodes > 1
        me, R = ranks_of(group)
        check_sizes(R, num_max_dispatch_tokens_per_rank, hidden, num_experts, max_topk)
        if num_threads not in K.THREAD_CHOICES:
            raise ValueError(f"num_threads must be one of {K.THREAD_CHOICES}, got {num_threads}")
        if self.across_nodes and len(set(group.comm.allgather(group.local_size))) != 1:
            raise ValueError("low-latency mode across nodes needs the same number of ranks on every node")
        self.group = group
        self.num_ranks, self.rank = R, me
        self.ranks_per_node = group.local_size
        self.max_tokens, self.hidden, self.num_experts = num_max_dispatch_tokens_per_rank, hidden, num_experts
        self.num_local_experts = num_experts // R
        self.num_device_sms = group.num_sms
        self.num_blocks = K.check_blocks(num_blocks, default_blocks(group, num_max_dispatch_tokens_per_rank, hidden)
                                         if num_blocks is None and not self.across_nodes else group.sm_share)
        self.num_waiters = K.check_waiters(num_waiters, self.num_blocks)
        self.num_threads = num_threads
        self.max_topk = max_topk
        self.programmatic_launch = (driver.programmatic_supported() if programmatic_launch is None
                                    else bool(programmatic_launch))
        devices = group.node_comm.allgather(group.device_id)
        K.check_peer_atomics(devices, driver.peer_native_atomics)
        self._one_gpu = len(set(devices)) == 1  # every local rank on this GPU (under MPS)
        self.capacity = check_capacity(capacity, num_max_dispatch_tokens_per_rank)
        self.layout = low_latency_layout(R, num_max_dispatch_tokens_per_rank, hidden, num_experts, max_topk,
                                         staged=self.across_nodes, capacity=self.capacity)
        if self.across_nodes:
            from ..nvshmem import HeapBuffer
            self.buffer = HeapBuffer(group, self.layout.nbytes)  # raises NvshmemUnavailable (how to install)
        else:
            self.buffer = SymmetricBuffer(group, self.layout.nbytes)
        self._structs = {}
        if mask is not None:
            mask = check(as_cupy(mask, "mask"), "mask", np.int32, shape=(R,))
        self.mask = mask if mask is not None else cupy.zeros(R, dtype=np.int32) if enable_shrink else None
        self.comm_stream = cupy.cuda.Stream(non_blocking=True)
        self._schedule = CallSchedule()
        self._pending_hook = None
        self.ablate = 0
        try:
            shrink = self.enable_shrink  # the build that reads the mask (kernels._spec)
            self._dispatch_fn = jit.kernel(K.dispatch_spec(num_threads, self.across_nodes, shrink), group)
            self._combine_fn = jit.kernel(K.combine_spec(num_threads, self.across_nodes, shrink), group)
            self._variants = {}  # dispatch_packed / combine_logfmt, loaded at their first use (load_kernel)
            self._check_resident()
        except BaseException:
            self.buffer.destroy()
            raise

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def size_hint(num_ranks: int, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                  max_topk: int = 16, capacity: int | None = None) -> int:
        """Bytes per rank of a buffer for these sizes (``capacity``: rows per
        (expert, source) region, layout.capacity_for a capacity factor)."""
        return low_latency_layout(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, max_topk,
                                  capacity=capacity).nbytes

    @property
    def num_bytes(self) -> int:
        return self.layout.nbytes

    def _profile_args(self, kernel_time_ns, trace) -> dict:
        """kernel_time / trace pointers of a call (checked before the call takes a set)."""
        trace = as_cupy(trace, "trace")
        if trace is not None:
            check(trace, "trace", np.int64, shape=(self.num_blocks, K.NUM_TRACE_SLOTS))
        return dict(kernel_time=_time_ptr(kernel_time_ns), trace=jit.ptr(trace))

    def _call_args(self, kernel: str, sets: dict, profile: dict, num_tokens: int, num_topk: int) -> dict:
        """The CallArgs fields of a call (args.cuh) but its phases, waiters and ablations."""
        return dict(peers=self.buffer.peer_ptrs.data.ptr, **sets, **profile, mask=jit.ptr(self.mask),
                    num_tokens=num_tokens,
                    hidden=self.hidden, num_topk=num_topk, num_experts=self.num_experts, num_ranks=self.num_ranks,
                    max_tokens=self.max_tokens, max_topk=self.max_topk, capacity=self.capacity, rank=self.rank,
                    ranks_per_node=self.ranks_per_node, guard=self._guard(kernel))

    def _check_resident(self) -> None:
        # Raises ValueError when the dispatch's shared memory cannot fit these sizes.
        K.dispatch_smem(self.max_tokens, self.num_blocks, self.max_topk, self.num_experts)
        # A call may use up to SMEM_BUDGET bytes (wider token windows for a small top-k): check that.
        per_sm = min(jit.max_resident_blocks(self._dispatch_fn, self.num_threads, K.SMEM_BUDGET),
                     jit.max_resident_blocks(self._combine_fn, self.num_threads, K.combine_smem(self.num_experts)))
        # Only the waiters wait; when some blocks only send, one more block per GPU
        # must fit beside all waiters so that those senders always make progress.
        jit.require_resident("low-latency kernels", per_sm, self.num_waiters, self.num_threads,
                             self.group.co_resident_ranks, self.num_device_sms, "num_waiters",
                             spare=int(self.num_blocks > self.num_waiters))

    # ---------------------------------------------------------------- helpers
    def _take_set(self, kind: str):
        """Take the signals and data copy of the next call of ``kind`` (CallSchedule).
        Returns (data copy, call number, offsets, cur/next SetOffsets struct arguments)."""
        if self._pending_hook is not None:
            raise ValueError("the receive hook of the previous low-latency call has not run yet; call it before "
                             "starting another dispatch or combine on this buffer")
        sched = self._schedule
        signal_set, region, call = sched.take(kind)
        key = (signal_set, sched.region["dispatch"], sched.region["combine"])
        cur, cur_struct = self._call_offsets(key)
        _, next_struct = self._call_offsets((signal_set ^ 1,) + key[1:])  # the next call: only its flags are cleared
        return region, call, cur, dict(cur=cur_struct, next=next_struct)

    def _call_offsets(self, key):
        """(SetLayout, packed SetOffsets struct) of layout.call_offsets(*key), made once per key."""
        if key not in self._structs:
            offsets = call_offsets(self.layout, *key)
            self._structs[key] = (offsets, K.set_struct(offsets))
        return self._structs[key]

    def _guard(self, kernel: str):
        # Across nodes the kernels name peers by world rank (errors.GLOBAL_PEER_KERNELS).
        return self.group.guard(kernel + ("_internode" if self.across_nodes else ""))

    def _stream(self, async_finish: bool):
        import cupy
        if not async_finish:
            return cupy.cuda.get_current_stream()
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(cupy.cuda.get_current_stream())
        self.comm_stream.wait_event(ev)
        return self.comm_stream

    def _finish(self, stream, async_finish: bool):
        import cupy
        if not async_finish:
            return None
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        return EventHandle(ev)

    def _check_routing(self, topk_idx, num_tokens: int, validate: bool):
        import cupy
        topk_idx = check(as_cupy(topk_idx, "topk_idx"), "topk_idx", np.int64, ndim=2)
        if topk_idx.shape[0] != num_tokens:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows, x has {num_tokens}")
        if not 1 <= topk_idx.shape[1] <= self.max_topk:
            raise ValueError(f"topk_idx has {topk_idx.shape[1]} columns; this buffer takes 1 to max_topk="
                             f"{self.max_topk}")
        if validate and topk_idx.size and not cupy.cuda.get_current_stream().is_capturing():
            lo, hi, ndup = routing_range(topk_idx, duplicates=True)
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(f"topk_idx holds expert ids in [{lo}, {hi}], outside [-1, {self.num_experts})")
            if ndup:
                raise ValueError(f"topk_idx names the same expert twice in {ndup} places; low-latency mode needs "
                                 "distinct experts per token")
        if validate and self.capacity < self.max_tokens and not cupy.cuda.get_current_stream().is_capturing():
            self.check_capacity(topk_idx)
        return topk_idx

    def region_rows(self, topk_idx) -> int:
        """Collective: the most rows any rank's dispatch of its ``topk_idx``
        ([T, k] int64, its own) would put in one (expert, source) region, over
        every rank of the buffer (one count on the GPU, one host exchange)."""
        topk_idx = check(as_cupy(topk_idx, "topk_idx"), "topk_idx", np.int64, ndim=2)
        counts = to_host(expert_counts(topk_idx, self.num_experts))  # E ints: no reduction kernel to compile
        mine = np.array([int(counts.max()) if counts.size else 0], dtype=np.int64)
        return int(self.group.exchange(mine, "low-latency dispatch: region rows").max())

    def check_capacity(self, topk_idx) -> None:
        """Collective: ValueError on every rank, naming the rows and the
        capacity, when some rank's routing puts more rows in one (expert,
        source) region than the buffer's ``capacity`` holds (the kernel would
        refuse them); cupyep.low_latency.overflow splits or falls back."""
        rows = self.region_rows(topk_idx)
        if rows > self.capacity:
            raise ValueError(f"a routing puts {rows} rows of one rank in one expert's region, more than this "
                             f"buffer's capacity={self.capacity} (num_max_dispatch_tokens_per_rank="
                             f"{self.max_tokens}); split the tokens or fall back to normal mode "
                             "(cupyep.low_latency.overflow)")

    # --------------------------------------------------------------- dispatch
    @traced_call("LowLatencyBuffer.dispatch")
    def dispatch(self, x, topk_idx, *, use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                 async_finish: bool = False, return_recv_hook: bool = False, validate: bool = True,
                 kernel_time_ns=None, trace=None, packed_out=None, topk_weights=None) -> LowLatencyDispatchResult:
        """Send every (token, expert) pair to the expert's rank.

        Arguments:
            x: [T, H] uint16 (BF16 bits), T <= num_max_dispatch_tokens_per_rank, H = the buffer's hidden.
            topk_idx: [T, k] int64 expert ids in [-1, E), distinct within a row.
            use_fp8: cast to FP8 e4m3 with one float32 scale per 128 channels (else send BF16).
            round_scale: power-of-two scales.
            use_ue8m0: store scales as UE8M0 exponent bytes (needs round_scale).
            cumulative_local_expert_recv_stats: [E_local] int32 device array, += rows received per expert.
            dispatch_wait_recv_cost_stats: [R] int64 device array, += nanoseconds waited for each source.
            topk_weights: None, or [T, k] float32: the rows carry their slot's weight, so that
                ``combine(..., partial=True)`` can reduce each token's rows on the expert side
                (with the weights given here: that combine takes no others).
            packed_out: None; True: the dispatch makes DeepEP's packed outputs itself (new
                arrays, as cupyep.reference.packed_layout.packed_outputs_for describes them; returned as
                ``result.packed``); or (x, scales, src_info, layout_range) device arrays for DeepEP's
                packed layout, which the receive half fills too (the dispatch_packed kernel; in the
                hook with return_recv_hook): x [E_local, R * max_tokens, H] uint8 (FP8) or uint16,
                C-contiguous; scales (FP8 only, else None) [E_local, R * max_tokens, S] float32
                (S = H / 128) or int32 words of four UE8M0 bytes (S = H / 512), the transpose of a
                C-contiguous [E_local, S, R * max_tokens] array; src_info [E_local, R * max_tokens]
                int32; layout_range [E_local, R] int64 (begin << 32 | count). As
                cupyep.reference.packed_layout.packed_outputs makes them and pack_dispatch fills them.
            async_finish: run on the communication stream and return an event.
            return_recv_hook: run only the send half now; ``result.hook()`` runs the receive half.
            validate: check expert ids and distinctness on the host (one small sync; skipped in graph capture).
            kernel_time_ns: optional [2] int64 device array, for profiling: the kernel(s) lower
                element 0 to their first block's start and raise element 1 to their last block's
                end (%globaltimer ns); initialise it to [2**63 - 1, 0].
            trace: optional [num_blocks, 8] int64 device array, for profiling: trace[b, m] is
                the %globaltimer ns at which block b reached mark m (kernels.TRACE_MARKS; both
                halves write it in hook mode). Tracing adds block barriers.

        Returns:
            LowLatencyDispatchResult (recv_x is a view valid until the next dispatch).
        """
        import cupy
        x = check(as_cupy(x, "x"), "x", BF16, ndim=2)
        T, H = x.shape
        if H != self.hidden:
            raise ValueError(f"x has hidden size {H}, the buffer was built for {self.hidden}")
        if T > self.max_tokens:
            raise ValueError(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank={self.max_tokens}")
        topk_idx = self._check_routing(topk_idx, T, validate)
        k = topk_idx.shape[1]
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (UE8M0 holds powers of two)")
        El, R = self.num_local_experts, self.num_ranks
        stats = as_cupy(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
        if stats is not None:
            check(stats, "cumulative_local_expert_recv_stats", np.int32, shape=(El,))
        wait = as_cupy(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
        if wait is not None:
            check(wait, "dispatch_wait_recv_cost_stats", np.int64, shape=(R,))
        if topk_weights is not None:
            topk_weights = check(as_cupy(topk_weights, "topk_weights"), "topk_weights", np.float32, shape=(T, k))
        ranked = topk_weights is not None
        if ranked and self.max_tokens > 0xFFFF:
            raise ValueError(f"a dispatch given topk_weights tags each row with its token's row among the "
                             f"{self.max_tokens} tokens in 16 bits: num_max_dispatch_tokens_per_rank must be at "
                             "most 65535")
        plan = K.dispatch_smem(max(T, 1), self.num_blocks, k, self.num_experts, R if ranked else 0)
        make_packed = packed_out is True
        if make_packed and use_ue8m0 and H % 512:
            raise ValueError(f"packed outputs with use_ue8m0 hold four UE8M0 exponents a word: hidden={H} must be "
                             "a multiple of 512")
        packed = None if make_packed else self._check_packed_out(packed_out, use_fp8, use_ue8m0)
        # (the packing kernel is loaded, collectively the first time, before the call takes its set)
        fn = self._dispatch_fn if packed is None and not make_packed else self.load_kernel("dispatch_packed")
        profile = self._profile_args(kernel_time_ns, trace)

        region, call, cur, sets = self._take_set("dispatch")
        stream = self._stream(async_finish)
        RT = R * self.max_tokens
        with stream:  # the small arrays in one allocation; packed rows and scales in their own
            small = carve({"layout_count": (El, R), "recv_count": (El,), "combine_pos": (T, k), "slot_pos": (T, k),
                           "status": (self.num_waiters,),
                           **({"rank_pos": (T, k)} if ranked else {}),
                           **({"src": (El, RT), "range": (El, 2 * R)} if make_packed else {})}, np.int32)
            layout_count, recv_count = small["layout_count"], small["recv_count"]
            combine_pos, slot_pos, rank_pos = small["combine_pos"], small["slot_pos"], small.get("rank_pos")
            if make_packed:
                packed = (*packed_payload(El, R, self.max_tokens, H, use_fp8, use_ue8m0, cupy), small["src"],
                          small["range"].view(np.int64))
        call_args = self._call_args("low_latency_dispatch", sets, profile, T, k)
        args = dict(x=x.data.ptr, topk_idx=topk_idx.data.ptr, layout_count=layout_count.data.ptr,
                    recv_count=recv_count.data.ptr, combine_pos=combine_pos.data.ptr,
                    slot_pos=slot_pos.data.ptr, cumulative_stats=jit.ptr(stats), status=small["status"].data.ptr,
                    topk_weights=jit.ptr(topk_weights), rank_pos=jit.ptr(rank_pos),
                    wait_stats=jit.ptr(wait), mask_words=plan.mask_words,
                    fp8=int(use_fp8), round_scale=int(round_scale), ue8m0=int(use_ue8m0),
                    **({} if packed is None else dict(
                        packed_x=packed[0].data.ptr, packed_scales=jit.ptr(packed[1]), packed_src=packed[2].data.ptr,
                        packed_range=packed[3].data.ptr, packed_rows=R * self.max_tokens)))

        hook = self._run(fn, K.DISPATCH_ARGS_DTYPE, call_args, args, plan.bytes, stream, return_recv_hook)
        event = self._finish(stream, async_finish)

        # Strided views of the messages (layout.message_layout).
        slots, m = self.layout.slots, message_layout(H, use_fp8, use_ue8m0)

        def part(offset, shape, dtype):
            item = np.dtype(dtype).itemsize
            return self.buffer.view(cur.recv_x + offset, shape, dtype,
                                    strides=(slots * m.nbytes, m.nbytes, item)[:len(shape)])

        recv_x = part(0, (El, slots, H), np.uint8 if use_fp8 else BF16)
        recv_scales = part(m.scales, (El, slots, H // 128), np.uint8 if use_ue8m0 else np.float32) if use_fp8 else None
        handle = LowLatencyHandle(layout_count=layout_count, recv_src=part(m.tag, (El, slots), np.int32),
                                  recv_slot=part(m.tag + 4, (El, slots), np.uint8), combine_pos=combine_pos,
                                  slot_pos=slot_pos, rank_pos=rank_pos, weights=topk_weights, status=small["status"],
                                  num_tokens=T, num_topk=k, hidden=H, num_experts=self.num_experts,
                                  max_tokens=self.max_tokens, capacity=self.capacity, set_index=region, call=call,
                                  buffer_id=id(self))
        return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle, event, hook, packed)

    def _run(self, fn, dtype, call_args: dict, args: dict, smem: int, stream, return_recv_hook: bool):
        """Launch both halves of a kernel on ``stream``, or the send half now and
        return the hook that launches the receive half on the then-current stream."""
        import cupy

        def launch(phases, s, kernel_time=None):
            c = dict(call_args, phases=phases, num_waiters=self.num_waiters, ablate=self.ablate)
            if kernel_time is not None:
                c["kernel_time"] = _time_ptr(kernel_time)
            a = jit.pack(dtype, c=jit.pack(K.CALL_DTYPE, **c), **args)
            # A receive half alone runs on the waiters only.
            blocks = self.num_blocks if phases & K.PHASE_SEND else self.num_waiters
            if self.programmatic_launch:
                driver.launch(fn, blocks, self.num_threads, (a,), shared_mem=smem, stream=s, programmatic=True)
            else:
                with s:
                    fn((blocks,), (self.num_threads,), (a,), shared_mem=smem)

        if not return_recv_hook:
            launch(K.PHASE_SEND | K.PHASE_RECV, stream)
            return None
        launch(K.PHASE_SEND, stream)
        return self._make_hook(lambda kt: launch(K.PHASE_RECV, cupy.cuda.get_current_stream(), kt))

    def _make_hook(self, run):
        state = {"done": False}

        @traced_call("LowLatencyBuffer.hook")
        def hook(kernel_time_ns=None):
            """Run the receive half on the current stream (kernel_time_ns: as in dispatch, for this half)."""
            if state["done"]:
                raise ValueError("this receive hook has already run")
            state["done"] = True
            self._pending_hook = None
            run(kernel_time_ns)

        self._pending_hook = hook
        return hook

    # ---------------------------------------------------------------- combine
    def get_next_combine_buffer(self, handle: LowLatencyHandle):
        """[E_local, R * capacity, H] uint16 (BF16) view the next combine reads
        when called with ``zero_copy=True``: write expert outputs straight here."""
        self._check_handle(handle)
        s = self.layout.sets[self._schedule.peek("combine")]
        return self.buffer.view(s.combine_send, (self.num_local_experts, self.layout.slots, self.hidden), BF16)

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, LowLatencyHandle) or handle.buffer_id != id(self):
            raise ValueError("expected a LowLatencyHandle made by this LowLatencyBuffer")
        if not self._schedule.holds("dispatch", handle.set_index, handle.call):
            raise ValueError(f"the rows of this handle's dispatch (call {handle.call}) have been overwritten by a "
                             f"later dispatch (a dispatch's rows are valid until the next dispatch)")

    @traced_call("LowLatencyBuffer.combine")
    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, *, zero_copy: bool = False,
                pull: bool | None = None, async_finish: bool = False, return_recv_hook: bool = False, out=None,
                validate: bool = False, kernel_time_ns=None, trace=None,
                x_layout: str = "regions", combine_wait_recv_cost_stats=None,
                use_logfmt: bool = False, partial: bool = False) -> LowLatencyCombineResult:
        """Return expert outputs to their tokens and reduce with the top-k weights.

        Arguments:
            x: [E_local, R * capacity, H] uint16 (BF16) expert outputs, rows as
                the dispatch laid them out: C-contiguous, or with any row stride
                that is a multiple of 16 bytes (a BF16 dispatch's recv_x works as
                is); ignored (may be None) with zero_copy.
            topk_idx: [T, k] int64, the routing that was dispatched.
            topk_weights: [T, k] float32.
            handle: the dispatch's LowLatencyHandle.
            zero_copy: read the expert outputs from get_next_combine_buffer().
            pull: each token's owner reads its rows from the expert ranks' combine
                buffers while it reduces, instead of the expert ranks writing
                them into the owners' buffers first (push). A row is then read
                remotely once and never written remotely; without zero_copy the
                expert rank first copies x into its own combine buffer, a local
                copy. Default (None): pull with zero_copy when all ranks share
                one GPU, push otherwise: the faster of each pair as measured
                (results/archive/low_latency.jsonl; across NVLink, remote reads are
                slower than remote writes: results/archive/low_latency_2gpus.jsonl).
                Every rank must pass the same value. The copy of the combine
                buffer a call reads is handed out again (get_next_combine_buffer)
                only after another call on this buffer, which completes only
                once every owner has finished this combine; so rows stay valid
                while they are read as long as each rank issues its calls, and
                its writes to the combine buffer, on one stream in call order.
            out: optional [T, H] uint16 output array.
            x_layout: "regions" (x as above) or "packed": x is [E_local, R *
                max_tokens, H] in DeepEP's packed layout, expert e's rows at
                [0, recv_count[e]) source after source in rank order (the
                layout cupyep.deep_ep returns), read in place; the same row
                stride rules. Not with zero_copy.
            use_logfmt: send the rows in LogFMT-10 (cupyep.reference.logfmt
                defines it; 10.5 bits a value instead of 16, each value within
                2 ** (step / 2) - 1 of itself for the step of its 128-channel
                group: results/logfmt). Within a node, pushed: pull=True and
                buffers across nodes raise ValueError. With partial=True the
                partial rows travel in LogFMT-10.
            partial: each expert rank first sums, per token, the weighted rows of its
                local experts (FP32, slot order) and returns one BF16 row per (token,
                expert rank) instead of one per (token, expert); the owner sums those
                in rank order (cupyep.reference.low_latency_partial_combine, which
                it equals bit for bit). Needs a dispatch given ``topk_weights``, whose
                weights it uses: ``topk_weights`` here must be None or that same
                array. Within a node, pushed, top-k <= 32: pull=True and buffers
                across nodes raise ValueError. With use_logfmt=True the partial rows
                travel in LogFMT-10: the owner sums the decoded partials
                (reference.low_latency_partial_combine(..., logfmt=True)).
            combine_wait_recv_cost_stats: [R] int64 device array, += nanoseconds
                block 0 waited for each expert rank's rows (as dispatch's
                dispatch_wait_recv_cost_stats; DeepEP's argument of that name).
            async_finish, return_recv_hook, kernel_time_ns, trace: as in dispatch.

        Returns:
            LowLatencyCombineResult with combined_x [T, H] uint16 (BF16).
        """
        import cupy
        self._check_handle(handle)
        El, H, T = self.num_local_experts, self.hidden, handle.num_tokens
        shape = (El, self.layout.slots, H)
        topk_idx = self._check_routing(topk_idx, T, validate)
        k = topk_idx.shape[1]
        if k != handle.num_topk:
            raise ValueError(f"topk_idx has {k} columns, the dispatch had {handle.num_topk}")
        if partial:
            if handle.rank_pos is None:
                raise ValueError("partial=True reduces with the weights the dispatch carried: dispatch with "
                                 "topk_weights=... first")
            if topk_weights is not None and topk_weights is not handle.weights:
                raise ValueError("partial=True reduces with the weights given to the dispatch; pass "
                                 "topk_weights=None or that same array")
            if self.across_nodes or pull or k > 32:
                raise ValueError("partial=True pushes partial rows within a node, for top-k <= 32: not with "
                                 "a buffer across nodes or pull=True "
                                 f"(got across_nodes={self.across_nodes}, pull={pull}, top-k={k})")
            pull, topk_weights = False, handle.weights
        else:
            topk_weights = check(as_cupy(topk_weights, "topk_weights"), "topk_weights", np.float32, shape=(T, k))
        if x_layout not in ("regions", "packed"):
            raise ValueError(f"x_layout must be 'regions' or 'packed', got {x_layout!r}")
        packed = x_layout == "packed"
        if zero_copy:
            if packed:
                raise ValueError("zero_copy reads get_next_combine_buffer(), which is in the region layout; "
                                 "x_layout='packed' needs zero_copy=False")
            src = self.get_next_combine_buffer(handle)
            if x is not None and (as_cupy(x, "x").data.ptr != src.data.ptr):
                raise ValueError("zero_copy reads get_next_combine_buffer(); pass x=None or that buffer")
        else:
            if packed:
                shape = (El, self.num_ranks * self.max_tokens, H)
            src = check(as_cupy(x, "x"), "x", BF16, shape=shape, contiguous=False)
            st = src.strides
            if st[2] != 2 or st[1] % 16 or st[1] < 2 * H or st[0] != shape[1] * st[1]:
                raise ValueError(f"x must have contiguous rows of H BF16 values, a row stride that is a multiple of "
                                 f"16 bytes and no gaps between experts (a C-contiguous array or a dispatch's "
                                 f"recv_x); its strides are {st}")
        if out is not None:
            out = check(as_cupy(out, "out"), "out", BF16, shape=(T, H))
        wait = as_cupy(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        if wait is not None:
            check(wait, "combine_wait_recv_cost_stats", np.int64, shape=(self.num_ranks,))
        if pull and self.across_nodes:
            raise ValueError("pull=True reads the expert ranks' buffers, which ranks of other nodes cannot; "
                             "across nodes the combine pushes (pull=None or False)")
        if use_logfmt:
            if self.across_nodes:
                raise ValueError("use_logfmt=True: the LogFMT combine runs within a node; this buffer spans nodes")
            if pull:
                raise ValueError("use_logfmt=True pushes the encoded rows; pass pull=None or False")
            pull = False
        # (a variant kernel is loaded, collectively the first time, before the call takes its set)
        name = ("combine_partial" if partial else "combine") + ("_logfmt" if use_logfmt else "")
        fn = self._combine_fn if name == "combine" else self.load_kernel(name)
        profile = self._profile_args(kernel_time_ns, trace)
        _, _, _, sets = self._take_set("combine")
        stream = self._stream(async_finish)
        with stream:
            if out is None:
                out = cupy.empty((T, H), dtype=BF16)
        call_args = self._call_args("low_latency_combine", sets, profile, T, k)
        args = dict(x=src.data.ptr, layout_count=handle.layout_count.data.ptr,
                    combine_pos=handle.combine_pos.data.ptr, slot_pos=handle.slot_pos.data.ptr,
                    topk_idx=topk_idx.data.ptr, topk_weights=topk_weights.data.ptr, out=out.data.ptr,
                    x_row_bytes=src.strides[1], wait_stats=jit.ptr(wait), x_expert_rows=shape[1] if packed else 0,
                    pull=int(zero_copy and self._one_gpu and not self.across_nodes if pull is None else bool(pull)),
                    dispatch_status=jit.ptr(handle.status))
        smem = K.combine_smem(self.num_experts)
        if partial:
            args.update(tags=handle.recv_src.data.ptr, tag_stride=handle.recv_src.strides[1],
                        rank_pos=handle.rank_pos.data.ptr)

        hook = self._run(fn, K.COMBINE_ARGS_DTYPE, call_args, args, smem, stream, return_recv_hook)
        return LowLatencyCombineResult(out, self._finish(stream, async_finish), hook)

    def load_kernel(self, name: str):
        """The kernel of ``name`` ("dispatch_packed", "combine_logfmt",
        "combine_partial" or "combine_partial_logfmt"), compiled and loaded
        collectively at its first use, then kept."""
        fn = self._variants.get(name)
        if fn is None:
            t, m = self.num_threads, self.enable_shrink
            specs = {"dispatch_packed": lambda: K.dispatch_packed_spec(t, self.across_nodes, m),
                     "combine_logfmt": lambda: K.combine_logfmt_spec(t, m),
                     "combine_partial": lambda: K.combine_partial_spec(t, m),
                     "combine_partial_logfmt": lambda: K.combine_partial_logfmt_spec(t, m)}
            if name not in specs:
                raise ValueError(f"no kernel {name!r}; one of {sorted(specs)}")
            fn = self._variants[name] = jit.kernel(specs[name](), self.group)
        return fn

    def _check_packed_out(self, packed_out, use_fp8: bool, use_ue8m0: bool):
        """dispatch's packed_out as CuPy arrays, checked (ValueError naming the array), or None."""
        if packed_out is None:
            return None
        if not isinstance(packed_out, (tuple, list)) or len(packed_out) != 4:
            raise ValueError("packed_out must be (x, scales, src_info, layout_range)")
        El, R, H = self.num_local_experts, self.num_ranks, self.hidden
        RT = R * self.max_tokens
        x, scales, src, rng = (as_cupy(a, n) for a, n in zip(packed_out, ("packed x", "packed scales",
                                                                          "packed src_info", "layout_range")))
        check(x, "packed x", np.uint8 if use_fp8 else BF16, shape=(El, RT, H))
        check(src, "packed src_info", np.int32, shape=(El, RT))
        check(rng, "layout_range", np.int64, shape=(El, R))
        if not (x.flags.c_contiguous and src.flags.c_contiguous and rng.flags.c_contiguous):
            raise ValueError("packed x, src_info and layout_range must be C-contiguous")
        if use_ue8m0 and H % 512:
            raise ValueError(f"packed_out with use_ue8m0 holds four UE8M0 exponents a word: hidden={H} must be a "
                             f"multiple of 512")
        if use_fp8:
            S = H // 512 if use_ue8m0 else H // 128
            dt = np.int32 if use_ue8m0 else np.float32
            if scales is None:
                raise ValueError("an FP8 dispatch's packed_out needs the scales")
            check(scales, "packed scales", dt, shape=(El, RT, S), contiguous=False)
            if scales.strides != (S * RT * 4, 4, RT * 4):
                raise ValueError(f"packed scales must be the transpose of a C-contiguous [{El}, {S}, {RT}] array "
                                 f"(DeepEP's column-major scales); their strides are {scales.strides}")
        elif scales is not None:
            raise ValueError("a BF16 dispatch's packed_out has no scales (None)")
        return x, scales, src, rng

    # ------------------------------------------------------------ shrink mode
    @property
    def enable_shrink(self) -> bool:
        return self.mask is not None

    def _shrink(self, what: str):
        if self.mask is None:
            raise ValueError(f"LowLatencyBuffer.{what} needs a buffer made with enable_shrink=True")
        return self.mask

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """Mask (or unmask) ``rank`` for the following calls, on the current stream."""
        mask = self._shrink("update_mask")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be an int in [0, {self.num_ranks}), got {rank!r}")
        mask[int(rank)] = int(bool(masked))

    def query_mask(self, out=None):
        """[R] int32 on the device, 1 for a masked rank: a copy of the mask on
        the current stream (into ``out``, an [R] int32 device array, if given)."""
        mask = self._shrink("query_mask")
        if out is None:
            return mask.copy()
        out = check(as_cupy(out, "out"), "out", np.int32, shape=(self.num_ranks,))
        out[...] = mask
        return out

    def clean_mask(self) -> None:
        """Unmask every rank, on the current stream."""
        self._shrink("clean_mask").fill(0)

    # --------------------------------------------------------------- lifetime
    def synchronize(self) -> None:
        """Bounded wait for this buffer's work on the current and communication streams."""
        import cupy
        for s in (cupy.cuda.get_current_stream(), self.comm_stream):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(s)
            self.group.wait(ev, "low_latency_dispatch", "host wait for low-latency kernels")

    def destroy(self) -> None:
        """Collective: free the IPC buffer."""
        if self.buffer.alive:
            self.buffer.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def default_blocks(group, max_tokens: int, hidden: int) -> int:
    """The blocks of a LowLatencyBuffer given none, within a node: the rank's
    SM share, or the measured defaults' most over the dispatch and the
    combine (cupyep.sm_defaults) where a measurement of every kind exists and
    that is smaller."""
    from .. import sm_defaults
    got = [sm_defaults.blocks_for(group, "low_latency", kind, max_tokens, hidden)
           for kind in sm_defaults.ROUTES["low_latency"]]
    return group.sm_share if None in got else min(group.sm_share, max(got))
