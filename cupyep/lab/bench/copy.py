"""The same-GPU copy roofline every efficiency figure divides by.

``copy_bandwidth`` times ``cuda_src/bench/copy.cu`` (16-byte streaming loads
and stores) on buffers far larger than L2 and returns bytes read plus bytes
written per second.
"""
from __future__ import annotations

import numpy as np

from ... import jit

COPY_SPEC = jit.KernelSpec(name="bench_copy", source="bench/copy.cu", kernels=("cupyep::copy_kernel",))


def kernel_specs() -> list[jit.KernelSpec]:
    return [COPY_SPEC]


def device_copy(src, dst, num_blocks: int | None = None, threads: int = 512) -> None:
    """Copy ``src`` into ``dst`` (cupy arrays of equal byte size, multiple of 16)."""
    import cupy
    n = src.nbytes
    if dst.nbytes != n or n % 16:
        raise ValueError(f"device_copy needs equal sizes that are multiples of 16 bytes, got {n} and {dst.nbytes}")
    blocks = num_blocks or cupy.cuda.Device().attributes["MultiProcessorCount"] * 2
    jit.kernel(COPY_SPEC)((blocks,), (threads,), (src, dst, np.int64(n // 16)))


def copy_probe(block_counts, nbytes: int = 2 << 30, iters: int = 10) -> dict:
    """{blocks: bytes moved (read + written) per second} of the copy kernel
    launched on each number of blocks in ``block_counts`` (512 threads
    each): the copy roofline at a number of SMs, which a communication
    kernel on as many blocks is measured against."""
    return {int(n): copy_bandwidth(nbytes, iters, int(n)) for n in sorted(set(block_counts))}


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20, num_blocks: int | None = None) -> float:
    """Bytes moved (read + written) per second by the copy kernel, median of ``iters``."""
    import cupy
    src = cupy.empty(nbytes // 16 * 16, dtype=np.uint8)
    src[...] = 1
    dst = cupy.empty_like(src)
    from .timing import time_fn
    t = time_fn(lambda: device_copy(src, dst, num_blocks), iters=iters, warmup=3, flush=False)
    return 2 * (nbytes // 16 * 16) / t.median_s


def probe_on_rank0(group, block_counts, out) -> dict:
    """:func:`copy_probe` on each count of ``block_counts`` (those > 0),
    timed by rank 0 alone while the others wait, written to ``out`` as
    "copy_probe" records; the same {blocks: bytes per second} on every rank."""
    counts = sorted({int(n) for n in block_counts if n and n > 0})
    got = group.comm.bcast(copy_probe(counts) if group.rank == 0 else None)
    for n in counts:
        out.write({"kind": "copy_probe", "blocks": n, "copy_GBps": round(got[n] / 1e9, 1),
                   "per_block_GBps": round(got[n] / 1e9 / n, 2)})
    return got


def against_copy(rec: dict, same: float | None, copy_bw: float) -> dict:
    """``rec`` (a benchmark record whose "efficiency" is its bytes over
    ``copy_bw``, per its time) with "copy_same_sms_GBps", the copy kernel's
    rate ``same`` on as many SMs, and "of_copy_same_sms", the record's
    fraction of it (and "of_copy_same_sms_kernel", at the kernel's own time,
    when the record has "kernel_efficiency"); ``rec`` unchanged when
    ``same`` is unknown."""
    if not same:
        return rec
    out = {**rec, "copy_same_sms_GBps": round(same / 1e9, 1),
           "of_copy_same_sms": None if rec.get("efficiency") is None else round(rec["efficiency"] * copy_bw / same, 4)}
    if rec.get("kernel_efficiency") is not None:
        out["of_copy_same_sms_kernel"] = round(rec["kernel_efficiency"] * copy_bw / same, 4)
    return out
