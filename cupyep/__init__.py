"""cupyep: expert-parallel dispatch and combine for Mixture-of-Experts, in
raw CUDA compiled at run time through CuPy, with mpi4py ranks.

Entry points:
    group = cupyep.init()                 # rank runtime (cupyep.runtime)
    buf = cupyep.Buffer(group)            # normal mode, every route (cupyep.normal)
    ll = cupyep.LowLatencyBuffer(group, 128, 7168, 256)  # low-latency mode (cupyep.low_latency)
    cupyep.reference                      # the NumPy oracle that defines the semantics
    python -m cupyep.launcher -n 8 app.py   # launcher (starts MPS when ranks share a GPU)
"""
from .errors import (CommTimeoutError, CupyepError, DeviceCapacityError, DeviceError, DeviceInputError,
                     StaleResultError)
from .runtime import Group, init
from .moe import MoELayer, MoEWeights  # the end-to-end MoE layer (cupyep.moe; imports NumPy only)

__version__ = "0.1.0"


def __getattr__(name):
    # GPU-facing classes import lazily so that `import cupyep` stays cheap
    # on machines without CUDA.
    if name in ("Buffer", "Config", "DirectConfig", "DispatchResult", "CombineResult", "DispatchHandle",
                "EventHandle"):
        from . import normal
        return getattr(normal, name)
    if name in ("LowLatencyBuffer",):
        from . import low_latency
        return getattr(low_latency, name)
    raise AttributeError(f"module 'cupyep' has no attribute {name!r}")


__all__ = ["init", "Group", "CommTimeoutError", "CupyepError", "StaleResultError", "DeviceError", "DeviceCapacityError", "DeviceInputError", "Buffer", "Config", "DirectConfig", "DispatchResult",
           "CombineResult", "DispatchHandle", "EventHandle", "LowLatencyBuffer", "__version__"]
