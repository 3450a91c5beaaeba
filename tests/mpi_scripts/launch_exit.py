"""Launcher test: rank 1 calls sys.exit(3) while the others wait."""
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.rank == 1:
    sys.exit(3)
comm.barrier()  # never completes
