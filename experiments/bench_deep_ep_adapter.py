"""The host cost of cupyep.deep_ep: the same calls through DeepEP's API on
torch tensors and through cupyep's own API, on the same cupyep buffers.

    python -m cupyep.launcher -n 8 experiments/bench_deep_ep_adapter.py --out results/deep_ep_adapter/adapter.json
    python experiments/bench_deep_ep_adapter.py --table results/deep_ep_adapter/*.json   # Markdown, no GPU
    python experiments/bench_deep_ep_adapter.py --summary results/deep_ep_adapter/interleaved_2ranks_?.json

For each call it times the host side of one call (time.perf_counter around
it, torch's stream drained before each call so that no call waits for the
GPU's launch queue) four ways, interleaved call by call:

- ``adapter``: ``cupyep.deep_ep.Buffer`` with torch tensors;
- ``native_cupy``: ``cupyep.Buffer`` / ``cupyep.LowLatencyBuffer`` with
  CuPy views of the same tensors, made before the timing (no conversion),
  asking for the same work (low-latency mode: DeepEP's packed outputs,
  ``packed_out=True``, and the combine reading them, ``x_layout="packed"``);
- ``native_torch``: the same native calls given the torch tensors;
- ``crossings``: the call's tensor crossings alone: every input tensor the
  adapter views as CuPy, torch's stream made CuPy's and back, every output
  handed to torch (of a result made before the timing).

``adapter_cost_us`` is the median over calls of adapter minus native_cupy
(the two timed back to back): the whole cost of the adapter.
``crossings_us`` is the part of it no Python adapter over CuPy avoids (its
conversions, the same in any design that hands DeepEP's torch tensors in
and out), and ``own_us`` = adapter_cost_us - crossings_us the rest (the
arguments, configs, handle, events and tuples). The target is at most 10 us
of adapter cost (``within_target``). The combines are given a fresh tensor
of expert outputs, as a model gives them, not the dispatch's own result
(which crosses back for free). A counted dispatch waits on the host for its
counts, so its host time carries the GPU's. ``inner_us`` and
``split_own_us`` split the adapter's calls within each call (a fifth,
interleaved variant): the time of the cupyep call the adapter makes inside
it, and everything else (crossings included). Every value is the slowest
rank's. ``pieces_us`` times single crossings alone. Rank 0 writes one JSON
document to ``--out``.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

TARGET_US = 10.0


def host_times(fn, iters: int, warmup: int, sync) -> list:
    """Host seconds of each of ``iters`` calls of ``fn`` (after ``warmup`` calls;
    the result of a call is released after its timing)."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        got = fn()
        out.append(time.perf_counter() - t0)
        got = None  # released outside the timing  # noqa: F841
    sync()
    return out


def interleaved_times(variants: dict, iters: int, warmup: int, drain) -> dict:
    """{variant: [[seconds of step 0 per call], [step 1], ...]}.

    Each variant is a sequence of steps: the first called with no argument,
    each next one with the result of the one before (a dispatch, then the
    combine of its handle). Every iteration runs each variant's steps in
    turn, calling ``drain`` (wait for the GPU) before each timed step, so
    that variants see the same host and an idle launch queue; the first
    ``warmup`` iterations are not kept. A step's timing holds no release of
    an earlier result (a dispatch's tensors are freed after its combine's
    timing)."""
    out = {v: [[] for _ in steps] for v, steps in variants.items()}
    for i in range(warmup + iters):
        for v, steps in variants.items():
            res = None
            for j, step in enumerate(steps):
                drain()
                t0 = time.perf_counter()
                got = step() if j == 0 else step(res)
                dt = time.perf_counter() - t0
                res = got  # the step before's result is released here, outside the timing
                if i >= warmup:
                    out[v][j].append(dt)
    return out


