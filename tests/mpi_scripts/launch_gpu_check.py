"""GPU smoke check for the launcher (not run by pytest; needs CuPy + a GPU).

Every rank runs a small CuPy reduction; rank 0 asks the MPS control daemon
(if any) for its servers and clients and reports whether every rank is an
MPS client.  Exit status 0 when the sums are right.
"""
import os
import subprocess
import sys

from mpi4py import MPI

import cupy as cp

comm = MPI.COMM_WORLD
x = cp.arange(1000, dtype=cp.float32) * (comm.rank + 1)
total = float(x.sum())
cp.cuda.Device().synchronize()
pids = comm.gather(os.getpid(), root=0)
totals = comm.gather(total, root=0)
if comm.rank == 0:
    ok = all(t == 499500.0 * (r + 1) for r, t in enumerate(totals))
    print("sums ok:", ok, flush=True)
    print("CUDA_MPS_PIPE_DIRECTORY:", os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))

    def ctl(cmd):
        res = subprocess.run(["nvidia-cuda-mps-control"], input=cmd + "\n",
                             capture_output=True, text=True, timeout=10)
        return res.stdout.split()

    clients = []
    try:
        for server in ctl("get_server_list"):
            clients += [int(p) for p in ctl(f"get_client_list {server}")
                        if p.isdigit()]
    except (OSError, subprocess.TimeoutExpired) as exc:
        print("mps query failed:", exc)
    print("MPS clients:", sorted(clients), "ranks:", sorted(pids))
    print("all ranks are MPS clients:", set(pids) <= set(clients), flush=True)
    if not ok:
        sys.exit(1)
comm.barrier()
