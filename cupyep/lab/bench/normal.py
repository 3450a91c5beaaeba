"""One normal-mode measurement: a kind of call, on a transport, on a timing
boundary; the record the benchmark (experiments/bench_normal.py) and the
"normal" sweep study (cupyep.lab.experiments.gpu_normal) write.

Kinds (``KINDS``; ``DIRECT_KINDS`` only on the direct transport):

- ``dispatch_bf16`` / ``dispatch_fp8``: cached dispatch (the handle of a
  first dispatch), BF16 rows / FP8 rows with their scales;
- ``dispatch_bf16_notify``: dispatch with the layout and the notify pass;
- ``combine_bf16``: combine of the dispatched rows (on the direct
  transport a copy of them in the caller's memory, as an expert's outputs
  are: the default combine reads it in place, ``DirectConfig.combine_in_place``);
- ``combine_bf16_pushed``: the same with ``DirectConfig(combine_in_place=False)``:
  each expert rank pushes its rows into the owners' partial rows (direct
  transport);
- ``combine_bf16_in_place_recv``: the in-place combine of the dispatch's own
  recv_x, a view of cupyep's pool, which the owners read where that pool is
  mapped (direct transport; against ``combine_bf16``, it tells the memory's
  allocator apart from the rest of the in-place path);
- ``combine_bf16_zero_copy``: the zero-copy combine (the rows written into
  ``get_combine_buffer``);
- ``dispatch_bf16_notify_unfused``: the same with layout, notify and send
  as three launches (``DirectConfig(fused=False)``; fused is the default);
- ``dispatch_bf16_expert_major``: dispatch with the layout and the notify
  pass into the expert-major layout (``expert_major=True``, alignment 1);
  its bytes are the (row, local expert) pairs delivered;
- ``dispatch_bf16_expert_major_unfused``: the same, unfused (direct transport).

Timing boundaries: "strict" (each call alone after an L2 flush and a GPU
barrier; the slowest rank's median) and "deepep" (DeepEP's benchmark: one
barrier, then calls back to back; each rank's own median).
"""
from __future__ import annotations

from dataclasses import asdict, replace

KINDS = ("dispatch_bf16", "dispatch_fp8", "dispatch_bf16_notify", "combine_bf16", "dispatch_bf16_expert_major")
DIRECT_KINDS = ("combine_bf16_zero_copy", "combine_bf16_pushed", "combine_bf16_in_place_recv",
                "dispatch_bf16_notify_unfused", "dispatch_bf16_expert_major_unfused")
TIMINGS = ("strict", "deepep")


