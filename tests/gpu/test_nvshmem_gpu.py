"""Device-side NVSHMEM from a runtime-built kernel (cupyep.nvshmem): the
put-with-signal primitive of the cross-node hops, every PE to every PE on
the symmetric heap, with rows tagged by (source PE, slot) so a misrouted
row shows; and a PE that never sends is a CommTimeoutError naming it.
Needs nvshmem4py (the "nvshmem" extra); skipped without it."""
import numpy as np
import pytest

from cupyep import CommTimeoutError

from cupyep.testing import all_ranks

pytestmark = pytest.mark.gpu
core = pytest.importorskip("nvshmem.core")
ROW_BYTES = 1 << 16


@pytest.fixture(scope="module")
def pe(group, nvshmem_session):
    from cupyep import jit

    from cupyep import nvshmem as NV

    fn = jit.kernel(NV.put_signal_spec())  # built, loaded and registered with NVSHMEM after init
    R = group.world_size  # one PE per rank of the world, across (emulated) nodes
    dst = core.array((R, ROW_BYTES), dtype="uint8")
    sig = core.array((R,), dtype="uint64")
    sig[...] = 0
    group.comm.Barrier()
    yield fn, dst, sig
    core.free_array(dst)
    core.free_array(sig)


def _tags(src_pe: int, slot: int) -> np.ndarray:
    return ((np.arange(ROW_BYTES) * 7 + 31 * src_pe + 131 * slot) % 251).astype(np.uint8)


def _launch(group, fn, dst, sig, expected: int, timeout_s: float | None = None):
    import cupy
    from cupyep import jit

    from cupyep import nvshmem as NV

    R, me = group.world_size, group.rank  # PE numbers are world ranks
    src = cupy.asarray(np.stack([_tags(me, b) for b in range(R)]))
    peers = cupy.arange(R, dtype=np.int32)
    args = jit.pack(NV.put_signal_args_dtype(), dst=dst.data.ptr, src=src.data.ptr, sig=sig.data.ptr,
                    peers=peers.data.ptr, bytes=ROW_BYTES, expected=expected, num_peers=R, my_slot=me,
                    guard=group.guard("shmem_put_signal", timeout_s))
    fn((R,), (256,), (args,))
    cupy.cuda.runtime.deviceSynchronize()
    return src


def test_put_signal_every_pe_to_every_pe(group, pe):
    fn, dst, sig = pe
    R = group.world_size
    for call in (1, 2):  # signals are cumulative: the second call waits for 2
        dst[...] = 0
        group.comm.Barrier()
        _launch(group, fn, dst, sig, expected=call)
        group.check_errors()
        got = dst.get()
        ok = all(np.array_equal(got[s], _tags(s, group.rank)) for s in range(R))
        assert all_ranks(group.comm, ok), call
        group.comm.Barrier()


def test_a_pe_that_never_sends_times_out_naming_it(group, pe):
    fn, dst, sig = pe
    if group.world_size < 2:
        pytest.skip("needs two PEs")
    group.comm.Barrier()
    expected = int(sig.get().max()) + 1
    if group.rank != 0:  # PE 0 stays silent this call
        _launch(group, fn, dst, sig, expected=expected, timeout_s=2.0)
        with pytest.raises(CommTimeoutError) as info:
            group.check_errors()
        assert "put with signal" in str(info.value) and info.value.peer == 0
        group.error_slot.reset()
    group.comm.Barrier()


def test_the_world_barrier_holds_every_rank_until_the_last_arrives(group, nvshmem_session):
    """cupyep.barrier.WorldBarrier (every rank of every node, on NVSHMEM
    signals): a rank that reaches it 200 ms late on the GPU holds every other
    rank's barrier that long; 50 barriers in one launch complete; a rank that
    never arrives is a CommTimeoutError naming it, and the next barrier of all
    ranks completes again."""
    import cupy
    from cupyep.barrier import WorldBarrier
    from cupyep.lab.bench.timing import gpu_sleep
    if group.world_size < 2:
        pytest.skip("needs two ranks")
    with WorldBarrier(group) as bar:
        bar.sync()
        late = group.world_size - 1
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        group.comm.Barrier()
        start.record()
        if group.rank == late:
            gpu_sleep(200_000.0)
        bar()
        end.record()
        end.synchronize()
        waited_ms = cupy.cuda.get_elapsed_time(start, end)
        bar.loop(50)
        bar.sync()
        assert all_ranks(group.comm, waited_ms > 150.0), waited_ms
        group.comm.Barrier()
        if group.rank != 0:  # rank 0 stays away from this one
            with pytest.raises(CommTimeoutError) as info:
                bar.sync(timeout_s=2.0)
            err = info.value
            assert "world barrier" in str(err) and err.peer == 0 and err.rank == group.rank, str(err)
            group.error_slot.reset()
        group.comm.Barrier()
        bar.sync()


def test_a_heap_buffer_too_large_for_the_gpu_is_a_memory_error_on_every_rank(group, nvshmem_session):
    """A HeapBuffer whose ranks together ask for more than the GPU holds is a
    MemoryError on every rank, naming the GPU, before NVSHMEM is asked (which
    would end the process); the heap stays usable: a buffer that fits is made,
    written through and freed afterwards."""
    import cupy
    from cupyep.nvshmem import HeapBuffer
    _, total = cupy.cuda.runtime.memGetInfo()
    with pytest.raises(MemoryError, match="do not fit") as info:
        HeapBuffer(group, total)  # every rank of this GPU asks for all of it
    assert f"GPU {group.device_id}" in str(info.value)
    buf = HeapBuffer(group, 1 << 20)
    view = buf.view(0, (1 << 18,), np.uint32)
    view[...] = group.rank
    ok = bool((view == group.rank).all())
    buf.destroy()
    assert all_ranks(group.comm, ok)
