"""cupyep.deep_ep on the GPU, in DeepEP's test style, against cupyep's NumPy
reference.

Every rank builds the same seeded global routing and computes its expected
result with cupyep.reference. x is either rank-valued (DeepEP's ``ones *
rank``, checked block by block with the rank prefix matrix) or tagged (a
hash of (source rank, token, column), compared bit for bit). Checked:
the layout; BF16 and FP8 dispatch; cached dispatch; worst-token mode and its
-1 padding; combine with and without weights, and with DeepEP's bias; a
dispatch routed by is_token_in_rank alone; an explicit Config; calls on a
non-default torch stream and with previous_event / async_finish;
low-latency dispatch and combine in DeepEP's packed layout (expert e's rows
at [0, recv_count[e]), sources in rank order, column-major scales; the
combine reads packed expert outputs and nothing past recv_count), with the
receive hook, zero-copy, ``out``, the statistics arrays and the LogFMT
combine. (The dispatch's own packing against the layout's definition:
tests/gpu/test_low_latency_gpu.py.)

Two ways to run it, the same checks:

    python -m cupyep.launcher.gpu_tests -k deep_ep          # mpi4py ranks (Buffer(comm=...)), 2, 4, 8
    python tests/gpu/test_deep_ep_gpu.py --ranks 4          # torch.multiprocessing.spawn, Buffer(torch group)
    python tests/gpu/test_deep_ep_gpu.py --kill --ranks 4   # shrink mode: the last rank SIGKILLed mid-run

The second starts a private MPS daemon when ranks share a GPU (as the
launcher does) and a gloo process group; it prints one line per check.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from cupyep import reference as ref
from cupyep.reference.intranode import worst_token_rows
from cupyep.testing import bf16_to_f32, f32_to_bf16, global_routing, payload_bf16

pytestmark = pytest.mark.gpu
E, K = 64, 8                 # experts, top-k (E / R local experts at 2, 4, 8 ranks)
T, H = 512, 2048             # normal mode: tokens per rank, hidden
LL_T, LL_H = 64, 2048        # low-latency mode: num_max_dispatch_tokens_per_rank, hidden
NVL_BYTES = 256 << 20


# ------------------------------------------------------------------ the checks (both launch paths)
@dataclass
class Ctx:
    """One rank's view: its deep_ep.Buffer, rank, rank count, and torch."""
    buf: object
    rank: int
    num_ranks: int
    torch: object

    def all(self, ok) -> bool:
        """``ok`` on every rank (over the Buffer's own communicator: MPI or torch.distributed)."""
        from mpi4py import MPI
        return bool(self.buf.cgroup.comm.allreduce(bool(ok), op=MPI.LAND))

    def allgather(self, obj):
        return self.buf.cgroup.comm.allgather(obj)

    def tensor(self, a):
        """A CUDA tensor of a NumPy array (uint16 arrays become bfloat16)."""
        torch = self.torch
        if a.dtype == np.uint16:
            return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def bits(t) -> np.ndarray:
    """The bits of a bfloat16 tensor as uint16, of a float8 tensor as uint8; other tensors as NumPy."""
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).cpu().numpy()
    return t.cpu().numpy()


def _inputs(ctx, seed, payload):
    """(every rank's topk_idx, topk_weights, x as uint16 BF16 bits) and this rank's x tensor."""
    R = ctx.num_ranks
    idx, w = global_routing(seed, [T] * R, E, K)
    if payload == "rank":
        xs = [f32_to_bf16(np.full((T, H), r, np.float32)) for r in range(R)]
    else:
        xs = [payload_bf16(r, np.arange(T), H) for r in range(R)]
    return idx, w, xs, ctx.tensor(xs[ctx.rank])


def _layout(ctx, idx):
    t = ctx.tensor(idx[ctx.rank])
    return ctx.buf.get_dispatch_layout(t, E)


