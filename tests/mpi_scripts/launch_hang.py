"""Launcher test: every rank writes its pid to DIR/<rank>.pid, then sleeps.

Usage: launch_hang.py DIR
"""
import os
import sys
import time

from mpi4py import MPI

rank = MPI.COMM_WORLD.rank
path = os.path.join(sys.argv[1], f"{rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(600)
