"""cupyep.init picks up the launcher's --ranks-per-node (CUPYEP_RANKS_PER_NODE);
an explicit ranks_per_node overrides it. Run with 4 ranks and
--ranks-per-node 2 (tests/test_runtime_mpi.py)."""
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
C.equal("env_ranks_per_node", os.environ.get("CUPYEP_RANKS_PER_NODE"), "2")

from_env = cupyep.init()
check_topology(C, "env", from_env, comm, 2, rank)
C.equal("env.device_id_none", from_env.device_id, None)
C.equal("env.has_gpu_false", from_env.has_gpu, False)
explicit = cupyep.init(ranks_per_node=4)
check_topology(C, "explicit4", explicit, comm, 4, rank)
explicit1 = cupyep.init(ranks_per_node=1)
check_topology(C, "explicit1", explicit1, comm, 1, rank)

C.finish("RUNTIME_ENV", extra={"env": comm.gather(describe(from_env), root=0),
                                "explicit4": comm.gather(describe(explicit), root=0)})
