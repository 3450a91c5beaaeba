"""Where cupyep.deep_ep's low-latency calls spend their host time: the
adapter's conversions and cupyep's own call, timed inside each call.

    python -m cupyep.launcher -n 8 experiments/probes/probe_adapter_conversions.py

Each of 300 rounds (after 20 of warm-up) drains torch's stream, times one
``low_latency_dispatch``, drains again and times its ``low_latency_combine``
(T = 128 tokens per rank, H = 7168, 256 experts, top-8, FP8). During the
combine the adapter's helpers (``to_cupy``, ``to_torch``, ``torch_stream``,
``overlap``, ``_hook``, ``native_handle``) and cupyep's
``LowLatencyBuffer.combine`` are wrapped so that each adds its host time to
its own total. Rank 0 prints, per rank, the median dispatch and combine
times and the median of each total per combine, in microseconds.
"""
import time


def main():
    from cupyep.lab.bench import require_gpu
    require_gpu(__file__)
    import numpy as np
    import torch

    import cupyep
    from cupyep import deep_ep
    from cupyep.deep_ep import buffer as BM
    from cupyep.testing import global_routing, payload_bf16

    group = cupyep.init()
    torch.cuda.set_device(group.device_id)
    R, me, E, T, H, k = group.local_size, group.local_rank, 256, 128, 7168, 8
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buf = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
    idx_all, w_all = global_routing(1, [T] * R, E, k)
    x_t = torch.from_numpy(payload_bf16(me, np.arange(T), H).view(np.int16)).cuda().view(torch.bfloat16)
    idx_t, w_t = torch.from_numpy(idx_all[me]).cuda(), torch.from_numpy(w_all[me]).cuda()
    buf.clean_low_latency_buffer(T, H, E)
    ll = buf.low_latency
    y_t = torch.zeros((E // R, R * T, H), dtype=torch.bfloat16, device="cuda")
    acc = {}
    def wrap(mod, name):
        f = getattr(mod, name)
        def w(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        setattr(mod, name, w)
    for n in ("to_cupy", "to_torch", "torch_stream", "overlap", "_hook", "native_handle"):
        wrap(BM, n)
    wrap(ll, "combine")
    wrap(ll, "dispatch")
    tot = {"dispatch": [], "combine": []}
    parts = []
    for i in range(320):
        torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        r = buf.low_latency_dispatch(x_t, idx_t, T, E, use_fp8=True)
        t1 = time.perf_counter()
        torch.cuda.current_stream().synchronize()
        acc.clear()
        t2 = time.perf_counter()
        c = buf.low_latency_combine(y_t, idx_t, w_t, r[2])
        t3 = time.perf_counter()
        if i >= 20:
            tot["dispatch"].append(t1 - t0); tot["combine"].append(t3 - t2); parts.append(dict(acc))
        del r, c
    med = {k: float(np.median(v)) * 1e6 for k, v in tot.items()}
    pm = {k: float(np.median([p.get(k, 0) for p in parts])) * 1e6 for k in parts[0]}
    res = group.comm.gather((med, pm), root=0)
    if group.rank == 0:
        for rk, (m, p) in enumerate(res):
            print(rk, {k: round(v, 1) for k, v in m.items()}, {k: round(v, 1) for k, v in p.items()}, flush=True)
    buf.destroy(); group.destroy()


if __name__ == "__main__":
    main()
