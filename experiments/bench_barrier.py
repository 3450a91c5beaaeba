"""IPC and GPU-barrier benchmark of the rank runtime.

    python -m cupyep.launcher -n 8 experiments/bench_barrier.py --out results/barrier.jsonl

Measures, per rank count: the barrier round trip inside one kernel (device
only), the barrier launched from the host (includes launch overhead), and
the copy bandwidth through IPC into a peer's buffer against a local copy.
"""
import argparse

import numpy as np

import cupyep
from cupyep.barrier import GpuBarrier
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.copy import copy_bandwidth, device_copy
from cupyep.lab.bench.report import JsonlWriter
from cupyep.lab.bench.timing import time_fn
from cupyep.ipc import SymmetricBuffer


def main():
    require_gpu(__file__)
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/barrier.jsonl")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--copy-mb", type=int, default=256)
    args = p.parse_args()
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    import cupy
    with GpuBarrier(group) as bar:
        bar.sync()
        t_loop = time_fn(lambda: bar.loop(args.iters), iters=5, warmup=1, flush=False)
        bar.sync()
        t_launch = time_fn(lambda: [bar() for _ in range(args.iters)], iters=5, warmup=1, flush=False)
        bar.sync()
    loop_us = group.comm.allreduce(t_loop.median_s, op=max_op()) / args.iters * 1e6
    launch_us = group.comm.allreduce(t_launch.median_s, op=max_op()) / args.iters * 1e6

    nbytes = args.copy_mb << 20
    local_bw = copy_bandwidth(nbytes) if group.local_rank == 0 else 0.0
    group.comm.Barrier()
    with SymmetricBuffer(group, nbytes) as buf, GpuBarrier(group) as bar:
        src = cupy.ones(nbytes // 2, dtype=np.uint16)
        peer = (group.local_rank + 1) % group.local_size
        dst = buf.view(0, (nbytes // 2,), np.uint16, peer=peer)
        bar.sync()
        t = time_fn(lambda: device_copy(src, dst, num_blocks=max(2, 132 // group.ranks_per_gpu)), iters=10,
                    warmup=2, flush=False, before=bar)
        bar.sync()
    ipc_bw_total = group.comm.allreduce(2 * nbytes / t.median_s)
    out.write({"bench": "barrier", "ranks": group.world_size, "iters": args.iters,
               "barrier_in_kernel_us": loop_us, "barrier_launched_us": launch_us})
    out.write({"bench": "ipc_copy", "ranks": group.world_size, "bytes_per_rank": nbytes,
               "ipc_copy_total_GBps": ipc_bw_total / 1e9, "local_copy_GBps": group.comm.bcast(local_bw) / 1e9,
               "ratio_to_copy_roofline": ipc_bw_total / max(group.comm.bcast(local_bw), 1)})
    group.comm.Barrier()
    group.destroy()


def max_op():
    from mpi4py import MPI
    return MPI.MAX


if __name__ == "__main__":
    main()
