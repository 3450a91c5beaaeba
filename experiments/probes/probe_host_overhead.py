"""Where a notified normal-mode dispatch's time goes when the kernels are
short: the host's share of each call, per transport.

    python -m cupyep.launch -n 2 experiments/probes/probe_host_overhead.py --out results/direct/host_overhead.json

For each variant (queue; direct fused, the default; direct unfused), after
warm-up, ``--iters`` calls each start after a device synchronisation and a
host MPI barrier; per call, ``host`` is the time until dispatch returns
(the host's own work plus its bounded wait for the counts) and ``total``
until the device is idle again. ``total - host`` is the GPU work still
running when the call returns: near zero means the host, not the GPU, set
the call's time. Rank 0 also profiles the direct fused calls (cProfile, the
top functions by own time). Medians over calls, max over ranks, microseconds.
"""
import argparse
import cProfile
import io
import json
import pstats
import time

import numpy as np

import cupyep
from cupyep.bench import require_gpu
from cupyep.intranode.direct import DirectConfig
from cupyep.testing import global_routing, payload_bf16


def main():
    require_gpu(__file__)
    import cupy
    from mpi4py import MPI
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group = cupyep.init()
    R, me = group.local_size, group.local_rank
    T, H, E = args.tokens, args.hidden, 256
    idx, w = global_routing(0, [T] * R, E, 8)
    x = cupy.asarray(payload_bf16(me, np.arange(T), H))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    buf = cupyep.Buffer(group)
    variants = {"queue": {"transport": "queue"}, "direct_fused": {"transport": "direct"},
                "direct_unfused": {"transport": "direct", "config": DirectConfig(fused=False)}}
    out = {"ranks": R, "tokens": T, "hidden": H, "iters": args.iters, "variants": {}}
    for name, kw in variants.items():
        call = lambda: buf.dispatch(x, ids, ws, num_experts=E, validate=False, **kw)  # noqa: E731
        for _ in range(3):
            call()
        host, total = [], []
        prof = cProfile.Profile() if name == "direct_fused" and me == 0 else None
        for _ in range(args.iters):
            cupy.cuda.runtime.deviceSynchronize()
            group.comm.Barrier()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            call()
            if prof:
                prof.disable()
            t1 = time.perf_counter()
            cupy.cuda.runtime.deviceSynchronize()
            t2 = time.perf_counter()
            host.append(t1 - t0)
            total.append(t2 - t0)
        rec = {k: group.comm.allreduce(float(np.median(v)) * 1e6, op=MPI.MAX)
               for k, v in (("host_us", host), ("total_us", total))}
        rec["gpu_after_return_us"] = group.comm.allreduce(
            float(np.median(np.subtract(total, host))) * 1e6, op=MPI.MAX)
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            rec["profile_rank0"] = s.getvalue().splitlines()
        out["variants"][name] = rec
    if me == 0:
        text = json.dumps(out, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
