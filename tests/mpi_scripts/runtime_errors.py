"""cupyep.init's argument errors, and groups over sub-communicators. Run with
4 ranks, without --ranks-per-node (tests/test_runtime_mpi.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpi4py import MPI  # noqa: E402

import cupyep  # noqa: E402
from runtime_checks import Checks, check_topology, describe  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
C = Checks(comm)
C.equal("world_size_is_4", size, 4)

# Every call below fails the same way on every rank, so collectives stay matched.
for k in (3, 0, -2, 8):
    C.raises(f"ranks_per_node_{k}", ValueError, lambda k=k: cupyep.init(ranks_per_node=k),
             match=f"ranks_per_node={k} must be positive and divide the world size 4")
C.raises("comm_int", TypeError, lambda: cupyep.init(42), match="got int")
C.raises("comm_str", TypeError, lambda: cupyep.init("COMM_WORLD"), match="got str")
C.raises("comm_group_not_comm", TypeError, lambda: cupyep.init(comm.Get_group()), match="Intracomm")
C.raises("comm_null", ValueError, lambda: cupyep.init(MPI.COMM_NULL), match="COMM_NULL")
excluded = comm.Split(MPI.UNDEFINED, rank)  # this process is in no resulting communicator
C.raises("comm_split_undefined", ValueError, lambda: cupyep.init(excluded), match="COMM_NULL")
for t in (0, -1.0, float("nan")):
    C.raises(f"timeout_s_{t}", ValueError, lambda t=t: cupyep.init(timeout_s=t), match="timeout_s must be > 0")

# Still usable after the failures above.
check_topology(C, "world_after_errors", cupyep.init(), comm, size, rank)

# Pairs {0,1} and {2,3}: a group over 2 ranks each.
pairs = comm.Split(color=rank // 2, key=rank)
pg = cupyep.init(pairs)
check_topology(C, "pairs", pg, pairs, 2, rank)
C.equal("pairs.rank_is_world_rank_mod_2", pg.rank, rank % 2)
C.equal("pairs.device_id_none", pg.device_id, None)
# The same pairs as two emulated nodes of one rank.
check_topology(C, "pairs_rpn1", cupyep.init(pairs, ranks_per_node=1), pairs, 1, rank)
C.raises("pairs_rpn4", ValueError, lambda: cupyep.init(pairs, ranks_per_node=4), match="world size 2")
C.raises("pairs_timeout_0", ValueError, lambda: cupyep.init(pairs, timeout_s=0), match="timeout_s")

# Strided, reversed sub-communicator: {2,0} and {3,1}.
strided = comm.Split(color=rank % 2, key=-rank)
sg = cupyep.init(strided)
check_topology(C, "strided", sg, strided, 2, rank)
C.equal("strided.rank_reversed", sg.rank, 1 - rank // 2)

C.finish("RUNTIME_ERRORS", extra={"pairs": comm.gather(describe(pg), root=0),
                                   "strided": comm.gather(describe(sg), root=0)})
