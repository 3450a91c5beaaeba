"""What DeepEP V1 offers and cupyep does not: each gap raises
``NotImplementedError`` naming it, never a silent fallback.

``GAPS`` maps the call or argument (as written in docs/deep_ep.md) to the
reason; :func:`refuse` raises for one of them.
"""
from __future__ import annotations

GAPS: dict[str, str] = {
    "Buffer(use_fabric=True)":
        "fabric memory handles: cupyep shares buffers within a node through CUDA IPC handles",
    "Buffer(allow_nvlink_for_low_latency_mode=False)":
        "low-latency traffic without NVLink: within a node cupyep's low-latency kernels write through CUDA IPC "
        "(NVLink or the one shared GPU) only",
    "Buffer.get_local_buffer_tensor":
        "raw views of the communication buffer: cupyep's buffers are laid out by its own routes, and writes "
        "there would corrupt them",
    "Buffer.low_latency_combine(use_logfmt=True) across nodes":
        "the LogFMT combine across nodes: cupyep's LogFMT-10 combine (cupyep.reference.logfmt) pushes its rows "
        "within a node only",
    "Buffer.dispatch(topk_idx=None) across nodes":
        "a dispatch routed by is_token_in_rank alone across nodes: cupyep's notify pass across nodes counts "
        "from topk_idx (pass topk_idx, or a handle for a cached dispatch)",
    "Buffer.dispatch(config=...) across nodes":
        "cupyep's routes across nodes take no chunk config (they run on their own tuned sizes)",
    "Buffer.combine(config=...) across nodes":
        "cupyep's routes across nodes take no chunk config (they run on their own tuned sizes)",
    "Buffer(group=<torch.distributed group of several nodes>)":
        "NVSHMEM across nodes bootstraps from an MPI communicator: pass comm=<mpi4py communicator>",
    "Buffer.low_latency_dispatch(use_ue8m0=True) with hidden % 512 != 0":
        "DeepEP packs four UE8M0 exponents per int32; a hidden size that is not a multiple of 512 leaves a "
        "partial word",
}


def refuse(what: str) -> None:
    """Raise NotImplementedError for the gap ``what`` (a key of GAPS)."""
    raise NotImplementedError(f"cupyep.deep_ep: {what} is not supported: {GAPS[what]}")
