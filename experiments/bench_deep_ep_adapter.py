"""The host cost of cupyep.deep_ep: the same calls through DeepEP's API on
torch tensors and through cupyep's own API, on the same cupyep buffers.

    python -m cupyep.launcher -n 8 experiments/bench_deep_ep_adapter.py --out results/deep_ep_adapter/adapter.json
    python experiments/bench_deep_ep_adapter.py --table results/deep_ep_adapter/*.json   # Markdown, no GPU

For each call it times the host side of one call (time.perf_counter around
it; the median over ``--iters`` calls, after a warm-up) three ways:

- ``adapter_us``: ``cupyep.deep_ep.Buffer`` with torch tensors;
- ``native_cupy_us``: ``cupyep.Buffer`` / ``cupyep.LowLatencyBuffer`` with
  CuPy views of the same tensors, made before the timing (no conversion);
- ``native_torch_us``: the same native calls given the torch tensors (cupyep
  views them through DLPack).

``pieces_us`` times the adapter's parts alone in the same launch (a tensor
viewed as CuPy, an array handed to torch, torch's stream entered, a config
mapped), so the cost can be split into them. ``-n 1`` runs one rank without
MPS: the host cost of a call on a GPU of its own.

``adapter_cost_us`` = adapter_us - native_cupy_us is the whole cost of the
adapter (tensor views in and out, torch's stream, the tuple and handle);
``adapter_minus_native_torch_us`` compares it with a caller of the native
API who holds torch tensors too. The target is at most 10 us
(``within_target``). The calls that never wait on the host are the ones to
read: cached and worst-token dispatch, combine, layout and the low-latency
calls; a counted dispatch waits on the host for its counts, so its host time
carries the GPU's. Every value is the slowest rank's. Rank 0 writes one JSON
document to ``--out``.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

TARGET_US = 10.0


def host_times(fn, iters: int, warmup: int, sync) -> list:
    """Host seconds of each of ``iters`` calls of ``fn`` (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    sync()
    return out


def allocations_per_call(fn, calls: int, sync) -> dict:
    """CuPy allocations per call of ``fn`` over ``calls`` calls: ``pool`` (every
    allocation through CuPy's memory pool) and ``device`` (those the pool could
    not serve from its cache, each a cudaMalloc)."""
    import cupy

    class Count(cupy.cuda.MemoryHook):
        name = "cupyep_count"

        def __init__(self):
            self.pool = self.device = 0

        def malloc_preprocess(self, **kw):
            self.pool += 1

        def alloc_preprocess(self, **kw):
            self.device += 1

    fn()
    sync()
    hook = Count()
    with hook:
        for _ in range(calls):
            fn()
    sync()
    return {"pool": hook.pool / calls, "device": hook.device / calls}


def profile_adapter(path, group, sync, iters, calls, ll_calls):
    """Rank 0 profiles ``iters`` adapter calls of each kind (the others make
    the same calls unprofiled) and writes each kind's top functions by own
    time, with their callers, to ``path``."""
    import cProfile
    import io
    import pstats
    out = io.StringIO()

    def run(name, fn):
        prof = cProfile.Profile() if group.rank == 0 else None
        sync()
        if prof:
            prof.enable()
        fn()
        if prof:
            prof.disable()
            out.write(f"==== {name}: {iters} calls\n")
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        sync()

    for name, fn in calls.items():
        run(name, lambda: [fn() for _ in range(iters)])
    dispatch, combine = ll_calls
    run("low_latency dispatch + combine", lambda: [combine(dispatch()) for _ in range(iters)])
    if group.rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(out.getvalue())


def table(paths) -> str:
    """The Markdown table of documents this benchmark wrote: per file and
    call, the slowest rank's median host time through the adapter and
    natively (CuPy views; torch tensors), and the adapter's cost."""
    lines = ["| file | ranks | call | adapter us | native us (CuPy views) | native us (torch tensors) | "
             "adapter cost us | within 10 us |", "|" + " --- |" * 8]
    for path in paths:
        doc = json.loads(Path(path).read_text())
        for r in doc["rows"]:
            lines.append(f"| {Path(path).name} | {doc['ranks']} | {r['call']} | {r['adapter_us']:.1f} | "
                         f"{r['native_cupy_us']:.1f} | {r['native_torch_us']:.1f} | {r['adapter_cost_us']:.1f} | "
                         f"{'yes' if r['within_target'] else 'no'} |")
    return "\n".join(lines)


def main():
    import sys
    if sys.argv[1:2] == ["--table"]:  # no GPU needed
        print(table(sys.argv[2:]))
        return
    from cupyep.lab.bench import require_gpu
    require_gpu(__file__)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/deep_ep_adapter/adapter.json")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (normal mode)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ll-tokens", type=int, default=128, help="num_max_dispatch_tokens_per_rank")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of adapter and native timings")
    p.add_argument("--cprofile", default=None,
                   help="after the timings, profile --iters adapter calls of each kind on rank 0 (cProfile) and "
                        "write the functions by own time to this text file")
    args = p.parse_args()

    import cupy
    import torch
    from mpi4py import MPI

    import cupyep
    import cupyep.arrays
    from cupyep import deep_ep
    from cupyep.lab.bench.report import environment
    from cupyep.testing import global_routing, payload_bf16

    group = cupyep.init()
    torch.cuda.set_device(group.device_id)
    R, me, E, T, H, k = group.local_size, group.local_rank, args.experts, args.tokens, args.hidden, args.topk
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.ll_tokens, H, R, E)
    buf = deep_ep.Buffer(group, int(1e9), rdma, low_latency_mode=True, explicitly_destroy=True)
    native = buf.normal
    # Both sides on the same SMs: the adapter's default configs take Buffer.num_sms, the native ones
    # cupyep's tuned count.
    deep_ep.Buffer.set_num_sms(native.default_dispatch_config().num_sms)

    def sync():
        torch.cuda.synchronize()
        group.comm.Barrier()

    def views(*tensors):
        return tuple(cupyep.arrays.as_cupy(t, "t") for t in tensors)

    idx_all, w_all = global_routing(1, [T] * R, E, k)
    x_t = torch.from_numpy(payload_bf16(me, np.arange(T), H).view(np.int16)).cuda().view(torch.bfloat16)
    idx_t, w_t = torch.from_numpy(idx_all[me]).cuda(), torch.from_numpy(w_all[me]).cuda()
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_t, E)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x_t, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx_t, topk_weights=w_t)
    x_c, idx_c, w_c, per_rank_c, per_expert_c, in_rank_c, recv_x_c, recv_w_c = views(
        x_t, idx_t, w_t, per_rank, per_expert, in_rank, recv_x, recv_w)
    worst = T * R
    layout_kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    layout_kw_c = dict(num_tokens_per_rank=per_rank_c, is_token_in_rank=in_rank_c,
                       num_tokens_per_expert=per_expert_c)
    # Worst-token results for the worst-token combine.
    wx, _, ww, _, whandle, _ = buf.dispatch(x_t, topk_idx=idx_t, topk_weights=w_t, num_worst_tokens=worst,
                                            **layout_kw)
    wx_c, ww_c = views(wx, ww)

    calls = {  # name: (adapter call, native call with CuPy views, native call with torch tensors)
        "get_dispatch_layout": (
            lambda: buf.get_dispatch_layout(idx_t, E),
            lambda: native.get_dispatch_layout(idx_c, E, validate=False),
            lambda: native.get_dispatch_layout(idx_t, E, validate=False)),
        "dispatch (counted: waits for counts)": (
            lambda: buf.dispatch(x_t, topk_idx=idx_t, topk_weights=w_t, **layout_kw),
            lambda: native.dispatch(x_c, idx_c, w_c, num_experts=E, validate=False, **layout_kw_c),
            lambda: native.dispatch(x_t, idx_t, w_t, num_experts=E, validate=False, **layout_kw)),
        "dispatch cached": (
            lambda: buf.dispatch(x_t, handle=handle),
            lambda: native.dispatch(x_c, handle=handle.native, validate=False),
            lambda: native.dispatch(x_t, handle=handle.native, validate=False)),
        "dispatch worst-token": (
            lambda: buf.dispatch(x_t, topk_idx=idx_t, topk_weights=w_t, num_worst_tokens=worst, **layout_kw),
            lambda: native.dispatch(x_c, idx_c, w_c, num_experts=E, num_worst_tokens=worst, validate=False,
                                    **layout_kw_c),
            lambda: native.dispatch(x_t, idx_t, w_t, num_experts=E, num_worst_tokens=worst, validate=False,
                                    **layout_kw)),
        "combine": (
            lambda: buf.combine(recv_x, handle, topk_weights=recv_w),
            lambda: native.combine(recv_x_c, handle.native, recv_w_c),
            lambda: native.combine(recv_x, handle.native, recv_w)),
        "combine worst-token": (
            lambda: buf.combine(wx, whandle, topk_weights=ww),
            lambda: native.combine(wx_c, whandle.native, ww_c),
            lambda: native.combine(wx, whandle.native, ww)),
    }

    # Low-latency mode: each dispatch is followed by its combine; both timed.
    T_ll = args.ll_tokens
    xl_t = x_t[:T_ll] if T_ll <= T else x_t.repeat((T_ll + T - 1) // T, 1)[:T_ll]
    il_t, wl_t = idx_t[:T_ll].contiguous(), w_t[:T_ll].contiguous()
    buf.clean_low_latency_buffer(T_ll, H, E)
    ll = buf.low_latency
    xl_c, il_c, wl_c = views(xl_t, il_t, wl_t)

    y_t = torch.zeros((E // R, R * T_ll, H), dtype=torch.bfloat16, device="cuda")  # the experts' outputs
    y_c = cupyep.arrays.as_cupy(y_t, "y")

    def ll_times(dispatch, combine, iters, warmup):
        d, c = [], []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            res = dispatch()
            t1 = time.perf_counter()
            combine(res)
            t2 = time.perf_counter()
            if i >= warmup:
                d.append(t1 - t0)
                c.append(t2 - t1)
        sync()
        return d, c

    ll_variants = {
        "adapter": (lambda: buf.low_latency_dispatch(xl_t, il_t, T_ll, E, use_fp8=True),
                    lambda r: buf.low_latency_combine(y_t, il_t, wl_t, r[2])),
        "native_cupy": (lambda: ll.dispatch(xl_c, il_c, use_fp8=True, validate=False),
                        lambda r: ll.combine(y_c, il_c, wl_c, r.handle)),
        "native_torch": (lambda: ll.dispatch(xl_t, il_t, use_fp8=True, validate=False),
                         lambda r: ll.combine(y_t, il_t, wl_t, r.handle)),
    }

    samples = {name: {"adapter": [], "native_cupy": [], "native_torch": []} for name in calls}
    samples["low_latency_dispatch"] = {v: [] for v in ll_variants}
    samples["low_latency_combine"] = {v: [] for v in ll_variants}
    sync()
    for _ in range(args.rounds):
        for name, fns in calls.items():
            for variant, fn in zip(("adapter", "native_cupy", "native_torch"), fns):
                samples[name][variant] += host_times(fn, args.iters, args.warmup, sync)
        for variant, (d, c) in ll_variants.items():
            ds, cs = ll_times(d, c, args.iters, args.warmup)
            samples["low_latency_dispatch"][variant] += ds
            samples["low_latency_combine"][variant] += cs

    # The adapter's pieces alone, in the same launch: one tensor viewed as CuPy, one array handed to
    # torch (with the BF16 view), torch's stream made CuPy's, a Config mapped.
    from cupyep.deep_ep import tensors as TS
    from cupyep.deep_ep.config import default_cupyep_config
    def stream_enter_exit():
        ctx = TS.torch_stream()
        ctx.__enter__()
        ctx.__exit__(None, None, None)
    pieces = {
        "to_cupy (one tensor)": lambda: TS.to_cupy(x_t, "x"),
        "to_torch (one array, as bfloat16)": lambda: TS.to_torch(x_c, "bf16"),
        "torch_stream (enter and exit)": stream_enter_exit,
        "default config": lambda: default_cupyep_config(R, 20, True),
    }
    piece_us = {}
    for name, fn in pieces.items():
        med = float(np.median(host_times(fn, args.iters * args.rounds, args.warmup, sync))) * 1e6
        piece_us[name] = group.comm.allreduce(med, op=MPI.MAX)

    # CuPy allocations per call, each variant (pool requests and cudaMallocs), outside the timings.
    allocs = {}
    for name, fns in calls.items():
        allocs[name] = {v: allocations_per_call(fn, 20, sync) for v, fn in
                        zip(("adapter", "native_cupy", "native_torch"), fns)}
    for name, (d, c) in (("low_latency_dispatch + combine", ll_variants["adapter"]),
                         ("low_latency_dispatch + combine (native)", ll_variants["native_cupy"])):
        allocs[name] = allocations_per_call(lambda: c(d()), 20, sync)

    if args.cprofile:
        profile_adapter(args.cprofile, group, sync, args.iters,
                        {name: fns[0] for name, fns in calls.items()}, ll_variants["adapter"])

    rows = []
    for name, by_variant in samples.items():
        med = {v: float(np.median(s)) * 1e6 for v, s in by_variant.items()}
        slowest = {v: group.comm.allreduce(m, op=MPI.MAX) for v, m in med.items()}
        cost = slowest["adapter"] - slowest["native_cupy"]
        rows.append({"call": name, "adapter_us": slowest["adapter"], "native_cupy_us": slowest["native_cupy"],
                     "native_torch_us": slowest["native_torch"], "adapter_cost_us": cost,
                     "adapter_minus_native_torch_us": slowest["adapter"] - slowest["native_torch"],
                     "within_target": cost <= TARGET_US,
                     "host_waits": name.startswith("dispatch (counted")})
    sync()
    if group.rank == 0:
        doc = {"bench": "deep_ep_adapter", "target_us": TARGET_US, "ranks": R,
               "shape": {"tokens": T, "hidden": H, "experts": E, "topk": k, "ll_tokens": T_ll},
               "iters": args.iters, "rounds": args.rounds, "rows": rows, "pieces_us": piece_us,
               "allocations_per_call": allocs,
               "env": environment(group)}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        for r in rows:
            print(f"{r['call']:40s} adapter {r['adapter_us']:8.1f} us  native {r['native_cupy_us']:8.1f} us  "
                  f"(torch in {r['native_torch_us']:8.1f})  cost {r['adapter_cost_us']:6.1f} us", flush=True)
        for name, us in piece_us.items():
            print(f"  piece: {name:36s} {us:8.1f} us", flush=True)
        print("  allocations per call (pool / cudaMalloc):", json.dumps(allocs), flush=True)
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
