"""The two-hop dispatch and combine across (emulated) nodes on the GPU: the
oracle check and the timing of one kind, shared by
experiments/bench_internode.py and the "internode" study
(cupyep.lab.experiments.gpu_internode).

Kinds (:data:`KINDS`):

- ``dispatch_bf16``: a counted dispatch, its notify pass across nodes (the
  layout, the count exchange, the plan) included;
- ``dispatch_bf16_cached``: a dispatch that reuses the first call's handle
  (its notify pass is only the barrier between calls);
- ``combine_bf16``: the combine of the last dispatch's rows (identity
  experts: each received row goes back unchanged).

Each timed call starts lined up across ranks when ``measure`` is given a GPU
barrier (``before``; the benchmark and the study pass cupyep.barrier.gpu_barrier):
a GPU sleep (so the host has queued what follows), the barrier, then the call,
as the low-latency benchmark's strict timing does. Without it a kernel's time
holds the ranks' host skew: a combine follows its untimed dispatch's read-back
on each rank's own schedule, and a notify waits for the last rank to arrive.
Records say which ("lined_up").

Times, the median over ``iters`` calls of the slowest rank (MPI MAX), on the
kernel clock ("clock": "kernel"): first block start to last block end, from
the stamps the kernels write (cupyep.lab.bench.stamps): "time_us" the dispatch
or combine kernel, "kernel_us_p90" its p90, "notify_us" the notify kernel
before a dispatch; "span_us" the median over calls of the first start on any
rank to the last end on any rank, when every rank is on one GPU (whose timer
they share; None otherwise). CUDA
events around the same kernels beside them: "event_us", "notify_event_us".
"host_us": the whole call on the host. Traffic as DeepEP's internode test counts it
(cupyep.reference.internode.two_hop_traffic): "rdma_bytes" one row per
(token, remote node), "rdma_bytes_without_dedup" one per (token, remote
rank), "dedup_saved_bytes" their difference, "nvlink_bytes" every row a rank
receives; "rdma_GBps" and "nvlink_GBps" are those over "time_us".
"""
from __future__ import annotations

import time

import numpy as np

KINDS = ("dispatch_bf16", "dispatch_bf16_cached", "combine_bf16")


def check_against_oracle(group, out, combined, idx, w, tokens, num_experts: int, hidden: int) -> None:
    """RuntimeError on every rank unless this rank's dispatch ``out`` (of rows
    tagged payload_bf16(source, token)) equals the one-node oracle row for
    row and its ``combined`` rows (identity experts) are within calc_diff
    5e-6 of each token's row times the ranks it visited (collective)."""
    from mpi4py import MPI

    from ... import reference as ref
    from ...testing import bf16_to_f32, payload_bf16
    R, me = group.world_size, group.rank
    res = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, num_experts,
                                 topk_weights=w)
    exp = res[me]
    rows = np.empty((exp.num_recv_tokens, hidden), dtype=np.uint16)
    for s in range(R):
        sel = exp.recv_src_rank == s
        rows[sel] = payload_bf16(s, exp.recv_src_idx[sel], hidden)
    ok = np.array_equal(out.recv_x.get(), rows) and np.array_equal(out.recv_src_idx.get(), exp.recv_src_idx)
    mine = bf16_to_f32(payload_bf16(me, np.arange(tokens[me]), hidden))
    visits = ref.get_dispatch_layout(idx[me], num_experts, R).is_token_in_rank.sum(axis=1)[:, None]
    diff = ref.calc_diff(bf16_to_f32(combined.get()), (mine * visits).astype(np.float32)) if tokens[me] else 0.0
    ok = ok and diff < 5e-6
    if not group.comm.allreduce(bool(ok), op=MPI.LAND):
        raise RuntimeError(f"two-hop dispatch / combine differ from the oracle (rank {me}: combine calc_diff {diff})")


def prepare(group, hop, idx, w):
    """This rank's rows (payload_bf16 tags) and routing on the GPU for the
    TwoHopDispatch ``hop``, after one dispatch and its combine are checked
    against the oracle (collective): (x, topk_idx, topk_weights, the
    routing's TwoHopTraffic, a handle of a counted call for cached calls).
    ``idx`` / ``w``: every rank's routing (lists of NumPy arrays)."""
    import cupy

    from ...reference import internode as I
    from ...testing import payload_bf16
    R, me, K = group.world_size, group.rank, group.local_size
    tokens = [len(i) for i in idx]
    x = cupy.asarray(payload_bf16(me, np.arange(tokens[me]), hop.hidden))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    out = hop.dispatch(x, ids, ws)
    check_against_oracle(group, out, hop.combine(out.recv_x.copy(), out.handle), idx, w, tokens, hop.E, hop.hidden)
    traffic = I.two_hop_traffic(I.two_hop_routes(idx, hop.E, R, K), K, hop.hidden * 2)
    return x, ids, ws, traffic, hop.dispatch(x, ids, ws).handle


