"""A trace-driven simulator of expert load balance at 64-1024 ranks (NumPy
only, no GPU): per step and layer, the logical expert loads of a routing
trace go through each balancing arm's placement to per-rank work, and a cost
model calibrated on the measured 8-rank runs turns the work into time.

    python -m cupyep.lab.balance_sim --records FILE.jsonl --ranks 64 128 256 512 1024 \\
        --gpus-per-node 8 --out results/balance_sim/sim.jsonl

**Traces** (:func:`trace_loads`, :func:`expected_loads`). At scale the
token-level routing of cupyep.routing (T tokens on each of R ranks, each
token's k distinct experts) is too large to materialise, so the simulator
draws each step's per-expert counts directly from the same popularity model.
Over N = R T tokens a token holds expert e with an inclusion probability
pi_e (sum_e pi_e = k), independently of the other tokens, so the token
model's count of expert e is Binomial(N, pi_e); the simulator draws exactly
that marginal, independently per expert (the token model's counts also sum
to exactly N k, which the independent draws hold only in expectation, with a
relative spread of about 1 / sqrt(N k)).

- ``"zipf"`` (``s``): popularity p_e ~ 1 / (rank_e + 1) ** s over the same
  seeded order of the experts as cupyep.routing; a token's k draws without
  replacement, each in proportion to popularity, hold expert e with
  probability pi_e (:func:`inclusion_probabilities`, exact up to quadrature,
  not the with-replacement k p_e);
- ``"hot_expert"`` (``hot_fraction``, ``hot_expert``): round(hot_fraction N)
  tokens hold the hot expert, exactly as in cupyep.routing; every other
  expert is held by a hot token with probability (k - 1) / (E - 1) and by a
  cold token with probability k / (E - 1);
- ``"drift"`` (``s``, ``period``): ``"zipf"`` whose order of the experts is
  cupyep.routing's order of epoch ``step // period``, so the hot set moves
  every ``period`` steps.

Layer l of a trace follows ``routing.make(kind, seed + l, ...)``: its own
order of the experts, the same hot expert. The mean per-expert loads
(:func:`expected_loads`) are routing.make's expected counts for the same
arguments; tests/test_balance_sim.py holds each routed count within 4.5
standard deviations of them.

**Arms** (:data:`ARMS`, :func:`simulate`), each a placement per layer and step
whose per-GPU pairs are ``Placement.gpu_loads`` (an expert's load split
evenly over its replicas):

- ``"none"``: ``Placement.identity``, E / R experts per rank, no replicas;
- ``"eplb"``: ``rebalance_experts`` (hierarchical across the nodes) with
  ``redundant`` extra slots per GPU, planned every ``period`` steps from an
  exponential moving average of the past steps' loads (history only, never
  the current step; before the first plan, a placement planned from equal
  loads);
- ``"migration"``: an ``OnlineBalancer`` (imbalance alarm, exponential
  moving average, ``MigrationPolicy`` on the cost model's per-pair time and
  copy bandwidth) fed each step's loads after the step, which is when it
  plans; it moves only when the move pays, during the next step;
- ``"per_step"``: from the current step's own loads before the step runs
  (the loads the layout pass has), as cupyep.balance.LayerBalancer does:
  the placement stays while it holds them within max over mean
  ``tolerance``; else a plan, moved to when it beats the placement
  (cupyep.balance.per_step_decision, the same code). ``tolerance`` 0 plans
  and moves every step.

Every plan is aligned to the current placement (``migration.align``) and
its moves planned (``migration.plan_moves``). As in the GPU study
(experiments/study_balance.py), eplb's and migration's moves run during a
step (started before it, finished after it), which still runs on the old
placement; the new one serves from the next step. per_step's move finishes
before its step runs. A balancing arm pays a fixed overhead every step
(counting and exchanging the loads), a plan's cost in a step that plans,
and in a step that moves its busiest rank's moved bytes (pulled or served)
over the copy bandwidth, times 1 - ``overlap``; a layer's first move also
pays a one-off setup (the expert store's creation, which registers the
layer's weights).

**Costs** (:class:`CostModel`). Per rank r, with p_r its (row, expert) pairs
and w_r the rows it receives: ffn = a + b p_r, dispatch = c + d w_r, combine
= c' + d' w_r, each a rank's own work (:meth:`CostModel.fit` takes the
waits out of the measured times: a rank's dispatch waits for the last
sender, its combine for the last rank's FFN). The straggler is the rank
whose dispatch + ffn ends last; the layer's time is its dispatch + ffn +
combine, plus the step's balancing cost, the arm's replica choice
(``map_us``: logical to physical ids, about 1 ms per step on the measured
runs for every arm with a placement, 15 us without) and a constant rest.
Every cost is >= 0: the fit is non-negative least squares (:func:`nnls`),
and a coefficient the bound holds at 0 is named in ``fit_error``. The rows
come from the pairs (:func:`rows_from_slot_pairs`): a token visits rank r
once if any of its slots lands there. With x_j the share of the N tokens
that physical expert j on rank r serves, independent slots would give w_r =
N (1 - prod_j (1 - x_j)); a token's k experts are distinct, which a factor
for drawing without replacement corrects (exact for equal loads, where w_r
= p_r D / k with D = R (1 - prod_{i<k} (1 - (E / R) / (E - i))) the
expected number of ranks a token visits, the distinct-rank factor of top-k;
within 2.5 % of the token-level rows under Zipf (s <= 1.2) and hot-expert
loads, 4 % at Zipf s = 2, with and without replicas).

**What grows with R.** With T tokens per rank, k slots per token and E =
experts_per_rank * R, the mean pairs per rank stay T k; what grows is
- the straggler's work: the rank holding a hot expert gets about
  hot_fraction R T pairs (a Zipf head's rank, its share of R T k), so
  without balancing its FFN (b per pair), dispatch and combine (d, d' per
  row, up to R T rows) grow in proportion to R: at 1024 ranks a hot expert
  of half the tokens puts 2.1 M pairs on one rank, about 1.7 s of FFN at
  the measured 0.78 us per pair;
- a plan: its cost grows with the experts planned, plan_us (E /
  plan_experts) ** plan_exponent (:meth:`CostModel.plan_cost`; plan_us
  measured at the records' E). cupyep.balance's host planner
  (rebalance_experts, align, plan_moves) grows about in proportion to E
  (exponent 1, the default): per_step's plan and eplb's and migration's
  are the measured 8-rank plan times E / 64 at R ranks;
- a move's busiest rank: a rank pulls at most its slots (experts_per_rank +
  redundant), but plan_moves serves every new replica of an expert from a
  holder, so the rank serving a hot expert's new replicas serves more of
  them as R grows (the moved bytes are simulated, not assumed).

What is held at its 8-rank value: the per-step overhead (the load count
and exchange: an all-reduce of E counts, 64 KiB at E = 8192, whose
latency at 1024 ranks (log2 R = 10 hops of a tree) is tens of
microseconds, below the measured overhead's error), the replica choice
(per token, O(T k)), the copy bandwidth (the measured effective one, about
31 GB/s with the copies' launch costs, near a 400 Gb/s NIC's 50 GB/s for a
move across nodes), the first-move setup (one-off, left out of the
steady-state means) and the per-row costs (a row crossing nodes costs what
a measured row on one GPU cost). The simulated times are the measured
costs applied to the per-rank work at R ranks, not a model of a network.

**Records** (:func:`read_records`): the balance study's JSONL, one line per
(trace, arm, step, layer) with "logical_loads", "pairs_per_rank",
"rows_per_rank", "us" (per rank "dispatch", "ffn", "combine", and optionally
"balance" and "map"), "layer_us", "planned", "moved_experts", "moved_bytes",
"moved_bytes_per_rank", "expert_bytes". :meth:`CostModel.fit` calibrates the
model on them, :func:`validate` re-simulates them (from the routing's own
warm-up steps where cupyep.routing regenerates them), and
:func:`synthetic_records` writes records of a known model, timed as the GPU
study times them.

**Where an arm stops paying** (:func:`study`, :func:`sweep`,
:func:`break_even`): per rank count, trace and arm the mean imbalance,
layer time and balancing cost (steady state: the first-move setup reported
apart) and the speed-up over ``"none"``; the expert size above which an
arm's balancing cost exceeds its straggler saving, and the drift period
below which it does.
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from ..balance import OnlineBalancer, MigrationPolicy, Placement, align, per_step_decision, plan_moves, rebalance_experts

TRACES = ("zipf", "hot_expert", "drift")
ARMS = ("none", "eplb", "migration", "per_step")
TRACE_PARAMS = {"zipf": {"s": 1.0}, "hot_expert": {"hot_fraction": 0.5, "hot_expert": 0},
                "drift": {"s": 1.0, "period": 8}}
# cupyep.routing's seeded streams of the expert order (zipf: [seed, 10]; drift: [seed, 10, 14, epoch]).
_ORDER_STREAM, _DRIFT_STREAM = 10, 14
# The simulator's own stream of per-step counts: [seed + layer, 20, step].
_COUNTS_STREAM = 20
# Quadrature of the inclusion probabilities: points per decade of time, the
# chance of fewer than k arrivals left past the last point.
_POINTS_PER_DECADE = 64
_TAIL = 1e-13


# ----------------------------------------------------------------- traces ---

def _int(name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _trace_params(kind: str, params: dict) -> dict:
    if kind not in TRACES:
        raise ValueError(f"kind must be one of {TRACES}, got {kind!r}")
    unknown = sorted(set(params) - set(TRACE_PARAMS[kind]) - {"step"})
    if unknown:
        raise ValueError(f"params: kind {kind!r} takes no {unknown}; it takes {sorted(TRACE_PARAMS[kind])}")
    out = {**TRACE_PARAMS[kind], **{k: v for k, v in params.items() if k != "step"}}
    if "s" in out and not (isinstance(out["s"], (int, float, np.number)) and math.isfinite(out["s"]) and out["s"] >= 0):
        raise ValueError(f"s must be finite and >= 0, got {out['s']!r}")
    if "period" in out:
        out["period"] = _int("period", out["period"], 1)
    if kind == "hot_expert":
        h = out["hot_fraction"]
        if not (isinstance(h, (int, float, np.number)) and 0 <= h <= 1):
            raise ValueError(f"hot_fraction must be in [0, 1], got {h!r}")
        out["hot_expert"] = _int("hot_expert", out["hot_expert"])
    return out


def inclusion_probabilities(weights, num_topk: int) -> np.ndarray:
    """The chance that a token's ``num_topk`` draws without replacement, each
    in proportion to ``weights`` among the experts left (cupyep.routing's
    Gumbel top-k), hold each expert.

    Exact up to quadrature: drawing in proportion to p without replacement
    is an exponential race (expert e arrives at time X_e ~ Exp(p_e)), so
    pi_e = integral over t of p_e exp(-p_e t) P(fewer than k others arrived
    by t); the count of the others is Poisson-binomial (prefix and suffix
    sums over the experts), the integral a trapezoid rule in log t.

    Arguments:
        weights: [E] non-negative numbers, at least ``num_topk`` of them > 0.
        num_topk: k >= 1.

    Returns:
        [E] float64 in [0, 1], summing to k (1 everywhere when k >= E).
    """
    p = np.asarray(weights, dtype=np.float64).reshape(-1)
    k = _int("num_topk", num_topk, 1)
    if not np.isfinite(p).all() or (p < 0).any() or (p > 0).sum() < min(k, p.size):
        raise ValueError(f"weights must be finite, >= 0 and > 0 for at least num_topk={k} experts")
    if k >= p.size:
        return np.ones(p.size)
    live = np.flatnonzero(p > 0)
    p_live = p[live] / p[live].sum()
    out = np.zeros(p.size)
    out[live] = _race(p_live, k)
    return out * (k / out.sum())


def _poisson_binomial_below(q: np.ndarray, k: int) -> np.ndarray:
    """[..., k]: P(count = m) for m < k of independent Bernoulli(q[..., j])."""
    dist = np.zeros(q.shape[:-1] + (k,))
    dist[..., 0] = 1.0
    for j in range(q.shape[-1]):
        qj = q[..., j:j + 1]
        dist[..., 1:] = dist[..., 1:] * (1 - qj) + dist[..., :-1] * qj
        dist[..., :1] *= 1 - qj
    return dist


def _race(p: np.ndarray, k: int) -> np.ndarray:
    E = p.size
    # where the race is over: fewer than k arrivals left with chance < _TAIL
    coarse = 10.0 ** np.arange(-9, 31, 0.5)
    below = _poisson_binomial_below(-np.expm1(-np.outer(coarse, p)), k).sum(-1)
    over = np.flatnonzero(below < _TAIL)
    t_hi = coarse[over[0]] if over.size else coarse[-1]
    t_lo = 1e-6
    u = np.linspace(math.log(t_lo), math.log(t_hi), int(math.log10(t_hi / t_lo) * _POINTS_PER_DECADE) + 2)
    t = np.exp(u)
    w = np.full(u.size, u[1] - u[0])
    w[[0, -1]] /= 2
    pi = -np.expm1(-p * t_lo)  # before t_lo nothing else has arrived
    chunk = max(1, int(32e6 // (E * k * 8)))
    for s in range(0, t.size, chunk):
        tc = t[s:s + chunk]
        q = -np.expm1(-np.outer(tc, p))  # [c, E]: arrived by t
        prefix = np.empty((tc.size, E, k))  # over experts < i
        dist = np.zeros((tc.size, k))
        dist[:, 0] = 1.0
        for i in range(E):
            prefix[:, i] = dist
            qi = q[:, i:i + 1]
            dist[:, 1:] = dist[:, 1:] * (1 - qi) + dist[:, :-1] * qi
            dist[:, :1] *= 1 - qi
        others = np.empty((tc.size, E))  # P(fewer than k of the others by t)
        suffix = np.zeros((tc.size, k))
        suffix[:, 0] = 1.0
        for i in range(E - 1, -1, -1):
            below_k = np.cumsum(suffix, axis=1)[:, ::-1]  # [:, a]: P(suffix count <= k - 1 - a)
            others[:, i] = (prefix[:, i] * below_k).sum(1)
            qi = q[:, i:i + 1]
            suffix[:, 1:] = suffix[:, 1:] * (1 - qi) + suffix[:, :-1] * qi
            suffix[:, :1] *= 1 - qi
        dens = (tc[:, None] * p[None, :]) * np.exp(-np.outer(tc, p)) * others  # d(pi)/d(log t)
        pi += (w[s:s + chunk, None] * dens).sum(0)
    return np.clip(pi, 0.0, 1.0)


@functools.lru_cache(maxsize=64)
def _zipf_inclusion(num_experts: int, num_topk: int, s: float) -> np.ndarray:
    """[E] float64 inclusion probabilities of the Zipf popularity by rank (read-only)."""
    pi = inclusion_probabilities(1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** s, num_topk)
    pi.flags.writeable = False
    return pi


def expert_order(kind: str, seed: int, num_experts: int, step: int = 0, period: int = 8) -> np.ndarray:
    """cupyep.routing's seeded order of the experts: [E] int64, entry r the
    expert of popularity rank r ("zipf": one order; "drift": the order of
    epoch step // period)."""
    if kind not in ("zipf", "drift"):
        raise ValueError(f"kind must be 'zipf' or 'drift' (the kinds with an expert order), got {kind!r}")
    stream = [_int("seed", seed), _ORDER_STREAM]
    if kind == "drift":
        stream += [_DRIFT_STREAM, _int("step", step) // _int("period", period, 1)]
    return np.random.default_rng(stream).permutation(_int("num_experts", num_experts, 1)).astype(np.int64)


def inclusion(kind: str, seed: int, num_experts: int, num_topk: int, step: int = 0, **params) -> tuple:
    """Per expert, the chance that one token holds it, as (cold [E] float64,
    hot_tokens): for "zipf" and "drift" every token holds expert e with
    probability cold[e] and hot_tokens is None; for "hot_expert" cold is the
    chance for a token outside the hot fraction and hot_tokens the pair
    (hot expert, [E] float64 chance for a hot token)."""
    params = _trace_params(kind, params)
    E = _int("num_experts", num_experts, 1)
    k = _int("num_topk", num_topk, 1)
    if k > E:
        raise ValueError(f"num_topk ({k}) must be <= num_experts ({E})")
    if kind == "hot_expert":
        hot = params["hot_expert"]
        if hot >= E:
            raise ValueError(f"hot_expert ({hot}) must be in [0, num_experts={E})")
        if k == E:
            raise ValueError(f"hot_expert traces need num_topk ({k}) < num_experts ({E})")
        cold = np.full(E, k / (E - 1))
        cold[hot] = 0.0
        warm = np.full(E, (k - 1) / (E - 1))
        warm[hot] = 1.0
        return cold, (hot, warm)
    order = expert_order(kind, seed, E, step, params.get("period", 8))
    pi = np.empty(E)
    pi[order] = _zipf_inclusion(E, k, float(params["s"]))
    return pi, None


def expected_loads(kind: str, seed: int, num_tokens: int, num_experts: int, num_topk: int, step: int = 0,
                   **params) -> np.ndarray:
    """[E] float64: the mean (token, slot) pairs of each expert over
    ``num_tokens`` tokens (all ranks together) of ``routing.make(kind, seed,
    ..., step=step, **params)`` (the module docstring)."""
    N = _int("num_tokens", num_tokens)
    cold, hot = inclusion(kind, seed, num_experts, num_topk, step, **params)
    if hot is None:
        return N * cold
    num_hot = int(round(_trace_params(kind, params)["hot_fraction"] * N))
    return (N - num_hot) * cold + num_hot * hot[1]


def trace_loads(kind: str, seed: int, num_tokens: int, num_experts: int, num_topk: int, steps: int,
                layers: int = 1, **params) -> np.ndarray:
    """Per step and layer, the pairs each logical expert receives from
    ``num_tokens`` tokens (all ranks together), drawn as the module
    docstring says (layer l follows cupyep.routing's seed + l).

    Returns:
        [steps, layers, E] int64.
    """
    params = _trace_params(kind, params)
    N = _int("num_tokens", num_tokens)
    S, L = _int("steps", steps, 1), _int("layers", layers, 1)
    E = _int("num_experts", num_experts, 1)
    out = np.empty((S, L, E), dtype=np.int64)
    num_hot = int(round(params["hot_fraction"] * N)) if kind == "hot_expert" else 0
    for layer in range(L):
        for step in range(S):
            cold, hot = inclusion(kind, seed + layer, E, num_topk, step, **params)
            rng = np.random.default_rng([seed + layer, _COUNTS_STREAM, step])
            counts = rng.binomial(N - num_hot, cold)
            if hot is not None:
                counts += rng.binomial(num_hot, np.minimum(hot[1], 1.0))
            out[step, layer] = counts
    return out


def experts_for(ranks: int, experts_per_rank: int = 4, num_experts: int | None = None) -> int:
    """E at ``ranks`` ranks: ``num_experts`` when given (a multiple of
    ranks), else experts_per_rank * ranks."""
    R = _int("ranks", ranks, 1)
    if num_experts is not None:
        E = _int("num_experts", num_experts, 1)
        if E % R:
            raise ValueError(f"num_experts={E} is not a multiple of ranks={R}")
        return E
    return _int("experts_per_rank", experts_per_rank, 1) * R


# ---------------------------------------------------------------- costs ---

def rows_from_slot_pairs(slot_pairs, num_tokens, num_experts: int, num_topk: int) -> np.ndarray:
    """The rows each rank receives, from the pairs of its physical experts.

    Arguments:
        slot_pairs: [..., G, n] float64, the pairs of each of the n physical
            experts on each of the G ranks.
        num_tokens: N, the tokens of all ranks (a number, or an array that
            broadcasts against [...]).
        num_experts: E, the logical experts; num_topk: k.

    Returns:
        [..., G] float64: N (1 - c(f) prod_j (1 - x_j)), x_j = slot_pairs / N
        (the share of the tokens that slot j serves), f = sum_j x_j / k and
        c(f) = prod_{i<k} (1 - f E / (E - i)) / (1 - k / E) ** (f E), the
        ratio of drawing without and with replacement for f E equally loaded
        experts (the module docstring). Exact for equal loads; against the
        rows of cupyep.routing's tokens at 8 ranks, k = 8, E = 64 and 256,
        with and without replicas: within 2.5 % for Zipf s <= 1.2 and
        hot-expert loads, within 4 % for Zipf s = 2.
    """
    pairs = np.asarray(slot_pairs, dtype=np.float64)
    N = np.asarray(num_tokens, dtype=np.float64)[..., None, None]
    E, k = _int("num_experts", num_experts, 1), _int("num_topk", num_topk, 1)
    if (N <= 0).any():
        raise ValueError("num_tokens must be > 0")
    if pairs.ndim < 2 or (pairs < 0).any():
        raise ValueError(f"slot_pairs must be a [..., G, n] array >= 0, got shape {pairs.shape}")
    x = np.clip(pairs / N, 0.0, 1.0)
    log_miss = np.log1p(-np.minimum(x, 1 - 1e-15)).sum(-1)  # independent slots
    if k < E:
        fE = np.clip(x.sum(-1) / k, 0.0, 1.0) * E
        i = np.arange(k)
        without = np.log(np.clip(1.0 - fE[..., None] / (E - i), 1e-300, None)).sum(-1)
        log_miss = log_miss + without - fE * math.log1p(-k / E)
    else:
        log_miss = np.where(x.sum(-1) > 0, -np.inf, 0.0)
    return N[..., 0] * -np.expm1(np.minimum(log_miss, 0.0))


def nnls(A, b, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares: the x >= 0 that minimises |A x - b|
    (Lawson and Hanson's active-set method, NumPy only).

    Arguments:
        A: [m, n] finite numbers; b: [m] finite numbers.
        max_iter: outer iterations at most (default 3 n).

    Returns:
        [n] float64, every entry >= 0 (0 where the constraint binds).
    """
    A = np.asarray(A, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if A.ndim != 2 or b.shape != (A.shape[0],) or not np.isfinite(A).all() or not np.isfinite(b).all():
        raise ValueError(f"nnls needs a finite [m, n] A and [m] b, got shapes {A.shape} and {b.shape}")
    m, n = A.shape
    tol = 10 * max(m, n) * np.finfo(np.float64).eps * max(np.abs(A).sum(0).max(initial=0.0), 1.0) \
        * max(np.abs(b).max(initial=0.0), 1.0)
    free = np.zeros(n, dtype=bool)  # the passive set: entries solved without their bound
    x = np.zeros(n)
    for _ in range(3 * n if max_iter is None else max_iter):
        grad = A.T @ (b - A @ x)
        if free.all() or grad[~free].max() <= tol:
            break
        free[np.flatnonzero(~free)[np.argmax(grad[~free])]] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            bad = free & (z <= 0)
            step = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + step * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x


def _nnls_fit(A, y) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coefficients >= 0, their standard errors, residuals) of y ~ A x by
    :func:`nnls`; the errors are least squares' (sigma^2 (A^T A)^-1, sigma
    from the constrained residuals), a bound coefficient's included."""
    A, y = np.asarray(A, dtype=np.float64), np.asarray(y, dtype=np.float64)
    sol = nnls(A, y)
    resid = y - A @ sol
    dof = max(len(y) - A.shape[1], 1)
    cov = (resid @ resid / dof) * np.linalg.pinv(A.T @ A)
    return sol, np.sqrt(np.clip(np.diag(cov), 0.0, None)), resid


_NUMBERS = ("ffn_us", "ffn_us_per_pair", "dispatch_us", "dispatch_us_per_row", "combine_us", "combine_us_per_row",
            "copy_GBps", "plan_us", "other_us", "setup_us", "plan_exponent")


@dataclass(frozen=True)
class CostModel:
    """Per-rank work to time, in microseconds (the module docstring). Every
    cost is >= 0.

    Attributes:
        ffn_us, ffn_us_per_pair: a, b of the expert FFN, a + b * pairs.
        dispatch_us, dispatch_us_per_row: c, d of the dispatch, c + d * rows
            (its own work, not the wait for the slowest sender).
        combine_us, combine_us_per_row: c', d' of the combine (its own work,
            not the wait for the slowest rank's FFN).
        copy_GBps: the expert-weight copy bandwidth per rank, GB/s (> 0).
        plan_us: the cost of one plan (per layer, in the step that plans) at
            ``plan_experts`` experts.
        other_us: the rest of a layer's time, every step and arm (gaps
            between the phases, waits the parts do not hold).
        overhead_us: {arm: us} the balancing an arm does every step whether
            it plans or not (counting and exchanging the loads); 0 where
            absent.
        map_us: {arm: us} the replica choice (logical to physical expert
            ids) every step; 0 where absent.
        setup_us: the one-off cost of a layer's first move (the expert
            store's creation), paid in the step that first moves.
        plan_experts: E at which plan_us was measured; 0: plan_us at any E.
        plan_exponent: a plan at E experts costs plan_us * (E /
            plan_experts) ** plan_exponent (:meth:`plan_cost`).
        source: where the numbers come from ("fit on N records", or
            "placeholder": not a measurement).
        fit_error: the standard error of each fitted coefficient (same
            names and units; "overhead_us" and "map_us" dicts of them, None
            for a value given rather than fitted), the relative rms
            residual of each part ("rel_rms_ffn", ...), the coefficients
            the non-negativity bound holds at 0 ("at_bound") and the
            records used; None when not fitted.
    """
    ffn_us: float
    ffn_us_per_pair: float
    dispatch_us: float
    dispatch_us_per_row: float
    combine_us: float
    combine_us_per_row: float
    copy_GBps: float
    plan_us: float = 0.0
    other_us: float = 0.0
    overhead_us: dict = field(default_factory=dict)
    map_us: dict = field(default_factory=dict)
    setup_us: float = 0.0
    plan_experts: int = 0
    plan_exponent: float = 1.0
    source: str = "given"
    fit_error: dict | None = field(default=None, compare=False)

    def __post_init__(self):
        for name in _NUMBERS:
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float, np.number)) and math.isfinite(v)) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0 (a cost cannot be negative), got {v!r}")
        if self.copy_GBps <= 0:
            raise ValueError(f"copy_GBps must be > 0, got {self.copy_GBps}")
        _int("plan_experts", self.plan_experts)
        for name in ("overhead_us", "map_us"):
            d = getattr(self, name)
            if not isinstance(d, dict) or any(
                    k not in ARMS or isinstance(v, bool) or not (isinstance(v, (int, float, np.number))
                                                              and math.isfinite(v) and v >= 0)
                    for k, v in d.items()):
                raise ValueError(f"{name} must map arms of {ARMS} to finite numbers >= 0, got {d!r}")

    @classmethod
    def default(cls) -> "CostModel":
        """PLACEHOLDER values, not measurements: for tests and smoke runs
        only (about the size of one H200 rank's work at T = 4096, H = 7168;
        fit the model on measured records for any result)."""
        return cls(ffn_us=20.0, ffn_us_per_pair=0.02, dispatch_us=15.0, dispatch_us_per_row=0.08,
                   combine_us=15.0, combine_us_per_row=0.08, copy_GBps=100.0, plan_us=200.0, other_us=10.0,
                   overhead_us={"eplb": 20.0, "migration": 20.0, "per_step": 20.0},
                   map_us={"eplb": 5.0, "migration": 5.0, "per_step": 5.0}, setup_us=1000.0,
                   source="placeholder (CostModel.default): not a measurement")

    def ffn(self, pairs) -> np.ndarray:
        """FFN time, us, of ``pairs`` (any shape, float64 out)."""
        return self.ffn_us + self.ffn_us_per_pair * np.asarray(pairs, dtype=np.float64)

    def dispatch(self, rows) -> np.ndarray:
        """Dispatch time, us, of ``rows`` received (any shape)."""
        return self.dispatch_us + self.dispatch_us_per_row * np.asarray(rows, dtype=np.float64)

    def combine(self, rows) -> np.ndarray:
        """Combine time, us, of ``rows`` (any shape)."""
        return self.combine_us + self.combine_us_per_row * np.asarray(rows, dtype=np.float64)

    def migration(self, moved_bytes) -> np.ndarray:
        """Copy time, us, of ``moved_bytes`` (any shape) at copy_GBps."""
        return np.asarray(moved_bytes, dtype=np.float64) / (self.copy_GBps * 1e3)

    def plan_cost(self, num_experts: int | None = None) -> float:
        """One plan's cost, us, at ``num_experts`` experts: plan_us * (E /
        plan_experts) ** plan_exponent (plan_us when either is 0 or None)."""
        if not num_experts or not self.plan_experts:
            return float(self.plan_us)
        return float(self.plan_us * (_int("num_experts", num_experts, 1) / self.plan_experts) ** self.plan_exponent)

    def straggler(self, pairs, rows) -> np.ndarray:
        """[...] float64: the layer's critical path for ``pairs`` and
        ``rows`` [..., R]: the dispatch + ffn of the rank whose FFN ends
        last (the max over ranks) + that rank's combine."""
        pairs, rows = np.broadcast_arrays(np.asarray(pairs, dtype=np.float64), np.asarray(rows, dtype=np.float64))
        head = self.dispatch(rows) + self.ffn(pairs)
        last = head.argmax(-1)[..., None]
        return (np.take_along_axis(head, last, -1) + self.combine(np.take_along_axis(rows, last, -1)))[..., 0]

    def balance(self, arm: str, planned, moved_bytes, num_experts: int | None = None,
                first_move=False) -> np.ndarray:
        """Balancing time, us, of a step of ``arm``: overhead_us[arm] +
        :meth:`plan_cost` (num_experts) where ``planned`` (bool, any shape)
        + the copy of ``moved_bytes`` + setup_us where ``first_move`` (all
        broadcast together)."""
        return (self.overhead_us.get(arm, 0.0) + self.plan_cost(num_experts) * np.asarray(planned, dtype=np.float64)
                + self.migration(moved_bytes) + self.setup_us * np.asarray(first_move, dtype=np.float64))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def fit(cls, records, copy_GBps: float | None = None, plan_us: float | None = None,
            plan_exponent: float = 1.0) -> "CostModel":
        """Calibration on measured records (:func:`read_records`'s dicts, or
        raw ones) by non-negative least squares (:func:`nnls`: a cost is
        never negative; a coefficient the bound holds at 0 is listed in
        fit_error["at_bound"]), each coefficient with its standard error.
        A rank's measured dispatch waits for the slowest sender and its
        combine for the slowest rank's FFN (the straggler); the parts are
        fit on the rank's own work:

        - ffn on (1, pairs_per_rank), every rank of every record a point;
        - dispatch on (1, rows_per_rank): each rank's dispatch less its
          wait for the last sender to start, max over ranks of (balance +
          map) less its own (the balance's part after the layer counted as
          before it: it differs little between ranks);
        - combine on (1, rows_per_rank): the combine of the rank whose FFN
          ended last (balance + map + dispatch + ffn), which waits for no
          other rank's FFN, one point per record;
        - map_us per arm: the mean of the slowest rank's "map";
        - the balancing cost, each record's slowest rank's "balance" time,
          over the records that are not a layer's first move
          (:func:`_first_moves`): one overhead per arm, plan_us where a plan
          ran (the record's "planned"; without it: every per_step record
          and every record that moved experts) and the busiest rank's moved
          bytes (the max of "moved_bytes_per_rank" when given, else
          ceil(moved_experts / ranks) * expert_bytes), whose slope is 1 /
          copy_GBps. Where the plans cannot be told apart from the per_step
          records (a plan ran in exactly those), per_step's overhead is
          folded into plan_us. Records without two distinct moved sizes
          cannot fit the bandwidth: ``copy_GBps`` must be given (and
          ``plan_us`` where no record planned);
        - setup_us: the mean over the first-move records of their balance
          less the steady part above (0 when there are none; clipped at 0);
        - other_us: the median of layer_us - (the slowest rank's balance
          and map + the model's straggler on the record's pairs and rows),
          clipped at 0.

        plan_experts is the records' median E; ``plan_exponent`` is given,
        not fit (every record has one E).

        Returns a CostModel whose fit_error holds the standard errors and
        the relative rms residual of each part.
        """
        recs = [r if r.get("_normalized") else _normalize(r, i) for i, r in enumerate(records)]
        if not recs:
            raise ValueError("records: no record to fit")
        if isinstance(plan_exponent, bool) or not (isinstance(plan_exponent, (int, float)) and plan_exponent >= 0):
            raise ValueError(f"plan_exponent must be a number >= 0, got {plan_exponent!r}")
        coef, err, at_bound = {}, {}, []
        pairs = np.concatenate([r["pairs_per_rank"] for r in recs])
        ffn = np.concatenate([r["us"]["ffn"] for r in recs])
        rows = np.concatenate([r["rows_per_rank"] for r in recs])
        disp = np.concatenate([r["us"]["dispatch"] - _start_wait(r) for r in recs])
        last = [int(np.argmax(_start(r) + r["us"]["dispatch"] + r["us"]["ffn"])) for r in recs]
        comb_rows = np.array([r["rows_per_rank"][i] for r, i in zip(recs, last)])
        comb = np.array([r["us"]["combine"][i] for r, i in zip(recs, last)])
        for part, x, y, what in (("ffn", pairs, ffn, "pairs_per_rank"), ("dispatch", rows, disp, "rows_per_rank"),
                                 ("combine", comb_rows, comb, "rows_per_rank")):
            (c0, c1), (e0, e1), rel = _line(x, y, f"records' {part} times against {what}")
            unit = "pair" if part == "ffn" else "row"
            names = (f"{part}_us", f"{part}_us_per_{unit}")
            coef[names[0]], coef[names[1]] = c0, c1
            err[names[0]], err[names[1]], err[f"rel_rms_{part}"] = e0, e1, rel
            at_bound += [n for n, v in zip(names, (c0, c1)) if v == 0]
        coef["map_us"], err["map_us"] = {}, {}
        for arm in sorted({r["arm"] for r in recs}):
            m = np.array([r["us"]["map"].max() for r in recs if r["arm"] == arm])
            coef["map_us"][arm] = float(m.mean())
            err["map_us"][arm] = float(m.std(ddof=1) / math.sqrt(m.size)) if m.size > 1 else None
        first = _first_moves(recs)
        coef_b, err_b, steady = _fit_balance([r for r, f in zip(recs, first) if not f], copy_GBps, plan_us)
        coef.update(coef_b)
        err.update(err_b)
        at_bound += err_b.pop("at_bound")
        experts = int(np.median([r["experts"] for r in recs]))
        probe = cls(**{**coef, "other_us": 0.0, "setup_us": 0.0, "plan_experts": experts,
                       "plan_exponent": plan_exponent})
        extra = np.array([r["balance_us"] - steady(probe, r) for r, f in zip(recs, first) if f])
        coef["setup_us"] = float(max(extra.mean(), 0.0)) if extra.size else 0.0
        err["setup_us"] = float(extra.std(ddof=1) / math.sqrt(extra.size)) if extra.size > 1 else None
        err["setup_us_range"] = [float(extra.min()), float(extra.max())] if extra.size else None
        err["first_moves"] = int(extra.size)
        if extra.size and extra.mean() <= 0:
            at_bound.append("setup_us")
        rest = np.array([r["layer_us"] - r["balance_us"] - r["us"]["map"].max()
                         - float(probe.straggler(r["pairs_per_rank"], r["rows_per_rank"])) for r in recs])
        coef["other_us"] = float(max(np.median(rest), 0.0))
        if np.median(rest) < 0:
            at_bound.append("other_us")
        err["other_us"] = float(1.2533 * rest.std(ddof=1) / math.sqrt(rest.size)) if rest.size > 1 else None
        err["at_bound"] = at_bound
        err["records"] = len(recs)
        return cls(**coef, plan_experts=experts, plan_exponent=float(plan_exponent),
                   source=f"fit on {len(recs)} records", fit_error=err)


def _start(rec: dict) -> np.ndarray:
    """[R]: when each rank starts its dispatch, from the step's start (its
    balance + map; the balance's part after the layer counted as before)."""
    return rec["us"]["balance"] + rec["us"]["map"]


def _start_wait(rec: dict) -> np.ndarray:
    """[R]: each rank's wait in the dispatch for the last sender to start."""
    s = _start(rec)
    return np.minimum(s.max() - s, rec["us"]["dispatch"])


def _planned(rec: dict) -> bool:
    """Whether a plan ran for the record's step: its "planned" when given,
    else for every per_step record and wherever experts moved."""
    if rec.get("planned") is not None:
        return bool(rec["planned"])
    return rec["arm"] == "per_step" or rec["moved_experts"] > 0


def _moved_before(arm: str, first_step: int, period: int) -> bool:
    """Whether an arm's schedule moved weights before a run's first recorded
    step: per_step moves from step 0 on, eplb from step ``period`` on."""
    return (arm == "per_step" and first_step > 0) or (arm == "eplb" and first_step > period)


def _first_moves(recs: list[dict]) -> list[bool]:
    """Per record, whether it is its layer's first move in its run (the
    expert store's creation): a record's "first_move" when given, else the
    first record of the (run, layer) that moved experts, unless the arm's
    schedule moved before the run's first record (:func:`_moved_before`,
    eplb's period from the record's "arm_params", else 4)."""
    out = {}
    for run in _runs(recs):
        first_step = min(r["step"] for r in run)
        for layer in sorted({r["layer"] for r in run}):
            recs_l = sorted((r for r in run if r["layer"] == layer), key=lambda r: r["step"])
            period = int((recs_l[0].get("arm_params") or {}).get("period", 4))
            done = _moved_before(recs_l[0]["arm"], first_step, period)
            for r in recs_l:
                if r.get("first_move") is not None:
                    out[id(r)] = bool(r["first_move"])
                    done = done or out[id(r)]
                    continue
                out[id(r)] = not done and r["moved_experts"] > 0
                done = done or out[id(r)]
    return [out[id(r)] for r in recs]


def _fit_balance(recs: list[dict], copy_GBps, plan_us) -> tuple[dict, dict, callable]:
    """CostModel.fit's balancing part on the steady (not first-move)
    records: ({copy_GBps, plan_us, overhead_us}, their errors and
    "at_bound", steady(model, record) -> the record's predicted balance)."""
    if not recs:
        raise ValueError("records: every record is a first move; nothing to fit the balancing cost on")
    y = np.array([r["balance_us"] for r in recs], dtype=np.float64)
    moved = np.array([r["busiest_bytes"] for r in recs], dtype=np.float64)
    planned = np.array([_planned(r) for r in recs], dtype=np.float64)
    arms = sorted({r["arm"] for r in recs})
    names, cols = [], []
    for arm in arms:
        ind = np.array([r["arm"] == arm for r in recs], dtype=np.float64)
        if arm == "per_step" and plan_us is None and np.linalg.matrix_rank(np.stack(cols + [ind, planned], 1)) \
                < len(cols) + 2:
            continue  # planned is per_step's column plus others': its overhead is folded into plan_us
        names.append(("overhead", arm))
        cols.append(ind)
    fixed = {}
    if plan_us is not None:
        fixed["plan_us"] = float(plan_us)
        if fixed["plan_us"] < 0:
            raise ValueError(f"plan_us must be >= 0, got {plan_us}")
        y = y - fixed["plan_us"] * planned
    elif planned.any():
        names.append(("plan_us", None))
        cols.append(planned)
    else:
        raise ValueError("records: no record planned, so plan_us cannot be fit; pass plan_us=")
    fit_bw = np.unique(moved).size >= 2
    if fit_bw:
        names.append(("slope", None))
        cols.append(moved / 1e6)  # us per MB
    elif copy_GBps is None:
        raise ValueError("records: too few records with two distinct moved sizes to fit the copy bandwidth; "
                         "pass copy_GBps=")
    else:
        y = y - moved / (float(copy_GBps) * 1e3)
    A = np.stack(cols, axis=1)
    if np.linalg.matrix_rank(A) < A.shape[1] or len(y) <= A.shape[1]:
        raise ValueError(f"records: the balancing times cannot separate {[n for n, _ in names]}; "
                         "pass copy_GBps= and plan_us=")
    sol, se, resid = _nnls_fit(A, y)
    coef = {"overhead_us": {}, **fixed}
    err = {"overhead_us": {}, **{k: None for k in fixed}, "at_bound": []}
    for (name, arm), v, e in zip(names, sol, se):
        if name == "overhead":
            coef["overhead_us"][arm], err["overhead_us"][arm] = float(v), float(e)
            if v == 0:
                err["at_bound"].append(f"overhead_us[{arm}]")
        elif name == "plan_us":
            coef["plan_us"], err["plan_us"] = float(v), float(e)
            if v == 0:
                err["at_bound"].append("plan_us")
        else:
            if v <= 0:
                raise ValueError("records: the balancing time does not grow with the moved bytes; "
                                 "pass copy_GBps= instead of fitting it")
            coef["copy_GBps"], err["copy_GBps"] = float(1e3 / v), float(1e3 * e / v ** 2)  # v us per MB: 1e3 / v GB/s
    if not fit_bw:
        coef["copy_GBps"], err["copy_GBps"] = float(copy_GBps), None
    err["rel_rms_balance"] = float(np.sqrt(np.mean(resid ** 2)) / max(np.mean(np.abs(y)), 1e-300))

    def steady(model: "CostModel", rec: dict) -> float:
        return float(model.balance(rec["arm"], _planned(rec), rec["busiest_bytes"], rec["experts"]))
    return coef, err, steady


def _line(x, y, what: str):
    """Non-negative least squares y = c0 + c1 x: ((c0, c1) >= 0, (se0, se1),
    relative rms residual)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 3 or np.unique(x).size < 2:
        raise ValueError(f"records: the fit of {what} needs 3 or more points and 2 or more distinct x")
    sol, se, resid = _nnls_fit(np.stack([np.ones_like(x), x], axis=1), y)
    rel = float(np.sqrt(np.mean(resid ** 2)) / max(np.mean(np.abs(y)), 1e-300))
    return (float(sol[0]), float(sol[1])), (float(se[0]), float(se[1])), rel


# ------------------------------------------------------------------ arms ---

@dataclass(frozen=True)
class ArmConfig:
    """How the balancing arms plan (the module docstring).

    Attributes:
        redundant: extra physical slots per GPU (eplb, migration, per_step).
        period: eplb's steps between plans (it plans at steps s > 0 with
            s % period == 0).
        smoothing: the weight of the newest step in the exponential moving
            average of past loads that eplb and migration plan from, in (0, 1].
        alarm: migration's max over mean per-GPU load that wakes it.
        horizon_steps: steps a migration is expected to serve.
        overlap: the fraction of a move hidden behind compute, in [0, 1].
        groups_per_node: expert groups per node (the hierarchical policy
            keeps a group on one node); across nodes E must be a multiple
            of groups_per_node * nodes (on one node the groups change
            nothing and one group is planned).
        policy: "hierarchical" or "global" (across nodes; the same on one).
        tolerance: per_step keeps its placement while the step's per-GPU
            max over mean is at most this (>= 1); 0 plans and moves every
            step.

    The defaults match the GPU balance study's (experiments/study_balance.py).
    """
    redundant: int = 2
    period: int = 4
    smoothing: float = 0.5
    alarm: float = 1.1
    horizon_steps: int = 8
    overlap: float = 0.0
    groups_per_node: int = 4
    policy: str = "hierarchical"
    tolerance: float = 1.05

    def __post_init__(self):
        _int("redundant", self.redundant)
        _int("period", self.period, 1)
        _int("horizon_steps", self.horizon_steps, 1)
        _int("groups_per_node", self.groups_per_node, 1)
        if not (isinstance(self.alarm, (int, float)) and self.alarm >= 1.0):
            raise ValueError(f"alarm must be a number >= 1, got {self.alarm!r}")
        if not (isinstance(self.smoothing, (int, float)) and 0 < self.smoothing <= 1):
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")
        if not (isinstance(self.overlap, (int, float)) and 0 <= self.overlap <= 1):
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
        if not (isinstance(self.tolerance, (int, float)) and (self.tolerance == 0 or self.tolerance >= 1)):
            raise ValueError(f"tolerance must be 0 (every step) or >= 1, got {self.tolerance!r}")
        if self.policy not in ("hierarchical", "global"):
            raise ValueError(f"policy must be 'hierarchical' or 'global', got {self.policy!r}")

    @classmethod
    def from_dict(cls, d: dict | None, base: "ArmConfig | None" = None) -> "ArmConfig":
        """``base`` (default ArmConfig()) with the known keys of ``d`` (others ignored)."""
        base = base or cls()
        names = {f.name for f in fields(cls)}
        return replace(base, **{k: v for k, v in (d or {}).items() if k in names})


@dataclass
class SimResult:
    """One arm simulated over a trace: S steps, L layers, R ranks.

    Attributes:
        arm, ranks, nodes, num_experts, num_physical: the setting.
        pairs: [S, L, R] float64 (row, expert) pairs per rank.
        rows: [S, L, R] float64 rows received per rank.
        straggler_us: [S, L] float64, max over ranks of dispatch + ffn + combine.
        balance_us: [S, L] float64, overhead + plan + busiest rank's move
            (+ setup_us in a layer's first move).
        balance_rank_us: [S, L, R] float64, the same with each rank's move.
        setup_us: [S, L] float64, the one-off cost of the layer's first move
            (the model's setup_us there, else 0), included in balance_us.
        map_us: the replica choice per step (the model's map_us of the arm).
        layer_us: [S, L] float64, straggler_us + balance_us + map_us + the
            model's other_us.
        imbalance: [S, L] float64, max over mean of pairs.
        moved_experts: [S, L] int64, slots that changed expert.
        moved_rank: [S, L, R] int64, experts each rank pulls or serves (the larger).
        planned: [S, L] bool, a plan ran for this step (migration: the
            step after which its alarm rang; the move runs in the next step).
        first_move: [S, L] bool, the layer's first move.
        phy2log: [S, L, P] int64, the placement each step ran on.
    """
    arm: str
    ranks: int
    nodes: int
    num_experts: int
    num_physical: int
    expert_bytes: int
    pairs: np.ndarray
    rows: np.ndarray
    straggler_us: np.ndarray
    balance_us: np.ndarray
    balance_rank_us: np.ndarray
    layer_us: np.ndarray
    imbalance: np.ndarray
    moved_experts: np.ndarray
    moved_rank: np.ndarray
    planned: np.ndarray
    phy2log: np.ndarray
    setup_us: np.ndarray
    first_move: np.ndarray
    map_us: float = 0.0

    def steady_layer_us(self) -> np.ndarray:
        """[S, L] float64: layer_us less the one-off first-move setup."""
        return self.layer_us - self.setup_us

    def steady_balance_us(self) -> np.ndarray:
        """[S, L] float64: balance_us less the one-off first-move setup."""
        return self.balance_us - self.setup_us


def _moves(old: Placement, new: Placement) -> tuple[Placement, int, np.ndarray]:
    """(new aligned to old, slots that change, [R] experts each rank pulls or serves)."""
    new = align(old, new)
    return new, *_move_counts(plan_moves(old, new), old.num_gpus)


def _move_counts(moves, num_gpus: int) -> tuple[int, np.ndarray]:
    remote = [m for m in moves if m.src_rank != m.dst_rank]
    pulled = np.bincount([m.dst_rank for m in remote], minlength=num_gpus)
    served = np.bincount([m.src_rank for m in remote], minlength=num_gpus)
    return len(moves), np.maximum(pulled, served).astype(np.int64)


def simulate(loads, arm: str, ranks: int, gpus_per_node: int, model: CostModel, expert_bytes: int,
             tokens_per_rank: int, num_topk: int, config: ArmConfig | None = None, step_ids=None,
             moved_before: bool = False) -> SimResult:
    """Run one arm over a trace.

    Arguments:
        loads: [S, L, E] non-negative numbers, pairs per logical expert per
            step and layer (:func:`trace_loads`, or records' "logical_loads").
        arm: one of :data:`ARMS`.
        ranks: R (E a multiple of R); gpus_per_node: GPUs per node (R a
            multiple of it).
        model: the CostModel.
        expert_bytes: the weights of one expert, bytes.
        tokens_per_rank: T (N = R T tokens in all, for the rows).
        num_topk: k (for the docstring's rows; the loads carry the rest).
        config: ArmConfig (default ArmConfig()).
        step_ids: [S] increasing ints, the trace's step numbers (eplb's
            schedule; default 0 .. S - 1).
        moved_before: the layers' weights moved before the first step (no
            first-move setup is paid).

    Returns:
        SimResult.
    """
    loads = np.asarray(loads)
    if loads.ndim != 3 or not np.issubdtype(loads.dtype, np.number) or not np.isfinite(loads).all() \
            or (loads < 0).any() or 0 in loads.shape:
        raise ValueError(f"loads must be a non-empty [steps, layers, experts] array of finite numbers >= 0, "
                         f"got shape {loads.shape} {loads.dtype}")
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    R = _int("ranks", ranks, 1)
    gpn = _int("gpus_per_node", gpus_per_node, 1)
    if R % gpn:
        raise ValueError(f"ranks={R} is not a multiple of gpus_per_node={gpn}")
    if not isinstance(model, CostModel):
        raise ValueError(f"model must be a CostModel, got {type(model).__name__}")
    expert_bytes = _int("expert_bytes", expert_bytes)
    T = _int("tokens_per_rank", tokens_per_rank, 1)
    _int("num_topk", num_topk, 1)
    config = config or ArmConfig()
    S, L, E = loads.shape
    step_ids = np.arange(S) if step_ids is None else np.asarray(step_ids)
    if step_ids.shape != (S,) or not np.issubdtype(step_ids.dtype, np.integer) or (np.diff(step_ids) <= 0).any():
        raise ValueError(f"step_ids must be {S} increasing ints, got {step_ids!r}")
    if E % R:
        raise ValueError(f"loads has {E} experts, not a multiple of ranks={R}")
    nodes = R // gpn
    N = R * T
    w = loads.astype(np.float64)
    if arm == "none":
        start = Placement.identity(1, E, R, nodes)
    else:
        groups = config.groups_per_node * nodes if config.policy == "hierarchical" and nodes > 1 else 1
        if E % groups:
            raise ValueError(f"{E} experts do not split into groups_per_node={config.groups_per_node} x "
                             f"{nodes} nodes groups")
        P = E + config.redundant * R
        plan = functools.partial(rebalance_experts, num_replicas=P, num_groups=groups, num_nodes=nodes,
                                 num_gpus=R, policy=config.policy if nodes > 1 else None)
        start = plan(np.ones((1, E)))
    P = start.num_physical
    placements = [start] * L
    out = {name: np.zeros((S, L), dtype=dt) for name, dt in
           (("straggler_us", np.float64), ("balance_us", np.float64), ("layer_us", np.float64),
            ("imbalance", np.float64), ("moved_experts", np.int64), ("planned", bool))}
    pairs, rows = np.zeros((S, L, R)), np.zeros((S, L, R))
    moved_rank = np.zeros((S, L, R), dtype=np.int64)
    phy2log = np.zeros((S, L, P), dtype=np.int64)
    balancers, pending, average, floor = [None] * L, [None] * L, [None] * L, [1.0] * L
    first_move = np.zeros((S, L), dtype=bool)
    has_moved = [bool(moved_before)] * L
    if arm == "migration":
        mp = MigrationPolicy(bytes_per_expert=expert_bytes, copy_GBps=model.copy_GBps,
                             us_per_pair=max(model.ffn_us_per_pair, 0.0), horizon_steps=config.horizon_steps,
                             overlap=config.overlap)
        balancers = [OnlineBalancer(start, mp, num_groups=groups, alarm=config.alarm, smoothing=config.smoothing)
                     for _ in range(L)]
    for s in range(S):
        for layer in range(L):
            pl = placements[layer]  # the placement this step runs on
            nxt = None  # a move running during this step: its placement serves from the next step
            moved, per_rank, planned = 0, np.zeros(R, dtype=np.int64), False
            if arm == "eplb" and step_ids[s] > 0 and step_ids[s] % config.period == 0 and average[layer] is not None:
                nxt, moved, per_rank = _moves(pl, plan(average[layer][None]))
                planned = True
            elif arm == "per_step":  # moved before the step runs
                planned, new, floor[layer] = per_step_decision(pl, w[s, layer], lambda v: plan(v[None]),
                                                               config.tolerance, floor[layer])
                if new is not None:
                    pl, moved, per_rank = _moves(pl, new)
            elif arm == "migration" and pending[layer] is not None:
                nxt, moved, per_rank = pending[layer]
                pending[layer] = None
            if moved and not has_moved[layer]:
                first_move[s, layer] = has_moved[layer] = True
            placements[layer] = pl if nxt is None else nxt
            share = w[s, layer] / pl.logcnt[0]
            slot = share[pl.phy2log[0]].reshape(R, -1)
            pairs[s, layer] = pl.gpu_loads(w[s, layer][None])[0]
            rows[s, layer] = rows_from_slot_pairs(slot, N, E, num_topk)
            moved_rank[s, layer] = per_rank
            out["moved_experts"][s, layer] = moved
            phy2log[s, layer] = pl.phy2log[0]
            if arm == "eplb":  # the average of the steps so far, for the next plans
                a = config.smoothing
                average[layer] = w[s, layer] if average[layer] is None else a * w[s, layer] + (1 - a) * average[layer]
            if arm == "migration":  # planned after the step, from its loads; the move runs in the next step
                decision = balancers[layer].step(w[s, layer])
                planned = decision is not None
                if planned and decision["pays"]:
                    n, per = _move_counts(decision["moves"], R)
                    pending[layer] = (balancers[layer].placement, n, per)
            out["planned"][s, layer] = planned
    mean = pairs.mean(-1)
    out["imbalance"] = np.divide(pairs.max(-1), mean, out=np.ones_like(mean), where=mean > 0)
    balance_rank = model.balance(arm, out["planned"][..., None], moved_rank * expert_bytes * (1.0 - config.overlap),
                                 E, first_move[..., None])
    map_us = float(model.map_us.get(arm, 0.0))
    out["straggler_us"] = model.straggler(pairs, rows)
    out["balance_us"] = balance_rank.max(-1)
    out["layer_us"] = out["straggler_us"] + out["balance_us"] + map_us + model.other_us
    return SimResult(arm=arm, ranks=R, nodes=nodes, num_experts=E, num_physical=P, expert_bytes=expert_bytes,
                     pairs=pairs, rows=rows, balance_rank_us=balance_rank, moved_rank=moved_rank, phy2log=phy2log,
                     setup_us=model.setup_us * first_move, first_move=first_move, map_us=map_us, **out)


# --------------------------------------------------------------- records ---

_REQUIRED = ("arm", "step", "layer", "ranks", "logical_loads", "pairs_per_rank", "rows_per_rank", "us", "layer_us")


def _normalize(rec: dict, where) -> dict:
    """A record with every field the simulator reads, defaults filled in."""
    if not isinstance(rec, dict):
        raise ValueError(f"records[{where}] is not a JSON object")
    missing = [k for k in _REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"records[{where}] lacks {missing}")
    R = int(rec["ranks"])
    us = rec["us"] if isinstance(rec["us"], dict) else {}
    out = dict(rec)
    for key in ("pairs_per_rank", "rows_per_rank"):
        out[key] = np.asarray(rec[key], dtype=np.float64)
        if out[key].shape != (R,):
            raise ValueError(f"records[{where}]['{key}'] has shape {out[key].shape}, not ({R},)")
    norm_us = {}
    for part in ("dispatch", "ffn", "combine", "balance", "map"):
        v = us.get(part)
        if v is None:
            if part not in ("balance", "map"):
                raise ValueError(f"records[{where}]['us'] lacks '{part}'")
            v = [0.0] * R
        norm_us[part] = np.asarray(v, dtype=np.float64).reshape(-1)
        if norm_us[part].shape != (R,):
            raise ValueError(f"records[{where}]['us']['{part}'] has {norm_us[part].size} entries, not {R}")
    out["us"] = norm_us
    out["logical_loads"] = np.asarray(rec["logical_loads"], dtype=np.float64)
    E = int(rec.get("experts", out["logical_loads"].size))
    if out["logical_loads"].shape != (E,):
        raise ValueError(f"records[{where}]['logical_loads'] has {out['logical_loads'].size} entries, not {E}")
    out["experts"] = E
    out["ranks_per_node"] = int(rec.get("ranks_per_node") or R)
    out["physical_experts"] = int(rec.get("physical_experts") or E)
    out["tokens"] = int(rec.get("tokens") or 4096)
    out["topk"] = int(rec.get("topk") or 8)
    out["trace"] = rec.get("trace", "unknown")
    out["trace_params"] = rec.get("trace_params") or {}
    out["moved_experts"] = int(rec.get("moved_experts") or 0)
    out["expert_bytes"] = int(rec.get("expert_bytes") or 0)
    out["moved_bytes"] = int(rec.get("moved_bytes") or out["moved_experts"] * out["expert_bytes"])
    per_rank = rec.get("moved_bytes_per_rank")
    if per_rank is not None:
        out["busiest_bytes"] = float(np.max(per_rank)) if len(per_rank) else 0.0
    elif out["moved_experts"] and out["expert_bytes"]:
        out["busiest_bytes"] = float(math.ceil(out["moved_experts"] / R) * out["expert_bytes"])
    else:
        out["busiest_bytes"] = float(out["moved_bytes"]) / R
    out["balance_us"] = float(norm_us["balance"].max())
    out["layer_us"] = float(rec["layer_us"])
    out["_normalized"] = True
    return out


def read_records(source) -> list[dict]:
    """The measured records, leniently: ``source`` a JSONL path (or a list
    of paths, or of dicts); lines that are not JSON objects of study
    "balance" (when they name a study) are skipped, optional keys default
    (missing us.balance and us.map: 0; ranks_per_node: ranks; physical_experts:
    experts; moved_bytes: moved_experts * expert_bytes). Returns dicts with
    NumPy float64 arrays for the per-rank and per-expert lists."""
    items = []
    if isinstance(source, (str, os.PathLike)):
        source = [source]
    for src in source:
        if isinstance(src, dict):
            items.append(src)
            continue
        path = Path(src)
        if not path.is_file():
            raise ValueError(f"records: {path} is not a file")
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                items.append(rec)
    items = [r for r in items if r.get("study", "balance") == "balance"]
    return [_normalize(r, i) for i, r in enumerate(items)]


def _runs(records: list[dict]) -> list[list[dict]]:
    """The records grouped into runs: same setting, and a new run wherever a
    (step, layer) repeats in file order."""
    groups: dict = {}
    for r in records:
        key = (r["trace"], json.dumps(r["trace_params"], sort_keys=True), r["arm"], r["ranks"], r["ranks_per_node"],
               r["experts"], r["physical_experts"], r["topk"], r["tokens"], r.get("run"), r.get("seed"))
        runs = groups.setdefault(key, [[]])
        if any((x["step"], x["layer"]) == (r["step"], r["layer"]) for x in runs[-1]):
            runs.append([])
        runs[-1].append(r)
    return [run for runs in groups.values() for run in runs]


def history_loads(rec: dict, steps, layers) -> np.ndarray | None:
    """The logical loads of a run's ``steps`` before its first record (the
    GPU study's warm-up), regenerated from cupyep.routing: layer l as
    ``routing.make(trace, seed + l, [tokens] * ranks, experts, topk,
    step=s, **trace_params)`` with the record's "seed" (default 0). Used
    only when the same call gives the record's own "logical_loads" for its
    step and layer; else None.

    Returns:
        [len(steps), len(layers), E] int64, or None.
    """
    from .. import routing
    kind = rec["trace"]
    if kind not in routing.KINDS:
        return None
    seed = int(rec.get("seed") or 0)

    def counts(step, layer):
        idx, _ = routing.make(kind, seed + layer, [rec["tokens"]] * rec["ranks"], rec["experts"], rec["topk"],
                              step=step, **rec["trace_params"])
        flat = np.concatenate([i.ravel() for i in idx])
        return np.bincount(flat[flat >= 0], minlength=rec["experts"])
    try:
        if not np.array_equal(counts(rec["step"], rec["layer"]), rec["logical_loads"]):
            return None
    except (ValueError, TypeError):
        return None
    return np.array([[counts(s, l) for l in layers] for s in steps], dtype=np.int64).reshape(
        len(steps), len(layers), rec["experts"])


def validate(records, model: CostModel, config: ArmConfig | None = None, history: bool = True) -> dict:
    """Re-simulate the measured runs and compare the layer times.

    Each run (records of one setting: trace, arm, R, nodes, E, P, k, T) is
    simulated with its own step loads ("logical_loads", steps in increasing
    order taken as consecutive), its arm, R, nodes (ranks / ranks_per_node),
    redundant slots (P - E) / R, expert_bytes and tokens, and ``config``
    overridden by the records' "arm_params" where present. With ``history``
    the steps before the run's first record (the GPU study's warm-up: eplb's
    moving average and per_step's moves start at step 0) are simulated
    first, their loads from :func:`history_loads`; not for "migration",
    whose balancer the study makes at the end of the warm-up (at the first
    record). Where they cannot be regenerated, a run whose arm moved before
    its first record (:func:`_moved_before`) pays no first-move setup. Only
    the recorded steps are compared.

    Returns:
        {"runs_with_history": runs whose earlier steps were simulated,
        "arms": {arm: {"points", "median_rel_err", "worst_rel_err",
        "median_rel_err_cost", "worst_rel_err_cost", "first_moves",
        "steady_points", "median_rel_err_steady", "worst_rel_err_steady",
        "median_rel_err_cost_steady", "worst_rel_err_cost_steady"}},
        "points": [...]}: |predicted - measured| / measured of "layer_us"
        per (step, layer), over every step (the model's setup_us in a first
        move) and "_steady" over the steps that are neither a measured nor
        a simulated first move; "_cost" is the cost model alone, on the
        records' own pairs_per_rank, rows_per_rank, busiest moved bytes,
        "planned" and first moves (as CostModel.fit reads them).
        experiments/study_balance.py plans with one expert group (the
        global policy across nodes): validate its runs across nodes with
        ``config.policy = "global"``.
    """
    if not isinstance(model, CostModel):
        raise ValueError(f"model must be a CostModel, got {type(model).__name__}")
    recs = [r if r.get("_normalized") else _normalize(r, i) for i, r in enumerate(records)]
    if not recs:
        raise ValueError("records: nothing to validate")
    first = dict(zip(map(id, recs), _first_moves(recs)))
    points, with_history = [], 0
    for run in _runs(recs):
        first_rec = run[0]
        steps = sorted({r["step"] for r in run})
        layers = sorted({r["layer"] for r in run})
        at = {(r["step"], r["layer"]): r for r in run}
        missing = [(s, l) for s in steps for l in layers if (s, l) not in at]
        if missing:
            raise ValueError(f"records: run {first_rec['trace']}/{first_rec['arm']} at {first_rec['ranks']} ranks "
                             f"lacks (step, layer) {missing[:4]}")
        loads = np.stack([np.stack([at[s, l]["logical_loads"] for l in layers]) for s in steps])
        R, E, P = first_rec["ranks"], first_rec["experts"], first_rec["physical_experts"]
        if (P - E) % R:
            raise ValueError(f"records: physical_experts={P} - experts={E} is not a multiple of ranks={R}")
        cfg = ArmConfig.from_dict(first_rec.get("arm_params"), config)
        # per_step's rule: the record's tolerance, else its arm_params', else (records made before the
        # rule existed) every step
        tol = first_rec.get("tolerance") or (first_rec.get("arm_params") or {}).get("tolerance") or 0.0
        cfg = replace(cfg, redundant=(P - E) // R if first_rec["arm"] != "none" else cfg.redundant, tolerance=tol)
        before = list(range(steps[0]))
        past = history_loads(at[steps[0], layers[0]], before, layers) \
            if history and before and first_rec["arm"] != "migration" else None
        step_ids = np.array(steps, dtype=np.int64)
        if past is not None:
            loads, step_ids = np.concatenate([past, loads]), np.concatenate([before, step_ids])
        res = simulate(loads, first_rec["arm"], R, first_rec["ranks_per_node"], model, first_rec["expert_bytes"],
                       first_rec["tokens"], first_rec["topk"], cfg, step_ids=step_ids,
                       moved_before=past is None and _moved_before(first_rec["arm"], steps[0], cfg.period))
        skip = len(step_ids) - len(steps)
        with_history += past is not None
        for i, s in enumerate(steps, start=skip):
            for j, l in enumerate(layers):
                r = at[s, l]
                cost_only = float(model.straggler(r["pairs_per_rank"], r["rows_per_rank"])
                                  + model.balance(r["arm"], _planned(r), r["busiest_bytes"], r["experts"],
                                                  first[id(r)])
                                  + model.map_us.get(r["arm"], 0.0) + model.other_us)
                measured = r["layer_us"]
                points.append({"trace": first_rec["trace"], "arm": first_rec["arm"], "ranks": R, "step": s,
                               "layer": l, "measured_us": measured, "predicted_us": float(res.layer_us[i, j]),
                               "cost_only_us": cost_only, "first_move": first[id(r)],
                               "simulated_first_move": bool(res.first_move[i, j]),
                               "rel_err": abs(float(res.layer_us[i, j]) - measured) / measured,
                               "rel_err_cost": abs(cost_only - measured) / measured})
    arms = {}
    for arm in sorted({p["arm"] for p in points}):
        mine = [p for p in points if p["arm"] == arm]
        steady = [p for p in mine if not (p["first_move"] or p["simulated_first_move"])]
        v = {"points": len(mine), "first_moves": sum(p["first_move"] for p in mine), "steady_points": len(steady)}
        for suffix, pts in (("", mine), ("_steady", steady)):
            for kind in ("rel_err", "rel_err_cost"):
                e = np.array([p[kind] for p in pts])
                v[f"median_{kind}{suffix}"] = float(np.median(e)) if e.size else None
                v[f"worst_{kind}{suffix}"] = float(e.max()) if e.size else None
        arms[arm] = v
    return {"runs_with_history": with_history, "arms": arms, "points": points}


def synthetic_records(model: CostModel, ranks: int = 8, ranks_per_node: int = 8,
                      traces=(("hot_expert", {"hot_fraction": 0.3}), ("zipf", {"s": 1.2}),
                              ("drift", {"s": 1.2, "period": 4})),
                      arms=ARMS, steps: int = 12, layers: int = 2, tokens: int = 4096, hidden: int = 7168,
                      ffn: int = 256, experts: int = 64, topk: int = 8, expert_bytes: int | None = None,
                      config: ArmConfig | None = None, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Records in the balance study's format whose times are ``model``'s,
    for tests and smoke runs (not measurements): each trace and arm
    simulated (:func:`simulate`), per rank the model's dispatch, ffn and
    combine of the rounded pairs and rows, times a lognormal factor of
    sigma ``noise`` (0: exact), balance per rank (plus "planned",
    "moved_bytes_per_rank", "first_move" and "arm_params") and map the
    arm's map_us, timed as the GPU study times them: a rank's dispatch
    also holds its wait for the last rank to start one (max over ranks of
    balance + map, less its own), and every rank's combine ends with the
    combine of the rank whose FFN ends last (its wait for that FFN, then
    that rank's combine). "layer_us" is the slowest rank's sum of its
    phases + other_us. ``expert_bytes`` defaults to 3 hidden ffn BF16
    matrices."""
    config = config or ArmConfig()
    expert_bytes = 3 * hidden * ffn * 2 if expert_bytes is None else expert_bytes
    if not (isinstance(noise, (int, float)) and noise >= 0):
        raise ValueError(f"noise must be a number >= 0, got {noise!r}")
    rng = np.random.default_rng([seed, 99])
    out = []
    for kind, params in traces:
        loads = trace_loads(kind, seed, ranks * tokens, experts, topk, steps, layers, **params)
        for arm in arms:
            res = simulate(loads, arm, ranks, ranks_per_node, model, expert_bytes, tokens, topk, config)
            for s in range(steps):
                for l in range(layers):
                    pairs = np.rint(res.pairs[s, l])
                    rows = np.rint(res.rows[s, l])
                    noisy = lambda v: v * (rng.lognormal(0.0, noise, v.shape) if noise else 1.0)  # noqa: E731
                    d, f, c = noisy(model.dispatch(rows)), noisy(model.ffn(pairs)), noisy(model.combine(rows))
                    b = res.balance_rank_us[s, l]
                    m = np.full(ranks, res.map_us)
                    start = b + m
                    d = d + (start.max() - start)  # the wait for the last sender
                    end = start + d + f
                    c = (end.max() - end) + c[end.argmax()]  # the wait for the last FFN, then its combine
                    layer_us = float((start + d + f + c).max() + model.other_us)
                    out.append({
                        "study": "balance", "trace": kind, "trace_params": dict(params), "arm": arm, "step": s,
                        "layer": l, "ranks": ranks, "ranks_per_node": ranks_per_node, "nodes": ranks // ranks_per_node,
                        "tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts,
                        "physical_experts": res.num_physical, "topk": topk,
                        "logical_loads": loads[s, l].tolist(), "pairs_per_rank": pairs.astype(int).tolist(),
                        "rows_per_rank": rows.astype(int).tolist(),
                        "imbalance": round(float(res.imbalance[s, l]), 4),
                        "us": {"dispatch": d.tolist(), "ffn": f.tolist(), "combine": c.tolist(), "balance": b.tolist(),
                               "map": m.tolist(), "layer": (b + m + d + f + c + model.other_us).tolist()},
                        "layer_us": layer_us, "planned": bool(res.planned[s, l]),
                        "first_move": bool(res.first_move[s, l]),
                        "moved_experts": int(res.moved_experts[s, l]),
                        "moved_bytes": int(res.moved_experts[s, l]) * expert_bytes,
                        "moved_bytes_per_rank": (res.moved_rank[s, l] * expert_bytes).tolist(),
                        "expert_bytes": expert_bytes, "sm_share": True, "arm_params": asdict(config),
                        "synthetic": True})
    return out


# ------------------------------------------------------------ the study ---

def _summary(res: SimResult, none: SimResult | None, warmup: int) -> dict:
    """Means over the steps from ``warmup`` on, in the steady state: a
    layer's one-off first-move setup is left out of the layer and balancing
    times and reported on its own ("setup_us_total", over the whole run)."""
    sl = slice(warmup, None)
    layer = float(res.steady_layer_us()[sl].mean())
    row = {"imbalance_mean": float(res.imbalance[sl].mean()), "imbalance_worst": float(res.imbalance[sl].max()),
           "layer_us_mean": layer, "straggler_us_mean": float(res.straggler_us[sl].mean()),
           "balance_us_mean": float(res.steady_balance_us()[sl].mean()), "map_us": res.map_us,
           "max_pairs_mean": float(res.pairs[sl].max(-1).mean()), "max_rows_mean": float(res.rows[sl].max(-1).mean()),
           "moved_experts_mean": float(res.moved_experts[sl].mean()),
           "busiest_moved_mean": float(res.moved_rank[sl].max(-1).mean()),
           "plans_per_step": float(res.planned[sl].mean()),
           "setup_us_total": float(res.setup_us.sum()), "first_moves": int(res.first_move.sum())}
    if none is not None:
        row["speedup_vs_none"] = float(none.steady_layer_us()[sl].mean()) / layer
        row["straggler_saving_us"] = float(none.straggler_us[sl].mean()) - row["straggler_us_mean"]
    return row


def break_even_expert_bytes(res: SimResult, none: SimResult, model: CostModel, overlap: float = 0.0,
                            warmup: int = 0) -> float | None:
    """The expert size, bytes, above which ``res``'s steady layer time (its
    straggler, balancing, replica choice and rest; no first-move setup)
    exceeds ``none``'s, its placements held (exact for "eplb" and
    "per_step", whose plans do not depend on the size; "migration" moves
    less as experts grow: use :func:`sweep`). inf when nothing moves and it
    pays, 0.0 when it never pays, None for "none"."""
    if res.arm == "none":
        return None
    sl = slice(warmup, None)
    target = float(none.steady_layer_us()[sl].mean())
    fixed = (float(res.straggler_us[sl].mean()) + model.overhead_us.get(res.arm, 0.0)
             + model.plan_cost(res.num_experts) * float(res.planned[sl].mean()) + res.map_us + model.other_us)
    busiest = float(res.moved_rank[sl].max(-1).mean()) * (1.0 - overlap)
    if target <= fixed:
        return 0.0
    if busiest <= 0:
        return math.inf
    return (target - fixed) * model.copy_GBps * 1e3 / busiest


def study(ranks, gpus_per_node: int, traces, arms, model: CostModel, expert_bytes: int, tokens_per_rank: int = 4096,
          num_topk: int = 8, experts_per_rank: int = 4, num_experts: int | None = None, steps: int = 32,
          layers: int = 1, warmup: int = 8, config: ArmConfig | None = None, seed: int = 0) -> list[dict]:
    """Per rank count, trace and arm: one row of the mean imbalance (max over
    mean pairs), layer time, straggler time, balancing cost, moved experts,
    speed-up over "none" and :func:`break_even_expert_bytes`, over the steps
    from ``warmup`` on.

    Arguments:
        ranks: rank counts (each a multiple of gpus_per_node).
        traces: (kind, params) pairs, e.g. ("drift", {"s": 1.2, "period": 8}).
        arms: names from :data:`ARMS` ("none" is simulated for the speed-up
            in any case).
        experts_per_rank, num_experts: E (:func:`experts_for`).
        the rest: as :func:`simulate` and :func:`trace_loads`.

    Returns:
        list of dicts, one per (ranks, trace, arm).
    """
    config = config or ArmConfig()
    warmup = _int("warmup", warmup)
    if warmup >= _int("steps", steps, 1):
        raise ValueError(f"warmup={warmup} leaves none of the {steps} steps")
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"arms: {a!r} is not one of {ARMS}")
    rows = []
    for R in ranks:
        E = experts_for(R, experts_per_rank, num_experts)
        for kind, params in traces:
            loads = trace_loads(kind, seed, R * tokens_per_rank, E, num_topk, steps, layers, **params)
            none = simulate(loads, "none", R, gpus_per_node, model, expert_bytes, tokens_per_rank, num_topk, config)
            for arm in arms:
                res = none if arm == "none" else simulate(loads, arm, R, gpus_per_node, model, expert_bytes,
                                                          tokens_per_rank, num_topk, config)
                be = break_even_expert_bytes(res, none, model, config.overlap, warmup)
                rows.append({"kind": "summary", "trace": kind, "trace_params": dict(params), "arm": arm, "ranks": R,
                             "nodes": R // gpus_per_node, "gpus_per_node": gpus_per_node, "experts": E,
                             "physical_experts": res.num_physical, "topk": num_topk, "tokens": tokens_per_rank,
                             "expert_bytes": expert_bytes, "steps": steps, "layers": layers, "warmup": warmup,
                             **_summary(res, none, warmup),
                             "break_even_expert_bytes": None if be is None or math.isinf(be) else be,
                             "always_pays": be is not None and math.isinf(be)})
    return rows


def sweep(param: str, values, ranks: int, gpus_per_node: int, trace, arms, model: CostModel, expert_bytes: int,
          tokens_per_rank: int = 4096, num_topk: int = 8, experts_per_rank: int = 4, num_experts: int | None = None,
          steps: int = 32, layers: int = 1, warmup: int = 8, config: ArmConfig | None = None,
          seed: int = 0) -> list[dict]:
    """Each arm against "none" as one parameter moves: ``param`` "period"
    (the trace's drift period; ``trace`` a ("drift", params) pair) or
    "expert_bytes". Returns one dict per (value, arm): the value, the mean
    layer, straggler and balancing times (steady: no first-move setup), the
    saving over "none" ("net_saving_us" = none's layer time - the arm's) and
    the speed-up."""
    if param not in ("period", "expert_bytes"):
        raise ValueError(f"param must be 'period' or 'expert_bytes', got {param!r}")
    kind, params = trace
    if param == "period" and kind != "drift":
        raise ValueError(f"trace: a period sweep needs the 'drift' trace, got {kind!r}")
    config = config or ArmConfig()
    E = experts_for(ranks, experts_per_rank, num_experts)
    out = []
    loads = None
    for v in values:
        p = dict(params)
        size = expert_bytes
        if param == "period":
            p["period"] = _int("values", v, 1)
            loads = trace_loads(kind, seed, ranks * tokens_per_rank, E, num_topk, steps, layers, **p)
        else:
            size = _int("values", int(v))
            if loads is None:
                loads = trace_loads(kind, seed, ranks * tokens_per_rank, E, num_topk, steps, layers, **p)
        none = simulate(loads, "none", ranks, gpus_per_node, model, size, tokens_per_rank, num_topk, config)
        for arm in arms:
            if arm == "none":
                continue
            res = simulate(loads, arm, ranks, gpus_per_node, model, size, tokens_per_rank, num_topk, config)
            row = _summary(res, none, warmup)
            out.append({"kind": "sweep", "param": param, "value": v, "trace": kind, "trace_params": p, "arm": arm,
                        "ranks": ranks, "nodes": ranks // gpus_per_node, "experts": E, "expert_bytes": size,
                        "net_saving_us": float(none.steady_layer_us()[warmup:].mean()) - row["layer_us_mean"],
                        **row})
    return out


def break_even(sweep_rows: list[dict]) -> list[dict]:
    """Per (param, trace, ranks, arm) of :func:`sweep`'s rows: where the
    arm's net saving over "none" changes sign, linearly interpolated between
    the neighbouring values ("value": the first such point, None when it
    keeps one sign; "crossings": all of them), and whether it pays at the
    lowest and at the highest value."""
    groups: dict = {}
    for r in sweep_rows:
        groups.setdefault((r["param"], r["trace"], r["ranks"], r["arm"]), []).append(r)
    out = []
    for (param, trace, R, arm), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["value"])
        xs = [float(r["value"]) for r in rows]
        ys = [r["net_saving_us"] for r in rows]
        crossings = [x0 + (x1 - x0) * y0 / (y0 - y1) if y0 != y1 else x0
                     for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])) if (y0 > 0) != (y1 > 0)]
        out.append({"kind": "break_even", "param": param, "trace": trace, "ranks": R, "arm": arm,
                    "value": crossings[0] if crossings else None, "crossings": crossings,
                    "pays_at_lowest": ys[0] > 0, "pays_at_highest": ys[-1] > 0, "values": xs,
                    "net_saving_us": ys})
    return out


