"""``cupyep.Buffer`` across nodes: what ``cupyep.Buffer(group)`` is when the
group spans two or more nodes (real, or emulated with ``--ranks-per-node``).

The same calls as normal mode within a node, carried by the two-hop mode
(cupyep.internode.TwoHopDispatch):

- ``dispatch(x, topk_idx, topk_weights, num_experts=E)``: BF16 or FP8 rows
  (``x_scales``, or the tuple ``(x, x_scales)``), a cached call
  (``handle=``), worst-token mode (``num_worst_tokens``, graph-capturable),
  ``expert_alignment`` for the per-expert counts. Returns a
  cupyep.DispatchResult: recv_x [N, H], recv_x_scales, recv_topk_idx [N, k]
  (local ids, -1 elsewhere), recv_topk_weights [N, k],
  num_recv_tokens_per_expert (E_local ints, rounded up to
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

``expert_major=True`` lays the received (row, local expert) pairs out in
per-expert blocks as within a node (cupyep.intranode.expert_major, from the
rank-major rows; DispatchResult's expert_x, expert_offsets, expert_src_row),
and ``combine(y, handle, pair_weights=..., expert_major=True)`` reduces such
outputs back to one row per received row first, so cupyep.moe.MoELayer runs
across nodes unchanged. Every call runs on the buffer's communication stream, ordered with the
caller's as within a node (``previous_event``, ``async_finish``,
cupyep.intranode.streams). ``transport="direct"`` runs the direct route
across nodes (TwoHopDispatch(route="direct"): every row put straight into
its final row, no node dedup); a buffer keeps the route of its first
dispatch, and a call with the other one raises ValueError. What the
kernels across nodes do not carry yet raises ValueError before anything is
launched: configs, the normal-mode metrics. The layout hints
(``num_tokens_per_rank``, ``num_tokens_per_expert``, ``is_token_in_rank``)
are accepted and not needed: the notify pass lays the tokens out itself.

Sizes: the two-hop buffers are made at the first dispatch (collectively, a
bounded host exchange), for the most tokens any rank passes then and that
call's hidden size, top-k and expert count, which every later call keeps
(``num_bytes`` is not used across nodes). A later call with more tokens
raises ValueError on its rank.
"""
from __future__ import annotations

import numpy as np

def _refuse(call: str, given: dict) -> None:
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{call} across nodes does not take {name} (the two-hop mode does not carry it yet)")


