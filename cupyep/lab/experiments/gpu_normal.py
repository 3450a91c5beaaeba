"""The "normal" study: normal-mode dispatch and combine on the GPU, one
configuration of knobs at a time (cupyep.lab.bench.normal.measure).

Knobs (defaults: the benchmark's shape, the library's default configs):

- ``transport``: "queue" or "direct"; ``kind``: one of
  cupyep.lab.bench.normal.KINDS (+ DIRECT_KINDS on the direct transport);
- ``timing``: "strict" or "deepep"; ``iters``: timed calls;
- shape: ``tokens`` (per rank), ``hidden``, ``topk``, ``experts``;
- routing: ``routing`` (a cupyep.routing kind), ``routing_params`` (its
  parameters, and ``drop_fraction``), ``seed``;
- the queue transport's config: ``num_sms``, ``queue_depth``,
  ``chunk_size``, ``num_threads``, ``l2_hints`` (0 / -1: the tuned default);
  the direct transport's: ``num_sms``, ``num_threads`` and ``fused``.

Metrics: the record of cupyep.lab.bench.normal.measure without its knob-like
fields ("time_us" and p10/p90/p99, "rank_GBps", "efficiency" against the
copy bandwidth measured once per sweep, "copy_GBps", the configs used),
"imbalance_factor" of the routing, and for the kinds that run the notify
pass (NOTIFY_KINDS) its device time over 10 more, untimed calls:
"notify_us_p50", "notify_us_p99", "notify_us_max" (cupyep.lab.metrics); for the
dispatch kinds of the queue transport the rings' occupancy over 10 more:
"queue_occupancy_mean" and "queue_occupancy_max" (rows waiting when a
receiver polls, over the queue depth). The Buffer, the barrier and the copy
bandwidth are kept between configurations (a larger buffer replaces the
Buffer when a configuration needs one).
"""
from __future__ import annotations

from dataclasses import replace

from .studies import Skip, Study, gpu_fixtures, register
from ...routing import KINDS as ROUTING_KINDS

KNOBS = {"transport": "queue", "kind": "dispatch_bf16", "timing": "strict", "tokens": 4096, "hidden": 7168,
         "topk": 8, "experts": 256, "routing": "uniform", "routing_params": {}, "seed": 0, "num_sms": 0,
         "queue_depth": 0, "chunk_size": 0, "num_threads": 0, "l2_hints": -1, "fused": True, "iters": 20}
QUEUE_ONLY = ("queue_depth", "chunk_size", "l2_hints")
# Kinds whose call runs the notify pass: their records also carry its device time (cupyep.lab.metrics).
NOTIFY_KINDS = ("dispatch_bf16_notify", "dispatch_bf16_notify_unfused", "dispatch_bf16_expert_major",
                "dispatch_bf16_expert_major_unfused")

_state: dict = {}


def _resources(group, nbytes: int, tokens: int, hidden: int, topk: int):
    """(Buffer of at least ``nbytes`` made for at least these sizes, GpuBarrier,
    copy bytes/s), kept across configurations."""
    import cupyep
    from ...sizes import DeclaredSizes
    barrier, copy_bw = gpu_fixtures(group, _state)
    buf = _state.get("buffer")
    want = DeclaredSizes(max(tokens, DeclaredSizes.max_tokens), max(hidden, DeclaredSizes.hidden),
                         max(topk, DeclaredSizes.num_topk))
    if buf is None or buf.buffer.nbytes < nbytes or any(getattr(buf.sizes, f) < getattr(want, f)
                                                        for f in ("max_tokens", "hidden", "num_topk")):
        if buf is not None:
            buf.destroy()
        _state["buffer"] = buf = cupyep.Buffer(group, nbytes, max_tokens=want.max_tokens, hidden=want.hidden,
                                               num_topk=want.num_topk)
    return buf, barrier, copy_bw