def check_layout(ctx):
    idx, _, _, _ = _inputs(ctx, 1, "tagged")
    per_rank, per_rdma, per_expert, in_rank, event = _layout(ctx, idx)
    want = ref.get_dispatch_layout(idx[ctx.rank], E, ctx.num_ranks)
    torch = ctx.torch
    ok = (per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
          and per_rdma is None and event.event is None
          and np.array_equal(bits(per_rank), want.num_tokens_per_rank)
          and np.array_equal(bits(per_expert), want.num_tokens_per_expert)
          and np.array_equal(bits(in_rank), want.is_token_in_rank))
    assert ctx.all(ok), "layout differs from the reference"


def check_dispatch_combine(ctx, payload, async_mode=False, previous_mode=False, explicit_config=False):
    """DeepEP's intranode test loop body for BF16 x, with top-k, then cached,
    worst-token and combine with and without weights."""
    torch, buf, me, R = ctx.torch, ctx.buf, ctx.rank, ctx.num_ranks
    idx, w, xs, x = _inputs(ctx, 2 + (payload == "rank"), payload)
    per_rank, _, per_expert, in_rank, _ = _layout(ctx, idx)
    refs = ref.intranode_dispatch(xs, idx, E, topk_weights=w, expert_alignment=4)
    mine = refs[me]
    config = combine_config = None
    if explicit_config:
        sms = max(2, min(buf.normal.sm_budget, 24) // 2 * 2)  # DeepEP's usual 20-24 SMs, within this rank's share
        config, combine_config = deep_ep_module().Config(sms, 6, 256), deep_ep_module().Config(sms, 4, 256)
    args = dict(x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=ctx.tensor(idx[me]), topk_weights=ctx.tensor(w[me]), expert_alignment=4, config=config,
                async_finish=async_mode)
    if previous_mode:
        args["previous_event"] = buf.capture()
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(**args)
    if async_mode:
        event.current_stream_wait()
    n = mine.num_recv_tokens
    checks = {
        "dtypes": recv_x.dtype == torch.bfloat16 and recv_idx.dtype == torch.int64 and recv_w.dtype == torch.float32,
        "recv_x": np.array_equal(bits(recv_x), mine.recv_x),
        "recv_topk_idx": np.array_equal(bits(recv_idx), mine.recv_topk_idx),
        "recv_topk_weights": np.array_equal(bits(recv_w), mine.recv_topk_weights),
        "counts": counts == mine.num_recv_tokens_per_expert,
        "handle rank_prefix_matrix": np.array_equal(bits(handle[0]), mine.rank_prefix_matrix),
        "handle recv_src_idx": np.array_equal(bits(handle[3]), mine.recv_src_idx),
        "handle is_token_in_rank": np.array_equal(bits(handle[4]), bits(in_rank)),
        "recv_topk_idx range": bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < E // R))).all()),
    }
    if payload == "rank":  # DeepEP's check_data: rows of source i sit where the prefix matrix says
        got, rpm, start = bits(recv_x), bits(handle[0]), 0
        for i in range(R):
            end = int(rpm[i][me])
            checks[f"block of rank {i}"] = bool((bf16_to_f32(got[start:end]) == i).all())
            start = end
    assert ctx.all(all(checks.values())), {k: v for k, v in checks.items() if not v}

    # Worst-token mode: the same rows first, then -1 padding, and an empty count list.
    worst = T * R
    wx, widx, ww, empty, _, event = buf.dispatch(**dict(args, num_worst_tokens=worst))
    if async_mode:
        event.current_stream_wait()
    pad = worst_token_rows(mine, worst)
    ok = (empty == [] and wx.shape[0] == worst and np.array_equal(bits(wx)[:n], mine.recv_x)
          and np.array_equal(bits(widx), pad.recv_topk_idx) and np.array_equal(bits(ww), pad.recv_topk_weights))
    assert ctx.all(ok), "worst-token dispatch differs from the reference (rows, -1 padding or count list)"

    # Cached dispatch: x alone, DeepEP's (recv_x, None, None, None, None, event).
    cargs = dict(x=x, handle=handle, config=config, async_finish=async_mode)
    if previous_mode:
        cargs["previous_event"] = buf.capture()
    cached = buf.dispatch(**cargs)
    if async_mode:
        cached[5].current_stream_wait()
    ok = cached[1:5] == (None, None, None, None) and np.array_equal(bits(cached[0]), mine.recv_x)
    assert ctx.all(ok), "cached dispatch differs"

    # Combine without weights (a plain sum) and with the top-k weights reduced alike.
    recv_all = [bf16_to_f32(r.recv_x) for r in refs]
    want = ref.intranode_combine(recv_all, refs, [T] * R)[me]
    for weights in (None, recv_w):
        cargs = dict(x=recv_x, handle=handle, topk_weights=weights, config=combine_config, async_finish=async_mode)
        if previous_mode:
            cargs["previous_event"] = buf.capture()
        combined, combined_w, event = buf.combine(**cargs)
        if async_mode:
            event.current_stream_wait()
        got = bf16_to_f32(bits(combined))
        diff = ref.calc_diff(got, want)
        ok = combined.dtype == torch.bfloat16 and diff < 5e-6 and (combined_w is None) == (weights is None)
        if weights is not None:
            want_w = ref.intranode_combine_topk_weights(refs, [T] * R)[me]
            ok = ok and float(np.abs(bits(combined_w) - want_w).max()) < 1e-6
        if payload == "rank":  # DeepEP's check: combined / ranks visited == x
            visited = bits(in_rank).sum(axis=1)
            sent = visited > 0  # a token whose slots are all -1 goes nowhere and combines to zero
            ok = ok and ref.calc_diff(got[sent] / visited[sent, None], bf16_to_f32(xs[me])[sent]) < 5e-6
        assert ctx.all(ok), ("combine", weights is not None, diff)

    # DeepEP's bias: bias_0 and bias_1 [T, H] bfloat16, added in FP32 (one BF16 ulp from DeepEP's single
    # rounding at most); the exact value is the BF16 rounding of the FP32 sum of the combined row and biases.
    rng = np.random.default_rng(100 + me)
    b0, b1 = (f32_to_bf16(rng.standard_normal((T, H)).astype(np.float32)) for _ in range(2))
    for bias in (ctx.tensor(b0), (ctx.tensor(b0), ctx.tensor(b1))):
        cargs = dict(x=recv_x, handle=handle, bias=bias, config=combine_config, async_finish=async_mode)
        combined, _, event = buf.combine(**cargs)
        plain, _, _ = buf.combine(x=recv_x, handle=handle, config=combine_config)
        if async_mode:
            event.current_stream_wait()
        terms = [b0] if not isinstance(bias, tuple) else [b0, b1]
        acc = bf16_to_f32(bits(plain))
        for t in terms:  # left to right, as cupyep.deep_ep.bias adds them: (row + bias_0) + bias_1
            acc = acc + bf16_to_f32(t)
        exact = f32_to_bf16(acc)
        with_bias = bf16_to_f32(bits(combined))
        diff = ref.calc_diff(with_bias, want + sum(bf16_to_f32(t) for t in terms))
        assert ctx.all(np.array_equal(bits(combined), exact) and diff < 1e-5), ("combine with bias", diff)


def check_dispatch_without_topk(ctx):
    """DeepEP's dispatch routed by is_token_in_rank alone: the rows of the reference dispatch of the same
    routing, no top-k, the caller's expert counts; its combine is each token's sum over the ranks it went
    to (DeepEP's check: combined / ranks visited == x)."""
    from cupyep.deep_ep.routing import rank_routing
    buf, me, R = ctx.buf, ctx.rank, ctx.num_ranks
    idx, _, xs, x = _inputs(ctx, 7, "rank")
    per_rank, _, per_expert, in_rank, _ = _layout(ctx, idx)
    by_rank = [rank_routing(ref.get_dispatch_layout(i, E, R).is_token_in_rank, E) for i in idx]
    mine = ref.intranode_dispatch(xs, by_rank, E)[me]
    want_counts = ref.intranode_dispatch(xs, idx, E)[me].num_recv_tokens_per_expert
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    ok = (recv_idx is None and recv_w is None and counts == want_counts
          and np.array_equal(bits(recv_x), mine.recv_x))
    assert ctx.all(ok), "dispatch without top-k differs (rows, counts or top-k not None)"
    combined, combined_w, _ = buf.combine(recv_x, handle)
    visited = bits(in_rank).sum(axis=1)
    got, sent = bf16_to_f32(bits(combined)), visited > 0
    ok = combined_w is None and ref.calc_diff(got[sent] / visited[sent, None], bf16_to_f32(xs[me])[sent]) < 5e-6
    assert ctx.all(ok), "combine of a dispatch without top-k differs"


def check_dispatch_fp8(ctx):
    """FP8 (x, scales) with DeepEP's column-major scales: bytes and scales carried exactly."""
    import cupy
    from cupyep.deep_ep.tensors import to_torch
    from cupyep.fp8 import per_token_cast_to_fp8
    torch, buf, me = ctx.torch, ctx.buf, ctx.rank
    idx, w, xs, x = _inputs(ctx, 5, "tagged")
    q, s = per_token_cast_to_fp8(cupy.asarray(xs[me]))
    everyone = ctx.allgather((q.get(), s.get()))
    mine = ref.intranode_dispatch([a for a, _ in everyone], idx, E, topk_weights=w,
                                  x_scales=[b for _, b in everyone])[me]
    x_fp8 = to_torch(q, "fp8")
    scales = to_torch(s).T.contiguous().T  # column-major, as DeepEP's test passes them
    per_rank, _, per_expert, in_rank, _ = _layout(ctx, idx)
    (recv_q, recv_s), recv_idx, _, counts, handle, _ = buf.dispatch(
        (x_fp8, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=ctx.tensor(idx[me]), topk_weights=ctx.tensor(w[me]))
    ok = (recv_q.dtype == torch.float8_e4m3fn and recv_s.dtype == torch.float32
          and np.array_equal(bits(recv_q), mine.recv_x) and np.array_equal(bits(recv_s), mine.recv_x_scales)
          and np.array_equal(bits(recv_idx), mine.recv_topk_idx) and counts == mine.num_recv_tokens_per_expert)
    cached = buf.dispatch((x_fp8, scales), handle=handle)
    ok = ok and np.array_equal(bits(cached[0][0]), mine.recv_x)
    assert ctx.all(ok), "FP8 dispatch differs from the reference"


def check_torch_stream_order(ctx):
    """x written on a non-default torch stream just before the dispatch: the
    dispatch runs after it (CuPy's current stream is torch's for the call)."""
    torch, buf, me = ctx.torch, ctx.buf, ctx.rank
    idx, w, xs, src = _inputs(ctx, 7, "tagged")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x = torch.zeros_like(src)
        for _ in range(4):  # enough work on s that a dispatch not ordered after it would read zeros
            x.copy_(src)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ctx.tensor(idx[me]), E)
        recv_x, *_ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=per_expert, topk_idx=ctx.tensor(idx[me]))
    torch.cuda.current_stream().wait_stream(s)
    mine = ref.intranode_dispatch(xs, idx, E)[me]
    assert ctx.all(np.array_equal(bits(recv_x), mine.recv_x)), "dispatch on a torch side stream read stale x"


