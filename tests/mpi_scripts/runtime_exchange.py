"""Group.exchange, the bounded host exchange: every rank's array stacked in
rank order; a rank that never takes part is a CommTimeoutError naming it,
within the timeout; the exchanges after it still match. Run with 4 ranks
(tests/test_runtime_mpi.py)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import cupyep  # noqa: E402
from cupyep import CommTimeoutError  # noqa: E402
from runtime_checks import Checks  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
C = Checks(comm)
g = cupyep.init()

got = g.exchange(np.arange(3, dtype=np.int64) + 10 * rank, "counts")
C.expect("stacked_in_rank_order", np.array_equal(got, np.arange(3)[None, :] + 10 * np.arange(4)[:, None]), got)
again = g.exchange(np.array([rank], dtype=np.int32), "again")
C.expect("second_exchange", again.ravel().tolist() == [0, 1, 2, 3], again)

# Rank 3 stays away from one exchange: the others raise within the timeout, naming it.
if rank != 3:
    t0 = time.monotonic()
    try:
        g.exchange(np.zeros(2), "missing rank", timeout_s=1.0)
        C.expect("missing_rank_raises", False, "returned")
    except CommTimeoutError as exc:
        C.expect("missing_rank_raises", exc.peer == 3 and "missing rank" in str(exc), str(exc))
    C.expect("missing_rank_bounded", time.monotonic() - t0 < 10.0, time.monotonic() - t0)
else:
    g._xseq += 1  # this rank skipped that exchange: keep the sequence in step, as a restart would
    C.expect("missing_rank_raises", True)
    C.expect("missing_rank_bounded", True)
comm.Barrier()
after = g.exchange(np.array([2 * rank], dtype=np.int64), "after the timeout")
C.expect("exchange_after_timeout", after.ravel().tolist() == [0, 2, 4, 6], after)

# Group.agree: the same fields pass; a field that differs is a ValueError on every rank naming it and each value.
try:
    g.agree("Buffer.dispatch", hidden=7168, fp8=False, num_topk=8)
    C.expect("agree_same_passes", True)
except Exception as exc:  # noqa: BLE001
    C.expect("agree_same_passes", False, repr(exc))
C.raises("agree_differing_raises_everywhere", ValueError,
         lambda: g.agree("Buffer.dispatch", hidden=7168, num_topk=8 if rank != 2 else 4), match="num_topk")
try:
    g.agree("Buffer.dispatch", hidden=1024 * (rank + 1), num_topk=rank)
    C.expect("agree_names_first_field_and_values", False, "returned")
except ValueError as exc:
    C.expect("agree_names_first_field_and_values",
             "disagree on hidden" in str(exc) and "rank 3: 4096" in str(exc) and "Buffer.dispatch" in str(exc),
             str(exc))
after = g.exchange(np.array([rank], dtype=np.int64), "after a disagreement")
C.expect("exchange_after_disagreement", after.ravel().tolist() == [0, 1, 2, 3], after)


# cupyep.ipc_peers.PeerArrays over this exchange (the direct route's in-place combine), with CUDA IPC stood in
# for: rank r's array lies at offset 64 * r of an allocation whose handle names the rank; a peer's mapping of
# it is at 0x1000_0000 * (peer + 1) here.
class _Ipc:
    def __init__(self):
        self.opened = []

    @staticmethod
    def export(ptr):
        return f"alloc of rank {rank}".encode().ljust(64, b"\0"), 64 * rank

    def open(self, handle):
        self.opened.append(handle.rstrip(b"\0").decode())
        return 0x1000_0000 * (int(self.opened[-1].split()[-1]) + 1)

    @staticmethod
    def symmetric(handle):
        return None

    @staticmethod
    def close(base):
        pass


from cupyep.ipc_peers import PeerArrays  # noqa: E402

ipc = _Ipc()
peers = PeerArrays(lambda rec: g.exchange(rec, "in-place combine"), rank, ipc=ipc)
got = peers.exchange(0xABC0)
want = [0xABC0 if r == rank else 0x1000_0000 * (r + 1) + 64 * r for r in range(4)]
C.expect("peer_arrays_addresses", got == want, (got, want))
again = peers.exchange(0xABC0)
C.expect("peer_arrays_mapped_once", again == want and len(ipc.opened) == 3, (again, ipc.opened))
# rank 1 has no rows; then rank 2 cannot export: every rank gets None
got = peers.exchange(None if rank == 1 else 0xABC0, empty=rank == 1)
C.expect("peer_arrays_empty_rank", got is not None and got[1] == 0, got)
got = peers.exchange(None if rank == 2 else 0xABC0)
C.expect("peer_arrays_cannot_everywhere", got is None, got)
g.destroy()
C.finish("RUNTIME_EXCHANGE")
