"""The "low_latency" study: low-latency dispatch and combine on the GPU, one
configuration of knobs at a time (cupyep.lab.bench.low_latency.measure, the
timing of experiments/bench_low_latency.py).

Knobs (defaults: the benchmark's shape and defaults):

- ``kind``: one of cupyep.lab.bench.low_latency.KINDS ("dispatch_fp8",
  "dispatch_bf16", "combine", "combine_pull", "combine_zero_copy",
  "combine_zero_copy_push", and hook mode's "dispatch_fp8_send_half",
  "dispatch_fp8_recv_half", "combine_send_half", "combine_recv_half");
- ``timing``: "strict" or "deepep"; ``iters``: timed calls (strict: each
  alone; deepep: the calls of the recorded period);
- shape: ``tokens`` (per rank), ``hidden``, ``topk``, ``experts``;
- routing: ``routing`` (a cupyep.routing kind), ``routing_params`` (its
  parameters, and ``drop_fraction``), ``seed`` (the benchmark seeds its
  "uniform" routing with the token count);
- the buffer: ``max_tokens`` (num_max_dispatch_tokens_per_rank; 0: the larger
  of 128, the benchmark's, and ``tokens``), ``num_blocks`` and ``num_waiters``
  (0: the buffer's defaults), ``num_threads`` (512 or 1024),
  ``plain_launch`` (true / 1: kernels launched plainly instead of as
  programmatic dependents);
- the boundary: ``flush`` (timing.FLUSH_MODES, before each strict call),
  ``sleep_us`` (GPU sleep ahead of each call), ``host_gap_ms`` (deepep hook
  mode's host-side gap between the halves).

Bad values raise ValueError (:func:`check_config`) before anything touches
the GPU; the sweep records them as "skipped".

Metrics: the benchmark's record without its knob-like fields (strict:
``event_*``/``kernel_*`` medians and p99, cross-rank skew on one GPU;
deepep: ``kernel_rank_*``; "n", "bytes_to_peers"), the figures of the
normal study ("time_us", the slowest rank's median kernel time, and
p10/p90/p99, "rank_mean_us", "rank_GBps", "efficiency" against the copy
bandwidth measured once per sweep, "copy_GBps"), "buffer_config" (the
buffer actually used: max_tokens, max_topk, num_blocks, num_waiters,
num_threads, programmatic_launch, buffer_bytes), "imbalance_factor" of
the routing, and for the dispatch kinds the in-kernel metrics of 10 more,
untimed dispatches (cupyep.lab.metrics): the signal-slot waits "wait_us_p50",
"wait_us_p99", "wait_us_max" over every (call, source rank) and those
waits themselves ("wait_us_samples", for cupyep.lab.plotting.cdf_figure; each
call after a GPU sleep and a GPU barrier, so a wait is the protocol's, not a
peer's late launch),
"slot_utilisation" and "expert_recv_imbalance". The barrier and the copy
bandwidth are kept between configurations, and the buffer while its configuration stays the same.
"""
from __future__ import annotations

import numbers

from .studies import Study, gpu_fixtures, register
from ...routing import KINDS as ROUTING_KINDS

KNOBS = {"kind": "dispatch_fp8", "timing": "strict", "tokens": 128, "hidden": 7168, "topk": 8, "experts": 256,
         "routing": "uniform", "routing_params": {}, "seed": 0, "max_tokens": 0, "num_blocks": 0, "num_waiters": 0,
         "num_threads": 512, "plain_launch": False, "flush": "write", "sleep_us": 400.0, "host_gap_ms": 2.0,
         "iters": 100}
# Fields of the benchmark's record that the configuration already holds or that move to buffer_config.
DROPPED = ("bench", "ranks", "l2_flush", "buffer_bytes", "programmatic_launch")
MIN_TOPK_SLOTS = 16  # the buffer's max_topk (LowLatencyBuffer's default) unless topk is larger
DEFAULT_MAX_TOKENS = 128  # the benchmark's --max-tokens, the buffer's size unless tokens is larger

_state: dict = {}


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _int(cfg, name, low):
    v = cfg[name]
    if not (_is_int(v) and v >= low):
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


def check_config(cfg: dict) -> None:
    """ValueError naming the first knob of ``cfg`` (a complete configuration)
    no low-latency measurement can take; needs no GPU. Sizes that depend on
    the rank count (experts a multiple of the ranks) are checked in :func:`run`."""
    from ... import routing
    from ..bench.low_latency import KINDS, TIMINGS
    from ..bench.timing import FLUSH_MODES
    from ...low_latency.kernels import MAX_BLOCKS, THREAD_CHOICES
    from ...low_latency.layout import MAX_TOPK
    for name, allowed in (("kind", KINDS), ("timing", TIMINGS), ("flush", FLUSH_MODES),
                          ("routing", routing.KINDS), ("num_threads", THREAD_CHOICES)):
        if cfg[name] not in allowed or isinstance(cfg[name], bool):
            raise ValueError(f"{name} must be one of {allowed}, got {cfg[name]!r}")
    tokens, hidden, experts = _int(cfg, "tokens", 1), _int(cfg, "hidden", 1), _int(cfg, "experts", 1)
    if hidden % 128:
        raise ValueError(f"hidden must be a positive multiple of 128, got {hidden}")
    topk = _int(cfg, "topk", 1)
    if topk > min(experts, MAX_TOPK):
        raise ValueError(f"topk must be at most experts ({experts}) and {MAX_TOPK}, got {topk}")
    max_tokens = _int(cfg, "max_tokens", 0)
    if max_tokens and max_tokens < tokens:
        raise ValueError(f"max_tokens ({max_tokens}) must be 0 (the default size) or at least tokens ({tokens})")
    blocks, waiters = _int(cfg, "num_blocks", 0), _int(cfg, "num_waiters", 0)
    if blocks > MAX_BLOCKS:
        raise ValueError(f"num_blocks must be at most {MAX_BLOCKS}, got {blocks}")
    if blocks and waiters > blocks:
        raise ValueError(f"num_waiters ({waiters}) must be at most num_blocks ({blocks})")
    if cfg["plain_launch"] not in (True, False, 0, 1):
        raise ValueError(f"plain_launch must be a bool (or 0 / 1), got {cfg['plain_launch']!r}")
    for name in ("sleep_us", "host_gap_ms"):
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")
    _int(cfg, "seed", 0)
    _int(cfg, "iters", 1)
    if not isinstance(cfg["routing_params"], dict):
        raise ValueError(f"routing_params must be a dict, got {cfg['routing_params']!r}")