def _ll_inputs(ctx, seed, payload):
    """Every rank's topk_idx, weights and x (BF16 bits; the token index in the last 128 columns)."""
    R = ctx.num_ranks
    idx, w = global_routing(seed, [LL_T] * R, E, K)
    xs = []
    for r in range(R):
        x = (f32_to_bf16(np.full((LL_T, LL_H), r - 128, np.float32)) if payload == "rank"
             else payload_bf16(r, np.arange(LL_T), LL_H))
        x[:, -128:] = f32_to_bf16(np.arange(LL_T, dtype=np.float32))[:, None]
        xs.append(x)
    return idx, w, xs


def _dequant(ctx, recv_x, use_fp8, use_ue8m0):
    """Identity experts: [E_local, R * T, H] bfloat16 from the received rows."""
    torch = ctx.torch
    if not use_fp8:
        return recv_x.clone()
    q, s = recv_x
    if use_ue8m0:
        s = torch.ldexp(torch.ones((), device=q.device), (s.contiguous().view(torch.uint8).int() - 127)).float()
    return (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)


def _poison_past_count(ctx, y, count):
    """NaN in every row of y past recv_count[e]: the combine must not read them."""
    for e, n in enumerate(bits(count).tolist()):
        y[e, n:] = float("nan")
    return y


