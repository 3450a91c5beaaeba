"""Where the direct route's in-place combine reads the expert outputs from,
and what that costs: the same combine of the same rows, with x in
different kinds of memory.

    python -m cupyep.launcher -n 8 experiments/probes/probe_in_place_memory.py --out in_place_memory_8ranks.jsonl

At 8 ranks, T = 4096 the in-place combine of a copy of recv_x in CuPy's
pool took 1168 us where the same kernel reading recv_x itself (a view of
cupyep's pool) took 766 us (results/normal_combine). Each variant here is a
``combine_bf16`` record of cupyep.lab.bench.normal.measure (strict and
DeepEP's boundary, kernel clock) with x:

- ``recv``: recv_x itself (cupyep's pool, mapped by the peers at init);
- ``cupy_pool``: ``recv_x.copy()``, a block of CuPy's memory pool (the
  benchmark's combine_bf16);
- ``malloc_exact``: its own cudaMalloc of exactly x's bytes, outside the pool;
- ``malloc_big``: the first bytes of a cudaMalloc of ``--big-gib`` GiB;
- ``malloc_big_end``: the last bytes of that allocation (x ending at its end);
- ``pool_after_big``: a CuPy pool copy made while a --big-gib GiB pool block is held.

Each record carries ``"memory": variant`` and the allocation's size.
"""
import argparse

import numpy as np

from cupyep.lab.bench import require_gpu


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--big-gib", type=float, default=2.0)
    p.add_argument("--timing", nargs="+", default=["strict", "deepep"])
    args = p.parse_args()
    require_gpu(__file__)
    import cupy

    import cupyep
    from cupyep.barrier import GpuBarrier
    from cupyep.lab.bench.copy import copy_bandwidth
    from cupyep.lab.bench.normal import measure
    from cupyep.lab.bench.report import JsonlWriter
    from cupyep.normal.direct_kernels import DirectConfig
    from cupyep.testing import global_routing, payload_bf16

    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    R, me = group.local_size, group.local_rank
    copy_bw = group.comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    idx, w = global_routing(0, [args.tokens] * R, args.experts, args.topk)
    x = cupy.asarray(payload_bf16(me, np.arange(args.tokens), args.hidden))
    topk_idx, topk_w = cupy.asarray(idx[me]), cupy.asarray(w[me])
    buf = cupyep.Buffer(group, max_tokens=args.tokens, hidden=args.hidden, num_topk=args.topk)
    bar = GpuBarrier(group)
    big = int(args.big_gib * (1 << 30))
    held = []

    def own(nbytes, at_end=False):
        def make(r):
            mem = cupy.cuda.Memory(nbytes)  # a cudaMalloc of its own, not CuPy's pool
            held.append(mem)
            off = nbytes - r.nbytes if at_end else 0
            y = cupy.ndarray(r.shape, r.dtype, cupy.cuda.MemoryPointer(mem, off))
            y[...] = r
            return y
        return make

    def pool_after_big(r):
        held.append(cupy.empty(big, dtype=np.uint8))
        return r.copy()

    variants = {"recv": lambda r: r, "cupy_pool": lambda r: r.copy(), "malloc_exact": lambda r: own(r.nbytes)(r),
                "malloc_big": own(big), "malloc_big_end": own(big, at_end=True), "pool_after_big": pool_after_big}
    for name, make in variants.items():
        for timing in args.timing:
            rec = measure(group, buf, bar, "combine_bf16", x, None, topk_idx, topk_w, args.experts, DirectConfig(),
                          None, "direct", timing, args.iters, copy_bw, expert_outputs=make)
            out.write({**rec, "memory": name, "big_bytes": big})
            held.clear()
            cupy.get_default_memory_pool().free_all_blocks()
    buf.destroy()


if __name__ == "__main__":
    main()
