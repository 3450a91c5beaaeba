"""How long a running kernel takes to see a word the host writes: a store
into mapped pinned host memory against a copy into device memory on a
second stream, with or without other kernels moving data meanwhile.

    python experiments/probes/probe_host_signal.py --out host_signal.json
    python -m cupyep.launcher -n 2 experiments/probes/probe_host_signal.py --traffic-blocks 32

A one-thread watcher kernel stamps %globaltimer, raises a "started" word in
mapped memory, and spins (bounded, 100 ms) on the word the host is to write,
with one of three loads: ``ld.acquire.sys``, ``ld.volatile`` or
``ld.relaxed.sys``; it stamps again when it sees the value. With
``--pollers N``, N other warps (one per block) poll the same word
meanwhile, as the receivers of a send launched before its counts would. The host spins
on "started", then writes the word:

- ``mapped``: a NumPy store into the mapped pinned word the watcher polls;
- ``copy``: ``cudaMemcpyAsync`` of 8 bytes from pinned memory into the
  device word the watcher polls, on a second stream.

``latency_us`` is the watcher's second stamp minus its first: the host's
reaction to "started" plus the write's way to the watcher, the same host
reaction in every mode. With ``--traffic-blocks N`` a copy kernel of N
blocks runs on a third stream meanwhile (HBM traffic, as a dispatch's
senders make); its stop word, and the pollers', is in device memory (a
stop word in mapped memory, read by every thread of the copy, slows
every other access to host memory by hundreds of us: the first records of
this probe). Records: per (mode, load), the median and the 90th
percentile over ``--trials``, and the trials that timed out.
"""
import argparse
import ctypes
import time

import numpy as np

from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import write_document

_SRC = r'''
extern "C" __device__ unsigned long long timer_ns() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
template <int kLoad>
__device__ __forceinline__ long long load_word(const long long* p) {
    long long v;
    if (kLoad == 0) asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    else if (kLoad == 1) asm volatile("ld.volatile.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    else asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
// out: [0] first stamp, [1] second stamp (0: timed out), [2] polls.
template <int kLoad>
__global__ void watch(const long long* word, long long expected, volatile int* started, unsigned long long* out) {
    const unsigned long long t0 = timer_ns();
    out[0] = t0;
    __threadfence_system();
    *started = 1;
    unsigned long long polls = 0;
    while (true) {
        ++polls;
        if (load_word<kLoad>(word) == expected) { out[1] = timer_ns(); break; }
        if ((polls & 255) == 0 && timer_ns() - t0 > 100000000ull) { out[1] = 0; break; }
    }
    out[2] = polls;
}
__global__ void traffic(const int4* src, int4* dst, long long n, volatile int* stop) {
    for (int round = 0; round < 2000 && !*stop; ++round)  // bounded: at most about 70 ms
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
            dst[i] = src[i];
}
// One warp per block polls the watched word as the watcher does (ld.volatile), until stop (bounded).
__global__ void pollers(const long long* word, volatile int* stop, unsigned long long* sink) {
    const unsigned long long t0 = timer_ns();
    long long acc = 0;
    for (unsigned long long polls = 1; !*stop; ++polls) {
        acc += load_word<1>(word);
        if ((polls & 255) == 0 && timer_ns() - t0 > 100000000ull) break;
    }
    if (acc == 42) sink[0] = acc;  // keeps the loads
}
'''
LOADS = ("acquire_sys", "volatile", "relaxed_sys")


def main():
    require_gpu(__file__)
    import cupy
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--traffic-blocks", type=int, default=0)
    p.add_argument("--pollers", type=int, default=0, help="warps polling the watched word meanwhile")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank = 0
    try:
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
    except ImportError:
        pass
    mod = cupy.RawModule(code=_SRC, options=("-std=c++17",), name_expressions=[f"watch<{i}>" for i in range(3)] + ["traffic", "pollers"])
    watch = [mod.get_function(f"watch<{i}>") for i in range(3)]
    traffic, pollers = mod.get_function("traffic"), mod.get_function("pollers")
    host = cupy.cuda.runtime.hostAlloc(64, 2)  # words: [0] the mapped word, [1] "started" (int 3), [3] staging
    words = np.frombuffer((ctypes.c_int64 * 8).from_address(host), dtype=np.int64)
    words[:] = 0
    flags = np.frombuffer((ctypes.c_int32 * 16).from_address(host), dtype=np.int32)
    dev_word = cupy.zeros(1, dtype=np.int64)
    out = cupy.zeros(3, dtype=np.uint64)
    stop = cupy.zeros(1, dtype=np.int32)  # the traffic's and the pollers' stop word, in device memory
    sink = cupy.zeros(1, dtype=np.uint64)
    s_watch, s_copy, s_traffic, s_poll = (cupy.cuda.Stream(non_blocking=True) for _ in range(4))
    src = cupy.zeros(1 << 26, dtype=np.uint8)
    dst = cupy.zeros_like(src)
    records = []
    for mode in ("mapped", "copy"):
        for li, load in enumerate(LOADS):
            lat, timeouts = [], 0
            for trial in range(args.trials):
                value = (trial + 1) * 1000 + li
                flags[3] = 0  # started
                stop.fill(0)
                cupy.cuda.runtime.deviceSynchronize()
                target = host if mode == "mapped" else dev_word.data.ptr
                if args.traffic_blocks:
                    traffic((args.traffic_blocks,), (512,), (src, dst, np.int64(src.nbytes // 16), stop),
                            stream=s_traffic)
                if args.pollers:
                    pollers((args.pollers,), (32,), (np.intp(target), stop, sink), stream=s_poll)
                watch[li]((1,), (1,), (np.intp(target), np.int64(value), np.intp(host + 12), out), stream=s_watch)
                deadline = time.monotonic() + 5
                while flags[3] == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the watcher never started")
                if mode == "mapped":
                    words[0] = value
                else:
                    words[3] = value
                    cupy.cuda.runtime.memcpyAsync(dev_word.data.ptr, host + 24, 8,
                                                  cupy.cuda.runtime.memcpyHostToDevice, s_copy.ptr)
                s_watch.synchronize()
                with s_copy:
                    stop.fill(1)
                s_traffic.synchronize()
                s_poll.synchronize()
                o = out.get()
                if o[1] == 0:
                    timeouts += 1
                else:
                    lat.append((int(o[1]) - int(o[0])) * 1e-3)
            rec = {"mode": mode, "load": load, "traffic_blocks": args.traffic_blocks, "pollers": args.pollers,
                   "trials": args.trials,
                   "timeouts": timeouts, "rank": rank}
            if lat:
                rec.update(latency_us=float(np.median(lat)), p90_us=float(np.percentile(lat, 90)),
                           max_us=float(np.max(lat)))
            records.append(rec)
    if rank == 0:
        write_document({"probe": "host_signal", "records": records}, args.out)
    cupy.cuda.runtime.freeHost(host)


if __name__ == "__main__":
    main()
