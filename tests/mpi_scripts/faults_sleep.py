"""Fault test: every rank makes three traced calls of FaultProbe.step, writes
its pid to DIR/<rank>.pid, then sleeps inside a traced FaultProbe.wait.

Usage: faults_sleep.py DIR
"""
import os
import sys
import time

from mpi4py import MPI

from cupyep.launcher.calls import traced_call


@traced_call("FaultProbe.step")
def step():
    return None


@traced_call("FaultProbe.wait")
def wait(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(600)


for _ in range(3):
    step()
wait(os.path.join(sys.argv[1], f"{MPI.COMM_WORLD.rank}.pid"))
