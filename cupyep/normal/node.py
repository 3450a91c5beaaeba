"""What the two routes within a node share (:class:`Node`): the rank's
symmetric IPC buffer (its barrier and notify regions, and the queue route's
rings), the mapped host words the notify pass writes, the layout and notify
passes that make a handle, and the expert-major layout of received rows.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import jit
from ..arrays import Carved, as_cupy, carve_plan, check
from ..ipc import SymmetricBuffer
from ..results import DispatchHandle, ExpandTables, LayoutResult, carved_handle, evolve
from . import expert_major as EM
from . import layout as L
from . import node_kernels as NK
from .queue_layout import MAX_LOCAL_EXPERTS, buffer_layout
from .route import Route

INT_MAX = 2**31 - 1
#: What a notify pass's args hold per call (jit.ArgTemplate sources, in launch order): the handle's
#: carved allocation, the layout's input (notify_layout) or the caller's layout, and the metric.
NOTIFY_LAYOUT_SOURCES = ("base", "topk_idx", "notify_time")
NOTIFY_SOURCES = ("base", "per_rank", "per_expert", "in_rank", "notify_time")


class _NotifyPlan(NamedTuple):
    template: "jit.ArgTemplate"
    pack: object  # the template's packing function (tests compare the two)
    fn: object
    smem: int
    parts: dict
    nbytes: int


class Node:
    """The ranks of one node (collective: made, used and destroyed on every
    rank in the same order).

    group: from cupyep.init, one node; num_bytes: bytes of each rank's IPC
    buffer (cupyep.normal.queue_layout.size_hint); comm_stream: the
    buffer's communication stream, on which every pass runs; buffer_id: the
    id its handles carry; num_device_sms, sm_budget: the SMs its kernels run
    on (the GPU's, or its partition's) and this rank's share of them (the
    Buffer's); resident_ranks: the ranks whose blocks share those SMs (a
    residency check counts them all)."""

    def __init__(self, group, num_bytes: int, comm_stream, buffer_id: int, num_device_sms: int, sm_budget: int,
                 resident_ranks: int):
        import ctypes

        import cupy
        self.group = group
        self.num_ranks = group.local_size
        self.rank = group.local_rank
        self.comm_stream = comm_stream
        self.buffer_id = buffer_id
        self.num_device_sms, self.sm_budget, self.resident_ranks = num_device_sms, sm_budget, resident_ranks
        self.layout = buffer_layout(self.num_ranks, num_bytes)
        self.buffer = SymmetricBuffer(group, num_bytes)
        # Mapped host memory the notify pass writes: [1 + E_local + R * R + 1] (see NotifyArgs), then
        # the fused direct dispatch's status word (HOST_STATUS).
        n_counts = 1 + MAX_LOCAL_EXPERTS + self.num_ranks ** 2 + 2
        self.host_status_index = n_counts - 1
        self.host_counts_ptr = cupy.cuda.runtime.hostAlloc(4 * n_counts, 2)
        self.host_counts = np.frombuffer((ctypes.c_int32 * n_counts).from_address(self.host_counts_ptr),
                                         dtype=np.int32)
        # Compile once per node, collectively (so that no rank compiles inside a call while its
        # peers' kernels already wait on it).
        jit.load(L.layout_spec(), group)
        jit.load(NK.notify_spec(self.num_ranks), group)
        jit.load(NK.notify_layout_spec(self.num_ranks), group)
        jit.load(EM.permute_spec(), group)
        self._notify_plans: dict = {}  # a notify pass's call shape -> its _NotifyPlan

    # ------------------------------------------------------------ layout
    def layout_pass(self, topk_idx, num_experts: int) -> LayoutResult:
        """The layout kernel's counts of one routing (on the communication stream)."""
        return LayoutResult(*L.launch_layout(topk_idx, num_experts, self.num_ranks, self.group.guard("layout")))

    def check_hints(self, hints, num_experts: int, T: int):
        """The caller's (num_tokens_per_rank [R], num_tokens_per_expert [E],
        is_token_in_rank [T, R]) checked (ValueError), or None unless all three
        are given."""
        per_rank, per_expert, in_rank = hints
        if per_rank is None or per_expert is None or in_rank is None:
            return None
        R = self.num_ranks
        return (check(as_cupy(per_rank, "num_tokens_per_rank"), "num_tokens_per_rank", np.int32, shape=(R,)),
                check(as_cupy(per_expert, "num_tokens_per_expert"), "num_tokens_per_expert", np.int32,
                      shape=(num_experts,)),
                check(as_cupy(in_rank, "is_token_in_rank"), "is_token_in_rank", np.bool_, shape=(T, R)))

    # ------------------------------------------------------------ notify
    def notify_launch(self, topk_idx, num_experts: int, hints, C: int, alignment: int, num_worst_tokens: int,
                      transport: str = "queue", notify_time_ns=None, src_rows: int = 0):
        """The layout (unless the caller's checked ``hints``, from
        :meth:`check_hints`, stand for it) and notify passes of a notified
        dispatch, launched as one block from a plan made once per call shape
        (:meth:`_notify_plan`); returns the handle's arrays (a
        cupyep.arrays.Carved, one allocation). The host reads the counts after
        :meth:`wait_counts`."""
        import cupy
        plan = self._notify_plan(topk_idx.shape[0], topk_idx.shape[1], num_experts, hints is None, C, alignment,
                                 num_worst_tokens, transport, notify_time_ns is not None, src_rows)
        arrays = Carved(cupy.empty(plan.nbytes, dtype=np.uint8), plan.parts)
        if hints is not None:
            arrays["per_rank"], arrays["per_expert"], arrays["in_rank"] = hints
        if transport == "direct":
            arrays["alignment"] = int(alignment)
        if num_worst_tokens <= 0:
            self.reset_host_counts()
        stream = cupy.cuda.get_current_stream().ptr
        if hints is None:
            plan.template.launch(plan.fn, 1, NK.NOTIFY_THREADS, plan.smem, stream, arrays.base_ptr,
                                 topk_idx.data.ptr, jit.ptr(notify_time_ns))
        else:
            plan.template.launch(plan.fn, 1, NK.NOTIFY_THREADS, plan.smem, stream, arrays.base_ptr,
                                 hints[0].data.ptr, hints[1].data.ptr, hints[2].data.ptr, jit.ptr(notify_time_ns))
        return arrays

    def _notify_plan(self, T: int, k: int, num_experts: int, layout: bool, C: int, alignment: int,
                     num_worst_tokens: int, transport: str, timed: bool, src_rows: int) -> "_NotifyPlan":
        """The launch of a notify pass of one call shape (with ``layout``, the
        layout in front of it, notify_layout): its kernel, shared memory, the
        carve plan of the handle's arrays and its args as a jit.ArgTemplate
        of the packing functions (sources: NOTIFY_LAYOUT_SOURCES or
        NOTIFY_SOURCES), checked against a full pack when made."""
        key = (T, k, num_experts, layout, C, alignment, num_worst_tokens, transport, timed, src_rows)
        plan = self._notify_plans.get(key)
        if plan is not None:
            return plan
        if len(self._notify_plans) >= jit.MAX_PLANS:  # call shapes that vary per call (T) would grow it
            self._notify_plans.clear()
        R, E = self.num_ranks, num_experts
        parts, nbytes = carve_plan(self.notify_shapes(T, E, C, transport, src_rows, in_rank=layout),
                                   dtypes=L.LAYOUT_DTYPES)
        layout_guard = self.group.guard("layout")

        def notify_args(a: dict):  # a pure function of the addresses
            arrays = Carved(jit.Address((0,), a["base"]), parts)  # only its parts' addresses are read
            if not layout:
                arrays["per_rank"] = jit.Address((R,), a["per_rank"])
                arrays["per_expert"] = jit.Address((E,), a["per_expert"])
                arrays["in_rank"] = jit.Address((T, R), a["in_rank"])
            timer = jit.Address((2,), a["notify_time"]) if timed else None
            return self.pack_notify(arrays, T, E, C, alignment, num_worst_tokens, timer)
        if layout:
            sources = NOTIFY_LAYOUT_SOURCES
            fn, smem = jit.kernel(NK.notify_layout_spec(R)), NK.notify_layout_smem(R, C, E)

            def pack(a: dict):
                return NK.notify_layout_args(notify_args(a), a["topk_idx"], k, layout_guard)
        else:
            sources, pack = NOTIFY_SOURCES, notify_args
            fn, smem = jit.kernel(NK.notify_spec(R)), NK.notify_smem(R, C)
        template = jit.ArgTemplate(pack, sources)
        template.check(pack, *((i + 1) << 36 for i in range(len(sources))))
        plan = self._notify_plans[key] = _NotifyPlan(template, pack, fn, smem, parts, nbytes)
        return plan

    def wait_counts(self, num_worst_tokens: int) -> None:
        """Bounded host wait for a notify pass's counts (none in worst-token mode)."""
        if num_worst_tokens <= 0:  # the kernel publishes the received rows last, after a fence
            self.group.wait_word(self.host_counts[0:1], self.comm_stream, "notify", "host wait for receive counts")

    def received_rows(self, num_worst_tokens: int) -> int:
        """N of a notify pass whose counts have arrived (num_worst_tokens in worst-token mode)."""
        return num_worst_tokens if num_worst_tokens > 0 else int(self.host_counts[0])

    def notify(self, topk_idx, H: int, num_experts: int, hints, C: int, alignment: int, num_worst_tokens: int,
               transport: str = "queue", notify_time_ns=None, src_rows: int = 0) -> DispatchHandle:
        """:meth:`notify_launch`, :meth:`wait_counts`, and the handle."""
        arrays = self.notify_launch(topk_idx, num_experts, hints, C, alignment, num_worst_tokens, transport,
                                    notify_time_ns, src_rows)
        self.wait_counts(num_worst_tokens)
        return self.notify_handle(arrays, topk_idx.shape[0], H, num_experts, C, num_worst_tokens, transport)

    def notify_shapes(self, T, num_experts, C, transport: str, src_rows: int = 0, in_rank: bool = False) -> dict:
        """{name: shape} of a notify pass's arrays (int32 but for
        cupyep.normal.layout.LAYOUT_DTYPES): the handle's routing; the direct route's
        expert-major tables (expand_base [R, E_local + 1], expert_meta
        [2 E_local + 1]); [T, R] bool "in_rank" with ``in_rank`` (a kernel
        that lays the tokens out itself); and, ``src_rows`` > 0, "src_idx"
        [src_rows] for the handle's copy of the source indices."""
        R = self.num_ranks
        E_local = num_experts // R
        shapes = {"send_head": (T, R), "send_list": (R, max(T, 1)), "send_cp": (R, C + 1), "recv_cp": (R, C + 1),
                  "recv_off": (R + 1,), "rpm": (R, R), "recv_per_expert": (E_local,)}
        if transport == "direct":
            shapes.update(expand_base=(R, E_local + 1), expert_meta=(2 * E_local + 1,))
        if in_rank:
            shapes["in_rank"] = (T, R)
        if src_rows:
            shapes["src_idx"] = (src_rows,)
        return shapes

    def reset_host_counts(self) -> None:
        """The mapped words the host reads first set to -1 (the kernel writes
        the counts before them)."""
        self.host_counts[0] = self.host_counts[self.host_status_index] = -1

    def pack_notify(self, arrays, T, num_experts, C, alignment, num_worst_tokens, notify_time_ns=None):
        """NotifyArgs over ``arrays`` (a Carved of :meth:`notify_shapes`'
        parts, with "per_rank", "per_expert" and "in_rank" set where the
        caller's layout stands for notify_layout's): a pure function of the
        arrays' addresses. Resets nothing (see :meth:`reset_host_counts`)."""
        worst = num_worst_tokens > 0
        return NK.notify_args(self.buffer, self.layout, arrays,
                              host_counts=0 if worst else self.host_counts_ptr, notify_time_ns=notify_time_ns,
                              num_tokens=T, num_experts=num_experts, num_channels=C, expert_alignment=alignment,
                              capacity=num_worst_tokens if worst else INT_MAX, rank=self.rank,
                              guard=self.group.guard("notify"))

    def notify_handle(self, arrays, T, H, num_experts, C, num_worst_tokens, transport, lease=None) -> DispatchHandle:
        """The handle of a notify pass whose host counts (if any) have arrived
        (``lease``: its dispatch slot's, on the direct route)."""
        R = self.num_ranks
        E_local = num_experts // R
        hc = self.host_counts
        if num_worst_tokens > 0:
            n_recv, counts, matrix = -1, None, None
        else:
            n_recv = int(hc[0])
            counts = tuple(hc[1:1 + E_local].tolist())  # unaligned
            matrix = hc[1 + E_local:1 + E_local + R * R].astype(np.int64).reshape(R, R)
        expand = None
        if "expand_base" in arrays:
            most = int(hc[1 + E_local + R * R]) if num_worst_tokens <= 0 else -1
            expand = ExpandTables(arrays, arrays["alignment"], most)
        return carved_handle(arrays, num_recv_tokens=n_recv, num_worst_tokens=num_worst_tokens, num_tokens=T,
                             hidden=H, num_experts=num_experts, num_channels=C, buffer_id=self.buffer_id,
                             recv_expert_counts=counts, transport=transport, counts=matrix, expand=expand,
                             lease=lease)

    # ------------------------------------------------------- expert major
    def with_expert_major(self, handle, expert_major: bool, per_expert, recv_x, recv_scales, recv_topk_idx,
                          num_experts, alignment):
        """(handle, expert-major layout or None) after a dispatch's send: the
        layout when asked for, and the handle's expert-major map set, or
        cleared (a cached handle's map may not fit this routing).
        ``per_expert``: this call's aligned host counts (exact M_cap), or
        None (the bound)."""
        em = None
        if expert_major:
            R = self.num_ranks
            worst = handle.num_worst_tokens > 0
            m_cap = EM.expert_rows_capacity(per_expert, recv_x.shape[0], recv_topk_idx.shape[1], num_experts // R,
                                            alignment)
            num_recv_ptr = handle.recv_rank_offset.data.ptr + 4 * R if worst else 0  # device: recv_rank_offset[R]
            em = EM.build(recv_x, recv_scales, recv_topk_idx, num_recv_ptr, num_experts // R, alignment, m_cap,
                          self.group.guard("expert_major"), self.num_device_sms)
        if em is not None:
            handle = evolve(handle, recv_expert_row=em.recv_expert_row, num_expert_rows=em.num_expert_rows)
        elif handle.recv_expert_row is not None:
            handle = evolve(handle, recv_expert_row=None, num_expert_rows=0)
        return handle, em

    def reduce_expert_major(self, x, handle, pair_weights, out=None):
        """[N, H] BF16 rows of expert-major outputs ``x`` [M_cap, H]: each
        received row's slots summed in FP32, weighted by ``pair_weights``
        (into ``out`` when given)."""
        num_recv_ptr = handle.recv_rank_offset.data.ptr + 4 * self.num_ranks if handle.num_worst_tokens else 0
        return EM.reduce(x, handle.recv_expert_row, pair_weights, num_recv_ptr, self.num_device_sms, out)

    # ------------------------------------------------------------ common
    def check_resident(self, fn, num_sms: int, num_threads: int, what: str, step: int,
                       shared_bytes: int = 0) -> None:
        """ValueError before launch unless every rank's ``num_sms`` blocks of
        ``fn`` (with ``shared_bytes`` of dynamic shared memory each) fit the
        SMs at once (ranks sharing them under MPS included)."""
        jit.require_resident(what, jit.max_resident_blocks(fn, num_threads, shared_bytes), num_sms, num_threads,
                             self.resident_ranks, self.num_device_sms, "num_sms", step=step)

    def destroy(self) -> None:
        import cupy
        if self.buffer.alive:
            self.buffer.destroy()
        if self.host_counts_ptr:
            self.host_counts = None
            cupy.cuda.runtime.freeHost(self.host_counts_ptr)
            self.host_counts_ptr = 0


class NodeRoute(Route):
    """What the routes within a node have in common: their handles are
    DispatchHandles of the node's buffer tagged with the route's transport,
    and their layout is the node's layout pass."""

    def __init__(self, node):
        self.node = node

    def owns(self, handle) -> bool:
        return isinstance(handle, DispatchHandle) and handle.buffer_id == self.node.buffer_id and \
            handle.transport == self.transport

    def expert_rows(self, handle) -> tuple[int, int]:
        return (handle.num_expert_rows, handle.recv_expert_row.shape[1]) if handle.recv_expert_row is not None \
            else (0, 0)

    def layout(self, topk_idx, num_experts: int):
        return self.node.layout_pass(topk_idx, num_experts)
