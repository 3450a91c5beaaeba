"""A rank's own share of its GPU's SMs for its compute, through a CUDA green context.

When R ranks share one GPU (under MPS), each rank's expert GEMMs spread over
every SM, so a rank with twice the rows of another is far from twice as slow
(results/sm_share). On GPUs of their own it would be: that rank is the
straggler every other rank waits for in the combine. :func:`partition_stream`
gives a stream whose kernels run only on this rank's part of the SMs: the
GPU's SMs split into ``ranks_per_gpu`` equal groups
(``cuDevSmResourceSplitByCount``, the same split on every rank, so the
groups are disjoint), the group at the rank's ``Group.gpu_slot``, held by a
green context. Work on it scales with the rank's own rows, as on a GPU of
that size.

Communication kernels must then run on the partition too
(``cupyep.Buffer(on_partition=True)``, the default when the launcher asked
for partitions): their blocks spin until the other ranks' kernels arrive,
and on the full GPU the blocks of the other ranks can hold every SM of a
rank's partition while they wait for that rank, whose experts then never
get an SM (a deadlock the kernels' timeouts end). Each rank's communication
blocks on its own partition wait only for kernels that hold SMs of their
own, so they all progress. :func:`partition_stream` gives one stream per
``purpose`` on the same partition, so that a rank's compute and its
communication still overlap.

``python -m cupyep.launcher --sm-share`` asks for it (``CUPYEP_SM_SHARE=1``);
:func:`compute_stream` returns the partition's stream when asked, else None,
for code that takes an optional compute stream (``MoELayer(compute_stream=)``).

Needs the CUDA Python driver bindings (``cuda-bindings``, in the ``lab``
extra), a driver with green contexts (CUDA 12.4+) and MPS clients without an
active-thread cap (a cap overrides the green context's SMs).
"""
from __future__ import annotations

import os

ENV_VAR = "CUPYEP_SM_SHARE"
#: SMs are split in multiples of this (a Hopper GPC's share; the driver refuses finer splits of 132).
GRANULE = 8

#: What a partition stream is for: each purpose has its own stream on the rank's partition.
PURPOSES = ("compute", "communication")
_CONTEXTS: dict = {}  # (device, ranks per GPU, slot) -> (green context, SMs)
_STREAMS: dict = {}  # the same key -> {purpose: (stream, SMs, raw stream)}


def requested() -> bool:
    """True when the launcher's ``--sm-share`` asked for SM partitions."""
    return os.environ.get(ENV_VAR, "") not in ("", "0")


def share_of(num_sms: int, ranks_per_gpu: int) -> int:
    """SMs of each of ``ranks_per_gpu`` equal partitions of ``num_sms``:
    the even share rounded down to a multiple of :data:`GRANULE` (at least
    one granule). ValueError when the GPU cannot hold that many."""
    if ranks_per_gpu < 1 or num_sms < 1:
        raise ValueError(f"need ranks_per_gpu >= 1 and num_sms >= 1, got {ranks_per_gpu} and {num_sms}")
    share = max(GRANULE, num_sms // ranks_per_gpu // GRANULE * GRANULE)
    if share * ranks_per_gpu > num_sms:
        raise ValueError(f"{ranks_per_gpu} ranks cannot each have {share} of {num_sms} SMs "
                         f"(partitions come in multiples of {GRANULE})")
    return share


def partition_stream(group, purpose: str = "compute"):
    """(stream, sms): a ``cupy.cuda.ExternalStream`` whose kernels run on
    this rank's partition of the GPU's SMs only, and that partition's SM
    count. One stream per ``purpose`` ("compute": the experts';
    "communication": a Buffer's on the partition), made once per rank and
    device (cached) on one green context. RuntimeError naming the driver call
    that failed."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    key = (group.device_id, group.ranks_per_gpu, group.gpu_slot)
    streams = _STREAMS.setdefault(key, {})
    if purpose not in streams:
        ctx, sms = _green_context(group, key)
        raw = _driver_call(group, "cuGreenCtxStreamCreate", ctx, _cu().CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        import cupy
        streams[purpose] = (cupy.cuda.ExternalStream(int(raw), group.device_id), sms, raw)  # live with the process
    return streams[purpose][:2]


def is_partition_stream(stream) -> bool:
    """True when ``stream`` is one :func:`partition_stream` made."""
    ptr = getattr(stream, "ptr", None)
    return any(ptr == s[0].ptr for streams in _STREAMS.values() for s in streams.values())


def _cu():
    from cuda.bindings import driver
    return driver


def _driver_call(group, name, *args):
    cu = _cu()
    res = getattr(cu, name)(*args)
    err, rest = res[0], res[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"rank {group.rank}: {name} failed ({err.name}) while making its SM partition "
                           f"({group.gpu_slot} of {group.ranks_per_gpu} on GPU {group.device_id})")
    return rest[0] if len(rest) == 1 else rest


def _green_context(group, key):
    """(green context, SMs) of this rank's partition (made once per key)."""
    if key in _CONTEXTS:
        return _CONTEXTS[key]
    group.require_gpu("an SM partition")
    import cupy
    cu = _cu()

    def call(name, *args):
        return _driver_call(group, name, *args)

    cupy.cuda.Device(group.device_id).use()  # the primary context exists before the green one
    dev = call("cuDeviceGet", group.device_id)
    sms = call("cuDeviceGetDevResource", dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
    n = max(1, group.ranks_per_gpu)
    share = share_of(sms.sm.smCount, n)
    parts, made, _rest = call("cuDevSmResourceSplitByCount", n, sms, 0, share)
    if made < n:
        raise RuntimeError(f"rank {group.rank}: the driver split {sms.sm.smCount} SMs into {made} partitions of "
                           f"{share}, fewer than the {n} ranks sharing GPU {group.device_id}")
    mine = parts[group.gpu_slot]
    desc = call("cuDevResourceGenerateDesc", [mine], 1)
    ctx = call("cuGreenCtxCreate", desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
    _CONTEXTS[key] = (ctx, int(mine.sm.smCount))  # the context lives with the process
    return _CONTEXTS[key]


def in_use(group) -> bool:
    """True when this rank computes on its partition: the launcher asked for
    SM partitions (:func:`requested`) and ranks share its GPU."""
    return requested() and group.has_gpu and group.ranks_per_gpu > 1


def compute_stream(group):
    """This rank's partition stream when :func:`in_use`, else None."""
    return partition_stream(group)[0] if in_use(group) else None