def buffer_args(cfg: dict) -> dict:
    """LowLatencyBuffer's arguments for a configuration (after :func:`check_config`)."""
    max_tokens = cfg["max_tokens"] or max(DEFAULT_MAX_TOKENS, cfg["tokens"])
    return {"num_max_dispatch_tokens_per_rank": max_tokens, "hidden": cfg["hidden"],
            "num_experts": cfg["experts"], "max_topk": max(MIN_TOPK_SLOTS, cfg["topk"]),
            "num_blocks": cfg["num_blocks"] or None, "num_waiters": cfg["num_waiters"] or None,
            "num_threads": cfg["num_threads"], "programmatic_launch": False if cfg["plain_launch"] else None}


def _resources(group, args: dict):
    """(LowLatencyBuffer built with ``args``, GpuBarrier, copy bytes/s), kept across configurations."""
    import cupyep
    barrier, copy_bw = gpu_fixtures(group, _state)
    buf = _state.get("buffer")
    if buf is None or _state.get("buffer_args") != args:
        if buf is not None:
            buf.synchronize()
            buf.destroy()
            _state.pop("buffer")
        a = dict(args)
        buf = cupyep.LowLatencyBuffer(group, a.pop("num_max_dispatch_tokens_per_rank"), a.pop("hidden"),
                                      a.pop("num_experts"), **a)
        _state["buffer"], _state["buffer_args"] = buf, args
    return buf, barrier, copy_bw


def run(group, cfg: dict) -> dict:
    """Measure one configuration (collective); see the module docstring."""
    check_config(cfg)
    from ... import routing
    from ...low_latency.layout import check_sizes
    from ...low_latency.buffer import ranks_of
    me, R = ranks_of(group)
    T, k, E = cfg["tokens"], cfg["topk"], cfg["experts"]
    args = buffer_args(cfg)
    check_sizes(R, args["num_max_dispatch_tokens_per_rank"], cfg["hidden"], E, args["max_topk"])
    idx, w = routing.make(cfg["routing"], cfg["seed"], [T] * R, E, k, **dict(cfg["routing_params"]))

    import cupy
    import numpy as np

    from ..bench.low_latency import measure
    from ...testing import payload_bf16
    buf, bar, copy_bw = _resources(group, args)
    x = cupy.asarray(payload_bf16(me, np.arange(T), cfg["hidden"]))
    rec = measure(group, buf, bar, cfg["kind"], x, cupy.asarray(idx[me]), cupy.asarray(w[me]), cfg["timing"],
                  cfg["iters"], copy_bw, flush=cfg["flush"], sleep_us=float(cfg["sleep_us"]),
                  host_gap_ms=float(cfg["host_gap_ms"]))
    buf.synchronize()
    metrics = metrics_of(rec, buf, routing.imbalance_factor(idx, E))
    if cfg["kind"] in ("dispatch_fp8", "dispatch_bf16"):  # untimed calls after the timed ones (cupyep.lab.metrics)
        from ...metrics import low_latency_metrics
        metrics.update(low_latency_metrics(group, buf, x, cupy.asarray(idx[me]),
                                           use_fp8=cfg["kind"] == "dispatch_fp8", barrier=bar,
                                           sleep_us=float(cfg["sleep_us"])))
    return metrics


def metrics_of(rec: dict, buf, imbalance_factor: float) -> dict:
    """The study's metrics from a measure() record: its fields but the knob-like
    ones, the buffer's configuration as "buffer_config", the routing's imbalance."""
    metrics = {key: v for key, v in rec.items() if key not in KNOBS and key not in DROPPED}
    metrics["buffer_config"] = {"max_tokens": buf.max_tokens, "max_topk": buf.max_topk, "num_blocks": buf.num_blocks,
                                "num_waiters": buf.num_waiters, "num_threads": buf.num_threads,
                                "programmatic_launch": buf.programmatic_launch, "buffer_bytes": buf.num_bytes}
    metrics["imbalance_factor"] = imbalance_factor
    return metrics


register(Study(name="low_latency", knobs=KNOBS, run=run, choices={"routing": ROUTING_KINDS}, needs_gpu=True,
               description="low-latency dispatch / combine on the GPU (strict or DeepEP's timing boundary)"))