class InnerClock:
    """Splits an adapter call into the cupyep call it makes and the rest, in
    the same call: while a call runs through :meth:`step`, the listed methods
    of cupyep's buffers (``targets``: (object, method name)) are wrapped so
    that their host time adds to ``inner``. ``samples[key]`` collects
    (outer seconds, inner seconds) per call."""

    def __init__(self, targets):
        self.targets, self.inner, self.samples = targets, 0.0, {}

    def _wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.inner += time.perf_counter() - t0
        return timed

    def step(self, key: str, call):
        """``call`` (taking the step before's result, or nothing) as a
        step of :func:`interleaved_times` that records its split."""
        def run(*prev):
            for obj, name in self.targets:  # instance attributes shadow the class's methods
                setattr(obj, name, self._wrap(getattr(obj, name)))
            self.inner = 0.0
            t0 = time.perf_counter()
            res = call(*prev)
            outer = time.perf_counter() - t0
            for obj, name in self.targets:
                delattr(obj, name)
            self.samples.setdefault(key, []).append((outer, self.inner))
            return res
        return run


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
    natively (CuPy views; torch tensors), and the adapter's cost; for
    documents that have them (interleaved timings), the cost's crossings
    and the rest."""
    docs = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    split = all("crossings_us" in r for _, d in docs for r in d["rows"])
    inner = all("inner_us" in r for _, d in docs for r in d["rows"])
    head = ["file", "ranks", "call", "adapter us", "native us (CuPy views)", "native us (torch tensors)",
            "adapter cost us"] + (["of which crossings us", "of which the rest us"] if split else []) + \
        (["in the call: cupyep's call us", "in the call: the rest us"] if inner else []) + ["within 10 us"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for path, doc in docs:
        for r in doc["rows"]:
            cells = [path.name, str(doc["ranks"]), r["call"], f"{r['adapter_us']:.1f}", f"{r['native_cupy_us']:.1f}",
                     f"{r['native_torch_us']:.1f}", f"{r['adapter_cost_us']:.1f}"]
            if split:
                cells += [f"{r['crossings_us']:.1f}", f"{r['own_us']:.1f}"]
            if inner:
                cells += [f"{r['inner_us']:.1f}", f"{r['split_own_us']:.1f}"]
            cells.append("yes" if r["within_target"] else "no")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(paths) -> str:
    """The Markdown table of repeated launches: per rank count and call, the
    median [min, max] over the documents of the adapter's cost, and the
    medians of its crossings and of the rest (documents with interleaved
    timings)."""
    by = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        for r in doc["rows"]:
            by.setdefault((doc["ranks"], r["call"]), []).append(r)
    lines = ["| ranks | call | launches | adapter cost us | of which crossings us | of which the rest us | "
             "within 10 us |", "|" + " --- |" * 7]
    for (ranks, call), rs in by.items():
        cost = [r["adapter_cost_us"] for r in rs]
        cross = float(np.median([r["crossings_us"] for r in rs]))
        rest = float(np.median([r["own_us"] for r in rs]))
        med = float(np.median(cost))
        lines.append(f"| {ranks} | {call} | {len(rs)} | {med:.1f} [{min(cost):.1f}, {max(cost):.1f}] | "
                     f"{cross:.1f} | {rest:.1f} | {'yes' if med <= TARGET_US else 'no'} |")
    return "\n".join(lines)


def pieces_table(paths) -> str:
    """The Markdown table of the single crossings (``pieces_us``) of documents
    this benchmark wrote, one column per document."""
    docs = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    names = list(dict.fromkeys(n for _, d in docs for n in d["pieces_us"]))
    lines = ["| piece | " + " | ".join(f"{p.name} ({d['ranks']} ranks) us" for p, d in docs) + " |",
             "|" + " --- |" * (len(docs) + 1)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{d['pieces_us'][n]:.1f}" if n in d["pieces_us"] else "-"
                                              for _, d in docs) + " |")
    return "\n".join(lines)


def main():
    import sys
    if sys.argv[1:2] == ["--table"]:  # no GPU needed
        print(table(sys.argv[2:]))
        return
    if sys.argv[1:2] == ["--summary"]:  # no GPU needed
        print(summary(sys.argv[2:]))
        return
    if sys.argv[1:2] == ["--pieces"]:  # no GPU needed
        print(pieces_table(sys.argv[2:]))
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
    x_c, idx_c, w_c, per_rank_c, per_expert_c, in_rank_c, recv_w_c = views(
        x_t, idx_t, w_t, per_rank, per_expert, in_rank, recv_w)
    worst = T * R
    layout_kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    layout_kw_c = dict(num_tokens_per_rank=per_rank_c, is_token_in_rank=in_rank_c,
                       num_tokens_per_expert=per_expert_c)
    # Worst-token results for the worst-token combine.
    wx, _, ww, _, whandle, _ = buf.dispatch(x_t, topk_idx=idx_t, topk_weights=w_t, num_worst_tokens=worst,
                                            **layout_kw)
    ww_c, = views(ww)

    # The combines' x: expert outputs the model made (a tensor of its own, which crosses as any input).
    y_t = recv_x.clone()
    wy_t = wx.clone()
    y_c, wy_c = views(y_t, wy_t)

    from cupyep.deep_ep import tensors as TS

    def stream_enter_exit():
        ctx = TS.torch_stream()
        ctx.__enter__()
        ctx.__exit__(None, None, None)

    def crossings(inputs, outputs):
        """The crossings of a call: ``inputs`` ({name: torch tensor or None})
        viewed as CuPy, torch's stream entered and left, ``outputs`` ((CuPy
        array or None, view)) handed to torch."""
        def run():
            for name, t in inputs.items():
                TS.to_cupy(t, name)
            stream_enter_exit()
            return [TS.to_torch(a, view) for a, view in outputs]
        return run

    def dispatch_out(r):
        return [(r.recv_x, "bf16"), (r.recv_topk_idx, None), (r.recv_topk_weights, None)]

    # Outputs of native results for the crossings to hand to torch, read as each result is made (a later
    # dispatch may take a result's pool slot).
    lay_n = native.get_dispatch_layout(idx_c, E, validate=False)
    lay_out = [(lay_n.num_tokens_per_rank, None), (lay_n.num_tokens_per_expert, None),
               (lay_n.is_token_in_rank, None)]
    res_out = dispatch_out(native.dispatch(x_c, idx_c, w_c, num_experts=E, validate=False, **layout_kw_c))
    cached_out = [(native.dispatch(x_c, handle=handle.native, validate=False).recv_x, "bf16")]
    worst_out = dispatch_out(native.dispatch(x_c, idx_c, w_c, num_experts=E, num_worst_tokens=worst,
                                             validate=False, **layout_kw_c))
    comb_n = native.combine(y_c, handle.native, recv_w_c)
    comb_out = [(comb_n.combined_x, "bf16"), (comb_n.combined_topk_weights, None)]
    sync()
    layout_in = dict(num_tokens_per_expert=per_expert, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank)
    dispatch_in = dict(x=x_t, **layout_in, topk_idx=idx_t, topk_weights=w_t)

    calls = {  # name: (adapter call, native with CuPy views, native with torch tensors, crossings alone)
        "get_dispatch_layout": (
            lambda: buf.get_dispatch_layout(idx_t, E),
            lambda: native.get_dispatch_layout(idx_c, E, validate=False),
            lambda: native.get_dispatch_layout(idx_t, E, validate=False),
            crossings(dict(topk_idx=idx_t), lay_out)),
        "dispatch (counted: waits for counts)": (
            lambda: buf.dispatch(x_t, topk_idx=idx_t, topk_weights=w_t, **layout_kw),
            lambda: native.dispatch(x_c, idx_c, w_c, num_experts=E, validate=False, **layout_kw_c),
            lambda: native.dispatch(x_t, idx_t, w_t, num_experts=E, validate=False, **layout_kw),
            crossings(dispatch_in, res_out)),
        "dispatch cached": (
            lambda: buf.dispatch(x_t, handle=handle),
            lambda: native.dispatch(x_c, handle=handle.native, validate=False),
            lambda: native.dispatch(x_t, handle=handle.native, validate=False),
            crossings(dict(x=x_t), cached_out)),
        "dispatch worst-token": (
            lambda: buf.dispatch(x_t, topk_idx=idx_t, topk_weights=w_t, num_worst_tokens=worst, **layout_kw),
            lambda: native.dispatch(x_c, idx_c, w_c, num_experts=E, num_worst_tokens=worst, validate=False,
                                    **layout_kw_c),
            lambda: native.dispatch(x_t, idx_t, w_t, num_experts=E, num_worst_tokens=worst, validate=False,
                                    **layout_kw),
            crossings(dispatch_in, worst_out)),
        "combine": (
            lambda: buf.combine(y_t, handle, topk_weights=recv_w),
            lambda: native.combine(y_c, handle.native, recv_w_c),
            lambda: native.combine(y_t, handle.native, recv_w),
            crossings(dict(x=y_t, topk_weights=recv_w), comb_out)),
        "combine worst-token": (
            lambda: buf.combine(wy_t, whandle, topk_weights=ww),
            lambda: native.combine(wy_c, whandle.native, ww_c),
            lambda: native.combine(wy_t, whandle.native, ww),
            crossings(dict(x=wy_t, topk_weights=ww), comb_out)),
    }
    VARIANTS = ("adapter", "native_cupy", "native_torch", "crossings")

    # Low-latency mode: each dispatch is followed by its combine; both timed. The native calls ask for
    # the adapter's work: DeepEP's packed outputs made by the dispatch, the combine reading packed rows.
    T_ll = args.ll_tokens
    xl_t = x_t[:T_ll] if T_ll <= T else x_t.repeat((T_ll + T - 1) // T, 1)[:T_ll]
    il_t, wl_t = idx_t[:T_ll].contiguous(), w_t[:T_ll].contiguous()
    buf.clean_low_latency_buffer(T_ll, H, E)
    ll = buf.low_latency
    xl_c, il_c, wl_c = views(xl_t, il_t, wl_t)

    yl_t = torch.zeros((E // R, R * T_ll, H), dtype=torch.bfloat16, device="cuda")  # the experts' outputs
    yl_c = cupyep.arrays.as_cupy(yl_t, "y")
    ll_n = ll.dispatch(xl_c, il_c, use_fp8=True, validate=False, packed_out=True)
    px, pscales = ll_n.packed[:2]
    ll_count = ll_n.recv_count
    ll_combined = ll.combine(yl_c, il_c, wl_c, ll_n.handle, x_layout="packed").combined_x
    sync()
    ll_variants = {
        "adapter": (lambda: buf.low_latency_dispatch(xl_t, il_t, T_ll, E, use_fp8=True),
                    lambda r: buf.low_latency_combine(yl_t, il_t, wl_t, r[2])),
        "native_cupy": (lambda: ll.dispatch(xl_c, il_c, use_fp8=True, validate=False, packed_out=True),
                        lambda r: ll.combine(yl_c, il_c, wl_c, r.handle, x_layout="packed")),
        "native_torch": (lambda: ll.dispatch(xl_t, il_t, use_fp8=True, validate=False, packed_out=True),
                         lambda r: ll.combine(yl_t, il_t, wl_t, r.handle, x_layout="packed")),
        "crossings": (crossings(dict(x=xl_t, topk_idx=il_t, stats=None, waits=None),
                                [(px, "fp8"), (pscales, None), (ll_count, None)]),
                      lambda _r: crossings(dict(x=yl_t, topk_idx=il_t, topk_weights=wl_t, out=None, waits=None),
                                           [(ll_combined, "bf16")])()),
    }

    def drain():
        torch.cuda.current_stream().synchronize()

    # The adapter's calls again, each split into the cupyep call it makes and the rest (InnerClock).
    clock = InnerClock([(native, "get_dispatch_layout"), (native, "dispatch"), (native, "combine"),
                        (ll, "dispatch"), (ll, "combine")])
    split_steps = {name: (clock.step(name, fns[0]),) for name, fns in calls.items()}
    split_ll = (clock.step("low_latency_dispatch", ll_variants["adapter"][0]),
                clock.step("low_latency_combine", ll_variants["adapter"][1]))

    samples = {name: {v: [] for v in VARIANTS} for name in calls}
    samples["low_latency_dispatch"] = {v: [] for v in VARIANTS}
    samples["low_latency_combine"] = {v: [] for v in VARIANTS}
    sync()
    for _ in range(args.rounds):
        for name, fns in calls.items():
            variants = {v: (fn,) for v, fn in zip(VARIANTS, fns)}
            variants["adapter_split"] = split_steps[name]
            got = interleaved_times(variants, args.iters, args.warmup, drain)
            for v in VARIANTS:
                samples[name][v] += got[v][0]
            sync()
        got = interleaved_times(dict(ll_variants, adapter_split=split_ll), args.iters, args.warmup, drain)
        for v in VARIANTS:
            samples["low_latency_dispatch"][v] += got[v][0]
            samples["low_latency_combine"][v] += got[v][1]
        sync()

    # Single crossings alone, in the same launch: one tensor viewed as CuPy, one array handed to torch
    # (with the BF16 view), torch's stream made CuPy's, a Config mapped.
    from cupyep.deep_ep.config import default_cupyep_config
    pieces = {
        "to_cupy (one tensor)": lambda: TS.to_cupy(x_t, "x"),
        "to_cupy (a tensor the adapter made)": lambda: TS.to_cupy(per_rank, "x"),
        "to_torch (one array, as bfloat16)": lambda: TS.to_torch(x_c, "bf16"),
        "to_torch (one array)": lambda: TS.to_torch(w_c),
        "torch_stream (enter and exit)": stream_enter_exit,
        "default config": lambda: default_cupyep_config(R, 20, True),
        # what a front end launching on torch tensors without CuPy arrays would pay instead of the crossings
        "torch tensor's pointer, shape and dtype (one tensor)": lambda: (x_t.data_ptr(), x_t.shape, x_t.dtype),
        "torch.empty (one output)": lambda: torch.empty((T, H), dtype=torch.bfloat16, device="cuda"),
        "cupy.empty (one output)": lambda: cupy.empty((T, H), dtype=np.uint16),
    }
    piece_us = {}
    for name, fn in pieces.items():
        med = float(np.median(host_times(fn, args.iters * args.rounds, args.warmup, sync))) * 1e6
        piece_us[name] = group.comm.allreduce(med, op=MPI.MAX)

    # CuPy allocations per call, each variant (pool requests and cudaMallocs), outside the timings.
    allocs = {}
    for name, fns in calls.items():
        allocs[name] = {v: allocations_per_call(fn, 20, sync) for v, fn in
                        zip(("adapter", "native_cupy", "native_torch"), fns[:3])}
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
        # the adapter's cost: each call against the native call timed right after it, then the median
        paired = float(np.median(np.subtract(by_variant["adapter"], by_variant["native_cupy"]))) * 1e6
        cost = group.comm.allreduce(paired, op=MPI.MAX)
        spread = [group.comm.allreduce(float(np.percentile(np.subtract(by_variant["adapter"],
                                                                        by_variant["native_cupy"]), q)) * 1e6,
                                       op=MPI.MAX) for q in (25, 75)]
        # each round's calls after its warm-up
        split = np.array(clock.samples[name]).reshape(args.rounds, args.warmup + args.iters, 2)[:, args.warmup:]
        split = split.reshape(-1, 2)
        inner_us = group.comm.allreduce(float(np.median(split[:, 1])) * 1e6, op=MPI.MAX)
        split_own_us = group.comm.allreduce(float(np.median(split[:, 0] - split[:, 1])) * 1e6, op=MPI.MAX)
        rows.append({"call": name, "adapter_us": slowest["adapter"], "native_cupy_us": slowest["native_cupy"],
                     "inner_us": inner_us, "split_own_us": split_own_us,
                     "native_torch_us": slowest["native_torch"], "adapter_cost_us": cost,
                     "adapter_cost_iqr_us": spread, "crossings_us": slowest["crossings"],
                     "own_us": cost - slowest["crossings"],
                     "adapter_minus_native_torch_us": slowest["adapter"] - slowest["native_torch"],
                     "within_target": cost <= TARGET_US,
                     "host_waits": name.startswith("dispatch (counted")})
    sync()
    if group.rank == 0:
        doc = {"bench": "deep_ep_adapter", "target_us": TARGET_US, "ranks": R,
               "shape": {"tokens": T, "hidden": H, "experts": E, "topk": k, "ll_tokens": T_ll},
               "iters": args.iters, "rounds": args.rounds, "timing": "interleaved, drained", "rows": rows,
               "pieces_us": piece_us,
               "allocations_per_call": allocs,
               "env": environment(group)}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        for r in rows:
            print(f"{r['call']:40s} adapter {r['adapter_us']:8.1f} us  native {r['native_cupy_us']:8.1f} us  "
                  f"(torch in {r['native_torch_us']:8.1f})  cost {r['adapter_cost_us']:6.1f} us  crossings "
                  f"{r['crossings_us']:6.1f}  own {r['own_us']:6.1f}  | split: cupyep's call inside "
                  f"{r['inner_us']:6.1f}, the rest {r['split_own_us']:6.1f}", flush=True)
        for name, us in piece_us.items():
            print(f"  piece: {name:36s} {us:8.1f} us", flush=True)
        print("  allocations per call (pool / cudaMalloc):", json.dumps(allocs), flush=True)
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
