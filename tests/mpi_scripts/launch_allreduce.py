"""Launcher test: allreduce of the ranks; fails (exit 1) on a wrong sum."""
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
n = comm.size
total = comm.allreduce(comm.rank + 1, op=MPI.SUM)
if total != n * (n + 1) // 2:
    sys.exit(f"rank {comm.rank}: bad sum {total}")
if comm.rank == 0:
    print(f"allreduce ok size={n} sum={total}", flush=True)
