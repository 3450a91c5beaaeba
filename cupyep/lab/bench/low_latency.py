"""Low-latency measurements: the calls of one shape on one LowLatencyBuffer,
timed in decode order on a timing boundary; the records the benchmark
(experiments/bench_low_latency.py) and the "low_latency" sweep study
(cupyep.lab.experiments.gpu_low_latency) write.

Kinds (``KINDS``), each timed in a round of calls (``ROUNDS``) as a decode
loop issues them, dispatch then combine, so that each kind of call writes
the data copy it wrote last time (layout.CallSchedule):

- ``dispatch_fp8`` / ``dispatch_bf16``: the dispatch of FP8 rows (with their
  scales) / BF16 rows, each followed by a combine;
- ``combine``: the default combine (pushing the rows) after an FP8 dispatch;
- ``combine_pull``: the expert ranks copy the rows into their own buffers
  and the owners pull them;
- ``combine_zero_copy`` / ``combine_zero_copy_push``: the zero-copy combine
  (rows in ``get_next_combine_buffer``), pulled / pushed;
- ``combine_partial``: the partial combine (``combine(partial=True)``: one
  row per (token, expert rank), summed on the expert side) after an FP8
  dispatch given the weights;
- ``combine_logfmt`` / ``combine_partial_logfmt``: the same combines with
  their rows in LogFMT-10 (``use_logfmt=True``: 10.5 bits a value);
- ``dispatch_fp8_send_half``, ``dispatch_fp8_recv_half``,
  ``combine_send_half``, ``combine_recv_half``: hook mode's halves;
  ``combine_partial_send_half``, ``combine_partial_recv_half``: the partial
  combine's; ``combine_partial_logfmt_send_half``,
  ``combine_partial_logfmt_recv_half``: its LogFMT-10 form's.

Timing boundaries (``TIMINGS``):

- "strict": every call on its own, after an L2 flush, a GPU sleep (so the
  host has queued the call before the GPU reaches it) and a GPU barrier that
  lines the ranks up (timing.timed_rounds); two clocks, CUDA events around
  the barrier and the call (``event_*``) and the kernel's own %globaltimer
  stamps, first block start to last block end (``kernel_*``); the slowest
  rank's median and p99; when every rank shares one GPU also the ranks'
  start skew, span and ``after_last_start`` (stamps.cross_rank).
- "deepep": DeepEP's own boundary (bench_kineto, test_low_latency): a warm-up
  period, then one recorded period of ``iters`` calls back to back behind a
  GPU sleep and a barrier, no flush or barrier between calls; hook mode as
  send half, a host-side gap (``host_gap_ms``, then a host barrier), receive
  half. Each rank's own kernel durations. Outside hook mode the recorded
  period's GPU sleep outlasts twice the slowest host's queueing of the
  warm-up period, so that every rank has queued its calls before the GPU
  reaches them; the records say how long that sleep was
  (``period_sleep_us``), how long the slowest host took to queue the
  recorded calls (``host_queue_max_us``) and whether it took longer than the
  sleep (``host_behind``: then a rank's late calls held its peers' kernels
  waiting, and the kernel times include that wait).

:class:`Session` runs the rounds and builds the records; :func:`measure` is
one kind's record with the figures the normal-mode bench gives
(cupyep.lab.bench.normal.measure): ``time_us`` (slowest rank's median kernel
time), ``p10_us``/``p90_us``/``p99_us`` (slowest rank's), ``rank_mean_us``
(mean over ranks of each rank's median), ``rank_GBps`` (bytes this rank
wrote to peers, or read from them for a pulling combine / its median time,
mean over ranks) and ``efficiency`` (2 x those bytes of all ranks / the copy
bandwidth measured in this run / time).
"""
from __future__ import annotations

import time

import numpy as np

from .timing import FLUSH_MODES

__all__ = ["KINDS", "HOOK_KINDS", "TIMINGS", "ROUNDS", "WARMUP", "round_of", "check", "row_bytes", "strict_record",
           "deepep_record", "figures", "Session", "measure"]

