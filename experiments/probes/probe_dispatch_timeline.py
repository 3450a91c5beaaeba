"""The timeline of notified dispatches called back to back (DeepEP's timing
boundary) on the fused direct route: where a call's period goes between the
host and the GPU.

    python -m cupyep.launcher -n 2 experiments/probes/probe_dispatch_timeline.py --out timeline_2ranks.json

Per call and rank, host stamps (``time.time_ns``) at the call's entry, after
the fused kernel's launch returned, after the host's wait for the kernel's
counts, and at the return; the kernel's own first block start and last block
end (``kernel_time_ns``, %globaltimer), moved onto the host's clock by an
offset measured first (a one-thread kernel reads %globaltimer between two
host stamps; ``clock`` reports the offset and the half-width of its
uncertainty). Per call:

- ``pre_us``: entry to launch returned (the host's work before the kernel);
- ``launch_to_start_us``: launch returned to the kernel's first block start
  (queueing behind the previous call, and launch latency);
- ``start_to_counts_us``: kernel start to the host seeing the counts (the
  kernel's layout and notify, including waiting for the peers' kernels);
- ``post_us``: counts seen to return (the host's work after the wait);
- ``kernel_us``: the kernel's first block start to last block end;
- ``gpu_gap_us``: the previous call's kernel end to this call's kernel start
  (the GPU idle between calls);
- ``period_us``: entry to the next call's entry;
- ``start_skew_us``: this rank's kernel start after the first rank's (ranks on
  one GPU).

The record holds each quantity's median over calls, per rank and the worst
rank's.
"""
import argparse
import time

import numpy as np

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import write_document
from cupyep.lab.bench.stamps import new_kernel_stamps, one_timer
from cupyep.testing import global_routing, payload_bf16

QUANTITIES = ("pre_us", "launch_to_start_us", "start_to_counts_us", "post_us", "kernel_us", "gpu_gap_us",
              "period_us", "start_skew_us")

_TIMER_SRC = r'''
extern "C" __global__ void read_globaltimer(unsigned long long* out) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[0] = t;
}
'''


def clock_offset(samples: int = 50) -> dict:
    """(GPU %globaltimer - host time_ns) in ns: the median over one-thread
    kernels of the timer minus the midpoint of the host stamps around launch
    and synchronisation, and the half-width of the tightest bracket."""
    import cupy
    fn = cupy.RawKernel(_TIMER_SRC, "read_globaltimer")
    out = cupy.zeros(1, dtype=np.uint64)
    fn((1,), (1,), (out,))
    cupy.cuda.runtime.deviceSynchronize()
    offsets, widths = [], []
    for _ in range(samples):
        t0 = time.time_ns()
        fn((1,), (1,), (out,))
        cupy.cuda.runtime.deviceSynchronize()
        t1 = time.time_ns()
        g = int(out.get()[0])
        offsets.append(g - (t0 + t1) / 2)
        widths.append((t1 - t0) / 2)
    best = int(np.argmin(widths))
    return {"offset_ns": float(offsets[best]), "median_offset_ns": float(np.median(offsets)),
            "half_width_us": widths[best] * 1e-3}


def per_call(host: np.ndarray, kernel: np.ndarray, first_start: np.ndarray) -> dict:
    """Quantities (module docstring) per call from host stamps [n, 4] (entry,
    launched, counts seen, return) and kernel stamps [n, 2] on the host's
    clock, and the first rank's kernel start per call [n]; in us."""
    h, k = host.astype(np.float64), kernel.astype(np.float64)
    n = len(h)
    q = {"pre_us": h[:, 1] - h[:, 0], "launch_to_start_us": k[:, 0] - h[:, 1],
         "start_to_counts_us": h[:, 2] - k[:, 0], "post_us": h[:, 3] - h[:, 2], "kernel_us": k[:, 1] - k[:, 0],
         "gpu_gap_us": np.concatenate([[np.nan], k[1:, 0] - k[:-1, 1]]),
         "period_us": np.concatenate([h[1:, 0] - h[:-1, 0], [np.nan]]),
         "start_skew_us": k[:, 0] - first_start.astype(np.float64)}
    assert all(len(v) == n for v in q.values())
    return {name: v * 1e-3 for name, v in q.items()}


def main():
    import cupy

    from cupyep.normal import direct_kernels as D
    from cupyep.normal.direct import DirectRoute
    require_gpu(__file__)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group = cupyep.init()
    R, me = group.world_size, group.rank
    if group.num_nodes > 1:
        raise SystemExit("the fused direct route is the route within a node")
    T, H, E = args.tokens, args.hidden, args.experts
    idx, w = global_routing(0, [T] * R, E, args.topk)
    x = cupy.asarray(payload_bf16(me, np.arange(T), H))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    buf = cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=args.topk)
    clock = clock_offset()
    n = args.iters
    host = np.zeros((n + 8, 4), dtype=np.int64)
    row = [0]
    launch_fused, wait_status = D.launch_fused, DirectRoute._wait_host_status

    def launched(*a, **kw):  # the route calls D.launch_fused through the module
        launch_fused(*a, **kw)
        host[row[0], 1] = time.time_ns()

    def waited(self):
        status = wait_status(self)
        host[row[0], 2] = time.time_ns()
        return status
    D.launch_fused, DirectRoute._wait_host_status = launched, waited
    stamps = new_kernel_stamps(n + 8)
    try:
        def call(i):
            row[0] = i
            host[i, 0] = time.time_ns()
            buf.dispatch(x, ids, ws, num_experts=E, validate=False, transport="direct", kernel_time_ns=stamps[i])
            host[i, 3] = time.time_ns()
        for i in range(8):  # warm-up rows, not kept
            call(n + i)
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()
        for i in range(n):  # back to back after one barrier
            call(i)
        cupy.cuda.runtime.deviceSynchronize()
    finally:
        D.launch_fused, DirectRoute._wait_host_status = launch_fused, wait_status
    kernel = stamps[:n].get() - int(round(clock["offset_ns"]))  # onto the host's clock
    starts = np.stack(group.comm.allgather(kernel[:, 0]))
    first = starts.min(axis=0) if one_timer(group) else kernel[:, 0]
    q = per_call(host[:n], kernel, first)
    mine = {name: float(np.nanmedian(v)) for name, v in q.items()}
    every = group.comm.gather(mine, root=0)
    clocks = group.comm.gather(clock, root=0)
    if me == 0:
        out = {"probe": "dispatch_timeline", "route": "direct (fused)", "ranks": R, "tokens": T, "hidden": H,
               "experts": E, "topk": args.topk, "iters": n, "clock": clocks, "per_rank": every,
               "worst_rank": {name: max(r[name] for r in every) for name in QUANTITIES}}
        write_document(out, args.out)
    buf.synchronize()
    group.comm.Barrier()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