# -------------------------------------------------------------- command ---

def _git(*args) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def environment() -> dict:
    """Where the simulation ran: host, platform, Python and NumPy."""
    return {"host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
            "executable": sys.executable, "numpy": np.__version__}


def _trace_arg(text: str) -> tuple:
    kind, _, rest = text.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"--traces: {text!r}: write kind:key=value,key=value")
        params[key] = int(val) if key in ("period", "hot_expert") else float(val)
    _trace_params(kind, params)
    return kind, params


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.balance_sim",
                                description="Expert load balance at scale: the balancing arms' imbalance, layer time "
                                            "and break-even, from a cost model fit on measured records.")
    p.add_argument("--records", nargs="+", help="measured balance-study JSONL (fits the cost model, validated)")
    p.add_argument("--default-model", action="store_true",
                   help="use CostModel.default() (placeholder numbers) instead of --records")
    p.add_argument("--write-synthetic", metavar="FILE",
                   help="write synthetic 8-rank records of CostModel.default() to FILE and exit")
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--traces", nargs="+", default=["zipf:s=1.2", "hot_expert:hot_fraction=0.3", "drift:s=1.2,period=8"],
                   help="kind:key=value,... (kinds: zipf, hot_expert, drift)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--experts", type=int, default=None, help="a fixed E instead of experts-per-rank x ranks")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the records', else 4096)")
    p.add_argument("--expert-bytes", type=int, default=None,
                   help="bytes of one expert's weights (default: the records' expert_bytes)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the means (default: --period + 1, the steps before eplb's first plan "
                        "serves)")
    p.add_argument("--seed", type=int, default=0)
    for f in fields(ArmConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    p.add_argument("--copy-GBps", type=float, default=None, help="when the records cannot fit it")
    p.add_argument("--plan-us", type=float, default=None, help="when the records cannot fit it")
    p.add_argument("--plan-exponent", type=float, default=1.0,
                   help="a plan at E experts costs plan_us * (E / the records' E) ** this (0: held at the records')")
    p.add_argument("--drift-periods", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--expert-bytes-sweep", type=float, nargs="*", default=None,
                   help="expert sizes for the break-even sweep (default: 1/16 to 16 x the expert size)")
    p.add_argument("--sweep-ranks", type=int, nargs="*", default=None,
                   help="(default: the smallest and largest --ranks)")
    p.add_argument("--out", default="results/balance_sim/sim.jsonl")
    a = p.parse_args(argv)
    try:
        config = ArmConfig(**{f.name: getattr(a, f.name) for f in fields(ArmConfig)})
        if a.write_synthetic:
            recs = synthetic_records(CostModel.default(), config=config, seed=a.seed)
            Path(a.write_synthetic).parent.mkdir(parents=True, exist_ok=True)
            Path(a.write_synthetic).write_text("".join(json.dumps(r) + "\n" for r in recs))
            print(f"{len(recs)} synthetic records (CostModel.default(), not measurements) -> {a.write_synthetic}")
            return 0
        if bool(a.records) == a.default_model:
            raise ValueError("give --records FILE ... or --default-model")
        traces = [_trace_arg(t) for t in a.traces]
        a.warmup = config.period + 1 if a.warmup is None else a.warmup
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0 = time.perf_counter()
        records = read_records(a.records) if a.records else []
        if records:
            model = CostModel.fit(records, copy_GBps=a.copy_GBps, plan_us=a.plan_us, plan_exponent=a.plan_exponent)
            checked = validate(records, model, config)
        else:
            model, checked = replace(CostModel.default(), plan_exponent=a.plan_exponent), None
        tokens = a.tokens or (int(np.median([r["tokens"] for r in records])) if records else 4096)
        eb = a.expert_bytes
        if eb is None:
            sizes = [r["expert_bytes"] for r in records if r["expert_bytes"] > 0]
            if not sizes:
                raise ValueError("--expert-bytes: the records hold no expert_bytes; give it")
            eb = int(np.median(sizes))
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"kind": "cost_model", **model.to_dict()}]
        if checked is not None:
            rows += [{"kind": "validation", "arm": arm, "runs_with_history": checked["runs_with_history"], **v}
                     for arm, v in checked["arms"].items()]
        rows += study(a.ranks, a.gpus_per_node, traces, a.arms, model, eb, tokens, a.topk, a.experts_per_rank,
                      a.experts, a.steps, a.layers, a.warmup, config, a.seed)
        sweep_rows = []
        arms = [x for x in a.arms if x != "none"]
        for R in a.sweep_ranks if a.sweep_ranks is not None else sorted({min(a.ranks), max(a.ranks)}):
            common = dict(tokens_per_rank=tokens, num_topk=a.topk, experts_per_rank=a.experts_per_rank,
                          num_experts=a.experts, steps=a.steps, layers=a.layers, warmup=a.warmup, config=config,
                          seed=a.seed)
            drift = next((t for t in traces if t[0] == "drift"), ("drift", {"s": 1.2, "period": 8}))
            if a.drift_periods:
                sweep_rows += sweep("period", a.drift_periods, R, a.gpus_per_node, drift, arms, model, eb, **common)
            sizes = a.expert_bytes_sweep or [eb * f for f in (1 / 16, 1 / 4, 1, 4, 16)]
            sweep_rows += sweep("expert_bytes", sizes, R, a.gpus_per_node, drift, arms, model, eb, **common)
        rows += sweep_rows + break_even(sweep_rows)
        with out.open("w") as f:
            for r in rows:
                f.write(json.dumps(r, default=_jsonable) + "\n")
        args = list(sys.argv[1:] if argv is None else argv)
        command = shlex.join(["python", "-m", "cupyep.lab.balance_sim", *args])
        commit = _git("rev-parse", "HEAD")
        # the simulator's own sources (this module, cupyep.balance, cupyep.routing) that differ from the commit
        dirty = sorted(line.split(maxsplit=1)[-1] for line in (_git("status", "--porcelain", "--", "cupyep/lab/balance_sim.py",
                                                  "cupyep/balance", "cupyep/routing.py") or "").splitlines())
        manifest = {"study": "balance_sim", "readme": "README.md",
                    "records": [{"files": [out.name], "command": command, "commit": commit, "git_dirty": bool(dirty),
                                 "git_dirty_paths": dirty,
                                 "environment": environment(), "inputs": a.records or [], "started_utc": started,
                                 "seconds": round(time.perf_counter() - t0, 1)}],
                    "argv": [sys.executable, "-m", "cupyep.lab.balance_sim", *args], "cwd": os.getcwd(),
                    "num_records": len(records), "model": model.to_dict(), "arm_config": asdict(config),
                    "tokens_per_rank": tokens, "expert_bytes": eb, "output": out.name,
                    "placeholder_model": not records}
        (out.parent / "manifest.json").write_text(json.dumps(manifest, indent=1, default=_jsonable) + "\n")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_table([r for r in rows if r["kind"] == "summary"], checked)
    print(f"-> {out} and {out.parent / 'manifest.json'}")
    return 0


