"""Rank runtime on the GPU: IPC buffers, the GPU barrier and its timeout."""
import time

import numpy as np
import pytest

from cupyep import CommTimeoutError

from cupyep.barrier import GpuBarrier, ipc_pattern_check
from cupyep.ipc import SymmetricBuffer
from cupyep.testing import all_ranks

pytestmark = pytest.mark.gpu


def test_ipc_read_write_every_peer(group):
    words = 1 << 16
    with SymmetricBuffer(group, group.local_size * words * 4) as buf, GpuBarrier(group) as bar:
        bad = ipc_pattern_check(group, buf, bar, words)
        assert all_ranks(group.comm, bad == 0), f"rank {group.rank}: {bad} bad words"
        # Host-side views of a peer's memory see the same bytes.
        peer = (group.local_rank + 1) % group.local_size
        theirs = buf.view(0, (group.local_size * words,), np.uint32, peer=peer).get()
        mine = buf.view(0, (group.local_size * words,), np.uint32).get()
        assert theirs.any() and mine.any()


def test_barrier_1000_times(group):
    with GpuBarrier(group) as bar:
        for _ in range(1000):
            bar()
        bar.sync()
        bar.loop(1000)
        bar.sync()
        epoch = int(bar.buffer.view(bar.offset + 4 * group.local_size, (1,), np.int32).get()[0])
    assert all_ranks(group.comm, epoch == 2002), f"epoch {epoch}"


def test_barrier_timeout_names_missing_rank(group):
    if group.local_size < 2:
        pytest.skip("needs two ranks")
    missing = group.node_ranks[-1]
    timeout = 2.0
    with GpuBarrier(group) as bar:
        bar.sync()
        if group.rank == missing:
            err = None
        else:
            t0 = time.monotonic()
            with pytest.raises(CommTimeoutError) as info:
                bar.sync(timeout_s=timeout)
            elapsed = time.monotonic() - t0
            err = info.value
            group.error_slot.reset()
            assert err.peer == missing, str(err)
            assert err.rank == group.rank and err.kernel == "barrier"
            assert f"peer rank {missing}" in str(err)
            assert elapsed < timeout + 3.0, f"took {elapsed:.1f}s"
        group.comm.Barrier()


def test_symmetric_buffer_that_does_not_fit_fails_on_every_rank(group):
    """A symmetric buffer larger than the GPU: every rank raises the same
    MemoryError (naming the bytes), none is left waiting for IPC handles, and
    the next buffer works."""
    import cupy
    total = cupy.cuda.runtime.memGetInfo()[1]
    with pytest.raises(MemoryError, match=rf"{total + 1} bytes per rank does not fit"):
        SymmetricBuffer(group, total + 1)
    buf = SymmetricBuffer(group, 1 << 20)
    try:
        assert all_ranks(group.comm, len(buf.peer_ptr_list) == group.local_size)
    finally:
        buf.destroy()


def test_carve_lays_out_mixed_dtypes_aligned_in_one_allocation(group):
    from cupyep.arrays import carve
    a = carve({"n": (3,), "mask": (5, 3), "w": (2, 2)}, dtypes={"mask": np.bool_, "w": np.float32}, zero=True)
    assert (a["n"].dtype, a["mask"].dtype, a["w"].dtype) == (np.int32, np.bool_, np.float32)
    views = [a[name] for name in ("n", "mask", "w")]
    assert a["mask"].shape == (5, 3) and all(v.data.ptr % 64 == 0 for v in views)
    assert a["mask"].data.ptr - a["n"].data.ptr == 64 and a["w"].data.ptr - a["mask"].data.ptr == 64
    assert [a.ptr(name) for name in ("n", "mask", "w")] == [v.data.ptr for v in views] and a.ptr("absent") == 0
    assert not any(bool(v.any()) for v in views)  # zeroed, every array
    assert a.view("mask", (3, 5)).data.ptr == a["mask"].data.ptr  # another shape over the same part
    with pytest.raises(ValueError, match="exceeds"):
        a.view("n", (4,))


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_expert_counts_on_the_device_are_the_host_counts(group, dtype):
    """arrays.expert_counts on the device (one pass of atomic adds) equals its
    NumPy path: -1 slots and ids outside [0, E) count for none, a strided
    view counts its own elements, an empty array counts nothing."""
    import cupy
    from cupyep.arrays import expert_counts
    rng = np.random.default_rng(group.rank)
    E = 37
    ids = rng.integers(-1, E, size=(300, 8)).astype(dtype)
    ids[::7, 3] = E + 5  # out of range: ignored on both paths
    ids[5, 0] = -4
    want = np.bincount(ids[(ids >= 0) & (ids < E)], minlength=E)
    for host, dev in ((ids, cupy.asarray(ids)), (ids[::3, 1:6], cupy.asarray(ids)[::3, 1:6]),
                      (ids[:0], cupy.asarray(ids)[:0])):
        got = expert_counts(dev, E)
        assert got.dtype == np.int64 and got.shape == (E,)
        assert np.array_equal(got.get(), expert_counts(host, E))
    assert np.array_equal(expert_counts(ids, E), want)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_routing_range_finds_the_extremes_and_repeats_of_each_token(group, dtype):
    """arrays.routing_range (one pass over the tokens): the smallest and
    largest id and the slots whose id (>= 0) an earlier slot of the same
    token names, as NumPy finds them; a strided view is taken as its own
    elements."""
    import cupy
    from cupyep.arrays import routing_range
    rng = np.random.default_rng(10 + group.rank)
    ids = rng.integers(-1, 40, size=(257, 9)).astype(dtype)
    ids[3] = [5, 5, 5, -1, -1, 7, 7, 2, 9]  # 2 repeats of 5, 1 of 7; -1 never counts

    def want(a):
        rep = sum(sum(1 for j, e in enumerate(row) if e >= 0 and e in row[:j]) for row in a.tolist())
        return int(a.min()), int(a.max()), rep
    for host in (ids, ids[1::2, 2:7]):
        dev = cupy.asarray(ids)[1::2, 2:7] if host is not ids else cupy.asarray(ids)
        assert routing_range(dev, duplicates=True) == want(host)
        assert routing_range(dev) == want(host)[:2] + (0,)
    ids[100, 4] = -7
    ids[200, 0] = 99
    assert routing_range(cupy.asarray(ids))[:2] == (-7, 99)
