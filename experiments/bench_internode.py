"""The two-hop dispatch and combine across (emulated) nodes: time and traffic.

    python -m cupyep.launch -n 8 --ranks-per-node 4 experiments/bench_internode.py --out results/internode.jsonl

One record per (kind, ranks, ranks per node): the kernel's device time
(CUDA events around the launch, median over --iters calls, the slowest
rank's; for the dispatch also its notify pass across nodes, "notify_us",
the kernel before it; "dispatch_bf16_cached" reuses the first call's
handle, so its notify pass is only the barrier between calls), the host time of the whole call, and the traffic
of the call as DeepEP's internode test counts it
(cupyep.reference.internode.two_hop_traffic): the logical network (RDMA)
bytes, one row per (token, remote node); the NVLink bytes, every row a rank
receives; and the bytes the per-node deduplication saves against one row
per (token, remote rank). The first call's output is checked against the
one-node oracle (cupyep.reference.intranode_dispatch) and the combine
against the exact sum (calc_diff < 5e-6) before anything is timed. "hop_us":
each hop's time from the kernels' own stamps over 10 more, untimed calls
(cupyep.metrics.two_hop_metrics): the dispatch's network hop, its NVLink
forwarding and the whole kernel; the combine's in-node hop, network hop and
final reduction.
"""
import argparse
import time

import numpy as np

import cupyep
from cupyep.bench import require_gpu
from cupyep.bench.report import JsonlWriter
from cupyep.testing import bf16_to_f32, global_routing, payload_bf16


def _check(group, out, comb, idx, w, tokens, E, H):
    from cupyep import reference as ref
    from mpi4py import MPI
    R, me = group.world_size, group.rank
    res = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, E, topk_weights=w)
    exp = res[me]
    rows = np.empty((exp.num_recv_tokens, H), dtype=np.uint16)
    for s in range(R):
        sel = exp.recv_src_rank == s
        rows[sel] = payload_bf16(s, exp.recv_src_idx[sel], H)
    ok = np.array_equal(out.recv_x.get(), rows) and np.array_equal(out.recv_src_idx.get(), exp.recv_src_idx)
    ys = [bf16_to_f32(payload_bf16(s, np.arange(tokens[s]), H)) for s in range(R)]
    visits = [ref.get_dispatch_layout(i, E, R).is_token_in_rank.sum(axis=1)[:, None] for i in idx]
    diff = ref.calc_diff(bf16_to_f32(comb.get()), (ys[me] * visits[me]).astype(np.float32)) if tokens[me] else 0.0
    ok = ok and diff < 5e-6
    if not group.comm.allreduce(ok, op=MPI.LAND):
        raise RuntimeError(f"two-hop dispatch / combine differ from the oracle (rank {me}: combine calc_diff {diff})")


def main():
    require_gpu(__file__)
    import cupy
    from mpi4py import MPI

    from cupyep.internode import TwoHopDispatch
    from cupyep.metrics import two_hop_metrics
    from cupyep.reference import internode as I
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/internode.jsonl")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    group = cupyep.init()
    if group.num_nodes < 2:
        if group.rank == 0:
            print("bench_internode needs ranks on two or more nodes: launch with --ranks-per-node K (K < ranks)")
        raise SystemExit(2)
    R, me, K = group.world_size, group.rank, group.local_size
    T, H, E, k = args.tokens, args.hidden, args.experts, args.topk
    tokens = [T] * R
    idx, w = global_routing(0, tokens, E, k)
    x = cupy.asarray(payload_bf16(me, np.arange(T), H))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    hop = TwoHopDispatch(group, T, H, k, E)
    out = hop.dispatch(x, ids, ws)
    comb = hop.combine(out.recv_x.copy())  # identity experts: each token's row times the ranks it visited
    _check(group, out, comb, idx, w, tokens, E, H)
    hops = two_hop_metrics(group, hop, x, ids, ws)  # untimed calls with the hop stamps (cupyep.metrics)
    traffic = I.two_hop_traffic(I.two_hop_routes(idx, E, R, K), K, H * 2)
    writer = JsonlWriter(args.out, group)
    handle = out.handle
    for kind in ("dispatch_bf16", "dispatch_bf16_cached", "combine_bf16"):
        kernel, host, notify = [], [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            if kind == "dispatch_bf16":
                out = hop.dispatch(x, ids, ws)
            elif kind == "dispatch_bf16_cached":
                out = hop.dispatch(x, handle=handle, topk_weights=ws)
            else:
                y = out.recv_x.copy()
                t0 = time.perf_counter()
                hop.combine(y)
            host.append(time.perf_counter() - t0)
            kernel.append(hop.last_kernel_us)
            if kind.startswith("dispatch"):
                notify.append(hop.last_notify_us)
        slow = lambda v: group.comm.allreduce(float(v), op=MPI.MAX)  # noqa: E731
        t_us = slow(np.median(kernel))
        writer.write({"bench": "internode", "kind": f"{kind}_two_hop", "ranks": R, "ranks_per_node": K,
                      "nodes": R // K, "tokens": T, "hidden": H, "topk": k, "experts": E, "time_us": t_us,
                      "kernel_us_p90": slow(np.percentile(kernel, 90)), "host_us": slow(np.median(host) * 1e6),
                      "notify_us": slow(np.median(notify)) if notify else None,
                      "rdma_bytes": traffic.rdma_bytes, "rdma_bytes_without_dedup": traffic.rdma_bytes_without_dedup,
                      "dedup_saved_bytes": traffic.saved_bytes, "nvlink_bytes": traffic.nvlink_bytes,
                      "rdma_GBps": traffic.rdma_bytes / t_us / 1e3, "nvlink_GBps": traffic.nvlink_bytes / t_us / 1e3,
                      "hop_us": hops["combine_hop_us" if kind == "combine_bf16" else "dispatch_hop_us"],
                      "checked": True, "version": "device notify"})
    hop.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
