"""The "internode" study: the two-hop dispatch and combine across (emulated)
nodes on the GPU, one configuration of knobs at a time
(cupyep.lab.bench.internode.measure). Run it with the nodes' layout:

    python -m cupyep.lab.experiments internode --ranks 8 --ranks-per-node 4 --grid num_sms=4,8,16

Knobs (defaults: the benchmark's shape):

- ``kind``: one of cupyep.lab.bench.internode.KINDS;
- shape: ``tokens`` (per rank), ``hidden``, ``topk``, ``experts``;
- routing: ``routing`` (a cupyep.routing kind), ``routing_params``, ``seed``;
- ``num_sms``: blocks per rank of the dispatch and combine (0: the rank's
  share of the SMs);
- ``route``: "two_hop" (node dedup, forwarding in the node) or "direct"
  (every row put straight into its final row; cupyep.normal.internode_kernels.ROUTES);
- ``rdma_chunk``: a rank's rows for one node that a warp stages and sends
  with one put; ``nvlink_chunk``: consecutive network rows a warp of the
  rail peer forwards (the dispatch's knobs, TwoHopDispatch);
- ``iters``: timed calls; ``hops``: also the per-hop times of 10 untimed
  calls (cupyep.lab.metrics.two_hop_metrics).

Metrics: cupyep.lab.bench.internode.measure's fields ("time_us" and
"notify_us" on the kernel clock, each call lined up across the ranks by a
GPU barrier ("lined_up"), "event_us" and "notify_event_us" on CUDA
events, "span_us", "host_us", the traffic and its GB/s), "hop_us" when ``hops``, "nodes",
"imbalance_factor" of the routing and "num_sms_used". Every configuration
first checks one dispatch and its combine against the one-node oracle.
Skipped: one node only (launch with ``--ranks-per-node``), no nvshmem4py.
The TwoHopDispatch is kept between configurations of the same shape,
``num_sms`` and ``route``.
"""
from __future__ import annotations

from .studies import Skip, Study, register
from ...routing import KINDS as ROUTING_KINDS

KNOBS = {"kind": "dispatch_bf16", "tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "routing": "uniform",
         "routing_params": {}, "seed": 0, "num_sms": 0, "route": "two_hop", "rdma_chunk": 1, "nvlink_chunk": 1, "iters": 10,
         "hops": True}

_state: dict = {}


def _two_hop(group, cfg: dict):
    """The TwoHopDispatch of this configuration's shape, made (collectively) when it changes."""
    from ...normal.internode_kernels import TwoHopDispatch
    shape = (cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"], cfg["num_sms"], cfg["route"])
    if _state.get("shape") != shape:
        old = _state.pop("hop", None)
        if old is not None:
            old.destroy()
        _state["hop"] = TwoHopDispatch(group, *shape[:4], num_sms=shape[4], route=shape[5])
        _state["shape"] = shape
    return _state["hop"]


def run(group, cfg: dict) -> dict:
    """Measure one configuration (collective); see the module docstring."""
    from ... import routing
    from ..bench.internode import KINDS, hop_times_of, measure, prepare
    from ...nvshmem import NvshmemUnavailable
    if cfg["kind"] not in KINDS:
        raise Skip(f"kind must be one of {KINDS}, got {cfg['kind']!r}")
    if group.num_nodes < 2:
        raise Skip("the two-hop mode needs ranks on two or more nodes: sweep with --ranks-per-node K (K < ranks)")
    from ...normal.internode_kernels import check_chunk, check_route
    try:  # the knobs, checked before anything is made
        check_route(cfg["route"])
        check_chunk("rdma_chunk", cfg["rdma_chunk"])
        check_chunk("nvlink_chunk", cfg["nvlink_chunk"])
    except ValueError as exc:
        raise Skip(str(exc)) from None
    R, K = group.world_size, group.local_size
    T, k, E = cfg["tokens"], cfg["topk"], cfg["experts"]
    idx, w = routing.make(cfg["routing"], cfg["seed"], [T] * R, E, k, **dict(cfg["routing_params"]))
    try:
        hop = _two_hop(group, cfg)
    except NvshmemUnavailable as exc:
        raise Skip(str(exc)) from None
    hop.rdma_chunk, hop.nvlink_chunk = cfg["rdma_chunk"], cfg["nvlink_chunk"]
    x, ids, ws, traffic, handle = prepare(group, hop, idx, w)  # checked against the oracle first
    from ...barrier import gpu_barrier
    with gpu_barrier(group) as barrier:  # each timed call lined up across every rank
        rec = measure(group, hop, cfg["kind"], x, ids, ws, handle, cfg["iters"], traffic, before=barrier)
    rec.update(nodes=R // K, imbalance_factor=routing.imbalance_factor(idx, E), num_sms_used=hop.num_sms)
    if cfg["hops"]:
        from ...metrics import two_hop_metrics
        hops = two_hop_metrics(group, hop, x, ids, ws)
        rec["hop_us"] = hop_times_of(hops, cfg["kind"])
    return rec


register(Study(name="internode", knobs=KNOBS, run=run, choices={"routing": ROUTING_KINDS}, needs_gpu=True,
               description="two-hop dispatch / combine across (emulated) nodes on the GPU (NVSHMEM)"))