HOOK_KINDS = ("dispatch_fp8_send_half", "dispatch_fp8_recv_half", "combine_send_half", "combine_recv_half")
# Round name -> the kinds it records, in the order the benchmark writes them.
ROUNDS = {"fp8": ("dispatch_fp8", "combine"), "bf16": ("dispatch_bf16",), "pull": ("combine_pull",),
          "zero_copy": ("combine_zero_copy",), "zero_copy_push": ("combine_zero_copy_push",), "hook": HOOK_KINDS,
          "partial": ("combine_partial",), "hook_partial": ("combine_partial_send_half", "combine_partial_recv_half"),
          "logfmt": ("combine_logfmt",), "partial_logfmt": ("combine_partial_logfmt",),
          "hook_partial_logfmt": ("combine_partial_logfmt_send_half", "combine_partial_logfmt_recv_half")}
# Round name -> the combine's keyword arguments (beyond the plain pushing combine's).
_COMBINE_KW = {"pull": {"pull": True}, "partial": {"partial": True}, "logfmt": {"use_logfmt": True},
               "partial_logfmt": {"partial": True, "use_logfmt": True}}
KINDS = tuple(k for kinds in ROUNDS.values() for k in kinds)
TIMINGS = ("strict", "deepep")
WARMUP = 10  # untimed rounds ahead of a strict measurement


def round_of(kind: str) -> str:
    """The round (``ROUNDS`` key) that times ``kind``; ValueError for an unknown kind."""
    for name, kinds in ROUNDS.items():
        if kind in kinds:
            return name
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def check(kind: str, timing: str = "strict", flush: str = "write") -> None:
    """ValueError for a kind, timing boundary or L2 flush mode no measurement has."""
    round_of(kind)
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    if flush not in FLUSH_MODES:
        raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")


