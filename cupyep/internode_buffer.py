"""``cupyep.Buffer`` across nodes: what ``cupyep.Buffer(group)`` is when the
group spans two or more nodes (real, or emulated with ``--ranks-per-node``).

The same calls as normal mode within a node, carried by the two-hop mode
(cupyep.internode.TwoHopDispatch), with DeepEP's contract: each dispatch
returns results and a handle that stay valid until the caller drops them
(the results within ``num_in_flight`` dispatches, below); combine and
cached dispatch take any live handle, any number of times, in any order.

- ``get_dispatch_layout(topk_idx, num_experts)``: a LayoutResult over the
  world's R ranks (num_tokens_per_rank [R], num_tokens_per_expert [E],
  is_token_in_rank [T, R]) and num_tokens_per_rdma_rank [num_nodes], the
  tokens with an expert on each node.
- ``dispatch(x, topk_idx, topk_weights=None, num_experts=E)``: BF16 or FP8
  rows (``x_scales``, or the tuple ``(x, x_scales)``), a cached call
  (``handle=``: only x and its scales; the routing is the handle's),
  worst-token mode (``num_worst_tokens``, graph-capturable),
  ``expert_alignment`` for the per-expert counts. Returns a
  cupyep.DispatchResult: recv_x [N, H], recv_x_scales, recv_topk_idx [N, k]
  (local ids, -1 elsewhere), recv_topk_weights [N, k] (None without
  topk_weights), num_recv_tokens_per_expert (E_local ints, rounded up to
  expert_alignment; None in worst-token mode), handle (a TwoHopHandle) and
  event. The rows are those of the dispatch within a node: one per (token,
  rank), by source rank then token.
- ``combine(x, handle, topk_weights=None, row_weights=w)``: x [N, H] BF16,
  one row per received row, optionally weighted per row; returns a
  cupyep.CombineResult whose combined_x [T, H] is each token's (weighted)
  sum over the ranks it visited (reduced inside each node, then across
  nodes), within calc_diff 5e-6 of the exact sum (TwoHopDispatch.combine
  says how the weights round), and with topk_weights ([N, k] float32) their
  float32 sums, combined_topk_weights [T, k].

Sizes: the buffer is declared for at most ``max_tokens`` tokens per rank,
``hidden`` channels and ``num_topk`` experts per token (cupyep.sizes.DeclaredSizes,
the same on every rank); every call checks them before anything is launched
(a ValueError naming the size and the constructor argument) and may pass
fewer. The engines are made from the declared sizes, collectively, at the
first call of each route. ``num_bytes`` is accepted for cupyep.Buffer's
signature and not used across nodes: the pools are sized from the declared
sizes.

Lifetime: the receive arrays (recv_x, recv_x_scales, recv_topk_idx,
recv_topk_weights and the expert-major arrays) live in one of
``num_in_flight`` receive pool slots of the route, taken round-robin by its
dispatches; reading them through a result whose slot a later dispatch took
raises cupyep.StaleResultError. ``dispatch(..., fresh=True)`` copies them
into arrays of the caller's own. Handles own everything combine needs.

Routes: ``transport`` None, "queue" or "two_hop" runs the two-hop route,
"direct" the direct route (TwoHopDispatch(route="direct"): every row put
straight into its final row, no node dedup); both may run in one buffer
(one engine each), and a cached dispatch or a combine runs on its handle's.

``expert_major=True`` lays the received (row, local expert) pairs out in
per-expert blocks as within a node (cupyep.expert_major, from the
rank-major rows; DispatchResult's expert_x, expert_offsets, expert_src_row),
and ``combine(y, handle, pair_weights=..., expert_major=True)`` reduces such
outputs back to one row per received row first (the map is in the handle),
so cupyep.moe.MoELayer runs across nodes unchanged. Every call runs on the
buffer's communication stream, ordered with the caller's as within a node
(``previous_event``, ``async_finish``, cupyep.streams). What the
kernels across nodes do not carry yet raises ValueError before anything is
launched: configs, the normal-mode metrics. The layout hints
(``num_tokens_per_rank``, ``num_tokens_per_expert``, ``is_token_in_rank``)
are accepted and not needed: the notify pass lays the tokens out itself.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .internode import check_num_experts
from .sizes import DEFAULT_HIDDEN, DEFAULT_MAX_TOKENS, DEFAULT_NUM_TOPK, DeclaredSizes
from .slots import DEFAULT_IN_FLIGHT, check_num_in_flight

TRANSPORTS = (None, "queue", "two_hop", "direct")


def route_of(transport) -> str:
    """The route a call's ``transport`` runs on: None, "queue" or "two_hop"
    -> "two_hop"; "direct" -> "direct"; ValueError otherwise."""
    if transport not in TRANSPORTS:
        raise ValueError(f"across nodes the transport is the two-hop mode (None, 'queue' or 'two_hop') or "
                         f"the direct route ('direct'), got transport={transport!r}")
    return "direct" if transport == "direct" else "two_hop"


def tokens_per_node(is_token_in_rank, ranks_per_node: int):
    """num_tokens_per_rdma_rank [R / ranks_per_node] int32 from is_token_in_rank
    [T, R] bool (NumPy or CuPy; nodes of consecutive ranks): the tokens with at
    least one expert on each node's ranks."""
    T, R = is_token_in_rank.shape
    return is_token_in_rank.reshape(T, R // ranks_per_node, ranks_per_node).any(axis=2).sum(axis=0, dtype=np.int32)


@dataclass(frozen=True)
class ExpertMap:
    """What ``combine(..., expert_major=True)`` needs of an expert-major
    dispatch (kept in its handle): recv_expert_row [N, k] int32, the
    expert-major row of each (row, slot) pair (-1 elsewhere); num_expert_rows
    M_cap; count: [1] int32 device count of the valid rows (worst-token
    mode), else None."""
    recv_expert_row: object
    num_expert_rows: int
    count: object = None


def _refuse(call: str, given: dict) -> None:
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{call} across nodes does not take {name} (the two-hop mode does not carry it yet)")


class TwoHopBuffer:
    """cupyep.Buffer for a group of two or more nodes (module docstring).
    Collective, as cupyep.Buffer: create, call and destroy it on every rank
    in the same order.

    Arguments:
        group: from cupyep.init, spanning two or more nodes.
        num_bytes: accepted and not used across nodes.
        max_tokens, hidden, num_topk: the declared sizes (cupyep.sizes).
        num_in_flight: receive pool slots per route: how many dispatches'
            results may be in use at once (cupyep.slots).
    """

    def __init__(self, group, num_bytes: int | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 hidden: int = DEFAULT_HIDDEN, num_topk: int = DEFAULT_NUM_TOPK,
                 num_in_flight: int = DEFAULT_IN_FLIGHT):
        group.require_gpu("cupyep.Buffer")
        if group.num_nodes < 2:
            raise ValueError("TwoHopBuffer is cupyep.Buffer across two or more nodes; this group has one")
        self.sizes = DeclaredSizes(max_tokens, hidden, num_topk)
        self.num_in_flight = check_num_in_flight(num_in_flight)
        self.group = group
        self.num_ranks, self.rank = group.world_size, group.rank
        from .streams import CommStream
        self._calls = CommStream(group)  # every call of the two-hop mode runs on this one stream
        self.comm_stream = self._calls.stream
        self._engines = {}  # route -> its TwoHopDispatch, made at the route's first call
        self._captured = []  # arrays of calls captured in CUDA graphs, alive as long as this buffer
        self._em_loaded = False  # the expert-major kernels, loaded by the first expert-major dispatch

    # ---------------------------------------------------------------- engines
    def _engine(self, route: str):
        """The TwoHopDispatch of ``route``, made from the declared sizes at the
        route's first call (collective: every rank's declared sizes are
        compared first, in one host exchange)."""
        engine = self._engines.get(route)
        if engine is None:
            s = self.sizes
            mine = np.array([s.max_tokens, s.hidden, s.num_topk, self.num_in_flight], dtype=np.int64)
            every = self.group.exchange(mine, f"cupyep.Buffer across nodes: the declared sizes ({route} route)")
            if not (every == mine).all():
                raise ValueError(f"the ranks made cupyep.Buffer with different sizes ([max_tokens, hidden, num_topk, "
                                 f"num_in_flight] by rank): {every.tolist()}")
            engine = self._engines[route] = self._make_engine(route)
        return engine

    def _make_engine(self, route: str):
        from .internode import TwoHopDispatch
        s = self.sizes
        return TwoHopDispatch(self.group, s.max_tokens, s.hidden, s.num_topk, route=route,
                              num_in_flight=self.num_in_flight)

    def _engine_of(self, handle):
        """The engine that made ``handle``; ValueError for a handle of another buffer."""
        from .internode import TwoHopHandle
        engine = self._engines.get(getattr(handle, "route", None))
        if not isinstance(handle, TwoHopHandle) or engine is None or handle.owner != id(engine):
            raise ValueError("handle was not made by this buffer")
        return engine

    # ----------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            validate: bool = True):
        """Token counts of this rank's routing over the world's ranks and nodes
        (no communication; the first call loads the layout kernel once per
        node, collectively over the node).

        Arguments:
            topk_idx: [T, k] int64 expert ids, -1 for none; T <= max_tokens, k <= num_topk.
            num_experts: E, divisible by the world size.
            validate: check the expert ids on the host first (skipped under
                graph capture, where the kernel reports a bad id).

        Returns:
            cupyep.intranode.buffer.LayoutResult: num_tokens_per_rank [R] int32,
            num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool,
            num_tokens_per_rdma_rank [num_nodes] int32, event.
        """
        import cupy

        from . import jit
        from .arrays import as_cupy, check, check_expert_ids
        from . import dispatch_layout
        from .results import LayoutResult
        from .sizes import MAX_EXPERTS
        if getattr(topk_idx, "ndim", None) != 2:
            raise ValueError(f"topk_idx must be 2-D [T, k], got shape {tuple(getattr(topk_idx, 'shape', ()))}")
        T, k = topk_idx.shape
        self.sizes.check("Buffer.get_dispatch_layout", T, None, k)
        E = check_num_experts(num_experts, self.num_ranks)
        if E > MAX_EXPERTS:
            raise ValueError(f"num_experts must be at most {MAX_EXPERTS}, got {E}")
        topk_idx = check(as_cupy(topk_idx, "topk_idx"), "topk_idx", np.int64, ndim=2)
        if validate and not cupy.cuda.get_current_stream().is_capturing():
            check_expert_ids(topk_idx, E)
        guard = self.group.guard("intranode_layout")
        jit.load(dispatch_layout.layout_spec(), self.group)  # once per node, collectively, before the stream's work
        self._calls.begin(previous_event)
        with self.comm_stream:
            per_rank, per_expert, in_rank = dispatch_layout.launch_layout(topk_idx, E, self.num_ranks, guard)
            per_node = tokens_per_node(in_rank, self.group.local_size)
        res = LayoutResult(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                           num_tokens_per_rdma_rank=per_node)
        res.event = self._calls.end(async_finish, (topk_idx,))
        return res

    # ---------------------------------------------------------------- calls
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, x_scales=None, num_experts: int | None = None,
                 handle=None, num_tokens_per_rank=None, num_tokens_per_expert=None, is_token_in_rank=None,
                 num_worst_tokens: int = 0, expert_alignment: int = 1, config=None, previous_event=None,
                 async_finish: bool = False, validate: bool = True, expert_major: bool = False,
                 transport: str | None = None, notify_time_ns=None, queue_occupancy=None, fresh: bool = False):
        """cupyep.Buffer.dispatch across nodes (module docstring). ``fresh``:
        return copies of the receive arrays, the caller's own (lease None),
        instead of views of the receive pool slot. ``validate``: as within a
        node, the expert ids and the arguments every rank must share (hidden
        size, row dtype, top-k, weights, num_experts, expert-major options,
        route, cached or not), the latter by a bounded host exchange."""
        from .results import check_hidden
        _refuse("dispatch", {"config": config, "notify_time_ns": notify_time_ns, "queue_occupancy": queue_occupancy})
        route = route_of(transport)
        if not (isinstance(expert_alignment, (int, np.integer)) and expert_alignment >= 1):
            raise ValueError(f"expert_alignment must be an integer >= 1, got {expert_alignment!r}")
        if isinstance(x, tuple):
            if x_scales is not None:
                raise ValueError("pass FP8 scales either in the x tuple or as x_scales, not both")
            x, x_scales = x
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
        if handle is not None:
            engine = self._engine_of(handle)
            if transport is not None and route != handle.route:
                raise ValueError(f"the handle is of the {handle.route} route, transport={transport!r} asks for the "
                                 f"{route} one (a cached dispatch runs on its handle's route)")
            route, k, num_experts = handle.route, handle.num_topk, handle.num_experts
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError("dispatch needs topk_idx and num_experts (or a handle)")
            if topk_idx.ndim != 2:
                raise ValueError(f"topk_idx must be 2-D [T, k], got shape {tuple(topk_idx.shape)}")
            k = topk_idx.shape[1]
            num_experts = check_num_experts(num_experts, self.num_ranks)
        T, H = x.shape
        check_hidden(H)
        self.sizes.check("Buffer.dispatch", T, H, k)
        engine = self._engine(route)
        if expert_major:
            self._load_expert_major()
        if validate:  # what every rank's kernels assume of the others' calls
            self.group.agree("Buffer.dispatch", hidden=H, fp8=x.dtype == np.uint8, num_topk=k,
                             topk_weights=topk_weights is not None, num_experts=num_experts,
                             expert_major=expert_major, expert_alignment=int(expert_alignment),
                             direct=route == "direct", cached=handle is not None)
        self._calls.begin(previous_event)
        with self.comm_stream:
            out = engine.dispatch(x, None if handle is not None else topk_idx, topk_weights, x_scales=x_scales,
                                  num_worst_tokens=num_worst_tokens, validate=validate, handle=handle,
                                  num_experts=num_experts)
            result = self._result(out, num_experts, int(expert_alignment), expert_major, fresh, engine.num_sms)
        result.event = self._calls.end(async_finish, (x, x_scales, topk_idx, topk_weights))
        return result

    def _result(self, out, num_experts: int, alignment: int, expert_major: bool, fresh: bool, sms: int):
        """The DispatchResult of an engine's dispatch (on the communication
        stream), its expert-major layout built when asked and its map put in
        a handle of its own; the event is set by the caller."""
        from .results import RECEIVE_FIELDS, DispatchResult, aligned_expert_counts
        counts = out.handle.recv_expert_counts  # a cached dispatch's: its handle's routing
        if counts is None and not out.handle.num_worst_tokens:
            counts = tuple(self._expert_counts(out.recv_topk_idx, num_experts))
        per_expert = aligned_expert_counts(counts, alignment)
        recv = (out.recv_x, out.recv_x_scales, out.recv_topk_idx, out.recv_topk_weights)
        if fresh:  # the caller's own arrays, copied on the communication stream
            recv = tuple(None if a is None else a.copy() for a in recv)
        em = expert_map = None
        if expert_major:
            em, expert_map = self._expert_major(*recv[:3], out.handle, per_expert, num_experts, alignment, sms)
        handle = replace(out.handle, recv_expert_counts=counts, expert_map=expert_map)
        result = DispatchResult(recv_x=recv[0], recv_x_scales=recv[1], recv_topk_idx=recv[2],
                                recv_topk_weights=recv[3], num_recv_tokens_per_expert=per_expert, handle=handle,
                                lease=None if fresh else out.lease, pooled=RECEIVE_FIELDS)
        if em is not None:
            result.expert_x, result.expert_x_scales = em.expert_x, em.expert_x_scales
            result.expert_offsets, result.expert_src_row = em.expert_offsets, em.expert_src_row
        return result

    def _load_expert_major(self) -> None:
        """Collective, at the first expert-major dispatch and before its kernels:
        the expert-major kernels compiled once per node (jit.load with the
        group), then every rank lined up on the host, so that no rank compiles
        inside the call while its peers wait in the combine for its rows."""
        if self._em_loaded:
            return
        from . import jit
        from . import expert_major as EM
        jit.load(EM.permute_spec(), self.group)
        self.group.comm.Barrier()
        self._em_loaded = True

    def _expert_counts(self, recv_topk_idx, num_experts: int) -> list[int]:
        """(row, slot) pairs of each local expert (host ints; one read back)."""
        import cupy
        xp = cupy.get_array_module(recv_topk_idx)
        El = num_experts // self.num_ranks
        ids = recv_topk_idx.ravel()
        counts = xp.bincount(ids[ids >= 0], minlength=El)[:El]
        counts = counts.get() if xp is not np else counts
        return [int(c) for c in counts]

    def _expert_major(self, recv_x, recv_x_scales, recv_topk_idx, handle, per_expert, num_experts: int,
                      alignment: int, sms: int):
        """(the expert-major layout of a dispatch's rows, its ExpertMap); ``sms``:
        the blocks per rank of the two-hop kernels (the rank's share of the SMs)."""
        from . import jit
        from . import expert_major as EM
        N, k = recv_topk_idx.shape
        El = num_experts // self.num_ranks
        m_cap = EM.expert_rows_capacity(per_expert, N, k, El, alignment)
        count = None
        if per_expert is None:  # worst-token mode: the valid rows are counted on the device
            count = handle.plan["rpm"][self.num_ranks - 1, self.rank].astype(np.int32).reshape(1)
        em = EM.build(recv_x, recv_x_scales, recv_topk_idx, jit.ptr(count), El, alignment, m_cap,
                      self.group.guard("intranode_expert_major"), sms)
        if self.comm_stream.is_capturing():  # a graph keeps raw pointers: the count must outlive it
            self._captured.append((count, em))
        return em, ExpertMap(em.recv_expert_row, em.num_expert_rows, count)

    def combine(self, x, handle, topk_weights=None, *, row_weights=None, config=None, previous_event=None,
                async_finish: bool = False, pair_weights=None, expert_major=None, zero_copy: bool = False):
        """cupyep.Buffer.combine across nodes (module docstring): any live
        handle of this buffer, any number of times, in any order."""
        from .results import CombineResult
        _refuse("combine", {"config": config})
        if zero_copy:
            raise ValueError("combine across nodes does not take zero_copy (the direct transport's)")
        engine = self._engine_of(handle)
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D [N, H], got shape {tuple(x.shape)}")
        self.sizes.check("Buffer.combine", handle.num_tokens, x.shape[1])
        em = handle.expert_map
        if expert_major or (expert_major is None and em is not None and x.shape[0] == em.num_expert_rows):
            if em is None:
                raise ValueError("expert_major=True needs the handle of a dispatch(..., expert_major=True)")
            if x.shape[0] != em.num_expert_rows:
                raise ValueError(f"expert-major x has {x.shape[0]} rows, the dispatch laid out {em.num_expert_rows}")
            from . import expert_major as EM
            EM.check_pair_weights(pair_weights, *em.recv_expert_row.shape)
        elif pair_weights is not None:
            raise ValueError("pair_weights weight expert-major rows; x holds rank-major rows")
        else:
            em = None
        self._calls.begin(previous_event)
        with self.comm_stream:
            reduced = None
            if em is not None:  # expert-major outputs -> one row per received row
                from . import jit
                from . import expert_major as EM
                x = reduced = EM.reduce(x, em.recv_expert_row, pair_weights, jit.ptr(em.count), engine.num_sms)
            got = engine.combine(x, handle, row_weights=row_weights, topk_weights=topk_weights)
            combined, combined_w = got if topk_weights is not None else (got, None)
        event = self._calls.end(async_finish, (x, topk_weights, row_weights, pair_weights))
        return CombineResult(combined, combined_w, event, reduced)

    # ------------------------------------------------------------- lifetime
    def synchronize(self) -> None:
        """Bounded wait for all work on the communication stream."""
        import cupy
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(self.comm_stream)
        self.group.wait(ev, "internode_two_hop_combine", "host wait for the communication stream")

    def destroy(self) -> None:
        """Collective: free the engines (those the calls made, in the order they were made)."""
        self._calls.release()
        self._captured = []
        for engine in self._engines.values():
            engine.destroy()
        self._engines = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
