"""Does an MPS client cap make a rank with more work take proportionally longer?

    python -m cupyep.launcher -n 8 experiments/probes/probe_sm_cap.py [--cap PCT] [--out F.json]

Each rank sets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` to ``--cap`` (0: no cap)
before its CUDA context exists, reports the SM count its context sees, then
all ranks copy ``rows`` rows of ``hidden`` BF16 at once (rank 0 twice the
others' rows), timed by events on each rank. Rank 0 prints one JSON record.
"""
import argparse
import json
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--cap", type=float, default=0.0)
p.add_argument("--rows", type=int, default=16384)
p.add_argument("--hidden", type=int, default=7168)
p.add_argument("--heavy", type=float, default=2.0, help="rank 0's rows over the others'")
p.add_argument("--iters", type=int, default=10)
p.add_argument("--out")
a = p.parse_args()
if a.cap:
    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{a.cap:g}"

from mpi4py import MPI  # noqa: E402
import cupy  # noqa: E402
import numpy as np  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
cupy.cuda.Device(0).use()
sms = cupy.cuda.Device(0).attributes["MultiProcessorCount"]
rows = int(a.rows * (a.heavy if rank == 0 else 1.0))
src = cupy.ones((rows, a.hidden), cupy.uint16)
dst = cupy.empty_like(src)
times = []
for it in range(a.iters + 2):
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    s, e = cupy.cuda.Event(), cupy.cuda.Event()
    s.record()
    dst[...] = src
    e.record()
    e.synchronize()
    if it >= 2:
        times.append(cupy.cuda.get_elapsed_time(s, e) * 1e3)
per_rank = comm.gather({"rank": rank, "sms_seen": int(sms), "rows": rows,
                        "median_us": float(np.median(times)), "min_us": float(np.min(times))}, root=0)
if rank == 0:
    light = [r["median_us"] for r in per_rank[1:]]
    rec = {"cap_pct": a.cap, "ranks": size, "hidden": a.hidden, "per_rank": per_rank,
           "heavy_over_light_rows": a.heavy,
           "heavy_over_light_time": per_rank[0]["median_us"] / float(np.median(light)) if light else None}
    print(json.dumps(rec))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
sys.stdout.flush()