def check_low_latency(ctx, use_fp8, hook_mode, payload="tagged", round_scale=False, use_ue8m0=False):
    """DeepEP's low-latency test in DeepEP's packed layout: each (expert,
    source) range of handle[1] against the reference's rows, the statistics,
    then combine of packed outputs (plain, zero-copy, into ``out``)."""
    import ml_dtypes
    torch, buf, me, R = ctx.torch, ctx.buf, ctx.rank, ctx.num_ranks
    El = E // R
    idx, w, xs = _ll_inputs(ctx, 11 + use_fp8 + 2 * hook_mode, payload)
    x, topk_idx, topk_w = ctx.tensor(xs[me]), ctx.tensor(idx[me]), ctx.tensor(w[me])
    stats = torch.zeros(El, dtype=torch.int32, device="cuda")
    waits = torch.zeros(R, dtype=torch.int64, device="cuda")

    def dispatch():
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(
            x, topk_idx, LL_T, E, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=waits,
            use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not hook_mode,
            return_recv_hook=hook_mode)
        hook() if hook_mode else event.current_stream_wait()
        return recv_x, count, handle

    recv_x, count, handle = dispatch()
    mine = ref.low_latency_dispatch(xs, idx, E, LL_T)[me]
    ranges, src = bits(handle[1]), bits(handle[0])
    begin, cnt = ranges >> 32, ranges & (2 ** 32 - 1)
    lc = mine.layout_count.astype(np.int64)
    # DeepEP's packed layout: shapes, begins = the prefix of the counts over the sources before (rank order)
    ok = (np.array_equal(bits(count), mine.recv_count) and np.array_equal(bits(stats), mine.recv_count)
          and bool((bits(waits) >= 0).all()) and np.array_equal(cnt, mine.layout_count)
          and np.array_equal(begin, np.cumsum(lc, axis=1) - lc) and handle[2:] == (LL_T, LL_H, E)
          and tuple(handle[0].shape) == (El, R * LL_T)
          and tuple((recv_x[0] if use_fp8 else recv_x).shape) == (El, R * LL_T, LL_H)
          and (recv_x[0] if use_fp8 else recv_x).is_contiguous())
    if use_fp8:  # column-major scales: the transpose of a contiguous [El, S, R * T] tensor, as DeepEP's
        S = LL_H // 512 if use_ue8m0 else LL_H // 128
        sc = recv_x[1]
        ok = ok and tuple(sc.shape) == (El, R * LL_T, S) and sc.transpose(1, 2).is_contiguous() \
            and sc.dtype == (torch.int32 if use_ue8m0 else torch.float32)
    got = bits(recv_x[0] if use_fp8 else recv_x)
    if use_fp8:  # UE8M0: four exponent bytes a word, as DeepEP packs them
        scales = bits(recv_x[1].contiguous().view(torch.uint8)) if use_ue8m0 else bits(recv_x[1])
    bad = []
    for e in range(El):
        n = int(mine.recv_count[e])
        # the reference's rows of expert e, source after source in rank order (cupyep's region layout)
        rows = np.concatenate([np.arange(s * LL_T, s * LL_T + int(mine.layout_count[e, s])) for s in range(R)])
        srcs = np.repeat(np.arange(R), mine.layout_count[e])
        if len(rows) != n or not np.array_equal(src[e, :n], mine.recv_src_info[e, rows]):
            bad.append(("src", e))
        elif not use_fp8:
            if not np.array_equal(got[e, :n], mine.recv_x[e, rows]):
                bad.append(("x", e))
            elif payload == "rank" and not (bf16_to_f32(got[e, :n, :-128]) == (srcs - 128)[:, None]).all():
                bad.append(("rank value", e))
        else:
            rq = ref.per_token_cast_to_fp8(mine.recv_x[e, rows].view(ml_dtypes.bfloat16), round_scale=round_scale)
            q = got[e, :n].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            want = rq.data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            want_scales = ref.pack_ue8m0(rq.scales) if use_ue8m0 else rq.scales
            close = (np.abs(q - want) <= ref.e4m3_step(want)).all()
            if not (np.array_equal(scales[e, :n], want_scales) and close):
                bad.append(("fp8", e))
    assert ctx.all(ok and not bad), (ok, bad[:5])

    # Combine: identity experts on the packed rows, reduced with the weights.
    y = _poison_past_count(ctx, _dequant(ctx, recv_x, use_fp8, use_ue8m0), count)
    valid = idx[me] >= 0
    want = bf16_to_f32(xs[me]) * (w[me] * valid).sum(axis=1, dtype=np.float64).astype(np.float32)[:, None]
    tol = 1e-5 if not use_fp8 else 9e-4  # REFERENCE.md's bounds
    cwaits = torch.zeros(R, dtype=torch.int64, device="cuda")
    combined, event, hook = buf.low_latency_combine(y, topk_idx, topk_w, handle, async_finish=not hook_mode,
                                                    return_recv_hook=hook_mode, combine_wait_recv_cost_stats=cwaits)
    hook() if hook_mode else event.current_stream_wait()
    d_plain = ref.calc_diff(bf16_to_f32(bits(combined)), want)
    # nanoseconds waited for each expert rank: never negative (0 where its rows were in before the wait)
    assert ctx.all(bool((bits(cwaits) >= 0).all()) and bits(cwaits).shape == (R,)), bits(cwaits)
    # The same combine with the rows in LogFMT-10: within the format's accuracy of the plain one
    lf, event, hook = buf.low_latency_combine(y, topk_idx, topk_w, handle, use_logfmt=True,
                                              async_finish=not hook_mode, return_recv_hook=hook_mode)
    hook() if hook_mode else event.current_stream_wait()
    d_lf = ref.calc_diff(bf16_to_f32(bits(lf)), bf16_to_f32(bits(combined)))
    assert ctx.all(d_lf < 1e-5 and not np.isnan(bf16_to_f32(bits(lf))).any()), ("use_logfmt", d_lf)
    # Zero-copy into a given out: the next dispatch, its combine buffer filled in place.
    recv_x, count, handle = dispatch()
    y = _poison_past_count(ctx, _dequant(ctx, recv_x, use_fp8, use_ue8m0), count)
    zbuf = buf.get_next_low_latency_combine_buffer(handle)
    zbuf.copy_(y)
    out = torch.empty((LL_T, LL_H), dtype=torch.bfloat16, device="cuda")
    combined_z, event, hook = buf.low_latency_combine(zbuf, topk_idx, topk_w, handle, zero_copy=True, out=out,
                                                      async_finish=not hook_mode, return_recv_hook=hook_mode)
    hook() if hook_mode else event.current_stream_wait()
    d_zero = ref.calc_diff(bf16_to_f32(bits(out)), want)
    ok = combined_z is out and zbuf.shape == (El, R * LL_T, LL_H) and zbuf.is_contiguous() and d_plain < tol \
        and d_zero < tol
    ok = ok and np.array_equal(bits(stats), 2 * mine.recv_count)  # cumulative over the two dispatches
    assert ctx.all(ok), ("low-latency combine", d_plain, d_zero)