def _jsonable(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, float) and math.isinf(v):
        return None
    return str(v)


def _print_table(rows: list[dict], checked: dict | None) -> None:
    def pct(v):
        return "    -" if v is None else f"{100 * v:5.1f}"
    if checked is not None:
        print("validation (layer time, |predicted - measured| / measured, %): median / worst over every step, "
              "then without the first moves; the cost model alone on the records' own work in brackets")
        for arm, v in checked["arms"].items():
            print(f"  {arm:<9} {pct(v['median_rel_err'])} / {pct(v['worst_rel_err'])}   "
                  f"steady {pct(v['median_rel_err_steady'])} / {pct(v['worst_rel_err_steady'])}   "
                  f"({pct(v['median_rel_err_cost'])} / {pct(v['worst_rel_err_cost'])}; "
                  f"steady {pct(v['median_rel_err_cost_steady'])} / {pct(v['worst_rel_err_cost_steady'])})")
    print(f"{'trace':<11}{'ranks':>6}  {'arm':<10}{'max/mean':>9}{'layer us':>12}{'straggler':>12}{'balance us':>11}"
          f"{'speed-up':>9}")
    for r in rows:
        print(f"{r['trace']:<11}{r['ranks']:>6}  {r['arm']:<10}{r['imbalance_mean']:>9.3f}{r['layer_us_mean']:>12.1f}"
              f"{r['straggler_us_mean']:>12.1f}{round(r['balance_us_mean'], 1) + 0.0:>11.1f}"
              f"{r['speedup_vs_none']:>9.3f}")


if __name__ == "__main__":
    sys.exit(main())
