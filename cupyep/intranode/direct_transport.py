"""The direct (one-copy) transport's calls, as methods of
:class:`cupyep.intranode.Buffer` (its base class): dispatch into the
receivers' pools, the pushing and the zero-copy combine, and the pools'
collective sizing. The layouts, pools and argument structs are in
:mod:`cupyep.intranode.direct`; the kernels in cuda_src/intranode/direct.cu.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import jit
from ..arrays import BF16, FP8, copy
from ..calls import traced_call
from . import direct as D
from .. import expert_major as EM
from ..results import (RECEIVE_FIELDS, DispatchHandle, DispatchResult, ExpandTables, aligned_expert_counts,
                      check_hidden, dispatch_result)


class DirectTransport:
    """Methods of Buffer for ``transport="direct"`` (they use the Buffer's
    group, streams, notify pass and error guards)."""

    def _check_direct_resident(self, fn, cfg: D.DirectConfig, what: str) -> None:
        """ValueError before launch unless every rank's blocks fit the GPU at
        once (the default, at most this rank's SM budget, always does)."""
        jit.require_resident(what, jit.max_resident_blocks(fn, cfg.num_threads), cfg.num_sms or self.sm_budget,
                             cfg.num_threads, self.group.ranks_per_gpu, self.num_device_sms, "num_sms", step=1)

    def _direct_pools(self) -> D.DirectPools:
        if self._direct is None:
            self._direct = D.DirectPools(self.group, self.sizes, self.num_in_flight, self.num_direct_bytes)
        return self._direct

    def _dispatch_direct(self, x, x_scales, topk_idx, topk_weights, num_experts, handle, arrays, num_worst_tokens,
                         expert_alignment, cfg, previous_event, async_finish, expert_major,
                         notify_time_ns=None, fresh: bool = False) -> DispatchResult:
        """Dispatch over the direct transport (arguments checked by dispatch).

        The receive arrays are views of the next dispatch slot (its Lease in
        the result and the handle); ``fresh``: copied out of it instead.
        expert_major: the senders write each row straight into its experts'
        blocks (once per local slot); no rank-major payload is written, so
        the result's recv_x and recv_x_scales are None. When some receiver's
        expert-major rows (padding included) do not fit the slot, the same
        verdict on every rank, the rows are sent rank-major into the slot
        instead and laid out expert-major locally into arrays of the result's
        own (``result.pooled`` is then RECEIVE_FIELDS): a slower call, never
        a refused one."""
        import cupy
        R = self.num_ranks
        T, H = x.shape
        fp8 = x.dtype == FP8
        k = topk_idx.shape[1] if topk_idx is not None else 0
        ns = H // 128 if fp8 else 0
        E_local = num_experts // R
        fn = jit.kernel(D.dispatch_spec(R, cfg.num_threads))
        self._check_direct_resident(fn, cfg, "direct dispatch")
        shape = (H * x.dtype.itemsize, ns, k, topk_idx is not None, topk_weights is not None)
        if expert_major and handle is not None and handle.expand.alignment != expert_alignment:
            raise ValueError(f"a cached expert-major dispatch on the direct transport keeps the expert_alignment of "
                             f"the handle's dispatch ({handle.expand.alignment}), got {expert_alignment}")
        pools = self._direct_pools()
        slot = pools.slots.peek()
        direct_em = expert_major  # the expert-major rows go straight into the slot
        lay = pools.expand_layout(shape, slot) if expert_major else pools.recv_layout(shape, slot)
        worst = handle.num_worst_tokens if handle is not None else num_worst_tokens
        if expert_major and worst > 0:  # decided before launch, from the bound, the same on every rank
            fits = EM.expert_rows_capacity(None, worst, k, E_local, expert_alignment) <= lay.em_rows
            # Senders write into every receiver's slot at one layout, and num_worst_tokens may differ between
            # ranks: the slot is laid out expert-major only where every rank's bound fits (a host exchange).
            if not self.group.exchange(np.array([fits], dtype=np.int8), "direct dispatch: its slot layout").all():
                direct_em, lay = False, pools.recv_layout(shape, slot)
        notified = handle is None
        fused = cfg.fused and notified
        if fused:
            fused_fn = jit.kernel(D.fused_spec(R, cfg.num_threads))
            self._check_direct_resident(fused_fn, cfg, "fused direct dispatch")
        pool = pools.pool("dispatch")
        capturing = cupy.cuda.get_current_stream().is_capturing() or self.comm_stream.is_capturing()
        lease = pools.slots.take("Buffer.dispatch (direct)", pin=capturing)
        self._begin(previous_event)
        with self.comm_stream:
            # On the communication stream, which its kernels use: memory the caller's stream
            # could reuse as soon as this call returns (async_finish) would be overwritten under them.
            pos = cupy.empty((T, k), dtype=np.int32) if direct_em else None
            sent = False
            if fused:  # layout, notify and the send in one launch
                handle, sent = self._dispatch_fused(fused_fn, cfg, pool, lay, x, x_scales, topk_idx, topk_weights,
                                                    num_experts, num_worst_tokens, expert_alignment, pos,
                                                    notify_time_ns)
            elif handle is None:
                routing = self._routing(topk_idx, num_experts, T, arrays)
                handle = self._notify(T, H, num_experts, *routing, D.notify_channels(R), expert_alignment,
                                      num_worst_tokens, transport="direct", notify_time_ns=notify_time_ns)
            N = handle.num_worst_tokens or handle.num_recv_tokens
            rows_sent, m_view, m_need = self._direct_rows(handle, direct_em, k, E_local, expert_alignment)
            if direct_em and not sent and m_need > lay.em_rows:  # the same verdict on every rank (global counts)
                direct_em, lay, pos, m_view = False, pools.recv_layout(shape, slot), None, 0
            recv_topk_idx = pool.view(lay.topk_idx, (N, k), np.int64) if topk_idx is not None else None
            recv_topk_weights = pool.view(lay.topk_weights, (N, k), np.float32) if topk_weights is not None else None
            recv_src_idx = pool.view(lay.src_idx, (N,), np.int32)
            if not sent:  # the send (a fused kernel that sent has sent already)
                blocks = cfg.num_sms or D.default_num_sms(self.sm_budget, rows_sent, cfg.num_threads)
                args = self._direct_dispatch_struct(handle, pool, lay, x, x_scales, topk_idx, topk_weights,
                                                    num_experts, capacity=N, pos=pos, compute_pos=False)
                if direct_em:
                    jit.kernel(D.positions_spec())((1,), (D.POSITIONS_THREADS,), (args,),
                                                    shared_mem=4 * D.hist_warps(num_experts) * num_experts)
                fn((blocks,), (cfg.num_threads,), (args,))
            # The handle owns its routing: the source indices (and the expert-major map) are copied out
            # of the slot, so combine and cached dispatch take it whatever happens to the slot later.
            handle = replace(handle, recv_src_idx=copy(recv_src_idx), lease=lease)
            per_expert = aligned_expert_counts(handle.recv_expert_counts, expert_alignment)
            if direct_em:
                em = EM.ExpertMajorOutput(
                    expert_x=pool.view(lay.em_x, (m_view, H), x.dtype),
                    expert_x_scales=pool.view(lay.em_x_scales, (m_view, ns), np.float32) if fp8 else None,
                    expert_offsets=handle.expand.meta[:E_local + 1],
                    expert_src_row=pool.view(lay.em_src_row, (m_view,), np.int32),
                    recv_expert_row=copy(pool.view(lay.em_recv_row, (N, k), np.int32)), num_expert_rows=m_view)
                handle = replace(handle, recv_expert_row=em.recv_expert_row, num_expert_rows=m_view)
                recv_x = recv_scales = None
            else:  # rank-major (and, past the slot's expert-major rows, the layout in arrays of its own)
                recv_x = pool.view(lay.x, (N, H), x.dtype)
                recv_scales = pool.view(lay.x_scales, (N, ns), np.float32) if fp8 else None
                handle, em = self._with_expert_major(handle, expert_major, per_expert if notified else None, recv_x,
                                                     recv_scales, recv_topk_idx, num_experts, expert_alignment)
            if fresh:  # the caller's own arrays: one more pass over the rows, never stale
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights = (
                    copy(a) if a is not None else None for a in (recv_x, recv_scales, recv_topk_idx,
                                                                 recv_topk_weights))
                if direct_em:
                    em = replace(em, expert_x=copy(em.expert_x), expert_src_row=copy(em.expert_src_row),
                                 expert_x_scales=copy(em.expert_x_scales) if em.expert_x_scales is not None
                                 else None)
        result = dispatch_result(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle,
                                 self._end(async_finish, (x, x_scales, topk_idx, topk_weights, pos)), em)
        result.lease = None if fresh else lease
        result.pooled = None if direct_em else RECEIVE_FIELDS
        return result

    def _direct_rows(self, handle, expert_major: bool, k: int, E_local: int, alignment: int) -> tuple[int, int, int]:
        """(rows this rank sends, this rank's expert-major rows M_cap, the most
        expert-major rows any rank lays out) of a direct dispatch; the
        expert-major ones are 0 without expert_major. M_cap is exact whenever
        the handle's counts are on the host (a notified call, or a cached one:
        the pairs go where the handle's expand tables say, so the handle's
        counts are this call's), else (worst-token mode) the bound
        EM.worst_expert_rows."""
        N = handle.num_worst_tokens or handle.num_recv_tokens
        rows_sent = int(handle.counts[self.rank].sum()) if handle.counts is not None else \
            handle.num_tokens * self.num_ranks
        if not expert_major:
            return rows_sent, 0, 0
        if handle.counts is not None:
            m_view = EM.expert_rows_capacity(aligned_expert_counts(handle.recv_expert_counts, alignment), N, k,
                                             E_local, alignment)
            return rows_sent, m_view, handle.expand.most_rows
        bound = EM.expert_rows_capacity(None, N, k, E_local, alignment)
        return rows_sent, bound, bound

    def _direct_dispatch_struct(self, handle, pool, lay, x, x_scales, topk_idx, topk_weights, num_experts,
                                capacity: int, pos=None, compute_pos: bool = False,
                                pos_threads: int = D.POSITIONS_THREADS) -> np.void:
        """DirectDispatchArgs of a send into ``pool`` laid out as ``lay``, at the
        offsets of ``handle`` (or of the arrays a fused notify fills);
        ``capacity``: rows of the receive arrays (padding past the count);
        ``pos``: the [T, k] expert-major positions (expert-major layouts),
        which the fused kernel fills when ``compute_pos`` (with blocks of
        ``pos_threads`` threads; else the position kernel)."""
        pools = self._direct
        T, H = x.shape
        k = topk_idx.shape[1] if topk_idx is not None else 0
        tables = handle.expand
        expand = jit.pack(D.EXPAND_DTYPE, base=jit.ptr(tables.base) if tables is not None else 0,
                          pos=jit.ptr(pos), meta=jit.ptr(tables.meta) if tables is not None else 0,
                          num_experts=num_experts, hist_warps=D.hist_warps(num_experts, pos_threads),
                          compute_pos=int(compute_pos))
        return jit.pack(
            D.DISPATCH_ARGS_DTYPE, pools=jit.ptr(pool.peer_ptrs), syncs=jit.ptr(pools.sync.peer_ptrs),
            sync=pools.sync_struct, out=lay.struct(), x=jit.ptr(x), x_scales=jit.ptr(x_scales),
            topk_idx=jit.ptr(topk_idx), topk_weights=jit.ptr(topk_weights), send_list=jit.ptr(handle.send_list),
            send_channel_prefix=jit.ptr(handle.send_channel_prefix),
            rank_prefix_matrix=jit.ptr(handle.rank_prefix_matrix), recv_rank_offset=jit.ptr(handle.recv_rank_offset),
            state=jit.ptr(pools.state), expand=expand, num_tokens=T, num_scales=H // 128 if x.dtype == FP8 else 0,
            num_topk=k, num_local_experts=num_experts // self.num_ranks, num_channels=handle.num_channels,
            capacity=capacity, rank=self.rank, guard=self.group.guard("intranode_direct_dispatch"))

    def _dispatch_fused(self, fn, cfg, pool, lay, x, x_scales, topk_idx, topk_weights, num_experts,
                        num_worst_tokens, alignment, pos, notify_time_ns=None) -> tuple[DispatchHandle, bool]:
        """One launch of the fused kernel (layout + notify + send into ``pool``
        laid out as ``lay``), on the communication stream. Returns (the
        handle, whether it sent). Outside worst-token mode the host waits,
        bounded, for the counts only (the kernel's status word), not for the
        send. When the slot is too small for some receiver's expert-major
        rows the kernel sends nothing (status 2, the same verdict on every
        rank) and the caller sends another way. ``pos``: the [T, k]
        expert-major positions the kernel fills (expert-major dispatch),
        else None."""
        import cupy
        R = self.num_ranks
        T, H = x.shape
        C = D.notify_channels(R)
        worst = num_worst_tokens > 0
        in_rank = cupy.empty((T, R), dtype=np.bool_)
        nargs, arrays = self._notify_struct(T, num_experts, None, None, in_rank, C, alignment, num_worst_tokens,
                                            "direct", notify_time_ns)
        handle = self._notify_handle(arrays, T, H, num_experts, C, num_worst_tokens, "direct") if worst else None
        view = handle or _Offsets(arrays, C)
        dargs = self._direct_dispatch_struct(view, pool, lay, x, x_scales, topk_idx, topk_weights, num_experts,
                                             capacity=num_worst_tokens if worst else 0, pos=pos,
                                             compute_pos=pos is not None, pos_threads=cfg.num_threads)
        args = jit.pack(D.FUSED_ARGS_DTYPE, notify=nargs, dispatch=dargs, layout_guard=self.group.guard("intranode_layout"),
                        host_status=0 if worst else self._host_counts_ptr + 4 * self._host_status_index)
        blocks = cfg.num_sms or self.sm_budget
        hist = D.hist_warps(num_experts, cfg.num_threads) * num_experts if pos is not None else 0
        smem = max(R * (C + 1) + R + num_experts, hist)
        fn((blocks,), (cfg.num_threads,), (args,), shared_mem=4 * smem)
        if worst:
            return handle, True
        status = self._wait_host_status()
        handle = self._notify_handle(arrays, T, H, num_experts, C, num_worst_tokens, "direct")
        if status == 2:  # nothing was sent: the slot cannot hold some receiver's rows
            if pos is not None and handle.expand.most_rows > lay.em_rows:
                return handle, False
            self.synchronize()
            raise RuntimeError(f"the fused direct dispatch found a receiver with more rows than its slot holds "
                               f"({lay.rows}), with at most max_tokens={self.sizes.max_tokens} tokens per rank")
        return handle, True

    def _wait_host_status(self) -> int:
        """Bounded host wait for the fused kernel's status word (1 sent, 2 pools
        too small); a device error (a timed-out barrier, a bad expert id) raises."""
        import time

        import cupy
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(self.comm_stream)
        word = self._host_counts[self._host_status_index:self._host_status_index + 1]
        deadline = time.monotonic() + self.group.timeout_s * 1.5 + 5.0
        spins = 0
        while int(word[0]) == -1:
            spins += 1  # the mapped word is cheap to read; the event and the clock are asked every 64th time
            if not spins & 63 and (ev.done or time.monotonic() > deadline):
                self.group.wait(ev, "intranode_direct_dispatch", "host wait for the fused notify's counts")
                if int(word[0]) == -1:  # ended without a status and without a device error
                    raise RuntimeError("the fused direct dispatch ended without publishing its counts")
                break
        status = int(word[0])
        if status == 3:
            self.group.wait(ev, "intranode_direct_dispatch", "fused notify")
            raise RuntimeError("the fused direct dispatch's notify pass failed without a device error")
        return status

    @traced_call("Buffer.get_combine_buffer")
    def get_combine_buffer(self, handle: DispatchHandle, hidden: int | None = None):
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
        if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
            raise ValueError("get_combine_buffer needs a DispatchHandle made by this Buffer")
        if handle.transport != "direct":
            raise ValueError("a zero-copy combine needs a handle of the direct transport")
        H = int(hidden or handle.hidden)
        check_hidden(H)
        self.sizes.check("Buffer.get_combine_buffer", handle.num_tokens, H)
        handle.lease.check("the zero-copy combine buffer")
        zc_x, _, _ = self._direct.zero_copy_layout(H, handle.lease.slot)
        N = handle.num_worst_tokens or handle.num_recv_tokens
        return self._direct.pool("zero_copy").view(zc_x, (N, H), BF16)

    def _check_zero_copy(self, x, handle, expert_major: bool, k: int) -> None:
        """ValueError unless x is ``handle``'s get_combine_buffer; StaleResultError
        when the handle's slot went to a later dispatch."""
        if handle.transport != "direct":
            raise ValueError("zero_copy needs a handle of the direct transport")
        if expert_major:
            raise ValueError("zero_copy takes one row per received row, not expert-major outputs")
        if k > D.ZERO_COPY_MAX_TOPK:
            raise ValueError(f"a zero-copy combine carries at most {D.ZERO_COPY_MAX_TOPK} top-k weights, got {k}")
        handle.lease.check("the zero-copy combine buffer")
        pool = self._direct.pools["zero_copy"]
        zc_x, _, _ = self._direct.zero_copy_layout(x.shape[1], handle.lease.slot)
        if pool is None or x.data.ptr != pool.ptr + zc_x:
            raise ValueError("zero_copy needs x = get_combine_buffer(handle), written with the expert outputs")

    def _combine_direct(self, fn, cfg, x, handle, row_weights, topk_weights, combined, combined_w, N,
                        zero_copy: bool = False) -> None:
        """Combine over the direct transport, on the communication stream:
        each expert rank pushes its rows (zero-copy: only their weights) into
        the owners' partial rows, each owner reduces them in rank order."""
        me = self.rank
        T, H = combined.shape
        k = topk_weights.shape[1] if topk_weights is not None else 0
        pools = self._direct
        if zero_copy:
            zc_x, partial_meta, fit = pools.zero_copy_layout(H, handle.lease.slot)
            pool, partial_x, meta_stride = pools.pools["zero_copy"], 0, 1 + D.ZERO_COPY_MAX_TOPK
        else:
            pool = pools.pool("combine")
            partial_x, partial_meta, fit = pools.combine_layout(H, k)
            zc_x, meta_stride = -1, 1 + k
        blocks = cfg.num_sms or D.default_num_sms(self.sm_budget, max(N, T), cfg.num_threads)
        args = jit.pack(
            D.COMBINE_ARGS_DTYPE, pools=jit.ptr(pool.peer_ptrs), syncs=jit.ptr(pools.sync.peer_ptrs),
            sync=pools.sync_struct, partial_x=partial_x, partial_meta=partial_meta, zc_x=zc_x, rows=fit,
            meta_stride=meta_stride, x=jit.ptr(x),
            row_weights=jit.ptr(row_weights), recv_topk_weights=jit.ptr(topk_weights),
            rank_prefix_matrix=jit.ptr(handle.rank_prefix_matrix), recv_rank_offset=jit.ptr(handle.recv_rank_offset),
            send_head=jit.ptr(handle.send_head), send_channel_prefix=jit.ptr(handle.send_channel_prefix),
            combined_x=jit.ptr(combined), combined_topk_weights=jit.ptr(combined_w), state=jit.ptr(pools.state),
            num_tokens=T, x_int4=H * 2 // 16, num_topk=k, num_channels=handle.num_channels, rank=me,
            guard=self.group.guard("intranode_direct_combine"))
        fn((blocks,), (cfg.num_threads,), (args,))


class _Offsets:
    """The offsets a fused send reads, before the handle exists (the arrays
    its notify block fills), as the attributes _direct_dispatch_struct uses."""

    def __init__(self, arrays: dict, num_channels: int):
        self.send_list, self.send_channel_prefix = arrays["send_list"], arrays["send_cp"]
        self.rank_prefix_matrix, self.recv_rank_offset = arrays["rpm"], arrays["recv_off"]
        self.num_channels = num_channels
        self.expand = ExpandTables(arrays["expand_base"], arrays["expert_meta"], arrays["alignment"], -1)