def _strided(msgs, offset: int, nbytes: int, dtype):
    """[E, rows, nbytes / itemsize] ``dtype`` view of bytes [offset, offset + nbytes) of each message of
    ``msgs`` ([E, rows, message bytes] uint8, NumPy or CuPy), as cupyep's dispatch views them."""
    dtype = np.dtype(dtype)
    shape, strides = msgs.shape[:2] + (nbytes // dtype.itemsize,), msgs.strides[:2] + (dtype.itemsize,)
    if isinstance(msgs, np.ndarray):
        return np.ndarray(shape, dtype, buffer=msgs, offset=offset, strides=strides)
    import cupy
    return cupy.ndarray(shape, dtype, memptr=msgs.data + offset, strides=strides)


CHECKS = {
    "layout": check_layout,
    "bf16 tagged": lambda c: check_dispatch_combine(c, "tagged"),
    "bf16 rank-valued": lambda c: check_dispatch_combine(c, "rank"),
    "bf16 async, previous_event": lambda c: check_dispatch_combine(c, "tagged", async_mode=True, previous_mode=True),
    "bf16 explicit Config": lambda c: check_dispatch_combine(c, "tagged", explicit_config=True),
    "bf16 without top-k": check_dispatch_without_topk,
    "fp8": check_dispatch_fp8,
    "torch side stream": check_torch_stream_order,
    "low-latency bf16": lambda c: check_low_latency(c, False, False),
    "low-latency bf16 rank-valued hook": lambda c: check_low_latency(c, False, True, "rank"),
    "low-latency fp8": lambda c: check_low_latency(c, True, False),
    "low-latency fp8 hook": lambda c: check_low_latency(c, True, True),
    "low-latency fp8 ue8m0": lambda c: check_low_latency(c, True, False, round_scale=True, use_ue8m0=True),
}


def deep_ep_module():
    from cupyep import deep_ep
    return deep_ep


def make_buffer(group_or_none, comm=None, timeout_s=None, num_ranks=None):
    """The Buffer of these tests: normal mode within the node and low-latency mode."""
    deep_ep = deep_ep_module()
    R = num_ranks
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_T, LL_H, R, E)
    return deep_ep.Buffer(group_or_none, NVL_BYTES, rdma, low_latency_mode=True, num_qps_per_rank=E // R,
                          explicitly_destroy=True, comm=comm, timeout_s=timeout_s)


