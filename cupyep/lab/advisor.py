"""Which mode (and transport) to use for a shape, from measured results.

    from .. import advisor, plotting
    records = plotting.load("results/sweeps/crossover_normal.jsonl") + \
        plotting.load("results/sweeps/crossover_low_latency.jsonl")
    a = advisor.advise(tokens_per_rank=96, num_ranks=8, hidden=7168, num_experts=256, records=records)
    a.mode, a.transport, a.reasons

    python -m cupyep.lab.advisor --tokens 96 --ranks 8 --records results/sweeps/crossover_*.jsonl

The rules (the seed articles' serving practice):

- normal mode above about :data:`NORMAL_ABOVE` tokens per rank, or when a
  low-latency buffer for the shape does not fit the memory budget;
- low-latency mode below about :data:`LOW_LATENCY_BELOW` tokens per rank when
  latency matters and the memory is there;
- between the two (and whenever records allow), the measured crossover:
  the token count where normal mode's dispatch + combine becomes faster than
  low-latency mode's at this rank count (:func:`crossover_tokens`). Measured
  crossovers replace the round numbers above; without records the advice
  says it is uncalibrated;
- from low-latency mode back to normal mode when routing is skewed beyond
  :data:`SEVERE_IMBALANCE` (max over mean tokens per expert): low-latency
  mode sizes every expert's slots for the worst case, so a hot expert makes
  one rank the straggler of every call; beyond :data:`LOAD_BALANCE_AT` the
  advice also says to balance the load (replicate or move hot experts).

For normal mode the transport is the faster one in the records at this rank
count (dispatch + combine), else "direct" (one copy instead of two). Across
nodes the same rules choose between low-latency mode across nodes and the
two-hop normal mode, from records of the same node layout.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

NORMAL_ABOVE = 256
LOW_LATENCY_BELOW = 64
DEFAULT_CROSSOVER = 128
SEVERE_IMBALANCE = 8.0
LOAD_BALANCE_AT = 4.0

# The kinds whose times make one call of a mode: (dispatch kinds, combine kinds), first present wins.
STUDY_BENCH = {"normal": "normal", "low_latency": "low_latency",  # sweep study -> the benchmark it times
               "internode": "internode"}
MODE_KINDS = {
    "low_latency": (("dispatch_fp8", "dispatch_bf16"), ("combine",)),
    "normal": (("dispatch_bf16_notify", "dispatch_bf16"), ("combine_bf16",)),
    "normal_direct": (("dispatch_bf16_notify_direct", "dispatch_bf16_direct"), ("combine_bf16_direct",)),
    # across nodes: the two-hop mode (the internode study's kinds, or the benchmark's)
    "normal_two_hop": (("dispatch_bf16", "dispatch_bf16_two_hop"), ("combine_bf16", "combine_bf16_two_hop")),
}
MODE_BENCH = {"low_latency": "low_latency", "normal": "normal", "normal_direct": "normal",
              "normal_two_hop": "internode"}


@dataclass(frozen=True)
class Advice:
    """The recommendation for one shape.

    Attributes:
        mode: "normal" or "low_latency".
        transport: "direct" or "queue" for normal mode within a node, "two_hop"
            across nodes, None for low-latency.
        reasons: why, in order of the rules applied.
        warnings: what the caller should act on (skew, memory).
        crossover_tokens: the crossover used (measured, or the default).
        calibrated: whether it came from records.
    """
    mode: str
    transport: str | None
    reasons: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    crossover_tokens: float = DEFAULT_CROSSOVER
    calibrated: bool = False


def _time_us(rec: dict) -> float | None:
    for key in ("kernel_median_us", "time_us", "median_us"):
        if rec.get(key) is not None:
            return float(rec[key])
    return None


def mode_times(records, num_ranks: int, mode: str, ranks_per_node: int | None = None) -> dict:
    """{tokens: dispatch + combine microseconds} of ``mode`` (a MODE_KINDS key)
    at ``num_ranks`` ranks in nodes of ``ranks_per_node`` (default: one node
    of all of them), from benchmark or sweep records on the default timing
    boundary (sweep points and other boundaries are skipped). A two-hop
    dispatch's time includes its notify kernel (``notify_us``), as normal
    mode's counted dispatch within a node includes its count exchange; the
    internode records of the direct route are left out. Several records of
    one kind and token count (repeats, or the files of several runs) count
    as their median."""
    bench = MODE_BENCH[mode]
    per_node = num_ranks if ranks_per_node is None else ranks_per_node
    by_kind: dict = {}
    for r in records:
        source = r.get("bench") or STUDY_BENCH.get(r.get("study"), bench)  # benchmark or sweep record
        if source != bench or r.get("ranks") != num_ranks or r.get("sweep"):
            continue
        if (r.get("ranks_per_node") or num_ranks) != per_node:  # records without it are of one node
            continue
        if r.get("timing") not in (None, "strict") or r.get("status", "ok") != "ok":
            continue
        if bench == "internode" and r.get("route", "two_hop") != "two_hop":  # the direct route is another path
            continue
        kind = r.get("measured_kind") or r.get("kind")
        t, tok = _time_us(r), r.get("tokens")
        if bench == "internode" and t is not None and r.get("notify_us") is not None:  # its notify kernel first
            t += float(r["notify_us"])
        if t is not None and tok is not None:
            by_kind.setdefault(kind, {}).setdefault(int(tok), []).append(t)
    by_kind = {kind: {tok: statistics.median(ts) for tok, ts in pts.items()} for kind, pts in by_kind.items()}
    dispatch_kinds, combine_kinds = MODE_KINDS[mode]
    d = next((by_kind[k] for k in dispatch_kinds if k in by_kind), {})
    c = next((by_kind[k] for k in combine_kinds if k in by_kind), {})
    return {t: d[t] + c[t] for t in sorted(set(d) & set(c))}


def _interp_loglog(points: dict, t: float) -> float | None:
    """points' time at ``t`` tokens, linear in log-log between measured
    token counts; None outside them."""
    xs = sorted(points)
    if not xs or t < xs[0] or t > xs[-1]:
        return None
    for a, b in zip(xs, xs[1:]):
        if a <= t <= b:
            f = (math.log(t) - math.log(a)) / (math.log(b) - math.log(a))
            return math.exp(math.log(points[a]) + f * (math.log(points[b]) - math.log(points[a])))
    return points[xs[-1]] if t == xs[-1] else None


def crossover_tokens(records, num_ranks: int, normal_mode: str = "normal",
                     ranks_per_node: int | None = None) -> float | None:
    """Tokens per rank above which ``normal_mode`` ("normal", "normal_direct",
    or across nodes "normal_two_hop") is faster than low-latency mode at
    ``num_ranks`` (in nodes of ``ranks_per_node``), interpolated in log-log
    over the token counts both modes were measured at (at least two, with
    the order changing between them); None when the records do not bracket
    a crossover."""
    ll = mode_times(records, num_ranks, "low_latency", ranks_per_node)
    nm = mode_times(records, num_ranks, normal_mode, ranks_per_node)
    lo, hi = max(min(ll, default=0), min(nm, default=0)), min(max(ll, default=0), max(nm, default=0))
    shared = sorted(t for t in set(ll) | set(nm) if lo <= t <= hi and t > 0)
    pts = [(t, _interp_loglog(ll, t), _interp_loglog(nm, t)) for t in shared]
    pts = [(t, a, b) for t, a, b in pts if a is not None and b is not None]
    for (t0, a0, b0), (t1, a1, b1) in zip(pts, pts[1:]):
        d0, d1 = math.log(b0) - math.log(a0), math.log(b1) - math.log(a1)  # > 0: low-latency faster
        if d0 > 0 >= d1:
            f = d0 / (d0 - d1)
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return None


def _measured_at(records, num_ranks: int, tokens: int, ranks_per_node: int | None = None,
                 normal_modes=("normal", "normal_direct")) -> tuple[float, float] | None:
    """(low-latency, best normal-mode) dispatch + combine microseconds at
    ``tokens``, interpolated in log-log between measured token counts; None
    unless both modes were measured on both sides of it (or at it)."""
    ll = _interp_loglog(mode_times(records, num_ranks, "low_latency", ranks_per_node), tokens)
    normal = [v for v in (_interp_loglog(mode_times(records, num_ranks, m, ranks_per_node), tokens)
                          for m in normal_modes) if v is not None]
    return (ll, min(normal)) if ll is not None and normal else None


def _faster_transport(records, num_ranks: int, tokens: int) -> tuple[str, str]:
    q, d = mode_times(records, num_ranks, "normal"), mode_times(records, num_ranks, "normal_direct")
    shared = sorted(set(q) & set(d), key=lambda t: abs(math.log(max(t, 1)) - math.log(max(tokens, 1))))
    if shared:
        t = shared[0]
        best = "direct" if d[t] <= q[t] else "queue"
        return best, f"{best} transport measured faster at {t} tokens per rank ({d[t]:.0f} us direct, {q[t]:.0f} us queue)"
    return "direct", "direct transport by default (one copy of every row instead of two; no records to compare)"


def advise(tokens_per_rank: int, num_ranks: int, hidden: int = 7168, num_experts: int = 256, num_topk: int = 8,
           memory_budget_bytes: int | None = None, latency_sensitive: bool = True,
           imbalance_factor: float | None = None, records=(), num_nodes: int = 1) -> Advice:
    """Recommend a mode (and transport) for this shape.

    Arguments:
        tokens_per_rank: T, the most tokens a rank dispatches per call.
        num_ranks: R, ranks of the expert-parallel group.
        hidden, num_experts, num_topk: H, E, k (the low-latency buffer's size).
        memory_budget_bytes: device bytes per rank the buffer may take (None: no limit).
        latency_sensitive: decode-style calls that wait on the result.
        imbalance_factor: max / mean (token, slot) pairs per expert of the
            expected routing (cupyep.routing.imbalance_factor); None: unknown.
        records: measured results (benchmark, main-job or sweep records) that
            calibrate the crossover and the transport.
        num_nodes: nodes the ranks span. Across nodes the same rules apply
            between low-latency mode across nodes and normal mode's two-hop
            path (transport "queue", which the two-hop route carries there), calibrated by
            records of the same node layout (their ``ranks_per_node``).

    Returns:
        Advice.
    """
    from ..low_latency.layout import size_hint as ll_size_hint
    if tokens_per_rank < 1 or num_ranks < 1:
        raise ValueError(f"tokens_per_rank and num_ranks must be >= 1, got {tokens_per_rank}, {num_ranks}")
    if not (isinstance(num_nodes, int) and num_nodes >= 1 and num_ranks % num_nodes == 0):
        raise ValueError(f"num_nodes must be an int >= 1 dividing num_ranks={num_ranks}, got {num_nodes!r}")
    records = list(records)
    reasons, warnings = [], []
    across = num_nodes > 1
    per_node = num_ranks // num_nodes
    where = f"{num_ranks} ranks in {num_nodes} nodes of {per_node}" if across else f"{num_ranks} ranks"
    normal_modes = ("normal_two_hop",) if across else ("normal", "normal_direct")
    if across:
        reasons.append(f"the ranks span {num_nodes} nodes: low-latency mode across nodes, or the two-hop normal "
                       "mode (timed by the two-hop route's records)")
    cross = crossover_tokens(records, num_ranks, normal_modes[0], per_node)
    calibrated = cross is not None
    measured = None if calibrated else _measured_at(records, num_ranks, tokens_per_rank, per_node, normal_modes)
    if calibrated:
        reasons.append(f"measured crossover at {where}: {cross:.0f} tokens per rank")
    elif measured is not None:
        cross = DEFAULT_CROSSOVER
        reasons.append(f"the records at {where} show no crossover (one mode is faster at every token count they "
                       f"cover), and they time this shape: the faster one decides")
    else:
        cross = DEFAULT_CROSSOVER
        reasons.append(f"uncalibrated: no records at {where} bracket the crossover; using {cross} tokens")
    ll_bytes = ll_size_hint(num_ranks, tokens_per_rank, hidden, num_experts, max(num_topk, 1), staged=across)
    fits = memory_budget_bytes is None or ll_bytes <= memory_budget_bytes
    skew = imbalance_factor is not None and imbalance_factor >= SEVERE_IMBALANCE
    if imbalance_factor is not None and imbalance_factor >= LOAD_BALANCE_AT:
        warnings.append(f"expert imbalance {imbalance_factor:.1f} (max / mean): balance the load "
                        "(replicate or move the hot experts)")
    if not fits:
        mode = "normal"
        reasons.append(f"a low-latency buffer needs {ll_bytes} bytes per rank, over the budget of {memory_budget_bytes}")
    elif skew:
        mode = "normal"
        reasons.append(f"expert imbalance {imbalance_factor:.1f} >= {SEVERE_IMBALANCE}: low-latency slots would make "
                       "the hot expert's rank the straggler of every call")
    elif calibrated:
        mode = "low_latency" if tokens_per_rank < cross else "normal"
        reasons.append(f"{tokens_per_rank} tokens per rank is {'below' if mode == 'low_latency' else 'above'} "
                       "the measured crossover")
    elif measured is not None:
        ll_us, normal_us = measured
        mode = "low_latency" if ll_us <= normal_us else "normal"
        reasons.append(f"measured at {where} around {tokens_per_rank} tokens per rank: low-latency "
                       f"{ll_us:.0f} us, normal {normal_us:.0f} us (dispatch + combine)")
    elif tokens_per_rank > NORMAL_ABOVE:
        mode = "normal"
        reasons.append(f"{tokens_per_rank} tokens per rank > {NORMAL_ABOVE}: throughput mode")
    elif tokens_per_rank < LOW_LATENCY_BELOW and latency_sensitive:
        mode = "low_latency"
        reasons.append(f"{tokens_per_rank} tokens per rank < {LOW_LATENCY_BELOW} and latency-sensitive")
    else:
        mode = "low_latency" if tokens_per_rank < cross and latency_sensitive else "normal"
        reasons.append(f"{tokens_per_rank} tokens per rank between the rules: the default crossover decides")
    transport = None
    if mode == "normal" and across:
        transport = "queue"  # carried across nodes by the two-hop route (cupyep.normal.route)
    elif mode == "normal":
        transport, why = _faster_transport(records, num_ranks, tokens_per_rank)
        reasons.append(why)
    return Advice(mode, transport, reasons, warnings, float(cross), calibrated)


def main(argv=None) -> int:
    """``python -m cupyep.lab.advisor --tokens T --ranks R [--nodes N] [--records FILE ...]``: print the advice."""
    import argparse
    import json
    import sys
    p = argparse.ArgumentParser(prog="python -m cupyep.lab.advisor", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, required=True, help="the most tokens a rank dispatches per call")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--memory-gb", type=float, default=None, help="device memory per rank the buffer may take")
    p.add_argument("--imbalance", type=float, default=None, help="max / mean pairs per expert of the routing")
    p.add_argument("--throughput", action="store_true", help="calls do not wait on the result (not latency-bound)")
    p.add_argument("--records", nargs="*", default=[], metavar="FILE.jsonl", help="measured results to calibrate")
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    args = p.parse_args(argv)
    from .plotting import load
    records = []
    for path in args.records:
        try:
            records += load(path)
        except OSError as exc:
            p.error(f"cannot read {path}: {exc.strerror or exc}")
    try:
        a = advise(args.tokens, args.ranks, args.hidden, args.experts, args.topk,
                   None if args.memory_gb is None else int(args.memory_gb * 2**30), not args.throughput,
                   args.imbalance, records, args.nodes)
    except ValueError as exc:
        p.error(str(exc))
    if args.json:
        print(json.dumps({"mode": a.mode, "transport": a.transport, "crossover_tokens": a.crossover_tokens,
                          "calibrated": a.calibrated, "reasons": a.reasons, "warnings": a.warnings}, indent=1))
    else:
        print(f"mode: {a.mode}" + (f", transport: {a.transport}" if a.transport else ""))
        for r in a.reasons:
            print(f"  because {r}")
        for w in a.warnings:
            print(f"  warning: {w}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
