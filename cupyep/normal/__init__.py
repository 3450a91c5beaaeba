"""Normal (high-throughput) mode: one :class:`Buffer` front over every route.

- ``buffer``: the front (checks, streams, which route carries a call);
- ``route``: the interface every route keeps, and the checked call arguments;
- within a node (``node``: what both share: the IPC buffer, the layout and
  notify passes): ``queue`` (ring queues; ``queue_kernels``, ``queue_layout``,
  ``config``) and ``direct`` (one copy into pools; ``direct_kernels``);
- across nodes: ``internode`` (the two-hop and direct routes;
  ``internode_kernels``);
- shared by every route: ``layout`` (the layout kernel), ``node_kernels``
  (the notify pass), ``expert_major`` (the per-expert layout of received rows).

The results and handles are in cupyep.results, below every mode.
"""
from ..results import CombineResult, DispatchHandle, DispatchResult, EventHandle, LayoutResult
from .buffer import Buffer
from .config import Config, get_combine_config, get_dispatch_config
from .direct_kernels import DirectConfig
from .route import TRANSPORTS

__all__ = ["Buffer", "LayoutResult", "Config", "DirectConfig", "get_dispatch_config", "get_combine_config",
           "DispatchHandle", "DispatchResult", "CombineResult", "EventHandle", "TRANSPORTS"]
