"""Launcher test: every rank ignores SIGINT and SIGTERM, writes its pid to
DIR/<rank>.pid, then sleeps (only SIGKILL ends it).

Usage: launch_ignore_signals.py DIR
"""
import os
import signal
import sys
import time

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)

from mpi4py import MPI  # noqa: E402

path = os.path.join(sys.argv[1], f"{MPI.COMM_WORLD.rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
while True:
    time.sleep(1)