class TwoHopBuffer:
    """cupyep.Buffer for a group of two or more nodes (module docstring).
    Collective, as cupyep.Buffer: create, call and destroy it on every rank
    in the same order."""

    def __init__(self, group, num_bytes: int | None = None):
        group.require_gpu("cupyep.Buffer")
        if group.num_nodes < 2:
            raise ValueError("TwoHopBuffer is cupyep.Buffer across two or more nodes; this group has one")
        self.group = group
        self.num_ranks, self.rank = group.world_size, group.rank
        from .intranode.streams import CommStream
        self._calls = CommStream(group)  # every call of the two-hop mode runs on this one stream
        self.comm_stream = self._calls.stream
        self._engine = None
        self._shape = None  # (max_tokens, hidden, num_topk, num_experts) of the engine
        self._route = None  # the engine's route: "two_hop" or "direct" (the first dispatch's transport)
        self._em = None  # the last dispatch's expert-major layout: (layout, handle, device count, SMs)
        self._captured = []  # arrays of calls captured in CUDA graphs, alive as long as this buffer
        self._em_loaded = False  # the expert-major kernels, loaded by the first expert-major dispatch

    # ----------------------------------------------------------------- sizing
    def _engine_for(self, num_tokens: int, hidden: int, num_topk: int, num_experts: int, route: str = "two_hop"):
        """The TwoHopDispatch for these sizes and ``route``, made collectively at the first call."""
        if self._engine is not None:
            if route != self._route:
                raise ValueError(f"this buffer runs the {self._route} route across nodes (its first dispatch's "
                                 f"transport); make another cupyep.Buffer for the {route} route")
            most, h, k, e = self._shape
            if (hidden, num_topk, num_experts) != (h, k, e):
                raise ValueError(f"this buffer carries hidden={h}, top-k={k}, num_experts={e} (its first call's); "
                                 f"got {hidden}, {num_topk}, {num_experts}")
            if num_tokens > most:
                raise ValueError(f"this buffer holds at most {most} tokens per rank (the most any rank passed to "
                                 f"its first dispatch), got {num_tokens}")
            return self._engine
        sizes = self.group.exchange(np.array([num_tokens, hidden, num_topk, num_experts], dtype=np.int64),
                                    "cupyep.Buffer across nodes: the sizes of the first dispatch")
        if not (sizes[:, 1:] == sizes[0, 1:]).all():
            raise ValueError(f"hidden, top-k and num_experts differ between ranks: {sizes[:, 1:].tolist()}")
        most = max(1, int(sizes[:, 0].max()))
        self._engine = self._make_engine(most, hidden, num_topk, num_experts, route)
        self._shape, self._route = (most, hidden, num_topk, num_experts), route
        return self._engine

    def _make_engine(self, max_tokens: int, hidden: int, num_topk: int, num_experts: int, route: str = "two_hop"):
        from .internode import TwoHopDispatch
        return TwoHopDispatch(self.group, max_tokens, hidden, num_topk, num_experts, route=route)

    # ---------------------------------------------------------------- calls
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, x_scales=None, num_experts: int | None = None,
                 handle=None, num_tokens_per_rank=None, num_tokens_per_expert=None, is_token_in_rank=None,
                 num_worst_tokens: int = 0, expert_alignment: int = 1, config=None, previous_event=None,
                 async_finish: bool = False, validate: bool = True, expert_major: bool = False,
                 transport: str | None = None, notify_time_ns=None, queue_occupancy=None):
        """cupyep.Buffer.dispatch across nodes (module docstring)."""
        _refuse("dispatch", {"config": config, "notify_time_ns": notify_time_ns, "queue_occupancy": queue_occupancy})
        if transport not in (None, "queue", "two_hop", "direct"):
            raise ValueError(f"across nodes the transport is the two-hop mode (None, 'queue' or 'two_hop') or "
                             f"the direct route ('direct'), got transport={transport!r}")
        route = "direct" if transport == "direct" else "two_hop"
        if not (isinstance(expert_alignment, (int, np.integer)) and expert_alignment >= 1):
            raise ValueError(f"expert_alignment must be an integer >= 1, got {expert_alignment!r}")
        if isinstance(x, tuple):
            if x_scales is not None:
                raise ValueError("pass FP8 scales either in the x tuple or as x_scales, not both")
            x, x_scales = x
        if expert_major and topk_idx is None and handle is None:
            raise ValueError("expert_major=True needs topk_idx or a handle")
        if handle is None:
            if topk_idx is None or num_experts is None:
                raise ValueError("dispatch needs topk_idx and num_experts (or a handle)")
            k = topk_idx.shape[1]
        else:
            if self._engine is None:
                raise ValueError("handle was not made by this buffer")
            k, num_experts = self._shape[2], self._shape[3]
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
        engine = self._engine_for(x.shape[0], x.shape[1], k, int(num_experts), route)
        if expert_major:
            self._load_expert_major()
        self._calls.begin(previous_event)
        with self.comm_stream:
            out = engine.dispatch(x, None if handle is not None else topk_idx, topk_weights, x_scales=x_scales,
                                  num_worst_tokens=num_worst_tokens, validate=validate, handle=handle)
            result = self._result(out, handle, num_experts, num_worst_tokens, expert_alignment, expert_major)
        result.event = self._calls.end(async_finish, (x, x_scales, topk_idx, topk_weights))
        return result

    def _result(self, out, handle, num_experts, num_worst_tokens, expert_alignment, expert_major):
        """The DispatchResult of a two-hop dispatch (on the communication stream), its
        expert-major layout built when asked; the event is set by the caller."""
        from .intranode.results import DispatchResult
        worst = (handle.num_worst_tokens if handle is not None else int(num_worst_tokens)) > 0
        A = int(expert_alignment)
        per_expert = None
        if not worst:
            counts = self._expert_counts(out.recv_topk_idx, int(num_experts))
            out.handle.recv_expert_counts = tuple(counts)
            per_expert = [-(-c // A) * A for c in counts]
        result = DispatchResult(out.recv_x, out.recv_x_scales, out.recv_topk_idx, out.recv_topk_weights, per_expert,
                                out.handle, None)
        self._em = None
        if expert_major:
            self._em = self._expert_major(out, per_expert, int(num_experts), A)
            em = self._em[0]
            result.expert_x, result.expert_x_scales = em.expert_x, em.expert_x_scales
            result.expert_offsets, result.expert_src_row = em.expert_offsets, em.expert_src_row
        return result

    def _load_expert_major(self) -> None:
        """Collective, at the first expert-major dispatch and before its kernels:
        the expert-major kernels compiled once per node (jit.load with the
        group), then every rank lined up on the host. Each rank compiling them
        itself inside the call, after the dispatch kernels, left a slow rank's
        peers waiting in the combine for its rows against the group's timeout."""
        if self._em_loaded:
            return
        from . import jit
        from .intranode import expert_major as EM
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

    def _expert_major(self, out, per_expert, num_experts: int, alignment: int):
        """(the expert-major layout of a dispatch's rows, its handle, the device
        count of valid rows it was built for: an int32 array, or None)."""
        from .barrier import GUARD_DTYPE
        from . import jit
        from .intranode import expert_major as EM
        N, k = out.recv_topk_idx.shape
        El = num_experts // self.num_ranks
        m_cap = EM.expert_rows_capacity(per_expert, N, k, El, alignment)
        count = None
        if per_expert is None:  # worst-token mode: the valid rows are counted on the device
            count = out.rank_prefix_matrix[self.num_ranks - 1, self.rank].astype(np.int32).reshape(1)
        sms = self._engine.num_sms  # the blocks per rank of the two-hop kernels: the rank's share of the SMs
        em = EM.build(out.recv_x, out.recv_x_scales, out.recv_topk_idx, 0 if count is None else count.data.ptr, El,
                      alignment, m_cap, jit.pack(GUARD_DTYPE, **self.group.guard("intranode_expert_major")), sms)
        if self.comm_stream.is_capturing():  # a graph keeps raw pointers: the count must outlive it
            self._captured.append((count, em))
        return em, out.handle, count, sms

    def combine(self, x, handle, topk_weights=None, *, row_weights=None, config=None, previous_event=None,
                async_finish: bool = False, pair_weights=None, expert_major=None, zero_copy: bool = False):
        """cupyep.Buffer.combine across nodes (module docstring)."""
        from .intranode.results import CombineResult
        _refuse("combine", {"config": config})
        if zero_copy:
            raise ValueError("combine across nodes does not take zero_copy (the direct transport's)")
        if self._engine is None:
            raise ValueError("combine needs a dispatch of this buffer first")
        self._calls.begin(previous_event)
        with self.comm_stream:
            combined, combined_w, reduced = self._combine(x, handle, topk_weights, row_weights, pair_weights,
                                                          expert_major)
        event = self._calls.end(async_finish, (x, topk_weights, row_weights, pair_weights))
        return CombineResult(combined, combined_w, event, reduced)

    def _combine(self, x, handle, topk_weights, row_weights, pair_weights, expert_major):
        """(combined_x, combined_topk_weights or None, the expert-major reduction
        or None), on the communication stream."""
        reduced = None
        em = self._em if self._em is not None and self._em[1] is handle else None
        if expert_major or (expert_major is None and em is not None and x.shape[0] == em[0].num_expert_rows):
            if em is None:
                raise ValueError("expert_major=True needs the handle of this buffer's last dispatch(..., "
                                 "expert_major=True)")
            from .intranode import expert_major as EM
            layout, _, count, sms = em
            if x.shape[0] != layout.num_expert_rows:
                raise ValueError(f"expert-major x has {x.shape[0]} rows, the dispatch laid out "
                                 f"{layout.num_expert_rows}")
            EM.check_pair_weights(pair_weights, layout.recv_expert_row.shape[0], layout.recv_expert_row.shape[1])
            x = reduced = EM.reduce(x, layout.recv_expert_row, pair_weights, 0 if count is None else count.data.ptr,
                                    sms)
        elif pair_weights is not None:
            raise ValueError("pair_weights weight expert-major rows; x holds rank-major rows")
        got = self._engine.combine(x, row_weights=row_weights, topk_weights=topk_weights)
        combined, combined_w = got if topk_weights is not None else (got, None)
        return combined, combined_w, reduced

    # ------------------------------------------------------------- lifetime
    def synchronize(self) -> None:
        """Bounded wait for all work on the communication stream."""
        import cupy
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(self.comm_stream)
        self.group.wait(ev, "internode_two_hop_combine", "host wait for the communication stream")

    def destroy(self) -> None:
        """Collective: free the two-hop buffers (if a dispatch made them)."""
        self._calls.release()
        self._captured = []
        if self._engine is not None:
            self._engine.destroy()
            self._engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