def _configs(buf, cfg: dict):
    """(dispatch config, combine config) of the configuration's knobs."""
    from ...normal.direct_kernels import DirectConfig
    if cfg["transport"] == "direct":
        if any(cfg[k] not in (0, -1) for k in QUEUE_ONLY):
            raise Skip(f"{', '.join(QUEUE_ONLY)} are knobs of the queue transport")
        d = DirectConfig(num_sms=cfg["num_sms"], fused=bool(cfg["fused"]))
        if cfg["num_threads"]:
            d = replace(d, num_threads=cfg["num_threads"])
        return d, None
    if not cfg["fused"]:
        raise Skip("fused=false is a knob of the direct transport (the queue's notify is its own launch)")
    out = []
    for base in (buf.default_dispatch_config(fp8=cfg["kind"] == "dispatch_fp8"), buf.default_combine_config()):
        over = {k: cfg[k] for k in ("num_sms", "queue_depth", "chunk_size", "num_threads") if cfg[k]}
        if cfg["l2_hints"] >= 0:
            over["l2_hints"] = cfg["l2_hints"]
        out.append(replace(base, **over))
    return tuple(out)


def run(group, cfg: dict) -> dict:
    """Measure one configuration (collective); see the module docstring."""
    import cupy
    import numpy as np

    import cupyep
    from ... import routing
    from ..bench.normal import DIRECT_KINDS, KINDS, measure
    from ...fp8 import per_token_cast_to_fp8
    from ...normal import Config
    from ...testing import payload_bf16
    if cfg["transport"] not in ("queue", "direct"):
        raise Skip(f"transport must be 'queue' or 'direct', got {cfg['transport']!r}")
    if cfg["kind"] not in KINDS + DIRECT_KINDS:
        raise Skip(f"kind must be one of {KINDS + DIRECT_KINDS}, got {cfg['kind']!r}")
    if cfg["kind"] in DIRECT_KINDS and cfg["transport"] != "direct":
        raise Skip(f"{cfg['kind']} needs the direct transport")
    R, me = group.local_size, group.local_rank
    T, H, k, E = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"]
    params = dict(cfg["routing_params"])
    idx, w = routing.make(cfg["routing"], cfg["seed"], [T] * R, E, k, **params)
    biggest = Config(num_sms=max(48, cfg["num_sms"] or 0), queue_depth=max(128, cfg["queue_depth"] or 0))
    buf, bar, copy_bw = _resources(group, cupyep.Buffer.size_hint(R, H, max(k, 16), biggest, biggest), T, H, k)
    dcfg, ccfg = _configs(buf, cfg)
    x = cupy.asarray(payload_bf16(me, np.arange(T), H))
    x_fp8 = per_token_cast_to_fp8(x) if cfg["kind"] == "dispatch_fp8" else None
    rec = measure(group, buf, bar, cfg["kind"], x, x_fp8, cupy.asarray(idx[me]), cupy.asarray(w[me]), E, dcfg,
                  ccfg, cfg["transport"], cfg["timing"], cfg["iters"], copy_bw)
    metrics = {key: v for key, v in rec.items() if key not in KNOBS and key not in ("bench", "ranks")}
    metrics["measured_kind"] = rec["kind"]
    metrics["imbalance_factor"] = routing.imbalance_factor(idx, E)
    if cfg["kind"] in NOTIFY_KINDS:  # untimed calls after the timed ones, with the notify pass's own clock
        from ...metrics import normal_metrics
        ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
        ncfg = replace(dcfg, fused=False) if cfg["kind"].endswith("_unfused") else dcfg
        metrics.update(normal_metrics(group, lambda notify_time_ns: buf.dispatch(
            x, ids, ws, num_experts=E, config=ncfg, transport=cfg["transport"], validate=False,
            expert_major="expert_major" in cfg["kind"], notify_time_ns=notify_time_ns)))
    if cfg["transport"] == "queue" and cfg["kind"].startswith("dispatch"):  # untimed, the rings' occupancy
        from ...metrics import queue_metrics
        ids = cupy.asarray(idx[me])
        payload = x_fp8 if x_fp8 is not None else x
        metrics.update(queue_metrics(group, lambda queue_occupancy: buf.dispatch(
            payload, ids, num_experts=E, config=dcfg, validate=False, queue_occupancy=queue_occupancy),
            dcfg.queue_depth))
    return metrics


register(Study(name="normal", knobs=KNOBS, run=run, choices={"routing": ROUTING_KINDS}, needs_gpu=True,
               description="normal-mode dispatch / combine on the GPU (queue or direct transport)"))
