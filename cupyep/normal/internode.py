"""The two routes across nodes (a group of two or more nodes, real or
emulated with ``--ranks-per-node``): :class:`InternodeRoute` ``"two_hop"``
carries ``transport="queue"`` (cupyep.normal.internode_kernels.TwoHopDispatch:
a token crosses to another node once, to its rail peer, which forwards it
in the node), ``"direct"`` carries ``transport="direct"`` (every row put
straight into its final row there, no node dedup). Both keep DeepEP's
contract, as within a node: each dispatch returns results and a handle
(a TwoHopHandle) that stay valid until the caller drops them (the receive
arrays within ``num_in_flight`` dispatches of the route); combine and
cached dispatch take any live handle, any number of times, in any order.

The rows a rank receives are those of the dispatch within a node: one per
(token, rank), by source rank then token (the oracle is
cupyep.reference.intranode_dispatch). A combine reduces inside each node,
then across nodes, within calc_diff 5e-6 of the exact sum
(TwoHopDispatch.combine says how the row weights round).

Each route's engine is made from the declared sizes, collectively, at the
route's first call; the receive arrays (and the expert-major arrays) live
in one of ``num_in_flight`` receive pool slots of the route, taken
round-robin by its dispatches (cupyep.slots); ``fresh=True`` copies them
into arrays of the caller's own. ``expert_major=True`` lays the received
(row, local expert) pairs out in per-expert blocks from the rank-major rows
(cupyep.normal.expert_major), so cupyep.moe.MoELayer runs across nodes
unchanged. Not carried across nodes (a ValueError before launch): configs,
the normal-mode metrics, the zero-copy combine. The layout hints
(num_tokens_per_rank, ...) are accepted and not needed: the notify pass
lays the tokens out itself.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import jit
from ..arrays import expert_counts, to_host
from ..results import RECEIVE_FIELDS, CombineResult, DispatchResult, LayoutResult, aligned_expert_counts
from . import expert_major as EM
from . import layout as L
from .route import CombineCall, DispatchCall, Route

ROUTES = {"queue": "two_hop", "direct": "direct"}  # transport -> the route across nodes that carries it


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


class InternodeRoute(Route):
    """One route across nodes (module docstring). ``world``: what the
    buffer's routes across nodes share (:class:`Internode`)."""

    metrics = frozenset()

    def __init__(self, world: "Internode", transport: str):
        self.world = world
        self.transport = transport
        self.name = ROUTES[transport]
        self._engine = None

    @property
    def engine(self):
        """The route's TwoHopDispatch, made from the declared sizes at its
        first call (collective: every rank's declared sizes are compared
        first, in one host exchange)."""
        if self._engine is None:
            self._engine = self.world.make_engine(self.name)
        return self._engine

    def dispatch_config(self, config, fp8: bool, handle):
        if config is not None:
            raise ValueError("dispatch across nodes does not take config (the two-hop mode does not carry it yet)")
        return None

    def combine_config(self, config, handle):
        if config is not None:
            raise ValueError("combine across nodes does not take config (the two-hop mode does not carry it yet)")
        return None

    def owns(self, handle) -> bool:
        from .internode_kernels import TwoHopHandle
        return isinstance(handle, TwoHopHandle) and self._engine is not None and handle.owner == id(self._engine) \
            and handle.route == self.name

    def expert_rows(self, handle) -> tuple[int, int]:
        em = handle.expert_map
        return (em.num_expert_rows, em.recv_expert_row.shape[1]) if em is not None else (0, 0)

    def received_rows(self, handle) -> int:
        return handle.num_rows

    def layout(self, topk_idx, num_experts: int):
        return self.world.layout(topk_idx, num_experts)

    def dispatch(self, call: DispatchCall):
        engine = self.engine
        if call.expert_major:
            self.world.load_expert_major()
        out = engine.dispatch(call.x, None if call.handle is not None else call.topk_idx, call.topk_weights,
                              x_scales=call.x_scales, num_worst_tokens=call.num_worst_tokens, validate=False,
                              handle=call.handle, num_experts=call.num_experts)
        return self._result(out, call, engine.num_sms)

    def _result(self, out, call: DispatchCall, sms: int):
        """The DispatchResult of an engine's dispatch, its expert-major layout
        built when asked and its map put in a handle of its own."""
        counts = out.handle.recv_expert_counts  # a cached dispatch's: its handle's routing
        if counts is None and not out.handle.num_worst_tokens:
            # (row, slot) pairs of each local expert: one pass of atomic adds, one read back
            El = call.num_experts // self.world.num_ranks
            counts = tuple(int(c) for c in to_host(expert_counts(out.recv_topk_idx, El)))
        per_expert = aligned_expert_counts(counts, call.expert_alignment)
        recv = (out.recv_x, out.recv_x_scales, out.recv_topk_idx, out.recv_topk_weights)
        if call.fresh:  # the caller's own arrays, copied on the communication stream
            recv = tuple(None if a is None else a.copy() for a in recv)
        em = expert_map = None
        if call.expert_major:
            em, expert_map = self._expert_major(*recv[:3], out.handle, per_expert, call, sms)
        handle = replace(out.handle, recv_expert_counts=counts, expert_map=expert_map)
        result = DispatchResult(recv_x=recv[0], recv_x_scales=recv[1], recv_topk_idx=recv[2],
                                recv_topk_weights=recv[3], num_recv_tokens_per_expert=per_expert, handle=handle,
                                lease=None if call.fresh else out.lease, pooled=RECEIVE_FIELDS)
        if em is not None:
            result.expert_x, result.expert_x_scales = em.expert_x, em.expert_x_scales
            result.expert_offsets, result.expert_src_row = em.expert_offsets, em.expert_src_row
        return result

    def _expert_major(self, recv_x, recv_x_scales, recv_topk_idx, handle, per_expert, call: DispatchCall, sms: int):
        """(the expert-major layout of a dispatch's rows, its ExpertMap); ``sms``:
        the blocks per rank of the route's kernels (the rank's share of the SMs)."""
        world = self.world
        N, k = recv_topk_idx.shape
        El = call.num_experts // world.num_ranks
        m_cap = EM.expert_rows_capacity(per_expert, N, k, El, call.expert_alignment)
        count = None
        if per_expert is None:  # worst-token mode: the valid rows are counted on the device
            count = handle.plan["rpm"][world.num_ranks - 1, world.rank].astype(np.int32).reshape(1)
        em = EM.build(recv_x, recv_x_scales, recv_topk_idx, jit.ptr(count), El, call.expert_alignment, m_cap,
                      world.group.guard("expert_major"), sms)
        if world.comm_stream.is_capturing():  # a graph keeps raw pointers: the count must outlive it
            world.captured.append((count, em))
        return em, ExpertMap(em.recv_expert_row, em.num_expert_rows, count)

    def combine(self, call: CombineCall):
        engine = self.engine
        x = reduced = None
        em = call.handle.expert_map
        if call.expert_major:  # expert-major outputs -> one row per received row
            x = reduced = EM.reduce(call.x, em.recv_expert_row, call.pair_weights, jit.ptr(em.count), engine.num_sms)
        got = engine.combine(call.x if x is None else x, call.handle, row_weights=call.row_weights,
                             topk_weights=call.topk_weights)
        combined, combined_w = got if call.topk_weights is not None else (got, None)
        return CombineResult(combined, combined_w, None, reduced)

    def destroy(self) -> None:
        if self._engine is not None:
            self._engine.destroy()
            self._engine = None


