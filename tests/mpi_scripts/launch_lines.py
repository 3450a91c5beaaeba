"""Each rank prints argv[1] lines of 128 bytes as fast as it can, then an
unfinished line to stderr."""
import sys

from mpi4py import MPI

r = MPI.COMM_WORLD.Get_rank()
for i in range(int(sys.argv[1])):
    print(f"<{r}:{i:05d}:" + "x" * 120 + ">")
sys.stderr.write(f"tail {r}")
