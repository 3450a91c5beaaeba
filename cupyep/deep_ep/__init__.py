"""DeepEP V1's Python API on cupyep: ``from cupyep import deep_ep`` in place
of ``import deep_ep``.

- ``Buffer``: DeepEP's buffer (cupyep.deep_ep.buffer): layout, dispatch,
  combine, their low-latency forms, configs, events, lifetime;
- ``Config``: DeepEP's performance config (cupyep.deep_ep.config);
- ``EventOverlap``, ``EventHandle``: events on torch streams (cupyep.deep_ep.events);
- ``topk_idx_t``: ``torch.int64``;
- what is not supported, and why: cupyep.deep_ep.gaps (docs/deep_ep.md).

Importing this package does not import torch; the calls do.
"""
from .buffer import Buffer
from .config import Config
from .events import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"]


def __getattr__(name):
    if name == "topk_idx_t":  # DeepEP's dtype of expert ids
        import torch
        return torch.int64
    raise AttributeError(f"module 'cupyep.deep_ep' has no attribute {name!r}")
