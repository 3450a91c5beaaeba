"""Can a combine read the expert outputs where the caller left them, in a
peer's own CuPy arrays, through CUDA IPC, and what would that cost the host
per call?

    python -m cupyep.launcher -n 2 experiments/probes/probe_ipc_caller_memory.py --out ipc_caller_memory.json

Today a combine that takes a plain caller array ``x`` pushes its rows into
the owners' registered pool, and the owners read them back (two passes over
the rows on one GPU). An owner that read each expert rank's ``x`` in place
would make one pass, as the zero-copy combine does with the pool's buffer.
That needs every rank to map its peers' allocations. This probe measures
the pieces, with arrays from CuPy's memory pool:

- ``interior``: a pool array is usually an interior piece of a larger
  ``cudaMalloc``; the exporter finds the allocation (``cuMemGetAddressRange``,
  through ctypes on the driver), takes its IPC handle, and the peer maps it
  and reads the array at base + offset. ``ok`` when the peer's sum over its
  view equals the exporter's over the array (a tagged pattern).
- ``handle_same`` / ``handle_after_realloc``: whether the handle of one
  allocation is the same bytes call after call, and whether a new
  allocation at the same address (free, then malloc of the same size) gets
  other bytes: a peer holding a cached mapping could then tell a stale one
  by comparing handles.
- host cost per call, us (median over ``--iters``): the address range, the
  IPC handle, comparing it with a cached one, the exchange of (handle,
  offset) with the other ranks (``allgather`` over mpi4py), and the first
  open of a peer's handle and its close.
"""
import argparse
import time

import numpy as np

from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.timing import host_median_us
from cupyep.lab.bench.report import write_document


def main():
    require_gpu(__file__)
    import cupy
    from mpi4py import MPI
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--rows", type=int, default=1000, help="rows of the probed array (hidden 7168, BF16 bits)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    rt = cupy.cuda.runtime
    from cupyep.ipc_peers import address_range
    rec: dict = {"probe": "ipc_caller_memory", "ranks": R, "rows": args.rows, "iters": args.iters}

    # An array at a non-zero offset inside its allocation: rows 64 on of a larger one (CuPy's pool may
    # also place a fresh array inside a larger block, or at its start).
    full = (cupy.arange((args.rows + 64) * 7168, dtype=np.int64) * (rank + 3) % 65521).astype(np.uint16)
    x = full.reshape(args.rows + 64, 7168)[64:]
    cupy.cuda.runtime.deviceSynchronize()
    base, size = address_range(x.data.ptr)
    offset = x.data.ptr - base
    handle = bytes(rt.ipcGetMemHandle(base))
    rec["exporter"] = {"offset": int(offset), "allocation_bytes": int(size), "array_bytes": int(x.nbytes),
                       "interior": bool(offset > 0)}
    mine = int(x.astype(np.int64).sum())
    everyone = comm.allgather((handle, int(offset), mine))

    # Each rank maps its next peer's allocation and sums the array there.
    peer = (rank + 1) % R
    if R > 1:
        t0 = time.perf_counter()
        mapped = rt.ipcOpenMemHandle(everyone[peer][0], 1)
        open_us = (time.perf_counter() - t0) * 1e6
        mem = cupy.cuda.UnownedMemory(mapped + everyone[peer][1], x.nbytes, None)
        view = cupy.ndarray(x.shape, np.uint16, cupy.cuda.MemoryPointer(mem, 0))
        theirs = int(view.astype(np.int64).sum())
        cupy.cuda.runtime.deviceSynchronize()
        del view, mem
        t0 = time.perf_counter()
        rt.ipcCloseMemHandle(mapped)
        close_us = (time.perf_counter() - t0) * 1e6
        rec["interior_ok_per_rank"] = comm.allgather(theirs == everyone[peer][2])
        rec["first_open_us_per_rank"] = comm.allgather(round(open_us, 1))
        rec["close_us_per_rank"] = comm.allgather(round(close_us, 1))
    comm.Barrier()

    # Handle bytes: stable for one allocation; and for a new allocation at the same address?
    rec["handle_same"] = bytes(rt.ipcGetMemHandle(base)) == handle
    raw = rt.malloc(64 << 20)
    h1 = bytes(rt.ipcGetMemHandle(raw))
    rt.free(raw)
    raw2 = rt.malloc(64 << 20)
    h2 = bytes(rt.ipcGetMemHandle(raw2))
    rec["realloc_same_address"] = raw2 == raw
    rec["handle_after_realloc_differs"] = h1 != h2
    rt.free(raw2)

    # Host cost of what a call would do.
    cached = {base: handle}
    ptr = x.data.ptr

    def lookup():
        b, _ = address_range(ptr)
        return bytes(rt.ipcGetMemHandle(b)) == cached[b]
    small = (handle, int(offset))
    costs = {
        "address_range_us": host_median_us(lambda: address_range(ptr), args.iters),
        "ipc_get_handle_us": host_median_us(lambda: rt.ipcGetMemHandle(base), args.iters),
        "range_handle_compare_us": host_median_us(lookup, args.iters),
    }
    comm.Barrier()
    costs["allgather_handle_offset_us"] = host_median_us(lambda: comm.allgather(small), args.iters)
    comm.Barrier()
    costs["allgather_offset_only_us"] = host_median_us(lambda: comm.allgather(int(offset)), args.iters)
    rec["host_cost_per_rank"] = comm.gather(costs, root=0)
    if rank == 0:
        write_document(rec, args.out)
    comm.Barrier()


if __name__ == "__main__":
    main()
