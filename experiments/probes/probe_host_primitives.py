"""What the host pays for each CuPy primitive a dispatch is made of, on one
GPU (no peers): allocations, views, events, stream waits, a kernel launch
with a struct argument, small device copies and struct packing.

    python experiments/probes/probe_host_primitives.py --out host_primitives.json

Each figure is the median over ``--iters`` repetitions, in microseconds of
host time (the GPU work they enqueue is tiny and not waited for, except
where the name says so). ``--busy-blocks B``: first fill the GPU with B
blocks of a sleep kernel on the measured stream and on the current one
(for longer than the measurements take), so that every call is enqueued
behind running work, as a dispatch's calls are.
"""
import argparse
import json

import numpy as np

from cupyep import jit

from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.timing import host_median_us

SOURCE = r"""
struct Args { unsigned long long a, b, c, d; int n, m; };
extern "C" __global__ void touch(Args args) { if (threadIdx.x == 0 && args.n < 0) *(int *)args.a = args.m; }
"""



def main():
    require_gpu(__file__)
    import cupy
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None)
    p.add_argument("--busy-blocks", type=int, default=0)
    args = p.parse_args()
    n = args.iters
    stream = cupy.cuda.Stream(non_blocking=True)
    if args.busy_blocks:
        from cupyep.lab.bench.timing import SLEEP_SPEC
        sleep = jit.kernel(SLEEP_SPEC)
        for s in (stream, cupy.cuda.get_current_stream()):
            sleep((args.busy_blocks,), (32,), (np.uint64(3_000_000_000),), stream=s)
    fn = cupy.RawModule(code=SOURCE).get_function("touch")
    dtype = jit.struct_dtype([("a", np.uint64), ("b", np.uint64), ("c", np.uint64), ("d", np.uint64),
                              ("n", np.int32), ("m", np.int32)])
    packed = jit.pack(dtype, a=1, b=2, n=3)
    base = cupy.empty(1 << 20, dtype=np.uint8)
    small = cupy.zeros(4096, dtype=np.int32)
    ev = cupy.cuda.Event(disable_timing=True)
    ev.record(stream)
    host = np.zeros(64, dtype=np.int32)
    out = {
        "cupy.empty (4 KiB)": host_median_us(lambda: cupy.empty(1024, dtype=np.int32), n),
        "cupy.empty (8 MiB)": host_median_us(lambda: cupy.empty(2 << 20, dtype=np.int32), n),
        "cupy.zeros (4 KiB)": host_median_us(lambda: cupy.zeros(1024, dtype=np.int32), n),
        "cupy.ndarray view (memptr)": host_median_us(lambda: cupy.ndarray((64, 8), np.int32, base.data + 4096), n),
        "slice + view of a uint8 arena": host_median_us(lambda: base[4096:4096 + 2048].view(np.int32), n),
        "Event()": host_median_us(lambda: cupy.cuda.Event(disable_timing=True), n),
        "Event.record": host_median_us(lambda: ev.record(stream), n),
        "Stream.wait_event": host_median_us(lambda: stream.wait_event(ev), n),
        "Event.done": host_median_us(lambda: ev.done, n),
        "get_current_stream": host_median_us(cupy.cuda.get_current_stream, n),
        "with stream:": host_median_us(lambda: stream.__enter__() and stream.__exit__(None, None, None), n),
        "RawKernel launch (struct arg)": host_median_us(lambda: fn((1,), (32,), (packed,)), n),
        "RawKernel launch (struct arg, stream)": host_median_us(lambda: fn((1,), (32,), (packed,), stream=stream), n),
        "ndarray.copy (16 KiB)": host_median_us(lambda: small.copy(), n),
        "memcpyAsync d2d (16 KiB)": host_median_us(lambda: cupy.cuda.runtime.memcpyAsync(
            base.data.ptr, small.data.ptr, small.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr), n),
        "memsetAsync (16 KiB)": host_median_us(lambda: cupy.cuda.runtime.memsetAsync(base.data.ptr, 0, 16384,
                                                                               stream.ptr), n),
        "jit.pack (6 fields)": host_median_us(lambda: jit.pack(dtype, a=1, b=2, c=3, d=4, n=5, m=6), n),
        "numpy host counts -> tuple (128)": host_median_us(lambda: tuple(host[:32].tolist()), n),
        "arr.data.ptr": host_median_us(lambda: small.data.ptr, n),
    }
    stream.synchronize()
    text = json.dumps({"probe": "host_primitives", "iters": n, "busy_blocks": args.busy_blocks, "us": out},
                      indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
