"""Creating and destroying buffers many times leaks neither device memory nor
IPC mappings.

Each kind (cupyep.Buffer, cupyep.LowLatencyBuffer, cupyep.barrier.GpuBarrier)
is created, used once (a small dispatch + combine, or a barrier) and
destroyed ITERATIONS times in this process. The device's free bytes
(``cudaMemGetInfo``, after every rank has synchronised and returned CuPy's
cached blocks) may drop by at most TOLERANCE_BYTES between the end of a
warm-up iteration and the end of the loop: 64 MiB for the whole device, all
ranks sharing it included, i.e. less than a tenth of one leaked buffer per
rank and iteration would leave. CuPy's pool holds no more live bytes at the
end than after the warm-up, and the count of open peer mappings
(``cupyep.ipc.open_mappings``) is back to its start after every destroy.
"""
import gc

import numpy as np
import pytest

from cupyep import ipc

from cupyep.testing import all_ranks, payload_bf16

pytestmark = pytest.mark.gpu
ITERATIONS = 200
TOLERANCE_BYTES = 64 << 20
HIDDEN, EXPERTS, TOPK, TOKENS = 1024, 16, 4, 8


def _settled_free_bytes(group) -> int:
    """Free device bytes once every rank has finished its work and returned
    CuPy's cached blocks (read between two barriers: no rank allocates meanwhile)."""
    import cupy
    gc.collect()  # objects in reference cycles release their arrays now
    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    group.comm.Barrier()
    free = cupy.cuda.runtime.memGetInfo()[0]
    group.comm.Barrier()
    return int(free)


def _inputs(group):
    """x [TOKENS, HIDDEN] BF16 bits, topk_idx [TOKENS, TOPK] int64 (distinct experts
    per row, some -1), topk_weights [TOKENS, TOPK] float32, on the device."""
    import cupy
    me = group.local_rank
    t = np.arange(TOKENS)[:, None]
    idx = (3 * t + 5 * np.arange(TOPK)[None, :] + me) % EXPERTS
    idx[::3, -1] = -1
    w = np.full((TOKENS, TOPK), 0.5, dtype=np.float32)
    return (cupy.asarray(payload_bf16(me, np.arange(TOKENS), HIDDEN)), cupy.asarray(idx.astype(np.int64)),
            cupy.asarray(w))


def _normal(group, x, idx, w):
    import cupy
    import cupyep
    from cupyep.normal.config import get_combine_config, get_dispatch_config
    R = group.local_size
    budget = cupy.cuda.Device().attributes["MultiProcessorCount"] // max(1, group.ranks_per_gpu)
    nbytes = cupyep.Buffer.size_hint(R, HIDDEN, TOPK, get_dispatch_config(R, budget), get_combine_config(R, budget))

    def create():
        return cupyep.Buffer(group, nbytes)

    def use(buf):
        out = buf.dispatch(x, idx, w, num_experts=EXPERTS)
        buf.combine(out.recv_x, out.handle)
        buf.synchronize()

    return create, use


def _low_latency(group, x, idx, w):
    import cupyep

    def create():
        return cupyep.LowLatencyBuffer(group, TOKENS, HIDDEN, EXPERTS, max_topk=TOPK)

    def use(buf):
        res = buf.dispatch(x, idx, use_fp8=False)
        buf.combine(res.recv_x, idx, w, res.handle)
        buf.synchronize()

    return create, use


def _barrier(group, x, idx, w):
    from cupyep.barrier import GpuBarrier

    def create():
        return GpuBarrier(group)

    def use(bar):
        bar.sync()

    return create, use


KINDS = {"Buffer": _normal, "LowLatencyBuffer": _low_latency, "GpuBarrier": _barrier}


@pytest.mark.parametrize("kind", list(KINDS))
def test_create_destroy_does_not_leak(group, kind):
    import cupy
    x, idx, w = _inputs(group)
    create, use = KINDS[kind](group, x, idx, w)
    pool = cupy.get_default_memory_pool()
    mappings = ipc.open_mappings()
    peers = group.local_size - 1
    bad = []

    def one(i):
        obj = create()
        if ipc.open_mappings() != mappings + peers:
            bad.append(("mappings while alive", i, ipc.open_mappings()))
        use(obj)
        obj.destroy()
        if ipc.open_mappings() != mappings:
            bad.append(("mappings after destroy", i, ipc.open_mappings()))

    one(-1)  # warm-up: compiles and loads the kernels, fills CuPy's pools
    free_start = _settled_free_bytes(group)
    used_start = pool.used_bytes()  # after the gc.collect() above
    for i in range(ITERATIONS):
        one(i)
    free_end = _settled_free_bytes(group)
    used_end = pool.used_bytes()
    lost = free_start - free_end
    ok = not bad and lost <= TOLERANCE_BYTES and used_end <= used_start
    assert all_ranks(group.comm, ok), dict(kind=kind, lost_MiB=lost / 2**20, tolerance_MiB=TOLERANCE_BYTES >> 20,
                                           pool_used=(used_start, used_end), mapping_errors=bad[:5])
