"""Launcher test: rank 2 raises while the others wait in a barrier forever."""
from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.rank == 2:
    raise RuntimeError("rank 2 fails on purpose")
comm.barrier()  # never completes: mpi4py's runner must abort the job
