"""cupyep.init on CPU over COMM_WORLD: the real host (one node of all ranks)
and nodes emulated with ranks_per_node=2; no GPU. Run with 4 ranks, without
--ranks-per-node (tests/test_runtime_mpi.py)."""
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
C.equal("env_ranks_per_node_unset", os.environ.get("CUPYEP_RANKS_PER_NODE"), None)

host = cupyep.init()
check_topology(C, "host", host, comm, size, rank)
emu = cupyep.init(ranks_per_node=2)
check_topology(C, "rpn2", emu, comm, 2, rank)

for name, g in (("host", host), ("rpn2", emu)):
    C.equal(f"{name}.device_id_none", g.device_id, None)
    C.equal(f"{name}.has_gpu_false", g.has_gpu, False)
    C.equal(f"{name}.num_devices_0", g.num_devices, 0)
    C.equal(f"{name}.ranks_per_gpu_0", g.ranks_per_gpu, 0)
    C.equal(f"{name}.shares_gpu_false", g.shares_gpu, False)
    C.raises(f"{name}.require_gpu", RuntimeError, lambda g=g: g.require_gpu("the test"),
             match=f"the test needs a CUDA GPU, and rank {rank} sees none")
    C.raises(f"{name}.error_slot_needs_gpu", RuntimeError, lambda g=g: g.error_slot, match="CUDA GPU")
    C.run(f"{name}.check_errors_noop", lambda g=g: g.check_errors() is None)

C.equal("default_timeout_s", host.timeout_s, 100.0)
short = cupyep.init(timeout_s=3)
C.expect("timeout_s_float", isinstance(short.timeout_s, float) and short.timeout_s == 3.0, repr(short.timeout_s))
with short as g:
    C.expect("context_manager_returns_group", g is short)

C.finish("RUNTIME_TOPOLOGY", extra={"host": comm.gather(describe(host), root=0),
                                     "rpn2": comm.gather(describe(emu), root=0)})
