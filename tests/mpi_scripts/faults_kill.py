"""Fault test: every rank calls a traced function in a loop; rank VICTIM
calls it COUNT times, then kills itself with SIGKILL in the middle of the
next call, while the other ranks keep calling.

Usage: faults_kill.py VICTIM COUNT [between]
    between: kill after the COUNT-th call returned instead of inside the next.
"""
import os
import signal
import sys

from mpi4py import MPI

from cupyep.launcher.calls import traced_call

victim, count = int(sys.argv[1]), int(sys.argv[2])
between = sys.argv[3:] == ["between"]
rank = MPI.COMM_WORLD.rank


@traced_call("FaultProbe.step")
def step(i):
    if rank == victim and i == count and not between:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


@traced_call("FaultProbe.other")
def other():
    return None


other()
MPI.COMM_WORLD.Barrier()
i = 0
while True:
    i += 1
    step(i)
    if rank == victim and between and i == count:
        os.kill(os.getpid(), signal.SIGKILL)