def row_bytes(hidden: int) -> dict:
    """Bytes per (token, expert) pair a call moves between ranks: "fp8" (an FP8
    dispatch row, its scales, the source and slot tags), "bf16" (a BF16 dispatch
    row and tags), "combine" (a BF16 combine row)."""
    return {"fp8": hidden + hidden // 128 * 4 + 4 + 1, "bf16": 2 * hidden + 4 + 1, "combine": 2 * hidden}


def _cross_rank_fields(kernel) -> dict:
    """stamps.cross_rank of [R, n, 2] kernel stamps as record fields:
    ``{skew,span,after_last_start}_{median,p99}_us``."""
    from .stamps import cross_rank
    return {f"{name}_{q}": x for name, v in cross_rank(kernel).items() for q, x in v.items()}


def _efficiency(total_bytes, copy_bw, seconds):
    return 2 * total_bytes / copy_bw / seconds if copy_bw else None


def strict_record(comm, base: dict, kind: str, timed, bytes_to_peers: int, copy_bw, one_gpu: bool) -> dict:
    """The benchmark's record of a kind timed on the strict boundary (collective).

    ``timed``: (event Timing, host int64 [n, 2] kernel stamps) of this rank;
    ``one_gpu``: every rank shares one GPU (one %globaltimer), so the stamps
    of different ranks compare. Fields: ``base``, "kind", ``event_median_us``,
    ``event_p99_us``, ``kernel_median_us``, ``kernel_p99_us`` (slowest rank's),
    with ``one_gpu`` ``{skew,span,after_last_start}_{median,p99}_us``, "n",
    "bytes_to_peers" (all ranks), "efficiency".
    """
    from .stamps import kernel_seconds
    from .timing import Timing
    event, stamps = timed
    kernel = Timing.from_samples(kernel_seconds(stamps))
    mine = {f"{c}_{q}": getattr(t, f"{q}_s") for c, t in (("event", event), ("kernel", kernel))
            for q in ("median", "p99")}
    everyone = comm.allgather((mine, np.asarray(stamps), int(bytes_to_peers)))
    r = {f"{name}_us": max(m[name] for m, _, _ in everyone) * 1e6 for name in mine}
    if one_gpu:
        r.update(_cross_rank_fields(np.stack([s for _, s, _ in everyone])))  # [R, n, 2]
    total = sum(b for _, _, b in everyone)
    return {**base, "kind": kind, **r, "n": event.n, "bytes_to_peers": total,
            "efficiency": _efficiency(total, copy_bw, r["kernel_median_us"] * 1e-6)}


def deepep_record(comm, base: dict, kind: str, stamps, bytes_to_peers: int, copy_bw, host_gap_ms: float,
                  one_gpu: bool = False) -> dict:
    """The benchmark's record of a kind timed on DeepEP's boundary (collective).

    ``stamps``: this rank's host int64 [n, 2] kernel stamps. Fields: ``base``,
    "kind", "timing": "deepep", "n", "host_gap_ms", ``kernel_median_us``
    (slowest rank's median), ``kernel_rank_median_mean_us`` and
    ``kernel_rank_mean_mean_us`` (mean over ranks of each rank's median /
    mean), ``kernel_rank_medians_us``, "bytes_to_peers", "efficiency"; with
    ``one_gpu`` (every rank on one GPU, one %globaltimer) also
    ``{skew,span,after_last_start}_{median,p99}_us`` and
    ``concurrent_ranks_{median,min,max}`` (stamps.concurrent_ranks): on this
    boundary nothing lines the ranks' calls up, so how many of them share the
    GPU at once varies from run to run.
    """
    from .stamps import concurrent_ranks, kernel_seconds
    dur = kernel_seconds(stamps)
    everyone = comm.allgather((float(np.median(dur)), float(np.mean(dur)), int(bytes_to_peers),
                               np.asarray(stamps) if one_gpu else None))
    meds, means = [e[0] for e in everyone], [e[1] for e in everyone]
    total = sum(e[2] for e in everyone)
    rec = {**base, "kind": kind, "timing": "deepep", "n": int(dur.size), "host_gap_ms": host_gap_ms,
           "kernel_median_us": max(meds) * 1e6, "kernel_rank_median_mean_us": np.mean(meds) * 1e6,
           "kernel_rank_mean_mean_us": np.mean(means) * 1e6, "kernel_rank_medians_us": [m * 1e6 for m in meds],
           "bytes_to_peers": total, "efficiency": _efficiency(total, copy_bw, max(meds))}
    if one_gpu:
        kernel = np.stack([e[3] for e in everyone])  # [R, n, 2]
        rec.update(_cross_rank_fields(kernel))
        rec.update({f"concurrent_ranks_{q}": x for q, x in concurrent_ranks(kernel).items()})
    return rec


def figures(comm, durations_s, bytes_to_peers: int, copy_bw) -> dict:
    """The normal-mode bench's figures of one kind from this rank's kernel
    durations (collective): "time_us" (slowest rank's median), "p10_us",
    "p90_us", "p99_us" (slowest rank's), "rank_mean_us" (mean of the ranks'
    medians), "rank_GBps" (bytes to peers / median, mean over ranks),
    "efficiency" (2 x all ranks' bytes / copy bandwidth / time_us), "copy_GBps"."""
    from .timing import Timing
    t = Timing.from_samples(durations_s)
    everyone = comm.allgather((t.median_s, t.p10_s, t.p90_s, t.p99_s, int(bytes_to_peers)))
    R = len(everyone)
    slowest = [max(e[i] for e in everyone) for i in range(4)]
    total = sum(e[4] for e in everyone)
    return {"time_us": slowest[0] * 1e6, "p10_us": slowest[1] * 1e6, "p90_us": slowest[2] * 1e6,
            "p99_us": slowest[3] * 1e6, "rank_mean_us": sum(e[0] for e in everyone) / R * 1e6,
            "rank_GBps": sum(e[4] / e[0] for e in everyone) / R / 1e9,
            "efficiency": _efficiency(total, copy_bw, slowest[0]), "copy_GBps": copy_bw / 1e9 if copy_bw else None}


class Session:
    """The low-latency calls of one shape on one buffer, and their timing.

    Arguments:
        group: the rank group; buf: cupyep.LowLatencyBuffer; barrier: a
            callable enqueuing a GPU barrier (cupyep.barrier.GpuBarrier).
        x: cupy [T, H] uint16 (BF16 bits); topk_idx: cupy [T, k] int64;
            topk_weights: cupy [T, k] float32 (this rank's).
        copy_bw: bytes/s of the copy kernel, the same on every rank (None:
            no efficiency).
        flush: timing.FLUSH_MODES mode before each strict call; sleep_us: GPU
            sleep ahead of each strict call (per call of a DeepEP period);
            warmup: untimed strict rounds.

    Collective: every rank builds it and runs the same rounds in the same
    order. Building it dispatches once (BF16) for the identity expert outputs
    ``y`` every combine sends back.

    Attributes: ``base`` (the fields every record starts with), ``pairs``
    (this rank's (token, expert) pairs), ``rows`` (row_bytes), ``y``,
    ``pending`` (the latest dispatch "d" and combine "c" results).
    """

    def __init__(self, group, buf, barrier, x, topk_idx, topk_weights, copy_bw, *, flush: str = "write",
                 sleep_us: float = 400.0, warmup: int = WARMUP):
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
        self.group, self.buf, self.barrier = group, buf, barrier
        self.x, self.topk_idx, self.topk_weights = x, topk_idx, topk_weights
        self.copy_bw, self.flush, self.sleep_us, self.warmup = copy_bw, flush, sleep_us, warmup
        T, H = x.shape
        self.pairs = int((topk_idx >= 0).sum())
        # (token, expert rank) pairs: the rows a partial combine returns
        from ...reference.low_latency import combine_rows
        host_idx = topk_idx.get() if hasattr(topk_idx, "get") else topk_idx
        self.rank_pairs = combine_rows([host_idx], buf.num_experts, buf.num_ranks)["per_rank"]
        self.rows = row_bytes(H)
        self.base = {"bench": "low_latency", "ranks": buf.num_ranks, "tokens": T, "hidden": H,
                     "topk": int(topk_idx.shape[1]), "experts": buf.num_experts, "max_tokens": buf.max_tokens,
                     "buffer_bytes": buf.num_bytes, "num_blocks": buf.num_blocks, "num_waiters": buf.num_waiters,
                     "num_threads": buf.num_threads, "copy_GBps": copy_bw / 1e9 if copy_bw else None,
                     "l2_flush": flush, "programmatic_launch": buf.programmatic_launch, "timing": "strict"}
        self.pending = {}
        self.last_period = {}  # the last DeepEP-boundary period's sleep and host queueing (period)
        # Identity expert outputs in the dispatch's row layout (the same for FP8 and BF16).
        self.y = buf.dispatch(x, topk_idx, use_fp8=False, validate=False).recv_x.copy()

    # ------------------------------------------------------------- the calls
    def dispatch(self, use_fp8: bool):
        """call(i, stamp_row, **more): a dispatch, its result kept as pending["d"]."""
        def call(i, st, **more):
            self.pending["d"] = self.buf.dispatch(self.x, self.topk_idx, use_fp8=use_fp8, validate=False,
                                                  kernel_time_ns=st, **more)
        return call

    def combine(self, i, st, **kw):
        """A combine of ``y`` for the pending dispatch (``kw``: pull, return_recv_hook, ...)."""
        return self.buf.combine(self.y, self.topk_idx, self.topk_weights, self.pending["d"].handle,
                                kernel_time_ns=st, **kw)

    def zero_copy_combine(self, pull: bool):
        """call(i, stamp_row): a zero-copy combine, pulled or pushed (fill_zero_copy first)."""
        def call(i, st):
            return self.buf.combine(None, self.topk_idx, self.topk_weights, self.pending["d"].handle,
                                    zero_copy=True, pull=pull, kernel_time_ns=st)
        return call

    def fill_zero_copy(self) -> None:
        """Write ``y`` into the combine buffer zero-copy combines read. In decode
        order every combine uses one data copy, so one fill serves every later
        zero-copy combine of the decode loop."""
        d0 = self.buf.dispatch(self.x, self.topk_idx, use_fp8=True, validate=False)
        self.buf.get_next_combine_buffer(d0.handle)[...] = self.y

    def bytes_to_peers(self, kind: str) -> int:
        """Bytes this rank's call of ``kind`` writes into (or, pulling, reads from) the ranks' buffers."""
        if kind.endswith("_recv_half"):
            return 0
        if kind.startswith("dispatch"):
            return self.pairs * self.rows["bf16" if kind.startswith("dispatch_bf16") else "fp8"]
        rows = self.rank_pairs if kind.startswith("combine_partial") else self.pairs
        if "logfmt" in kind:  # LogFMT-10 rows (cupyep.reference.logfmt)
            from ...reference.logfmt import payload_bytes
            return payload_bytes(rows, int(self.x.shape[1]))
        return rows * self.rows["combine"]

    # ------------------------------------------------------ strict boundary
    def steps(self, calls, iters: int) -> list:
        """Each call (call(i, stamp_row)) on its own, lined up across ranks by the GPU barrier:
        per call (event Timing, host kernel stamps [iters, 2]) (timing.timed_rounds)."""
        from .timing import timed_rounds
        return timed_rounds(calls, iters, self.warmup, self.flush, self.sleep_us, before=self.barrier)

    @property
    def one_gpu(self) -> bool:
        """Every rank on one GPU: stamps compare across ranks (stamps.one_timer)."""
        from .stamps import one_timer
        return one_timer(self.group)

    def record(self, kind: str, timed, bytes_to_peers: int) -> dict:
        """:func:`strict_record` of ``timed`` (collective)."""
        return strict_record(self.group.comm, self.base, kind, timed, bytes_to_peers, self.copy_bw, self.one_gpu)

    def deepep(self, kind: str, stamps, bytes_to_peers: int, host_gap_ms: float) -> dict:
        """:func:`deepep_record` of ``stamps`` with the last period's sleep and host queueing (collective)."""
        return {**deepep_record(self.group.comm, self.base, kind, stamps, bytes_to_peers, self.copy_bw, host_gap_ms,
                                self.one_gpu), **self.last_period}

    def _strict_calls(self, name: str) -> list:
        """The calls of round ``name``, in order, each with the kind it records (or None)."""
        d_fp8 = self.dispatch(True)
        if name == "fp8":
            return [(d_fp8, "dispatch_fp8"), (self.combine, "combine")]
        if name == "bf16":
            return [(self.dispatch(False), "dispatch_bf16"), (self.combine, None)]
        if name in ("pull", "logfmt"):
            return [(d_fp8, None), (lambda i, st: self.combine(i, st, **_COMBINE_KW[name]), ROUNDS[name][0])]
        if name in ("zero_copy", "zero_copy_push"):
            return [(d_fp8, None), (self.zero_copy_combine(name == "zero_copy"), ROUNDS[name][0])]
        if name in ("partial", "partial_logfmt"):
            return [(lambda i, st: d_fp8(i, st, topk_weights=self.topk_weights), None),
                    (lambda i, st: self.combine(i, st, **_COMBINE_KW[name]), ROUNDS[name][0])]
        if name in ("hook_partial", "hook_partial_logfmt"):
            def cps(i, st):
                self.pending["c"] = self.combine(i, st, return_recv_hook=True, **_COMBINE_KW[name.removeprefix("hook_")])
            return [(lambda i, st: d_fp8(i, st, topk_weights=self.topk_weights, return_recv_hook=True), None),
                    (lambda i, st: self.pending["d"].hook(kernel_time_ns=st), None),
                    (cps, ROUNDS[name][0]), (lambda i, st: self.pending["c"].hook(kernel_time_ns=st), ROUNDS[name][1])]
        if name == "hook":
            def cs(i, st):
                self.pending["c"] = self.combine(i, st, return_recv_hook=True)
            return [(lambda i, st: d_fp8(i, st, return_recv_hook=True), HOOK_KINDS[0]),
                    (lambda i, st: self.pending["d"].hook(kernel_time_ns=st), HOOK_KINDS[1]),
                    (cs, HOOK_KINDS[2]), (lambda i, st: self.pending["c"].hook(kernel_time_ns=st), HOOK_KINDS[3])]
        raise ValueError(f"round must be one of {tuple(ROUNDS)}, got {name!r}")

    def time_strict(self, name: str, iters: int) -> dict:
        """Run round ``name`` on the strict boundary: {kind: (event Timing, host kernel stamps)}."""
        if name.startswith("zero_copy"):
            self.fill_zero_copy()
        calls = self._strict_calls(name)
        timed = self.steps([c for c, _ in calls], iters)
        return {kind: t for (_, kind), t in zip(calls, timed) if kind is not None}

    # ------------------------------------------------------ DeepEP boundary
    def period(self, body, names, n: int, queue_ahead: bool = True) -> dict:
        """A warm-up period, then the recorded one, of ``n`` calls of ``body(st)``
        back to back behind a GPU sleep and a barrier; ``st(name)`` is that call's
        stamp row for ``name`` (None in the warm-up). With ``queue_ahead`` the
        recorded period's sleep is at least twice the slowest rank's host time
        to queue the warm-up's calls, so the GPU finds them all queued (not for
        hook mode, whose host gap between the halves is part of what it
        measures). ``self.last_period`` then holds "period_sleep_us",
        "host_queue_max_us" (the recorded period's) and "host_behind" (the
        latter above the sleep; None without ``queue_ahead``). Returns
        {name: device stamps [n, 2]}."""
        from .stamps import new_kernel_stamps
        from .timing import gpu_sleep
        stamps = {k: new_kernel_stamps(n) for k in names}
        sleep_us = self.sleep_us * n
        for live in (False, True):  # a warm-up period, then the recorded one
            # bench_kineto's large GEMM and all-reduce: the GPU is busy while every host
            # queues its calls, then the ranks start together.
            self.buf.synchronize()
            self.group.comm.Barrier()
            gpu_sleep(sleep_us)
            self.barrier()
            t0 = time.perf_counter()
            for i in range(n):
                body(lambda k: stamps[k][i] if live and k in stamps else None)
            queued_us = max(self.group.comm.allgather((time.perf_counter() - t0) * 1e6))
            if not live and queue_ahead:
                sleep_us = max(sleep_us, 2 * queued_us)
        self.buf.synchronize()
        self.last_period = {"period_sleep_us": sleep_us, "host_queue_max_us": queued_us,
                            "host_behind": bool(queued_us > sleep_us) if queue_ahead else None}
        return stamps

    def _deepep_body(self, name: str, host_gap_ms: float):
        buf, x, idx, w = self.buf, self.x, self.topk_idx, self.topk_weights
        if name in ("hook", "hook_partial", "hook_partial_logfmt"):
            partial = name != "hook"
            ck = ROUNDS[name][-2:] if partial else HOOK_KINDS[2:]

            def gap_then_align():
                # The work between the halves (DeepEP: a GEMM on the CPU, about as long on every
                # rank): every send half is out before any rank starts its receive half.
                time.sleep(host_gap_ms * 1e-3)
                self.group.comm.Barrier()

            def hooked(st):
                d = buf.dispatch(x, idx, use_fp8=True, validate=False, return_recv_hook=True,
                                 kernel_time_ns=st(HOOK_KINDS[0]), **({"topk_weights": w} if partial else {}))
                gap_then_align()
                d.hook(kernel_time_ns=st(HOOK_KINDS[1]))
                c = buf.combine(self.y, idx, w, d.handle, return_recv_hook=True, kernel_time_ns=st(ck[0]),
                                **(_COMBINE_KW[name.removeprefix("hook_")] if partial else {}))
                gap_then_align()
                c.hook(kernel_time_ns=st(ck[1]))
            return hooked
        if name not in ROUNDS:
            raise ValueError(f"round must be one of {tuple(ROUNDS)}, got {name!r}")
        dkind = "dispatch_bf16" if name == "bf16" else "dispatch_fp8"
        ckind = None if name == "bf16" else ROUNDS[name][-1]
        kw = ({"zero_copy": True, "pull": name == "zero_copy"} if name.startswith("zero_copy")
              else _COMBINE_KW.get(name, {}))
        dkw = {"topk_weights": w} if name.startswith("partial") else {}
        src = None if name.startswith("zero_copy") else self.y

        def single(st):
            d = buf.dispatch(x, idx, use_fp8=name != "bf16", validate=False, kernel_time_ns=st(dkind), **dkw)
            buf.combine(src, idx, w, d.handle, kernel_time_ns=st(ckind) if ckind else None, **kw)
        return single

    def time_deepep(self, name: str, n: int, host_gap_ms: float = 2.0) -> dict:
        """Run round ``name`` on DeepEP's boundary, ``n`` calls: {kind: host kernel stamps [n, 2]}."""
        if name.startswith("zero_copy"):
            self.fill_zero_copy()
        kinds = ROUNDS.get(name)
        st = self.period(self._deepep_body(name, host_gap_ms), kinds, n, queue_ahead=not name.startswith("hook"))
        return {k: st[k].get() for k in kinds}

    # --------------------------------------------------------------- records
    def records(self, name: str, timing: str, iters: int, host_gap_ms: float = 2.0) -> list:
        """The benchmark's records of round ``name`` on ``timing`` (collective)."""
        if timing == "strict":
            return [self.record(k, t, self.bytes_to_peers(k)) for k, t in self.time_strict(name, iters).items()]
        if timing == "deepep":
            return [self.deepep(k, st, self.bytes_to_peers(k), host_gap_ms)
                    for k, st in self.time_deepep(name, iters, host_gap_ms).items()]
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")

    def measure(self, kind: str, timing: str = "strict", iters: int = 100, host_gap_ms: float = 2.0) -> dict:
        """One kind's benchmark record plus :func:`figures` (collective); see :func:`measure`."""
        from .stamps import kernel_seconds
        check(kind, timing, self.flush)
        name, nbytes, comm = round_of(kind), self.bytes_to_peers(kind), self.group.comm
        if timing == "strict":
            timed = self.time_strict(name, iters)[kind]
            rec, stamps = self.record(kind, timed, nbytes), timed[1]
        else:
            stamps = self.time_deepep(name, iters, host_gap_ms)[kind]
            rec = self.deepep(kind, stamps, nbytes, host_gap_ms)
        return {**rec, **figures(comm, kernel_seconds(stamps), nbytes, self.copy_bw)}


def measure(group, buf, barrier, kind: str, x, topk_idx, topk_weights, timing: str = "strict", iters: int = 100,
            copy_bw: float | None = None, *, flush: str = "write", sleep_us: float = 400.0, host_gap_ms: float = 2.0,
            warmup: int = WARMUP) -> dict:
    """Time ``kind`` in its round and return its record (collective over the group).

    Arguments:
        group, buf, barrier, x, topk_idx, topk_weights, copy_bw, flush,
            sleep_us, warmup: as :class:`Session`'s.
        kind: one of ``KINDS``; timing: "strict" or "deepep".
        iters: timed calls (strict: after ``warmup`` untimed rounds; deepep:
            calls of the recorded period); host_gap_ms: deepep hook mode's
            host-side gap between the halves.

    Returns:
        dict: the benchmark's record (:func:`strict_record` or
        :func:`deepep_record`) and :func:`figures`: "time_us", "p10_us",
        "p90_us", "p99_us", "rank_mean_us", "rank_GBps", "efficiency",
        "copy_GBps"; the buffer's configuration in "num_blocks",
        "num_waiters", "num_threads", "programmatic_launch", "max_tokens",
        "buffer_bytes".

    Raises ValueError for an unknown kind, timing or flush mode before anything runs.
    """
    check(kind, timing, flush)
    if not (isinstance(iters, int) and iters >= 1):
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    s = Session(group, buf, barrier, x, topk_idx, topk_weights, copy_bw, flush=flush, sleep_us=sleep_us,
                warmup=warmup)
    return s.measure(kind, timing, iters, host_gap_ms)
