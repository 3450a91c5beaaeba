"""Metrics from inside the kernels, for sweeps and monitoring (opt-in).

The kernels write them only when given somewhere to write, so a call that
asks for none pays one untaken branch:

- normal mode: ``Buffer.dispatch(..., notify_time_ns=a)`` (int64 [2]) adds
  the notify pass's device time (``%globaltimer`` in the block that runs it)
  to ``a[0]`` and 1 to ``a[1]``; on the queue transport,
  ``queue_occupancy=q`` (uint64 [3]) adds the rows each receiver poll finds
  waiting in its ring to ``q[0]``, the polls to ``q[1]`` and keeps their
  maximum in ``q[2]``;
- across nodes: ``TwoHopDispatch.dispatch(..., hop_ns=s)`` and
  ``combine(..., hop_ns=s)`` (uint64 [4], set to
  ``cupyep.normal.internode_kernels.HOP_STAMPS_INIT`` first) write four %globaltimer stamps
  that delimit each hop: the network hop and the NVLink forwarding of the
  dispatch, the in-node hop, the network hop and the final reduction of the
  combine;
- low-latency mode: ``LowLatencyBuffer.dispatch(...,
  dispatch_wait_recv_cost_stats=w)`` (int64 [R]) adds the nanoseconds block 0
  waited for each source rank's flag (the signal-slot wait) to ``w[src]``, and
  ``cumulative_local_expert_recv_stats=c`` (int32 [E_local]) the tokens each
  local expert received; the result's ``recv_count`` gives the slots used.

The collectors below run extra, untimed calls with those arrays (after the
timed ones, so the timing never carries them) and reduce what they read to
the figures a sweep record holds: notify time per call, the distribution of
signal waits (p50 / p99 over calls x source ranks), ring-queue occupancy
(rows waiting / queue depth, mean and max over receiver polls), slot
utilisation (slots used / slots allocated) and the per-expert imbalance of received tokens
(max / mean over every expert of every rank). Each is collective over the
group.
"""
from __future__ import annotations

import numpy as np

PERCENTILES = (50, 99)


def percentiles(values, qs=PERCENTILES) -> dict:
    """{"p50": ..., "p99": ...} of ``values`` (linear interpolation, NumPy's
    default); None for each when there are none."""
    v = np.asarray(list(values), dtype=np.float64)
    return {f"p{q}": (float(np.percentile(v, q)) if v.size else None) for q in qs}


def imbalance(counts) -> float | None:
    """max / mean of per-expert counts (None when they are all zero or absent)."""
    c = np.asarray(counts, dtype=np.float64).ravel()
    if not c.size or c.mean() == 0:
        return None
    return float(c.max() / c.mean())


def notify_samples_us(deltas) -> list[float]:
    """Per-call notify times in microseconds from successive readings of a
    notify_time_ns array: ``deltas`` is a list of (ns added, calls added)
    pairs, one per call; a reading that added no call is skipped."""
    return [ns / 1e3 / calls for ns, calls in deltas if calls > 0]


def normal_metrics(group, call, calls: int = 10) -> dict:
    """Notify time of ``calls`` notified dispatches (``call(notify_time_ns=a)``
    runs one; the device is synchronised after each so every call is read on
    its own). Returns {"notify_us_p50", "notify_us_p99", "notify_us_max"},
    each the slowest rank's."""
    import cupy
    from mpi4py import MPI
    stats = cupy.zeros(2, dtype=np.int64)
    deltas, last = [], np.zeros(2, dtype=np.int64)
    for _ in range(calls):
        call(notify_time_ns=stats)
        cupy.cuda.runtime.deviceSynchronize()
        now = stats.get()
        deltas.append(tuple(int(v) for v in now - last))
        last = now
    samples = notify_samples_us(deltas)
    p = percentiles(samples)
    local = {"notify_us_p50": p["p50"], "notify_us_p99": p["p99"], "notify_us_max": max(samples, default=None)}
    return {k: (group.comm.allreduce(v, op=MPI.MAX) if v is not None else None) for k, v in local.items()}


def occupancy(stats, queue_depth: int) -> dict:
    """{"queue_occupancy_mean", "queue_occupancy_max"}: rows waiting per ring
    poll over ``queue_depth``, from a queue_occupancy reading [sum, polls,
    max] (None for each without polls)."""
    total, polls, most = (int(v) for v in stats)
    if polls == 0:
        return {"queue_occupancy_mean": None, "queue_occupancy_max": None}
    return {"queue_occupancy_mean": total / polls / queue_depth, "queue_occupancy_max": most / queue_depth}


def queue_metrics(group, call, queue_depth: int, calls: int = 10) -> dict:
    """Ring-queue occupancy of ``calls`` queue-transport dispatches
    (``call(queue_occupancy=q)`` runs one), as :func:`occupancy` over every
    rank's polls: the mean over all of them and the largest."""
    import cupy
    stats = cupy.zeros(3, dtype=np.uint64)
    for _ in range(calls):
        call(queue_occupancy=stats)
    cupy.cuda.runtime.deviceSynchronize()
    mine = stats.get()
    every = np.stack(group.comm.allgather(mine))
    return occupancy((every[:, 0].sum(), every[:, 1].sum(), every[:, 2].max()), queue_depth)


