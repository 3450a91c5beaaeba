"""Launcher test: rank 0 prints every rank's cupyep-related env as JSON."""
import json
import os

from mpi4py import MPI

NAMES = ("CUPYEP_RANKS_PER_NODE", "CUPYEP_LAUNCHED", "NVSHMEM_DISABLE_NVLS",
         "NCCL_NVLS_ENABLE", "CUDA_MPS_PIPE_DIRECTORY",
         "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
comm = MPI.COMM_WORLD
mine = {name: os.environ.get(name) for name in NAMES}
everyone = comm.gather(mine, root=0)
if comm.rank == 0:
    print("ENV " + json.dumps(everyone), flush=True)