def measure(group, buf, barrier, kind: str, x, x_fp8, topk_idx, topk_weights, num_experts: int,
            dispatch_config, combine_config=None, transport: str = "queue", timing: str = "strict",
            iters: int = 30, copy_bw: float | None = None, expert_outputs=None) -> dict:
    """Time ``kind`` and return its record (collective over the group).

    Arguments:
        group: the rank group; buf: cupyep.Buffer; barrier: a callable
            enqueuing a GPU barrier (cupyep.barrier.GpuBarrier).
        x: cupy [T, H] uint16 (BF16 bits); x_fp8: (x_fp8 [T, H] uint8, scales
            [T, H / 128] float32) or None (needed by dispatch_fp8 only).
        topk_idx: cupy [T, k] int64; topk_weights: cupy [T, k] float32.
        num_experts: E.
        dispatch_config: the queue transport's Config or a DirectConfig;
            combine_config: the queue's combine Config (direct: unused).
        transport: "queue" or "direct"; timing: "strict" or "deepep".
        iters: timed calls; copy_bw: bytes/s of the copy kernel (read +
            write), the same on every rank, for the efficiency (None: omitted).
        expert_outputs: for ``combine_bf16`` on the direct transport, a
            function of the dispatch's recv_x that returns the combine's x
            (default: ``recv_x.copy()``, an array of CuPy's pool).

    Returns:
        dict: "bench": "normal", "kind" (``<kind>_direct`` on the direct
        transport), "transport", "timing", "ranks", "tokens", "hidden",
        "topk", "experts", "time_us" (slowest rank's median), "p10_us",
        "p90_us", "p99_us" (slowest rank's), "rank_mean_us", "rank_GBps"
        (received rows x row bytes / time, mean over ranks), "efficiency"
        (2 x bytes received by all ranks / copy bandwidth / time),
        "copy_GBps", "dispatch_config", "combine_config"; on the direct
        transport also "kernel_us" and "kernel_p90_us" (the slowest rank's
        median and p90 of its kernel's first block start to last block end,
        the kernel_time_ns stamps of the timed calls), and, when every rank
        is on one GPU (one %globaltimer), "kernel_span_us" (median over calls
        of the first rank's first block start to the last rank's last block
        end: the time in which all ranks' bytes moved) and "kernel_skew_us"
        (the last rank's start after the first's); "kernel_efficiency" is the
        efficiency at "kernel_span_us" when there is one, else at "kernel_us".
    """
    import numpy as np
    from mpi4py import MPI

    from .timing import time_fn
    if kind not in KINDS + DIRECT_KINDS:
        raise ValueError(f"kind must be one of {KINDS + DIRECT_KINDS}, got {kind!r}")
    if kind in DIRECT_KINDS and transport != "direct":
        raise ValueError(f"{kind} needs the direct transport")
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    dcfg, ccfg = dispatch_config, combine_config
    if transport == "direct":
        ccfg = dcfg
    elif kind == "combine_bf16":  # a combine runs on its dispatch's channels
        dcfg = replace(dcfg, num_sms=ccfg.num_sms)
    T, H = x.shape
    first = buf.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, config=dcfg, transport=transport)
    stamps, used = None, [0]
    if transport == "direct":  # the kernel's own clock: one row of stamps per call from here on
        from .stamps import new_kernel_stamps
        stamps = new_kernel_stamps(iters + 16)  # the timed calls are the last iters rows used

    def kt() -> dict:  # a fresh row per call (an IndexError rather than a row stamped twice)
        if stamps is None:
            return {}
        used[0] += 1
        return {"kernel_time_ns": stamps[used[0] - 1]}
    n = first.recv_x.shape[0]
    row = 2 * H
    if kind == "dispatch_bf16":
        fn = lambda: buf.dispatch(x, handle=first.handle, config=dcfg, **kt())  # noqa: E731
    elif kind == "dispatch_fp8":
        if x_fp8 is None:
            raise ValueError("dispatch_fp8 needs x_fp8")
        fn = lambda: buf.dispatch(x_fp8, handle=first.handle, config=dcfg, **kt())  # noqa: E731
        row = H + H // 128 * 4
    elif kind == "dispatch_bf16_notify":
        fn = lambda: buf.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, config=dcfg,  # noqa: E731
                                  validate=False, transport=transport, **kt())
    elif kind == "dispatch_bf16_notify_unfused":
        fcfg = replace(dcfg, fused=False)
        fn = lambda: buf.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, config=fcfg,  # noqa: E731
                                  validate=False, transport=transport, **kt())
    elif kind.startswith("dispatch_bf16_expert_major"):
        ecfg = replace(dcfg, fused=False) if kind.endswith("_unfused") else dcfg
        fn = lambda: buf.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, config=ecfg,  # noqa: E731
                                  validate=False, transport=transport, expert_major=True, **kt())
        n = int(fn().expert_offsets[-1].get())  # alignment 1: the pairs delivered
    elif kind == "combine_bf16_zero_copy":
        y = buf.get_combine_buffer(first.handle)
        y[...] = first.recv_x
        fn = lambda: buf.combine(y, first.handle, config=ccfg, zero_copy=True, **kt())  # noqa: E731
    else:
        # the experts' outputs: on the direct transport a copy in the caller's memory (recv_x is a view of its pool)
        y = first.recv_x
        if transport == "direct" and kind != "combine_bf16_in_place_recv":
            y = (expert_outputs or (lambda r: r.copy()))(first.recv_x)
        if kind == "combine_bf16_pushed":
            ccfg = replace(ccfg, combine_in_place=False)
        fn = lambda: buf.combine(y, first.handle, config=ccfg, **kt())  # noqa: E731
    if timing == "strict":
        t = time_fn(fn, iters=iters, warmup=3, before=barrier)
    else:  # DeepEP's boundary: one barrier, then calls back to back
        fn()
        barrier()
        t = time_fn(fn, iters=iters, warmup=0, flush=False)
    buf.synchronize()
    comm, R = group.comm, group.local_size
    slowest = lambda v: comm.allreduce(v, op=MPI.MAX) * 1e6  # noqa: E731
    t_max = comm.allreduce(t.median_s, op=MPI.MAX)
    recv_bytes = n * row
    total = comm.allreduce(recv_bytes)
    kernel = {}
    if stamps is not None:
        from .stamps import cross_rank, kernel_seconds, one_timer
        mine = stamps[used[0] - iters:used[0]].get()
        k = kernel_seconds(mine)
        k_med = comm.allreduce(float(np.median(k)), op=MPI.MAX)
        kernel = {"kernel_us": k_med * 1e6, "kernel_p90_us": slowest(float(np.percentile(k, 90)))}
        clock = k_med
        if one_timer(group):
            every = cross_rank(np.stack(comm.allgather(mine)))
            kernel["kernel_span_us"] = every["span"]["median_us"]
            kernel["kernel_skew_us"] = every["skew"]["median_us"]
            clock = kernel["kernel_span_us"] * 1e-6
        kernel["kernel_efficiency"] = 2 * total / copy_bw / clock if copy_bw else None
    return {"bench": "normal", "kind": kind if transport == "queue" else f"{kind}_direct", "transport": transport,
            "timing": timing, "ranks": R, "tokens": T, "hidden": H, "topk": int(topk_idx.shape[1]),
            "experts": num_experts, "time_us": t_max * 1e6, "p10_us": slowest(t.p10_s), "p90_us": slowest(t.p90_s),
            "p99_us": slowest(t.p99_s), "rank_mean_us": comm.allreduce(t.median_s) / R * 1e6,
            "rank_GBps": comm.allreduce(recv_bytes / t.median_s) / R / 1e9,
            "efficiency": 2 * total / copy_bw / t_max if copy_bw else None,
            "copy_GBps": copy_bw / 1e9 if copy_bw else None,
            **kernel, "dispatch_config": asdict(dcfg), "combine_config": asdict(ccfg)}
