"""Soak: many dispatch + combine calls whose shapes and routings change every
call, each one checked on the GPU, in every mode.

    python -m cupyep.launcher -n 8 experiments/soak.py --calls 10000 --out results/soak/soak.jsonl

Calls go round-robin over ``--modes`` (comma-separated; default all), each
normal-mode one on every route of ``--routes`` (default both: ``default``,
the queue transport within a node and the two-hop route across nodes, and
``direct``, the one-copy route of either); one buffer serves them all:

- ``normal``: Buffer.get_dispatch_layout, dispatch with its arrays, combine.
- ``cached``: dispatch, then a cached dispatch (``handle=``) of other rows
  with the same routing, and the combine of the cached one.
- ``worst``: dispatch with ``num_worst_tokens`` (R x max tokens; no host
  wait), combine.
- ``micro_batches``: two micro-batches in flight: dispatch A, dispatch B,
  then their combines, in an order that changes from call to call.
- ``backward``: dispatch and combine (the forward), another dispatch and
  combine (the next layer), then the backward on the first handle: a
  cached dispatch of other rows (x alone) and their combine on that
  handle. On a route whose results live in pool slots the first forward
  result is then stale, and reading it must raise StaleResultError.
- ``expert_major``: dispatch(expert_major=True), alignment 1, 4, 128 in turn,
  every other call in worst-token mode; combine of expert_x, every other call
  weighted by the received top-k weights (pair_weights).
- ``ll``: LowLatencyBuffer.dispatch, BF16 (its recv_x combined as is) and,
  every fourth call, FP8 (dequantised first); combine.
- ``ll_hook``: the same with return_recv_hook=True, then each hook.
- ``ll_zero_copy``: the expert outputs written into
  get_next_combine_buffer, combine(None, ..., zero_copy=True).

Every call, every rank draws its token count T in [1, max tokens] (normal
modes ``--max-tokens``, low-latency ``--ll-max-tokens``), an offset into its
tagged rows (cupyep.testing.payload_bf16 of (rank, row)) and a fresh routing:
top-k distinct experts per token, (a + j * b) mod E with a random and b odd
(E a power of two), about a tenth of the slots -1, weights in [0.5, 1.5].
Experts are the identity, so the combined row of token t is c_t * x[t], with
c_t the number of ranks t went to (normal, cached, worst), the number of its
valid slots or, with pair weights, their weights' sum (expert-major), and the
sum of its valid slots' weights (low-latency). Each row is compared with that
on the GPU by its similarity 1 - 2 <g, e> / (|g|^2 + |e|^2) (calc_diff of
one row): above 1e-4 after a BF16 dispatch, or 0.05 after an FP8 one (only
gross errors, such as a misrouted row or a missing contribution), or NaN, the
row is bad. Counts and the worst similarity per mode stay on the device; the
host reads them every ``--sync-every`` calls (a bounded wait) and at the end.

Device memory (cudaMemGetInfo: the whole GPU; CuPy pool's used and held
bytes: this rank) and host RSS (VmRSS) are taken after the buffers are made
and one call of every mode has run ("start"), and at the end. Rank 0 writes
one JSONL record with every rank's numbers and per-mode totals; the exit
status is 1 when a row was bad.
"""
import argparse
import time

import numpy as np

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import JsonlWriter
from cupyep.testing import payload_bf16

MODES = ("normal", "cached", "worst", "micro_batches", "backward", "expert_major", "ll", "ll_hook",
         "ll_zero_copy")
ROUTES = ("default", "direct")  # the transport of a normal-mode call: None, or "direct"
BF16_LIMIT, FP8_LIMIT = 1e-4, 5e-2
ALIGNMENTS = (1, 4, 128)
WARMUP_CALLS = 12  # per mode: every (alignment, worst-token, pair-weights) and every FP8 variant


def _choices(allowed: tuple, what: str):
    """An argparse type: a comma-separated, non-empty list of ``allowed`` names."""
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad}; choose from {','.join(allowed)}")
        return names
    return parse