def slowest_medians(group, samples: list[dict]) -> dict:
    """{name: the slowest rank's median over ``samples``} of per-call dicts
    (None values skipped; None where a name has no value on any rank)."""
    from mpi4py import MPI
    names = list(samples[0]) if samples else []
    out = {}
    for name in names:
        vals = [v[name] for v in samples if v.get(name) is not None]
        mine = float(np.median(vals)) if vals else -1.0
        most = group.comm.allreduce(mine, op=MPI.MAX)
        out[name] = most if most >= 0 else None
    return out


def two_hop_metrics(group, two_hop, x, topk_idx, topk_weights, calls: int = 10) -> dict:
    """Per-hop times of ``calls`` two-hop dispatches and their combines
    (identity experts: each received row combined back), untimed. Returns
    {"dispatch_hop_us": {"network", "forward", "total"}, "combine_hop_us":
    {"node", "network", "reduce", "total"}}, each the slowest rank's median
    over the calls (cupyep.normal.internode_kernels.DISPATCH_HOPS / COMBINE_HOPS). The
    direct route forwards nothing: its "forward" is None and its "network"
    ends when every row from other nodes has arrived."""
    import cupy

    from ..normal.internode_kernels import COMBINE_HOPS, DISPATCH_HOPS, HOP_STAMPS_INIT, hop_times_us
    init = np.array(HOP_STAMPS_INIT, dtype=np.uint64)
    d, c = [], []
    for _ in range(calls):
        stamps = cupy.asarray(init)
        out = two_hop.dispatch(x, topk_idx, topk_weights, hop_ns=stamps)
        d.append(hop_times_us(stamps.get(), DISPATCH_HOPS))
        stamps = cupy.asarray(init)
        two_hop.combine(out.recv_x.copy(), out.handle, hop_ns=stamps)
        c.append(hop_times_us(stamps.get(), COMBINE_HOPS))
    return {"dispatch_hop_us": slowest_medians(group, d), "combine_hop_us": slowest_medians(group, c)}


def low_latency_metrics(group, buf, x, topk_idx, calls: int = 10, use_fp8: bool = True, barrier=None,
                        sleep_us: float = 400.0) -> dict:
    """Signal waits, slot utilisation and received-token imbalance of
    ``calls`` low-latency dispatches (each combined away, so the buffer's
    sets stay in step). Returns {"wait_us_p50", "wait_us_p99", "wait_us_max"}
    over every (call, source rank) wait of every rank, those waits
    themselves ("wait_us_samples", for a CDF), "slot_utilisation"
    (slots used / slots allocated, mean over calls and ranks) and
    "expert_recv_imbalance" (max / mean over all ranks' experts).

    ``barrier`` (a cupyep.barrier.GpuBarrier, or None): line the ranks up on
    the GPU before each call, after a GPU sleep of ``sleep_us`` that lets
    every host queue the call first (as the timed rounds do), so that a wait
    measures the protocol and not how late a peer's host launched. Without
    it the waits include that launch skew."""
    import cupy
    R = buf.num_ranks
    El = buf.num_local_experts
    recv_stats = cupy.zeros(El, dtype=np.int32)
    from .bench.timing import gpu_sleep
    waits, used = [], []
    buf._check_routing(topk_idx, x.shape[0], validate=True)  # once: a host check inside the loop would sync
    for _ in range(calls):
        wait = cupy.zeros(R, dtype=np.int64)
        if barrier is not None:
            gpu_sleep(sleep_us)
            barrier()
        # validate=False: the routing check reads back to the host, which would hold this launch until
        # the sleep and the barrier ended, so the call would start as late as its host got there.
        d = buf.dispatch(x, topk_idx, use_fp8=use_fp8, cumulative_local_expert_recv_stats=recv_stats,
                         dispatch_wait_recv_cost_stats=wait, validate=False)
        cupy.cuda.runtime.deviceSynchronize()
        waits.extend(float(v) / 1e3 for v in wait.get())
        used.append(int(d.recv_count.get().sum()))
        buf.combine(cupy.zeros(d.recv_x.shape, dtype=np.uint16), topk_idx,
                    cupy.zeros(topk_idx.shape, dtype=np.float32), d.handle)
    cupy.cuda.runtime.deviceSynchronize()
    all_waits = [v for part in group.comm.allgather(waits) for v in part]
    all_used = [v for part in group.comm.allgather(used) for v in part]
    all_recv = np.concatenate(group.comm.allgather(recv_stats.get()))
    p = percentiles(all_waits)
    slots = El * buf.layout.slots
    return {"wait_us_p50": p["p50"], "wait_us_p99": p["p99"], "wait_us_max": max(all_waits, default=None),
            "wait_us_samples": all_waits,
            "slot_utilisation": float(np.mean(all_used)) / slots if slots else None,
            "expert_recv_imbalance": imbalance(all_recv)}
