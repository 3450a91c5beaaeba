"""Study "reference": the NumPy reference dispatch + combine, timed on CPU.

The reference is a global oracle (it computes every rank from the inputs of
all ranks), so rank 0 computes the whole job of the R launched ranks and
the other ranks return ``{}`` at once and wait at the runner's
per-configuration synchronisation (which sleeps, leaving the CPU to rank 0).

Per configuration: the seeded routing of every rank
(``cupyep.routing.make(routing, seed, tokens_per_rank, experts, topk,
**routing_params)``, ``tokens_per_rank`` from
``cupyep.routing.imbalanced_tokens(seed, R, tokens, imbalance)``), tagged
BF16 rows (``cupyep.testing.payload_bf16``), then ``warmup`` untimed and
``iters`` timed repetitions of ``intranode_dispatch`` (BF16 rows carried as
uint16 bits, with weights) and ``intranode_combine`` of the received rows
(as float32) with per-row weights, the sum of each row's local top-k
weights. The combine is then checked against the direct computation
``x[t] * sum_j topk_weights[t, j]`` per source token (float64, rtol and
atol 1e-5); a mismatch raises ``AssertionError`` (recorded as "error").

Knobs (defaults): tokens=128 (per rank, the mean when imbalance > 1),
hidden=1024, topk=8, experts=64, routing="uniform", routing_params={}
(the kind's parameters and drop_fraction), imbalance=1.0, seed=0,
iters=5, warmup=1.

Metrics (rank 0): ``dispatch_us_{median,p10,p90,p99}``,
``combine_us_{...}``, ``total_us_{...}`` (float, microseconds over the
``iters`` repetitions); ``recv_tokens`` (int, rows received over all ranks);
``recv_bytes`` (int, their BF16 bytes); ``imbalance_factor`` (float,
``cupyep.routing.imbalance_factor``); ``combine_max_abs_err`` (float);
``backend`` ("numpy-reference").
"""
from __future__ import annotations

import time

import numpy as np

from ... import reference, routing
from ...testing import bf16_to_f32, payload_bf16
from .studies import Skip, Study, register
from ...routing import KINDS as ROUTING_KINDS

KNOBS = {"tokens": 128, "hidden": 1024, "topk": 8, "experts": 64, "routing": "uniform",
         "routing_params": {}, "imbalance": 1.0, "seed": 0, "iters": 5, "warmup": 1}
PERCENTILES = {"median": 50, "p10": 10, "p90": 90, "p99": 99}
TOLERANCE = 1e-5


def summarize(name: str, seconds) -> dict:
    """``{name}_us_{median,p10,p90,p99}`` of a list of durations in seconds."""
    us = np.asarray(seconds, dtype=np.float64) * 1e6
    return {f"{name}_us_{label}": float(np.percentile(us, q)) for label, q in PERCENTILES.items()}


def check_combine(combined, x_bits, topk_weights) -> float:
    """Largest |combined - x * sum(weights)| over every rank; AssertionError
    when a token is off by more than the tolerance."""
    worst = 0.0
    for src, (got, bits, w) in enumerate(zip(combined, x_bits, topk_weights)):
        want = bf16_to_f32(bits).astype(np.float64) * w.astype(np.float64).sum(axis=1, keepdims=True)
        err = np.abs(got.astype(np.float64) - want)
        worst = max(worst, float(err.max(initial=0.0)))
        bad = err > TOLERANCE + TOLERANCE * np.abs(want)
        if bad.any():
            t, h = np.argwhere(bad)[0]
            raise AssertionError(f"combine of rank {src} token {t} column {h} is {got[t, h]!r}, "
                                 f"expected {want[t, h]!r} (|error| up to {worst:.3g})")
    return worst


def run(group, config: dict) -> dict:
    """Rank 0: time and check the reference on ``group.world_size`` ranks;
    other ranks: ``{}``."""
    if group.rank != 0:
        return {}
    num_ranks = group.world_size
    iters, warmup = config["iters"], config["warmup"]
    if not (isinstance(iters, int) and iters >= 1 and isinstance(warmup, int) and warmup >= 0):
        raise Skip(f"iters must be an int >= 1 and warmup an int >= 0, got {iters!r} and {warmup!r}")
    if not (isinstance(config["hidden"], int) and config["hidden"] >= 1):
        raise Skip(f"hidden must be an int >= 1, got {config['hidden']!r}")
    if not isinstance(config["routing_params"], dict):
        raise Skip(f"routing_params must be a dict, got {config['routing_params']!r}")
    seed, experts = config["seed"], config["experts"]
    tokens = routing.imbalanced_tokens(seed, num_ranks, config["tokens"], config["imbalance"])
    idx, weights = routing.make(config["routing"], seed, tokens, experts, config["topk"],
                                **config["routing_params"])
    x = [payload_bf16(r, np.arange(t), config["hidden"]) for r, t in enumerate(tokens)]

    dispatch_s, combine_s = [], []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        res = reference.intranode_dispatch(x, idx, experts, topk_weights=weights)
        t1 = time.perf_counter()
        y = [bf16_to_f32(r.recv_x) for r in res]  # identity experts, outside the timing
        row_w = [r.recv_topk_weights.sum(axis=1, dtype=np.float32) for r in res]
        t2 = time.perf_counter()
        combined = reference.intranode_combine(y, res, tokens, weights=row_w)
        t3 = time.perf_counter()
        if i >= warmup:
            dispatch_s.append(t1 - t0)
            combine_s.append(t3 - t2)
    err = check_combine(combined, x, weights)
    recv_tokens = sum(r.num_recv_tokens for r in res)
    return {**summarize("dispatch", dispatch_s), **summarize("combine", combine_s),
            **summarize("total", np.add(dispatch_s, combine_s)),
            "recv_tokens": int(recv_tokens), "recv_bytes": int(sum(r.recv_x.nbytes for r in res)),
            "imbalance_factor": routing.imbalance_factor(idx, experts),
            "combine_max_abs_err": err, "backend": "numpy-reference"}


STUDY = register(Study(name="reference", knobs=KNOBS, run=run, choices={"routing": ROUTING_KINDS}, needs_gpu=False,
                       description="NumPy reference dispatch + combine of all ranks, timed on rank 0 (CPU)"))