class Internode:
    """What the routes across nodes of one buffer share: the group, the
    declared sizes, the communication stream, the arrays of captured calls
    (alive as long as the buffer) and the expert-major kernels' loading."""

    def __init__(self, group, sizes, num_in_flight: int, comm_stream, num_sms: int = 0):
        self.group = group
        self.num_sms = num_sms  # blocks per rank of every route's kernels (0: the rank's share)
        self.sizes = sizes
        self.num_in_flight = num_in_flight
        self.comm_stream = comm_stream
        self.num_ranks, self.rank = group.world_size, group.rank
        self.captured: list = []
        self._em_loaded = False
        self._layout_loaded = False

    def make_engine(self, route: str):
        """A TwoHopDispatch of ``route`` from the declared sizes (collective)."""
        s = self.sizes
        mine = np.array([s.max_tokens, s.hidden, s.num_topk, self.num_in_flight, self.num_sms], dtype=np.int64)
        every = self.group.exchange(mine, f"cupyep.Buffer across nodes: the declared sizes ({route} route)")
        if not (every == mine).all():
            raise ValueError(f"the ranks made cupyep.Buffer with different sizes ([max_tokens, hidden, num_topk, "
                             f"num_in_flight, num_sms] by rank): {every.tolist()}")
        return self.new_engine(route)

    def new_engine(self, route: str):
        """The TwoHopDispatch of ``route`` at the declared sizes (collective)."""
        from .internode_kernels import TwoHopDispatch
        s = self.sizes
        return TwoHopDispatch(self.group, s.max_tokens, s.hidden, s.num_topk, route=route,
                              num_in_flight=self.num_in_flight, num_sms=self.num_sms)

    def load_layout(self) -> None:
        """Collective, at the first layout: the layout kernel compiled once per
        node, before the stream's work."""
        if not self._layout_loaded:
            jit.load(L.layout_spec(), self.group)
            self._layout_loaded = True

    def layout(self, topk_idx, num_experts: int) -> LayoutResult:
        """Counts over the world's ranks and nodes (no communication):
        num_tokens_per_rank [R], num_tokens_per_expert [E], is_token_in_rank
        [T, R] and num_tokens_per_rdma_rank [num_nodes] int32."""
        self.load_layout()
        per_rank, per_expert, in_rank = L.launch_layout(topk_idx, num_experts, self.num_ranks,
                                                        self.group.guard("layout"))
        return LayoutResult(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                            num_tokens_per_rdma_rank=tokens_per_node(in_rank, self.group.local_size))

    def load_expert_major(self) -> None:
        """Collective, at the first expert-major dispatch and before its kernels:
        the expert-major kernels compiled once per node, then every rank lined
        up on the host, so that no rank compiles inside the call while its
        peers wait in the combine for its rows."""
        if self._em_loaded:
            return
        jit.load(EM.permute_spec(), self.group)
        self.group.comm.Barrier()
        self._em_loaded = True

    def destroy(self) -> None:
        self.captured = []
