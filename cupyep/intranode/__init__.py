"""Normal (high-throughput) mode within one node: layout, notify, ring-queue
dispatch and combine."""
from ..results import CombineResult, DispatchHandle, DispatchResult, EventHandle, LayoutResult
from .buffer import Buffer
from .config import Config, get_combine_config, get_dispatch_config

__all__ = ["Buffer", "LayoutResult", "Config", "get_dispatch_config", "get_combine_config", "DispatchHandle",
           "DispatchResult", "CombineResult", "EventHandle"]
