"""The direct route within a node (``transport="direct"``): senders write
each row straight into the receiver's output, so every received byte
crosses HBM once (the queue route moves it twice: into a ring, then out of
it). The outputs live in IPC-registered pools sized from the buffer's
declared sizes (cupyep.normal.direct_kernels.DirectPools); a dispatch's
receive arrays are views of the next of ``num_in_flight`` slots, valid
until that slot goes to a later dispatch (then reading them raises
StaleResultError); the handle owns its routing and stays valid. The
combine pushes the rows back into the owners' partial rows, or, zero-copy,
the owners read the expert outputs in place. Kernels:
cuda_src/normal/direct.cu.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import jit
from ..arrays import BF16, Carved, carve_plan, copy
from ..results import (RECEIVE_FIELDS, CarvedRouting, CombineResult, DispatchHandle, ExpandTables,
                       aligned_expert_counts, dispatch_result, evolve)
from . import direct_kernels as D
from . import expert_major as EM
from .layout import LAYOUT_DTYPES
from .node import NodeRoute
from .route import CombineCall, DispatchCall


class DirectRoute(NodeRoute):
    """``transport="direct"`` on the ranks of one node (cupyep.normal.node.Node).

    sizes: the buffer's declared sizes; num_in_flight: dispatch slots;
    slot_bytes: bytes of one slot (None: DirectPools' default); measured:
    whether a call without a block count of its own takes the measured
    default of its kind (cupyep.sm_defaults) where that is below the node's
    SM budget (the Buffer passes True unless it was given num_sms). The pools
    are allocated, collectively, by the first call that uses each."""

    transport = name = "direct"
    metrics = frozenset({"notify_time_ns", "kernel_time_ns"})
    zero_copy = True

    def __init__(self, node, sizes, num_in_flight: int, slot_bytes: int | None = None, measured: bool = False):
        self.node = node
        self.measured = measured
        self._budgets: dict = {}  # kind -> blocks a call of that kind takes at most by default
        self.sizes = sizes
        self.num_in_flight = num_in_flight
        self.slot_bytes = slot_bytes
        self._pools: D.DirectPools | None = None
        self._configs: dict = {}  # the caller's config -> validated and resolved (every call asks)
        self._kernels: dict = {}  # (spec, config, shared bytes) -> kernel, its residency checked
        self._fused: dict = {}  # a fused dispatch's call shape -> its _FusedPlan
        self._peer_x = None  # cupyep.ipc_peers.PeerArrays of the in-place combines (made by the first)

    @property
    def pools(self) -> D.DirectPools:
        """The route's pools (made by the first call; collective)."""
        if self._pools is None:
            self._pools = D.DirectPools(self.node.group, self.sizes, self.num_in_flight, self.slot_bytes)
        return self._pools

    def dispatch_config(self, config, fp8: bool, handle) -> D.DirectConfig:
        if config is not None and not isinstance(config, D.DirectConfig):
            raise ValueError(f"the direct transport takes a DirectConfig, got {type(config).__name__}")
        kind = "dispatch_fp8" if fp8 else "dispatch_bf16"
        return self._config(config, kind)

    def _config(self, config, kind: str) -> D.DirectConfig:
        cfg = self._configs.get((config, kind))
        if cfg is None:
            cfg = (config or D.DirectConfig()).validate().resolved(self.budget(kind))
            R, most = self.node.num_ranks, D.max_combine_words(self.node.num_ranks)
            if cfg.combine_words is not None and cfg.combine_words > most:
                raise ValueError(f"combine_words={cfg.combine_words} at {R} ranks keeps {cfg.combine_words * R} row "
                                 f"words per lane in flight; at most 16 fit its registers: use combine_words <= "
                                 f"{most}")
            self._configs[(config, kind)] = cfg
        return cfg

    def combine_config(self, config, handle) -> D.DirectConfig:
        if config is not None and not isinstance(config, D.DirectConfig):
            raise ValueError(f"the direct transport takes a DirectConfig, got {type(config).__name__}")
        return self._config(config, "combine_bf16")

    def budget(self, kind: str) -> int:
        """The most blocks a call of ``kind`` (cupyep.sm_defaults.ROUTES["direct"])
        takes when its config names none: the node's SM budget, or the
        measured default for this GPU, rank layout and the buffer's declared
        tokens and hidden size where that is smaller."""
        got = self._budgets.get(kind)
        if got is None:
            got = self.node.sm_budget
            if self.measured:
                from .. import sm_defaults
                m = sm_defaults.blocks_for(self.node.group, "direct", kind, self.sizes.max_tokens, self.sizes.hidden)
                got = min(got, m) if m else got
            self._budgets[kind] = got
        return got


    def _kernel(self, spec, cfg: D.DirectConfig, what: str, shared_bytes: int | None = None):
        """The kernel, after checking that every rank's blocks fit the GPU at
        once with ``shared_bytes`` of dynamic shared memory (default: the
        config's bulk stages); the default, at most this rank's SM budget,
        always does."""
        key = (spec, cfg, shared_bytes)
        fn = self._kernels.get(key)
        if fn is None:
            fn = jit.kernel(spec)
            shared = cfg.bulk_shared_bytes() if shared_bytes is None else shared_bytes
            self.node.check_resident(D.with_shared(fn, shared), cfg.num_sms or self.node.sm_budget, cfg.num_threads,
                                     what, step=1, shared_bytes=shared)
            self._kernels[key] = fn
        return fn

    # ---------------------------------------------------------- dispatch
    def dispatch(self, call: DispatchCall):
        """The receive arrays are views of the next dispatch slot (its Lease
        in the result and the handle); ``call.fresh``: copied out of it.
        expert_major: the senders write each row straight into its experts'
        blocks (once per local slot); no rank-major payload is written, so
        the result's recv_x and recv_x_scales are None. When some
        receiver's expert-major rows (padding included) do not fit the slot,
        the same verdict on every rank, the rows are sent rank-major into
        the slot instead and laid out expert-major locally into arrays of
        the result's own (``result.pooled`` is then RECEIVE_FIELDS): a
        slower call, never a refused one."""
        import cupy
        node, cfg, handle = self.node, call.config, call.handle
        R = node.num_ranks
        x, topk_idx = call.x, call.topk_idx
        T, H, k, fp8 = call.num_tokens, call.hidden, call.num_topk, call.fp8
        ns = H // 128 if fp8 else 0
        E_local = call.num_experts // R
        alignment = call.expert_alignment
        shape = (H * x.dtype.itemsize, ns, k, topk_idx is not None, call.topk_weights is not None)
        if call.expert_major and handle is not None and handle.expand.alignment != alignment:
            raise ValueError(f"a cached expert-major dispatch on the direct transport keeps the expert_alignment of "
                             f"the handle's dispatch ({handle.expand.alignment}), got {alignment}")
        pools = self.pools
        slot = pools.slots.peek()
        direct_em = call.expert_major  # the expert-major rows go straight into the slot
        lay = pools.expand_layout(shape, slot) if direct_em else pools.recv_layout(shape, slot)
        worst = handle.num_worst_tokens if handle is not None else call.num_worst_tokens
        if direct_em and worst > 0:  # decided before launch, from the bound, the same on every rank
            fits = EM.expert_rows_capacity(None, worst, k, E_local, alignment) <= lay.em_rows
            # Senders write into every receiver's slot at one layout, and num_worst_tokens may differ between
            # ranks: the slot is laid out expert-major only where every rank's bound fits (a host exchange).
            if not node.group.exchange(np.array([fits], dtype=np.int8), "direct dispatch: its slot layout").all():
                direct_em, lay = False, pools.recv_layout(shape, slot)
        notified = handle is None
        fused = cfg.fused and notified
        # The send kernel (a fused call needs it only where its kernel sent nothing), checked before the call
        # takes a slot, as the fused launch is.
        fn = None if fused else self._kernel(D.dispatch_spec(R, cfg.num_threads), cfg, "direct dispatch")
        pool = pools.pool("dispatch")
        if fused:  # its launch, checked before the call takes a slot
            plan = self._fused_plan(call, pool, lay, direct_em, (shape, slot, direct_em))
        capturing = node.comm_stream.is_capturing()  # the current stream (the caller's joins it when capturing)
        lease = pools.slots.take("Buffer.dispatch (direct)", pin=capturing)
        # On the communication stream, which its kernels use: memory the caller's stream could reuse as
        # soon as this call returns (async_finish) would be overwritten under them.
        pos = cupy.empty((T, k), dtype=np.int32) if direct_em else None
        call.keep.append(pos)
        sent = False
        if fused:  # layout, notify and the send in one launch
            handle, sent = self._dispatch_fused(plan, call, pool, lay, pos, lease)
        elif notified:
            hints = node.check_hints(call.hints, call.num_experts, T)
            handle = node.notify(topk_idx, H, call.num_experts, hints, D.notify_channels(R), alignment,
                                 call.num_worst_tokens, transport="direct", notify_time_ns=call.notify_time_ns,
                                 src_rows=lay.rows)
        N = handle.num_worst_tokens or handle.num_recv_tokens
        m_view, m_need = self._expert_rows(handle, direct_em, k, E_local, alignment)
        if direct_em and not sent and m_need > lay.em_rows:  # the same verdict on every rank (global counts)
            direct_em, lay, pos, m_view = False, pools.recv_layout(shape, slot), None, 0
        recv_topk_idx = pool.view(lay.topk_idx, (N, k), np.int64) if topk_idx is not None else None
        recv_topk_weights = pool.view(lay.topk_weights, (N, k), np.float32) if call.topk_weights is not None else None
        if not sent:  # the send (a fused kernel that sent has sent already)
            fn = fn or self._kernel(D.dispatch_spec(R, cfg.num_threads), cfg, "direct dispatch")
            blocks = cfg.num_sms or D.default_num_sms(self.budget(_dispatch_kind(call)), self._rows_sent(handle),
                                                      cfg.num_threads)
            args = D.send_args(pools, pool, lay, handle, x, call.x_scales, topk_idx, call.topk_weights,
                               call.num_experts, capacity=N, rank=node.rank,
                               guard=node.group.guard("direct_dispatch"), pos=pos,
                               bulk_stage=cfg.bulk_stage(), kernel_time=call.kernel_time_ns,
                               src_copy=handle.array_ptr("recv_src_idx") if notified else 0)
            if direct_em:
                D.launch_positions(args, call.num_experts)
            D.launch_send(fn, blocks, cfg.num_threads, args, cfg.bulk_shared_bytes())
        # The handle owns its routing: the send kernel's last block copies the source indices out of the
        # slot into the handle's carved array (the expert-major map is copied below; a cached call's are
        # its handle's already), so combine and cached dispatch take it whatever happens to the slot later.
        if handle.lease is not lease:
            handle = evolve(handle, lease=lease)
        per_expert = aligned_expert_counts(handle.recv_expert_counts, alignment)
        if direct_em:
            em = EM.ExpertMajorOutput(
                expert_x=pool.view(lay.em_x, (m_view, H), x.dtype),
                expert_x_scales=pool.view(lay.em_x_scales, (m_view, ns), np.float32) if fp8 else None,
                expert_offsets=handle.expand.meta[:E_local + 1],
                expert_src_row=pool.view(lay.em_src_row, (m_view,), np.int32),
                recv_expert_row=copy(pool.view(lay.em_recv_row, (N, k), np.int32)), num_expert_rows=m_view)
            handle = evolve(handle, recv_expert_row=em.recv_expert_row, num_expert_rows=m_view)
            recv_x = recv_scales = None
        else:  # rank-major (and, past the slot's expert-major rows, the layout in arrays of its own)
            recv_x = pool.view(lay.x, (N, H), x.dtype)
            recv_scales = pool.view(lay.x_scales, (N, ns), np.float32) if fp8 else None
            handle, em = node.with_expert_major(handle, call.expert_major, per_expert if notified else None, recv_x,
                                                recv_scales, recv_topk_idx, call.num_experts, alignment)
        if call.fresh:  # the caller's own arrays: one more pass over the rows, never stale
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights = (
                copy(a) if a is not None else None for a in (recv_x, recv_scales, recv_topk_idx, recv_topk_weights))
            if direct_em:
                em = replace(em, expert_x=copy(em.expert_x), expert_src_row=copy(em.expert_src_row),
                             expert_x_scales=copy(em.expert_x_scales) if em.expert_x_scales is not None else None)
        result = dispatch_result(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle, None, em)
        result.lease = None if call.fresh else lease
        result.pooled = None if direct_em else RECEIVE_FIELDS
        return result

    def _rows_sent(self, handle) -> int:
        """Rows this rank sends in a dispatch on ``handle`` (the bound
        T * R in worst-token mode, where the counts never reach the host)."""
        if handle.counts is not None:
            return int(handle.counts[self.node.rank].sum())
        return handle.num_tokens * self.node.num_ranks

    def _expert_rows(self, handle, expert_major: bool, k: int, E_local: int, alignment: int) -> tuple[int, int]:
        """(this rank's expert-major rows M_cap, the most expert-major rows
        any rank lays out) of a dispatch; both 0 without expert_major. M_cap
        is exact whenever the handle's counts are on the host (a notified
        call, or a cached one: the pairs go where the handle's expand tables
        say, so the handle's counts are this call's), else (worst-token
        mode) the bound."""
        if not expert_major:
            return 0, 0
        N = handle.num_worst_tokens or handle.num_recv_tokens
        if handle.counts is not None:
            m_view = EM.expert_rows_capacity(aligned_expert_counts(handle.recv_expert_counts, alignment), N, k,
                                             E_local, alignment)
            return m_view, handle.expand.most_rows
        bound = EM.expert_rows_capacity(None, N, k, E_local, alignment)
        return bound, bound

    def _dispatch_fused(self, plan: "_FusedPlan", call: DispatchCall, pool, lay, pos,
                        lease) -> tuple[DispatchHandle, bool]:
        """One launch of the fused kernel (layout + notify + send into ``pool``
        laid out as ``lay``), as ``plan`` (:meth:`_fused_plan`) says, its args
        patched with this call's addresses. Returns (the handle, whether it
        sent). Outside worst-token mode the host waits, bounded, for the
        counts only (the kernel's status word), not for the send. When the
        slot is too small for some receiver's expert-major rows the kernel
        sends nothing (status 2, the same verdict on every rank) and the
        caller sends another way. ``pos``: the [T, k] expert-major positions
        the kernel fills (expert-major dispatch), else None; ``lease``: the
        call's slot, which the handle carries."""
        import cupy
        node = self.node
        T, worst = call.num_tokens, call.num_worst_tokens
        arrays = Carved(cupy.empty(plan.nbytes, dtype=np.uint8), plan.parts)
        arrays["alignment"] = call.expert_alignment
        C = plan.num_channels
        if worst > 0:
            handle = node.notify_handle(arrays, T, call.hidden, call.num_experts, C, worst, "direct", lease)
        else:
            node.reset_host_counts()
        D.launch_fused(plan.fn, plan.template, plan.num_blocks, plan.num_threads, plan.shared_bytes,
                       cupy.cuda.get_current_stream().ptr, _fused_addresses(arrays.base_ptr, call, pos))
        if worst > 0:
            return handle, True
        status = self._wait_host_status()
        handle = node.notify_handle(arrays, T, call.hidden, call.num_experts, C, worst, "direct", lease)
        if status == 2:  # nothing was sent: the slot cannot hold some receiver's rows
            if pos is not None and handle.expand.most_rows > lay.em_rows:
                return handle, False
            self._synchronize()
            raise RuntimeError(f"the fused direct dispatch found a receiver with more rows than its slot holds "
                               f"({lay.rows}), with at most max_tokens={self.sizes.max_tokens} tokens per rank")
        return handle, True

    def _fused_plan(self, call: DispatchCall, pool, lay, with_pos: bool, lay_key) -> "_FusedPlan":
        """The launch of a fused dispatch of this call's shape (``lay_key``:
        what determines ``lay``; ``with_pos``: expert-major positions), made
        once per shape: its kernel (its residency checked), blocks and shared
        memory, the carve plan of its notify pass's arrays, and its args as
        a jit.ArgTemplate of the packing functions, checked against a full
        pack for this call's addresses."""
        key = (lay_key, call.num_tokens, call.num_experts, call.expert_alignment, call.num_worst_tokens,
               call.config, with_pos, call.kernel_time_ns is not None, call.notify_time_ns is not None,
               self.node.group.timeout_s)
        plan = self._fused.get(key)
        if plan is None:
            if len(self._fused) >= jit.MAX_PLANS:  # call shapes that vary per call (T) would grow it
                self._fused.clear()
            plan = self._fused[key] = self._new_fused_plan(call, pool, lay, with_pos)
        return plan

    def _new_fused_plan(self, call: DispatchCall, pool, lay, with_pos: bool) -> "_FusedPlan":
        node, cfg = self.node, call.config
        R, T, E, worst = node.num_ranks, call.num_tokens, call.num_experts, call.num_worst_tokens
        C = D.notify_channels(R)
        smem = D.fused_shared_bytes(R, E, C, with_pos, cfg.num_threads, cfg.bulk_shared_bytes())
        fn = D.with_shared(self._kernel(D.fused_spec(R, cfg.num_threads), cfg, "fused direct dispatch", smem), smem)
        parts, nbytes = carve_plan(node.notify_shapes(T, E, C, "direct", lay.rows, in_rank=True),
                                   dtypes=LAYOUT_DTYPES)
        def shape(a):
            return a.shape if a is not None else None
        shapes = {"x": call.x.shape, "x_scales": shape(call.x_scales), "topk_idx": shape(call.topk_idx),
                  "topk_weights": shape(call.topk_weights), "pos": (T, call.num_topk) if with_pos else None,
                  "kernel_time": shape(call.kernel_time_ns), "notify_time": shape(call.notify_time_ns)}
        guard, layout_guard = node.group.guard("direct_dispatch"), node.group.guard("layout")
        host_status = 0 if worst > 0 else node.host_counts_ptr + 4 * node.host_status_index
        alignment, pools = call.expert_alignment, self.pools

        def pack(addr: dict):  # a pure function of the addresses (it holds no array of the call's)
            arrays = Carved(jit.Address((nbytes,), addr["base"]), parts)
            arrays["alignment"] = alignment
            a = {n: jit.Address(s, addr[n]) if s is not None else None for n, s in shapes.items()}
            nargs = node.pack_notify(arrays, T, E, C, alignment, worst, a["notify_time"])
            sargs = D.send_args(pools, pool, lay, _Offsets(arrays, C), a["x"], a["x_scales"], a["topk_idx"],
                                a["topk_weights"], E, capacity=max(worst, 0), rank=node.rank, guard=guard,
                                pos=a["pos"], compute_pos=with_pos, pos_threads=cfg.num_threads,
                                bulk_stage=cfg.bulk_stage(), kernel_time=a["kernel_time"],
                                src_copy=arrays.ptr("src_idx"))
            return D.fused_args(nargs, sargs, layout_guard, host_status)
        template = jit.ArgTemplate(pack, D.FUSED_SOURCES)
        template.check(pack, *_fused_addresses(1 << 40, call, None))  # the addresses a call passes, in its order
        return _FusedPlan(fn, template, pack, parts, nbytes, C, cfg.num_sms or self.budget(_dispatch_kind(call)),
                          cfg.num_threads, smem)

    def _synchronize(self) -> None:
        self.node.group.wait(self.node.comm_stream, "direct_dispatch", "host wait for the communication stream")

    def _wait_host_status(self) -> int:
        """Bounded host wait for the fused kernel's status word (1 sent, 2 pools
        too small); a device error (a timed-out barrier, a bad expert id) raises."""
        node = self.node
        word = node.host_counts[node.host_status_index:node.host_status_index + 1]
        status = node.group.wait_word(word, node.comm_stream, "direct_dispatch", "host wait for the fused notify's counts")
        if status == 3:
            self._synchronize()
            raise RuntimeError("the fused direct dispatch's notify pass failed without a device error")
        return status

    # ----------------------------------------------------------- combine
    def get_combine_buffer(self, handle: DispatchHandle, hidden: int):
        """cupy [N, H] uint16: this rank's part of the zero-copy slot of the
        handle's dispatch slot (cupyep.normal.Buffer.get_combine_buffer)."""
        handle.lease.check("the zero-copy combine buffer")
        pools = self.pools
        pool = pools.pool("zero_copy")
        zc_x, _, _ = pools.zero_copy_layout(hidden, handle.lease.slot)
        N = handle.num_worst_tokens or handle.num_recv_tokens
        return pool.view(zc_x, (N, hidden), BF16)

    def _check_zero_copy(self, call: CombineCall) -> None:
        """ValueError unless x is the handle's get_combine_buffer (or, expert-major,
        the outputs whose reduce goes there); StaleResultError when the handle's
        slot went to a later dispatch."""
        if call.num_topk > D.ZERO_COPY_MAX_TOPK:
            raise ValueError(f"a zero-copy combine carries at most {D.ZERO_COPY_MAX_TOPK} top-k weights, "
                             f"got {call.num_topk}")
        call.handle.lease.check("the zero-copy combine buffer")
        if call.expert_major:  # the reduce writes the handle's buffer; x stays where the experts wrote it
            return
        pool = self.pools.pools["zero_copy"]
        zc_x, _, _ = self.pools.zero_copy_layout(call.x.shape[1], call.handle.lease.slot)
        if pool is None or call.x.data.ptr != pool.ptr + zc_x:
            raise ValueError("zero_copy needs x = get_combine_buffer(handle), written with the expert outputs")

    def check_combine(self, call: CombineCall) -> None:
        """Before launch: a zero-copy combine's x must be its handle's buffer."""
        if call.zero_copy:
            self._check_zero_copy(call)

    def _in_place(self, call: CombineCall) -> list | None:
        """Every rank's x as addresses here when this combine reads the
        expert outputs where the callers left them (DirectConfig.combine_in_place),
        else None. Collective over the node whenever the config and call allow
        it (the same on every rank): the ranks exchange their x's IPC handles
        (Group.exchange: a rank that never comes is a CommTimeoutError)."""
        cfg, node = call.config, self.node
        if cfg.combine_in_place is False or call.zero_copy or call.expert_major:
            return None
        if node.comm_stream.is_capturing():  # the exchange is a host collective: a graph replays no host work
            if cfg.combine_in_place:
                raise ValueError("combine_in_place=True cannot be captured in a CUDA graph (its exchange of the "
                                 "ranks' x is a host collective); use combine_in_place=None or False")
            return None
        if self._peer_x is None:
            from ..ipc_peers import PeerArrays
            group = node.group
            if group.world_size != group.local_size:
                raise RuntimeError("the direct route's in-place combine runs on the ranks of one node")
            self._peer_x = PeerArrays(lambda rec: group.exchange(rec, "direct combine: the ranks' x (in place)"),
                                      group.local_rank, before_close=node.comm_stream.synchronize)
        x = call.x
        ptrs = self._peer_x.exchange(x.data.ptr if x.flags.c_contiguous else None, empty=x.shape[0] == 0)
        if ptrs is None and cfg.combine_in_place:
            raise ValueError("combine_in_place=True: some rank's x cannot be read in place (not C-contiguous, or "
                             "not in cudaMalloc'd memory that CUDA IPC can export)")
        return ptrs

    def combine(self, call: CombineCall):
        import cupy
        node, cfg, handle = self.node, call.config, call.handle
        x_peers = self._in_place(call)
        stage = 0 if call.zero_copy or x_peers is not None else cfg.bulk_stage()  # rows read in place: none pushed
        fn = self._kernel(D.combine_spec(node.num_ranks, cfg.num_threads, cfg.combine_words), cfg,
                          "direct combine", D.bulk_shared_bytes(stage, cfg.num_threads))
        T, H, k = handle.num_tokens, call.x.shape[1], call.num_topk
        N = handle.num_worst_tokens or handle.num_recv_tokens
        reduced = None
        if call.expert_major:  # one row per received row; zero-copy: straight into the handle's buffer
            out = self.get_combine_buffer(handle, H) if call.zero_copy else None
            reduced = node.reduce_expert_major(call.x, handle, call.pair_weights, out)
        x = call.x if reduced is None else reduced
        combined = cupy.empty((T, H), dtype=BF16)
        combined_w = cupy.empty((T, k), dtype=np.float32) if call.topk_weights is not None else None
        blocks = cfg.num_sms or D.default_num_sms(self.budget("combine_bf16"), max(N, T), cfg.num_threads)
        D.launch_combine(fn, blocks, cfg.num_threads, self.pools, handle, x, call.row_weights, call.topk_weights,
                         combined, combined_w, call.zero_copy, node.rank, node.group.guard("direct_combine"),
                         stage, call.kernel_time_ns, x_peers)
        return CombineResult(combined, combined_w, None, None if call.zero_copy else reduced)

    def destroy(self) -> None:
        self._fused.clear()  # their args hold the pools' addresses
        if self._peer_x is not None:
            self._peer_x.close()  # after the communication stream's kernels (before_close)
            self._peer_x = None
        if self._pools is not None:
            self._pools.destroy()
            self._pools = None


def _fused_addresses(base: int, call: DispatchCall, pos) -> tuple:
    """A fused dispatch's addresses in the order of D.FUSED_SOURCES: its
    notify allocation ``base``, the call's arrays and ``pos`` (0 for none)."""
    ptr = jit.ptr
    return (base, call.x.data.ptr, ptr(call.x_scales), ptr(call.topk_idx), ptr(call.topk_weights), ptr(pos),
            ptr(call.kernel_time_ns), ptr(call.notify_time_ns))


class _Offsets(CarvedRouting):
    """The offsets a fused send reads, before the handle exists (the arrays
    its notify block fills), as send_args reads a handle's."""

    __slots__ = ("num_channels", "expand")

    def __init__(self, arrays, num_channels: int):
        super().__init__(arrays)
        self.num_channels = num_channels
        self.expand = ExpandTables(arrays, arrays["alignment"], -1)


@dataclass(frozen=True)
class _FusedPlan:
    """The launch of a fused dispatch of one call shape (DirectRoute._fused_plan)."""
    fn: object
    template: jit.ArgTemplate
    pack: object  # the full packing function the template stands for ({source: address} -> args)
    parts: dict  # the notify pass's carve plan, and its bytes
    nbytes: int
    num_channels: int
    num_blocks: int
    num_threads: int
    shared_bytes: int


def _dispatch_kind(call: DispatchCall) -> str:
    """The dispatch's kind in the measured defaults (cupyep.sm_defaults)."""
    return "dispatch_fp8" if call.fp8 else "dispatch_bf16"
