"""Default blocks per rank, measured: the smallest block count whose kernel
time is within :data:`TOLERANCE` of the best one measured.

A communication kernel that takes every SM leaves none to the expert GEMM
it is meant to overlap, so a rank's default is not "as many as it may" but
the fewest that lose at most 5 % against the best count of a sweep
(``experiments/bench_normal.py --direct-sms ...`` and
``experiments/bench_low_latency.py --num-blocks ...``, kernel clock, median
over the runs). :func:`build` turns such records into a table;
``python -m cupyep.lab.sm_table`` writes it.

The table shipped with the package (``sm_defaults.json``) holds what was
measured on one H200 with the ranks sharing it under MPS
(``results/sm_economy/defaults/``). ``CUPYEP_SM_DEFAULTS=path`` names a
table measured on other machines; its entries come first.
``CUPYEP_SM_DEFAULTS=off`` turns the measured defaults off. A shape with no
entry (another GPU, a rank count never swept, a rank with an SM cap) keeps
the rank's share of the SMs, the default before any measurement.

An entry (one JSON object; every field but ``times_us`` is a key):

- ``route``: ``"direct"`` (normal mode's direct route) or ``"low_latency"``;
- ``kind``: ``dispatch_bf16``, ``dispatch_fp8`` or ``combine_bf16`` (direct);
  ``dispatch_fp8``, ``dispatch_bf16`` or ``combine`` (low-latency);
- ``gpu``, ``sms``: the device's name and SM count;
- ``ranks``: ranks per node; ``ranks_per_gpu``: ranks sharing each GPU;
- ``tokens``, ``hidden``: the swept shape (tokens per rank);
- ``times_us``: {blocks per rank: median kernel time in us};
- ``blocks``: the rule's choice, :func:`smallest_within` of ``times_us``;
- ``runs``: records per point the medians are over.
"""
from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

TOLERANCE = 0.05
ENV_VAR = "CUPYEP_SM_DEFAULTS"
OFF = "off"
PACKAGED = Path(__file__).with_name("sm_defaults.json")
ROUTES = {"direct": ("dispatch_bf16", "dispatch_fp8", "combine_bf16"),
          "low_latency": ("dispatch_fp8", "dispatch_bf16", "combine")}
_KEY = ("route", "kind", "gpu", "sms", "ranks", "ranks_per_gpu", "tokens", "hidden")


def smallest_within(times_us: dict, tolerance: float = TOLERANCE) -> int:
    """The smallest block count whose time is at most (1 + tolerance) x the
    best time in ``times_us`` ({blocks: time}; ValueError when empty or a
    time is not positive)."""
    if not times_us:
        raise ValueError("no measured block counts")
    if any(not t > 0 for t in times_us.values()):
        raise ValueError(f"times must be positive, got {times_us}")
    best = min(times_us.values())
    return min(int(b) for b, t in times_us.items() if t <= best * (1.0 + tolerance))


def _point(rec: dict) -> tuple | None:
    """(route, kind, blocks, time_us) of one benchmark record that timed an
    explicit block count on the kernel clock, strict boundary; else None."""
    if rec.get("timing") != "strict":
        return None
    if rec.get("bench") == "normal" and rec.get("transport") == "direct" and rec.get("sweep"):
        kind = rec["kind"].removesuffix("_direct")
        cfg = rec["dispatch_config" if kind.startswith("dispatch") else "combine_config"]
        if kind in ROUTES["direct"] and cfg.get("num_sms") and rec.get("kernel_us"):
            return "direct", kind, int(cfg["num_sms"]), float(rec["kernel_us"])
    if rec.get("bench") == "low_latency" and rec.get("kind") in ROUTES["low_latency"] and rec.get("num_blocks"):
        if rec.get("kernel_median_us"):
            return "low_latency", rec["kind"], int(rec["num_blocks"]), float(rec["kernel_median_us"])
    return None


def build(records, tolerance: float = TOLERANCE) -> list[dict]:
    """The table of ``records`` (benchmark JSONL records; see :func:`_point`
    for the ones it takes): one entry per key, each point's time the median
    over the records that timed it."""
    groups = defaultdict(lambda: defaultdict(list))
    for rec in records:
        p = _point(rec)
        env = rec.get("env") or {}
        if p is None or env.get("sm_capped") or not env.get("gpu"):
            continue
        route, kind, blocks, t = p
        key = (route, kind, env["gpu"], int(env["sms"]), int(env["ranks_per_node"]), int(env["ranks_per_gpu"]),
               int(rec["tokens"]), int(rec["hidden"]))
        groups[key][blocks].append(t)
    table = []
    for key, points in sorted(groups.items()):
        times = {b: statistics.median(v) for b, v in sorted(points.items())}
        table.append({**dict(zip(_KEY, key)), "times_us": {str(b): round(t, 3) for b, t in times.items()},
                      "blocks": smallest_within(times, tolerance), "runs": min(len(v) for v in points.values())})
    return table


def load_table(path) -> list[dict]:
    """The entries of a table file (a JSON list, :func:`build`'s output)."""
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list) or any(not all(f in e for f in (*_KEY, "blocks")) for e in entries):
        raise ValueError(f"{path}: not an SM-defaults table (a JSON list of entries with {_KEY} and 'blocks')")
    return entries


@lru_cache(maxsize=None)
def _tables(extra: str | None) -> tuple:
    return tuple((load_table(extra) if extra else []) + (load_table(PACKAGED) if PACKAGED.exists() else []))


def lookup(route: str, kind: str, gpu: str, sms: int, ranks: int, ranks_per_gpu: int, tokens: int,
           hidden: int | None = None) -> int | None:
    """The measured default of (route, kind) for this GPU and rank layout,
    or None without an entry. Of the entries at other token counts the one
    with the fewest tokens at or above ``tokens`` answers (else the most);
    at equal tokens, the nearest hidden size."""
    if route not in ROUTES or kind not in ROUTES[route]:
        raise ValueError(f"unknown route/kind {route!r}/{kind!r}; known: {ROUTES}")
    extra = os.environ.get(ENV_VAR) or None
    if extra == OFF:
        return None
    hits = [e for e in _tables(extra)
            if (e["route"], e["kind"], e["gpu"], e["sms"], e["ranks"], e["ranks_per_gpu"]) ==
            (route, kind, gpu, sms, ranks, ranks_per_gpu)]
    if not hits:
        return None
    above = [e for e in hits if e["tokens"] >= tokens]
    pick = min(above, key=lambda e: e["tokens"]) if above else max(hits, key=lambda e: e["tokens"])
    same = [e for e in hits if e["tokens"] == pick["tokens"]]
    return int(min(same, key=lambda e: abs(e["hidden"] - (hidden or e["hidden"])))["blocks"])


@lru_cache(maxsize=None)
def device(device_id: int) -> tuple[str, int]:
    """(name, SM count) of CUDA device ``device_id``: the "gpu" and "sms" a
    benchmark record's env holds (cupyep.lab.bench.report), which the
    table's entries are keyed by."""
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    return (name.decode() if isinstance(name, bytes) else name), int(props["multiProcessorCount"])


def blocks_for(group, route: str, kind: str, tokens: int, hidden: int | None = None) -> int | None:
    """:func:`lookup` for this rank's GPU and layout; None without a GPU,
    under an SM cap (the table times uncapped ranks), or without an entry."""
    if not group.has_gpu or group.sm_capped:
        return None
    gpu, sms = device(group.device_id)
    return lookup(route, kind, gpu, sms, group.local_size, group.ranks_per_gpu, tokens, hidden)
