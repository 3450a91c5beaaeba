"""Low-latency (decode) mode: fixed per-(expert, source) receive slots,
flag-signalled, FP8 or BF16 dispatch and BF16 combine, graph-capturable.

Within a node every transfer is a plain store (or, for the pulling combine,
which is the default, a plain load) through the CUDA IPC peer pointers
(``cupyep.ipc.SymmetricBuffer``); the buffer's peer table is the only
transport seam, which an NVSHMEM symmetric heap can fill for ranks on other
nodes.
"""
from .buffer import LowLatencyBuffer
from .layout import LowLatencyLayout, SetLayout, low_latency_layout, size_hint
from .results import LowLatencyCombineResult, LowLatencyDispatchResult, LowLatencyHandle

__all__ = ["LowLatencyBuffer", "LowLatencyLayout", "SetLayout", "low_latency_layout", "size_hint",
           "LowLatencyDispatchResult", "LowLatencyCombineResult", "LowLatencyHandle"]