_modes, _routes = _choices(MODES, "mode"), _choices(ROUTES, "route")


def soak_keys(modes, routes, num_nodes: int = 1) -> list[str]:
    """The tallies of a soak: each normal-mode mode on each route ("mode@route",
    the default route named "queue" within a node and "two_hop" across
    nodes), then the low-latency modes."""
    name = {"default": "two_hop" if num_nodes > 1 else "queue", "direct": "direct"}
    return [f"{m}@{name[r]}" for m in modes if not m.startswith("ll") for r in routes] + \
        [m for m in modes if m.startswith("ll")]


def host_rss_bytes() -> int:
    """VmRSS of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def memory_point(group) -> list[dict]:
    """Every rank's device free/total bytes, CuPy pool used/total bytes and RSS."""
    import cupy
    cupy.cuda.runtime.deviceSynchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    pool = cupy.get_default_memory_pool()
    mine = {"device_free_bytes": int(free), "device_total_bytes": int(total),
            "pool_used_bytes": int(pool.used_bytes()), "pool_total_bytes": int(pool.total_bytes()),
            "host_rss_bytes": host_rss_bytes()}
    return group.comm.allgather(mine)


class Soak:
    """The buffers, this rank's inputs and the device-side tallies of one soak."""

    def __init__(self, group, args):
        import cupy
        self.cupy = cupy
        self.group, self.args = group, args
        self.R, self.me = group.world_size, group.rank  # every rank of every node takes part
        E, H = args.experts, args.hidden
        if E & (E - 1) or E % self.R or args.topk > E:
            raise SystemExit(f"--experts {E} must be a power of two, divisible by the {self.R} ranks and >= --topk")
        self.El = E // self.R
        self.buf = cupyep.Buffer(group, max_tokens=args.max_tokens, hidden=H, num_topk=max(args.topk, 8),
                                 num_in_flight=2)
        self.ll = cupyep.LowLatencyBuffer(group, args.ll_max_tokens, H, E, max_topk=args.topk)
        rows = 2 * max(args.max_tokens, args.ll_max_tokens)
        self.x_all = cupy.asarray(payload_bf16(self.me, np.arange(rows), H))   # [rows, H] BF16 bits
        self.xf_all = self.bf16_to_f32(self.x_all)                             # [rows, H] float32
        import ml_dtypes
        self.e4m3 = cupy.asarray(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
        self.host_rng = np.random.default_rng([args.seed, group.rank])
        self.rs = cupy.random.RandomState(args.seed * 7919 + group.rank)
        self.keys = soak_keys(args.modes, args.routes, group.num_nodes)
        n = len(self.keys)
        self.bad = cupy.zeros(n, dtype=np.int64)        # rows over the limit (or NaN), per key
        self.checked = cupy.zeros(n, dtype=np.int64)    # rows checked, per key
        self.worst = cupy.zeros(n, dtype=np.float32)    # largest row dissimilarity, per key
        self.stale = 0                                  # stale results read without StaleResultError
        self.calls = dict.fromkeys(self.keys, 0)

    # ------------------------------------------------------------ helpers
    def bf16_to_f32(self, bits):
        """uint16 BF16 bits -> float32 (same shape)."""
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def f32_to_bf16(self, v):
        """float32 -> uint16 BF16 bits, round to nearest even (finite values)."""
        u = v.view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)

    def rows(self, T: int):
        """(x [T, H] BF16 bits, xf [T, H] float32): T consecutive tagged rows from a random offset."""
        off = int(self.host_rng.integers(0, self.x_all.shape[0] - T + 1))
        return self.x_all[off:off + T], self.xf_all[off:off + T]

    def draw(self, max_tokens: int):
        """(x [T, H] BF16 bits, xf [T, H] float32, topk_idx [T, k] int64, topk_weights [T, k] float32),
        T in [1, max_tokens]."""
        cupy, k, E = self.cupy, self.args.topk, self.args.experts
        T = int(self.host_rng.integers(1, max_tokens + 1))
        x, xf = self.rows(T)
        a = self.rs.randint(0, E, size=(T, 1), dtype=np.int64)
        b = 2 * self.rs.randint(0, E // 2, size=(T, 1), dtype=np.int64) + 1
        idx = (a + cupy.arange(k, dtype=np.int64)[None, :] * b) % E   # distinct: b is odd, E a power of two
        idx = cupy.where(self.rs.random_sample((T, k), dtype=np.float32) < 0.1, -1, idx)
        w = (0.5 + self.rs.random_sample((T, k), dtype=np.float32)).astype(np.float32)
        return x, xf, idx, w

    def ranks_visited(self, idx):
        """[T] float32: how many ranks own at least one of each token's experts."""
        cupy = self.cupy
        dst = cupy.where(idx >= 0, idx // self.El, -1)
        hit = (dst[:, :, None] == cupy.arange(self.R)[None, None, :]).any(axis=1)
        return hit.sum(axis=1).astype(np.float32)

    def check(self, key: str, combined, xf, factor, limit: float) -> None:
        """Tally the rows of ``combined`` [T, H] (BF16 bits) unlike xf * factor[:, None]."""
        cupy = self.cupy
        m = self.keys.index(key)
        g = self.bf16_to_f32(combined)
        e = xf * factor[:, None]
        num = (g * e).sum(axis=1)
        den = (g * g + e * e).sum(axis=1)
        some = den > 0  # both rows zero (a token routed nowhere): alike
        d = cupy.where(some, 1 - 2 * num / cupy.where(some, den, 1), 0)
        d = cupy.where(cupy.isfinite(num) & cupy.isfinite(den), d, 1).astype(np.float32)  # NaN / inf: bad
        self.bad[m] += (d > limit).sum()
        self.checked[m] += d.size
        self.worst[m] = cupy.maximum(self.worst[m], d.max())

    def dequantised(self, res):
        """Identity experts after an FP8 dispatch: BF16 rows of recv_x times its scales."""
        cupy = self.cupy
        vals = self.e4m3[res.recv_x.astype(np.int32)]                # [E_local, slots, H] float32
        vals *= cupy.repeat(res.recv_x_scales, 128, axis=2)
        return self.f32_to_bf16(vals)

    # -------------------------------------------------------------- modes
    def call(self, key: str) -> None:
        self.calls[key] += 1
        n = self.calls[key]
        if key.startswith("ll"):
            self.low_latency(key, n)
        else:
            self.normal(key, n)

    def normal(self, key: str, n: int) -> None:
        buf, E = self.buf, self.args.experts
        mode, route = key.split("@")
        kw = dict(num_experts=E, validate=False, transport="direct" if route == "direct" else None)
        x, xf, idx, w = self.draw(self.args.max_tokens)
        worst = self.R * self.args.max_tokens
        if mode == "normal":
            lay = buf.get_dispatch_layout(idx, E, validate=False)
            out = buf.dispatch(x, idx, w, num_tokens_per_rank=lay.num_tokens_per_rank,
                               num_tokens_per_expert=lay.num_tokens_per_expert,
                               is_token_in_rank=lay.is_token_in_rank, **kw)
            comb = buf.combine(out.recv_x, out.handle)
        elif mode == "cached":
            first = buf.dispatch(x, idx, w, **kw)
            x, xf = self.rows(x.shape[0])  # other rows along the same routing
            out = buf.dispatch(x, handle=first.handle)
            comb = buf.combine(out.recv_x, out.handle)
        elif mode == "worst":
            out = buf.dispatch(x, idx, w, num_worst_tokens=worst, **kw)
            comb = buf.combine(out.recv_x, out.handle)
        elif mode == "micro_batches":
            x2, xf2, idx2, w2 = self.draw(self.args.max_tokens)
            a = buf.dispatch(x, idx, w, **kw)
            b = buf.dispatch(x2, idx2, w2, **kw)
            batches = [(a, xf, idx), (b, xf2, idx2)]
            for out, f, i in (batches if n % 2 else batches[::-1]):  # combines are collective: one order on all
                self.check(key, buf.combine(out.recv_x, out.handle).combined_x, f, self.ranks_visited(i), BF16_LIMIT)
            return
        elif mode == "backward":
            fwd = buf.dispatch(x, idx, w, **kw)
            self.check(key, buf.combine(fwd.recv_x, fwd.handle).combined_x, xf, self.ranks_visited(idx), BF16_LIMIT)
            x2, xf2, idx2, w2 = self.draw(self.args.max_tokens)
            nxt = buf.dispatch(x2, idx2, w2, **kw)
            self.check(key, buf.combine(nxt.recv_x, nxt.handle).combined_x, xf2, self.ranks_visited(idx2),
                       BF16_LIMIT)
            gx, gxf = self.rows(x.shape[0])  # the gradient rows, along the forward's routing
            grad = buf.dispatch(gx, handle=fwd.handle)
            comb = buf.combine(grad.recv_x, fwd.handle)
            if fwd.lease is not None and not fwd.lease.valid:  # a slot route: the forward's slot is grad's now
                try:
                    fwd.recv_x
                    self.stale += 1
                except cupyep.StaleResultError:
                    pass
            self.check(key, comb.combined_x, gxf, self.ranks_visited(idx), BF16_LIMIT)
            return
        else:  # expert_major
            alignment = ALIGNMENTS[n % len(ALIGNMENTS)]
            out = buf.dispatch(x, idx, w, expert_alignment=alignment, expert_major=True,
                               num_worst_tokens=worst if n % 2 else 0, **kw)
            weighted = (n // 2) % 2 == 1
            comb = buf.combine(out.expert_x, out.handle, pair_weights=out.recv_topk_weights if weighted else None,
                               expert_major=True)
            valid = (idx >= 0).astype(np.float32)
            factor = (w * valid).sum(axis=1) if weighted else valid.sum(axis=1)
            self.check(key, comb.combined_x, xf, factor, BF16_LIMIT)
            return
        self.check(key, comb.combined_x, xf, self.ranks_visited(idx), BF16_LIMIT)

    def low_latency(self, mode: str, n: int) -> None:
        ll = self.ll
        x, xf, idx, w = self.draw(self.args.ll_max_tokens)
        fp8 = n % 4 == 0
        hook = mode == "ll_hook"
        res = ll.dispatch(x, idx, use_fp8=fp8, validate=False, return_recv_hook=hook)
        if hook:
            res.hook()
        y = self.dequantised(res) if fp8 else res.recv_x
        if mode == "ll_zero_copy":
            ll.get_next_combine_buffer(res.handle)[...] = y
            comb = ll.combine(None, idx, w, res.handle, zero_copy=True)
        else:
            comb = ll.combine(y, idx, w, res.handle, return_recv_hook=hook)
            if hook:
                comb.hook()
        factor = (w * (idx >= 0)).sum(axis=1).astype(np.float32)
        self.check(mode, comb.combined_x, xf, factor, FP8_LIMIT if fp8 else BF16_LIMIT)

    # ------------------------------------------------------------- totals
    def wait(self) -> None:
        """Bounded host wait for every call so far (raises the device's errors)."""
        cupy = self.cupy
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record()
        self.group.wait(ev, "soak", "host wait for the soak's calls")
        self.buf.synchronize()

    def totals(self) -> dict:
        """Per mode, over all ranks: calls, rows checked, bad rows, worst dissimilarity."""
        comm = self.group.comm
        bad, rows, worst = (np.asarray(comm.allgather(a.get())) for a in (self.bad, self.checked, self.worst))
        bad, rows, worst = bad.sum(axis=0), rows.sum(axis=0), worst.max(axis=0)
        return {m: {"calls": self.calls[m], "rows": int(rows[i]), "bad_rows": int(bad[i]),
                    "worst_row_diff": float(worst[i])}
                for i, m in enumerate(self.keys) if self.calls[m]}

    def stale_unraised(self) -> int:
        """Stale results read without StaleResultError, over all ranks."""
        return int(sum(self.group.comm.allgather(self.stale)))

    def destroy(self) -> None:
        self.ll.synchronize()
        self.buf.synchronize()
        self.group.comm.Barrier()
        self.ll.destroy()
        self.buf.destroy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10000, help="dispatch + combine calls in all (default 10000)")
    p.add_argument("--modes", type=_modes, default=list(MODES), help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--routes", type=_routes, default=list(ROUTES),
                   help="normal-mode routes, comma-separated: default (queue / two-hop), direct")
    p.add_argument("--out", default="results/soak/soak.jsonl")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="normal modes: most tokens per rank and call")
    p.add_argument("--ll-max-tokens", type=int, default=128, help="low-latency: most tokens per rank and call")
    p.add_argument("--sync-every", type=int, default=500, help="calls between host reads of the tallies")
    p.add_argument("--timeout-s", type=float, default=60.0, help="budget of every bounded wait")
    args = p.parse_args(argv)
    require_gpu(__file__)
    group = cupyep.init(timeout_s=args.timeout_s)
    out = JsonlWriter(args.out, group)
    soak = Soak(group, args)
    modes = soak.keys
    for _ in range(WARMUP_CALLS):  # every variant of every mode once: compiles, allocates the pools
        for mode in modes:
            soak.call(mode)
    soak.wait()
    soak.bad.fill(0)
    soak.checked.fill(0)
    soak.worst.fill(0)
    soak.calls = dict.fromkeys(modes, 0)
    soak.stale = 0
    group.comm.Barrier()
    start_mem = memory_point(group)
    t0 = time.monotonic()
    for i in range(args.calls):
        soak.call(modes[i % len(modes)])
        if (i + 1) % args.sync_every == 0 or i + 1 == args.calls:
            soak.wait()
            tot = soak.totals()
            if group.rank == 0:
                bad = sum(v["bad_rows"] for v in tot.values())
                print(f"soak: {i + 1}/{args.calls} calls, {time.monotonic() - t0:.1f} s, bad rows {bad}", flush=True)
    wall = time.monotonic() - t0
    end_mem = memory_point(group)
    totals = soak.totals()
    stale = soak.stale_unraised()
    soak.destroy()
    passed = all(v["bad_rows"] == 0 for v in totals.values()) and stale == 0
    growth = [{k: e[k] - s[k] for k in ("pool_used_bytes", "pool_total_bytes", "host_rss_bytes")}
              | {"device_used_bytes": s["device_free_bytes"] - e["device_free_bytes"]}
              for s, e in zip(start_mem, end_mem)]
    out.write({"study": "soak", "calls": args.calls, "modes": modes, "passed": passed,
               "stale_results_unraised": stale, "num_nodes": group.num_nodes, "wall_s": round(wall, 2),
               "calls_per_s": round(args.calls / wall, 1), "per_mode": totals,
               "sizes": {"hidden": args.hidden, "experts": args.experts, "topk": args.topk,
                         "max_tokens": args.max_tokens, "ll_max_tokens": args.ll_max_tokens, "seed": args.seed},
               "memory_start": start_mem, "memory_end": end_mem, "memory_growth": growth})
    if group.rank == 0:
        for m, v in totals.items():
            print(f"soak: {m}: {v['calls']} calls, {v['rows']} rows, {v['bad_rows']} bad, "
                  f"worst row diff {v['worst_row_diff']:.2e}", flush=True)
        g0 = growth[0]
        print(f"soak: {'passed' if passed else 'FAILED'} in {wall:.1f} s; rank 0 growth: pool used "
              f"{g0['pool_used_bytes'] / 2**20:+.1f} MiB, device used {g0['device_used_bytes'] / 2**20:+.1f} MiB, "
              f"RSS {g0['host_rss_bytes'] / 2**20:+.1f} MiB", flush=True)
    group.destroy()
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
