"""Fault test: every rank makes COUNT traced calls; then rank 2 raises while
the others wait in a barrier (mpi4py's runner aborts the job).

Usage: faults_raise.py COUNT
"""
import sys

from mpi4py import MPI

from cupyep.launcher.calls import traced_call


@traced_call("FaultProbe.step")
def step():
    return None


for _ in range(int(sys.argv[1])):
    step()
if MPI.COMM_WORLD.rank == 2:
    raise RuntimeError("rank 2 fails on purpose")
MPI.COMM_WORLD.Barrier()