def hop_times_of(hops: dict, kind: str) -> dict:
    """The per-hop times (cupyep.lab.metrics.two_hop_metrics) that belong to ``kind``'s record."""
    return hops["combine_hop_us" if kind == "combine_bf16" else "dispatch_hop_us"]


LINE_UP_SLEEP_US = 400.0  # the GPU sleep before the barrier (timing.timed_rounds' default)


def measure(group, hop, kind: str, x, topk_idx, topk_weights, handle, iters: int, traffic,
            new_stamps=None, before=None, sleep_us: float = LINE_UP_SLEEP_US) -> dict:
    """Time ``iters`` calls of ``kind`` on the TwoHopDispatch ``hop`` (collective).

    Arguments:
        x: cupy [T, H] uint16; topk_idx [T, k] int64; topk_weights [T, k] float32.
        handle: the TwoHopHandle a cached dispatch reuses.
        traffic: cupyep.reference.internode.TwoHopTraffic of the routing.
        new_stamps: n -> int64 [n, 2] kernel stamps (default
            cupyep.lab.bench.stamps.new_kernel_stamps, on the device).
        before: None, or a callable enqueuing a GPU barrier over every rank
            (cupyep.barrier.gpu_barrier): each timed call then runs behind a
            GPU sleep of ``sleep_us`` and that barrier (its untimed dispatch,
            for a combine, before them).

    Returns the record fields of the module docstring.
    """
    from mpi4py import MPI
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if new_stamps is None:
        from .stamps import new_kernel_stamps as new_stamps
    dispatching = kind != "combine_bf16"
    stamps, notify_stamps = new_stamps(iters), new_stamps(iters) if dispatching else None
    events, host, notify_events = [], [], []

    def line_up():
        if before is None:
            return
        if sleep_us:
            from .timing import gpu_sleep
            gpu_sleep(sleep_us)
        before()

    for i in range(iters):
        if not dispatching:  # one combine per dispatch: each after its own (untimed) dispatch
            made = hop.dispatch(x, topk_idx, topk_weights)
            y = made.recv_x.copy()
            line_up()
            t0 = time.perf_counter()
            hop.combine(y, made.handle, kernel_ns=stamps[i])
        else:
            line_up()
            t0 = time.perf_counter()
            if kind == "dispatch_bf16":
                hop.dispatch(x, topk_idx, topk_weights, kernel_ns=stamps[i], notify_ns=notify_stamps[i])
            else:
                hop.dispatch(x, handle=handle, topk_weights=topk_weights, kernel_ns=stamps[i],
                             notify_ns=notify_stamps[i])
        host.append(time.perf_counter() - t0)
        events.append(hop.last_kernel_us)
        if dispatching:
            notify_events.append(hop.last_notify_us)

    def slowest(v):
        return group.comm.allreduce(float(v), op=MPI.MAX)

    def on_host(st):
        return np.asarray(st.get() if hasattr(st, "get") else st, dtype=np.int64)

    from .stamps import cross_rank, kernel_seconds, one_timer
    kernel = on_host(stamps)
    kernel_us = kernel_seconds(kernel) * 1e6
    notify_us = kernel_seconds(on_host(notify_stamps)) * 1e6 if dispatching else None
    span = cross_rank(np.stack(group.comm.allgather(kernel)))["span"]["median_us"] if one_timer(group) else None
    t_us = slowest(np.median(kernel_us))
    return {"clock": "kernel", "lined_up": before is not None, "time_us": t_us, "kernel_us_p90": slowest(np.percentile(kernel_us, 90)),
            "span_us": span, "event_us": slowest(np.median(events)),
            "host_us": slowest(np.median(host) * 1e6),
            "notify_us": slowest(np.median(notify_us)) if dispatching else None,
            "notify_event_us": slowest(np.median(notify_events)) if dispatching else None,
            **route_bytes(traffic, hop.direct, t_us)}


def route_bytes(traffic, direct: bool, t_us: float) -> dict:
    """A record's traffic fields for the route: the two-hop route's network
    bytes are one row per (token, remote node) and every received row crosses
    NVLink last; the direct route sends one row per (token, remote rank)
    over the network (no dedup) and only the rows within a node over NVLink."""
    rdma = traffic.rdma_bytes_without_dedup if direct else traffic.rdma_bytes
    nvlink = traffic.nvlink_bytes - traffic.rdma_bytes_without_dedup if direct else traffic.nvlink_bytes
    return {"rdma_bytes": rdma, "rdma_bytes_without_dedup": traffic.rdma_bytes_without_dedup,
            "dedup_saved_bytes": 0 if direct else traffic.saved_bytes, "nvlink_bytes": nvlink,
            "rdma_GBps": rdma / t_us / 1e3, "nvlink_GBps": nvlink / t_us / 1e3}