# ------------------------------------------------------------------ under the launcher (pytest, mpi4py)
@pytest.fixture(scope="module")
def ctx(group):
    torch = pytest.importorskip("torch", reason="cupyep.deep_ep works on torch tensors")
    if group.num_nodes > 1:
        pytest.skip("cupyep.deep_ep across nodes needs NVSHMEM for both modes; these checks run within a node")
    torch.cuda.set_device(group.device_id)
    buf = make_buffer(None, comm=group.comm, timeout_s=group.timeout_s, num_ranks=group.local_size)
    yield Ctx(buf, buf.rank, buf.group_size, torch)
    torch.cuda.synchronize()
    group.comm.Barrier()
    buf.destroy()


@pytest.mark.parametrize("name", list(CHECKS))
def test_deep_ep(ctx, name):
    CHECKS[name](ctx)


# ------------------------------------------------------------------ under torch.multiprocessing.spawn
def _spawned(rank: int, num_ranks: int, init_file: str, checks: list) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=num_ranks)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    buf = make_buffer(dist.group.WORLD, num_ranks=num_ranks)
    ctx = Ctx(buf, buf.rank, buf.group_size, torch)
    try:
        for name in checks:
            CHECKS[name](ctx)
            if rank == 0:
                print(f"[{num_ranks} ranks, torch.distributed] {name}: passed", flush=True)
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        buf.destroy()
        dist.destroy_process_group()


