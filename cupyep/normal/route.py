"""What the normal-mode :class:`~cupyep.normal.Buffer` front hands a route:
the checked arguments of one call, and the interface every route keeps.

A *transport* is what a caller asks for (``transport="queue"`` or
``"direct"``); a *route* is the object that carries it on this buffer's
topology:

- ``"queue"``: within a node :class:`~cupyep.normal.queue.QueueRoute`
  (ring queues over IPC); across nodes
  :class:`~cupyep.normal.internode.InternodeRoute` ``"two_hop"`` (one
  network row per (token, node), forwarded in the node by a relay rank);
- ``"direct"``: within a node :class:`~cupyep.normal.direct.DirectRoute`
  (one copy, into the receivers' pools); across nodes
  :class:`~cupyep.normal.internode.InternodeRoute` ``"direct"`` (one put
  per row, into its final row).

The front checks a call once (shapes, dtypes, sizes, expert ids, the
handle's owner, what every rank must pass alike) and begins and ends it on
the communication stream; the route runs it there (layout, notify, send,
the expert-major layout) and returns the result. A route's kernel launches
live in its kernels module (``queue_kernels``, ``direct_kernels``,
``internode_kernels``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

TRANSPORTS = ("queue", "direct")


@dataclass
class DispatchCall:
    """A dispatch's arguments after the front's checks.

    x: [T, H] uint16 (BF16 bits) or uint8 (FP8 e4m3); x_scales [T, H / 128]
    float32 with FP8, else None; topk_idx [T, k] int64 or None (a cached call
    may omit it); topk_weights [T, k] float32 or None; handle: a live handle
    of this route (cached dispatch) or None; hints: the caller's
    (num_tokens_per_rank [R], num_tokens_per_expert [E], is_token_in_rank
    [T, R]) or Nones; config: the route's checked config. ``keep``: arrays
    the route's kernels read that the caller does not hold (appended by the
    route; the front holds them until the call's event under async_finish).
    """
    x: object
    x_scales: object
    topk_idx: object
    topk_weights: object
    num_experts: int
    handle: object
    hints: tuple
    num_worst_tokens: int
    expert_alignment: int
    config: object
    expert_major: bool
    fresh: bool
    validate: bool
    notify_time_ns: object = None
    queue_occupancy: object = None
    kernel_time_ns: object = None
    keep: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def hidden(self) -> int:
        return self.x.shape[1]

    @property
    def num_topk(self) -> int:
        return self.topk_idx.shape[1] if self.topk_idx is not None else 0

    @property
    def fp8(self) -> bool:
        return self.x.dtype.itemsize == 1


@dataclass
class CombineCall:
    """A combine's arguments after the front's checks.

    x: [N, H] uint16 (BF16 bits), one row per received row, or, with
    ``expert_major``, [M_cap, H] expert-major rows (then ``pair_weights``
    [N, k_e] float32, the weight of each (row, slot) pair, or None);
    topk_weights [N, k] float32 or None; row_weights [N] float32 or None;
    handle: a live handle of this route; config: the route's checked config;
    zero_copy: x is the handle's get_combine_buffer (routes that have one).
    """
    x: object
    handle: object
    topk_weights: object
    row_weights: object
    pair_weights: object
    expert_major: bool
    zero_copy: bool
    config: object
    kernel_time_ns: object = None
    keep: list = field(default_factory=list)

    @property
    def num_topk(self) -> int:
        return self.topk_weights.shape[1] if self.topk_weights is not None else 0


class Route:
    """The interface of one route (module docstring). ``transport`` is the
    name a call asks for; ``name`` says which route carries it here;
    ``metrics``: the dispatch metric arguments it fills (others are refused
    before launch); ``zero_copy``: whether its combine reads the expert
    outputs in place (get_combine_buffer)."""

    transport: str = ""
    name: str = ""
    metrics: frozenset = frozenset()
    zero_copy: bool = False

    def dispatch_config(self, config, fp8: bool, handle):
        """The checked config of a dispatch (``config`` or the route's default); ValueError for a foreign one."""
        raise NotImplementedError

    def combine_config(self, config, handle):
        """The checked config of a combine of ``handle``."""
        raise NotImplementedError

    def owns(self, handle) -> bool:
        """Whether ``handle`` was made by this route."""
        raise NotImplementedError

    def expert_rows(self, handle) -> tuple[int, int]:
        """(M_cap, slots per received row) of a handle's expert-major map; (0, 0) without one."""
        raise NotImplementedError

    def received_rows(self, handle) -> int:
        """N: the rows a handle's dispatch received (num_worst_tokens in worst-token mode)."""
        return handle.num_worst_tokens or handle.num_recv_tokens

    def layout(self, topk_idx, num_experts: int):
        """LayoutResult of one routing, on the communication stream."""
        raise NotImplementedError

    def dispatch(self, call: DispatchCall):
        """DispatchResult (its event unset) of a notified dispatch, or of a
        cached one when ``call.handle`` is set; on the communication stream."""
        raise NotImplementedError

    def combine(self, call: CombineCall):
        """CombineResult (its event unset), on the communication stream."""
        raise NotImplementedError

    def check_combine(self, call: CombineCall) -> None:
        """Route-specific checks of a combine, before anything is launched."""

    def get_combine_buffer(self, handle, hidden: int):
        raise ValueError(f"a zero-copy combine needs a handle of the direct transport, not the {self.name} route")

    def destroy(self) -> None:
        """Collective: free what the route allocated."""
