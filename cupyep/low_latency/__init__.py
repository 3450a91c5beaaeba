"""Low-latency (decode) mode: fixed per-(expert, source) receive slots,
flag-signalled, FP8 or BF16 dispatch and BF16 combine, graph-capturable.

Within a node every transfer is a plain store (or, for the pulling combine,
which is the default, a plain load) through the CUDA IPC peer pointers
(``cupyep.ipc.SymmetricBuffer``). Across nodes the buffer is on the NVSHMEM
symmetric heap (``cupyep.nvshmem.HeapBuffer``): ranks of the node are still
reached by stores, ranks of other nodes by NVSHMEM puts with signals, in the
NVSHMEM-linked build of the same kernels.
"""
from .buffer import LowLatencyBuffer, ranks_of
from .layout import LowLatencyLayout, SetLayout, low_latency_layout, size_hint
from .results import LowLatencyCombineResult, LowLatencyDispatchResult, LowLatencyHandle

__all__ = ["LowLatencyBuffer", "ranks_of", "LowLatencyLayout", "SetLayout", "low_latency_layout", "size_hint",
           "LowLatencyDispatchResult", "LowLatencyCombineResult", "LowLatencyHandle"]