# ------------------------------------------------------------------ shrink mode: a rank killed mid-run
KILL_ROUNDS, KILL_AT = 4, 2  # low-latency rounds; the last rank SIGKILLs itself before round KILL_AT


def _kill_rank(rank: int, num_ranks: int, init_file: str, out_dir: str, timeout_s: float) -> None:
    """One rank of the kill check: DeepEP's shrink mode over gloo. The last rank kills itself (SIGKILL)
    before round KILL_AT; from that round on, the others' first dispatch waits for it until the timeout,
    masks it, and every result must be the reference with its experts and tokens dropped. Each survivor
    writes its verdict to out_dir and leaves without tearing down gloo (its peer is gone)."""
    import json
    import signal
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=num_ranks)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    deep_ep = deep_ep_module()
    R, El, victim = num_ranks, E // num_ranks, num_ranks - 1
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_T, LL_H, R, E)
    buf = deep_ep.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True, num_qps_per_rank=El,
                         explicitly_destroy=True, enable_shrink=True, timeout_s=timeout_s)
    ctx = Ctx(buf, rank, R, torch)
    rounds = []
    for it in range(KILL_ROUNDS):
        if rank == victim and it == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        idx, w, xs = _ll_inputs(ctx, 80 + it, "tagged")
        dropped = it >= KILL_AT
        kept = ref.low_latency.without_ranks(idx, [victim] if dropped else [], E)  # its experts and tokens out
        x, topk_idx, topk_w = ctx.tensor(xs[rank]), ctx.tensor(idx[rank]), ctx.tensor(w[rank])
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, LL_T, E, use_fp8=False)
        torch.cuda.synchronize()
        mine = ref.low_latency_dispatch(xs, kept, E, LL_T)[rank]
        got, ok = bits(recv_x), np.array_equal(bits(count), mine.recv_count)
        for e in range(El):
            rows = np.concatenate([np.arange(s * LL_T, s * LL_T + int(mine.layout_count[e, s])) for s in range(R)])
            ok = ok and np.array_equal(got[e, :len(rows)], mine.recv_x[e, rows])
        y = _poison_past_count(ctx, recv_x.clone(), count)
        combined, _, _ = buf.low_latency_combine(y, topk_idx, topk_w, handle)
        torch.cuda.synchronize()
        valid = kept[rank] >= 0
        want = bf16_to_f32(xs[rank]) * (w[rank] * valid).sum(axis=1, dtype=np.float64).astype(np.float32)[:, None]
        diff = ref.calc_diff(bf16_to_f32(bits(combined)), want)
        rounds.append({"round": it, "dispatch": bool(ok), "combine_diff": float(diff)})
    status = torch.zeros(R, dtype=torch.int32, device="cuda")
    buf.low_latency_query_mask_buffer(status)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "rounds": rounds, "mask": status.cpu().tolist()}, f)
    os._exit(0)


def kill_check(num_ranks: int, timeout_s: float = 5.0) -> bool:
    """Run :func:`_kill_rank` on ``num_ranks`` spawned processes; print and return the verdict: the victim
    died by SIGKILL, every survivor finished every round equal to the reference (dispatch exactly,
    combine within 1e-5) and its mask names the victim alone."""
    import json
    import tempfile
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_kill_rank, args=(r, num_ranks, os.path.join(tmp, "rendezvous"), tmp, timeout_s))
                 for r in range(num_ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60 + 4 * timeout_s)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in alive:
            procs[r].kill()
        verdicts = {}
        for r in range(num_ranks - 1):
            path = os.path.join(tmp, f"rank{r}.json")
            verdicts[r] = json.load(open(path)) if os.path.exists(path) else None
    victim = num_ranks - 1
    want_mask = [int(r == victim) for r in range(num_ranks)]
    ok = not alive and procs[victim].exitcode == -9 and all(
        v is not None and v["mask"] == want_mask and all(x["dispatch"] and x["combine_diff"] < 1e-5 for x in v["rounds"])
        for v in verdicts.values())
    print(f"[{num_ranks} ranks, shrink mode, rank {victim} killed before round {KILL_AT}] "
          f"{'passed' if ok else 'FAILED'}: exit codes {[p.exitcode for p in procs]}, still running {alive}, "
          f"survivors {json.dumps(verdicts)}", flush=True)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="cupyep.deep_ep checks with ranks started by torch.multiprocessing.spawn")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("-k", default=None, help="run the checks whose name contains this")
    p.add_argument("--kill", action="store_true",
                   help="instead: shrink mode with the last rank killed mid-run (kill_check)")
    args = p.parse_args(argv)
    import tempfile
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print("skipped: torch is not installed (cupyep.deep_ep works on torch tensors)")
        return 2
    from cupyep.launcher.mps import mps_daemon
    checks = [n for n in CHECKS if args.k is None or args.k in n]
    ndev = torch.cuda.device_count()
    if ndev == 0:
        print("skipped: no GPU")
        return 2
    failed = False
    for n in args.ranks:
        with mps_daemon() if n > ndev else _nothing() as env:
            os.environ.update(env or {})
            if args.kill:
                failed |= not kill_check(n)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_spawned, args=(n, os.path.join(tmp, "rendezvous"), checks), nprocs=n, join=True)
        print(f"== {n} ranks (torch.distributed): {len(checks)} checks passed", flush=True)
    return 1 if failed else 0


class _nothing:
    def __enter__(self):
        return {}

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
