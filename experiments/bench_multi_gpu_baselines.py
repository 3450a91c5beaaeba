"""Baselines for several GPUs: the NVLink P2P copy roofline, NCCL
all-to-all with a dispatch's bytes, and cupyep's direct transport beside them.

    python -m cupyep.launcher -n 8 experiments/bench_multi_gpu_baselines.py --out results/multi_gpu/baselines.jsonl

Needs one rank per GPU on 2 or more GPUs of one node (``-n`` at most the GPU
count); with ranks sharing a GPU, one GPU or several nodes it says what it
needs and exits with status 2, before any measurement.

Parts (``--parts``, default all three, in this order):

- **p2p**: copies of ``--bytes`` (1 GiB) from a rank's own GPU into a peer's
  memory through the CUDA IPC peer pointer (a cupyep.ipc.SymmetricBuffer),
  by the SMs (``engine`` "kernel": cupyep/lab/bench/copy.py's copy kernel on
  the sender's stream, reading local memory and writing the peer's) and by
  the copy engines (``engine`` "copy_engine": cudaMemcpyAsync on the peer
  pointer). Kinds: ``p2p_uni`` (one ordered pair at a time, only the sender
  copies; ``--pairs all``: every ordered pair, ``ring``: r -> r+1),
  ``p2p_bi`` (both directions of a pair at once), ``p2p_ring`` (every rank
  r -> r + shift at once, for each shift of ``--shifts``) and
  ``p2p_all_pairs`` (every rank sends 1/(R-1) of the bytes to every peer at
  once, each share on its own stream: the pattern a dispatch makes).
  ``bytes`` is what one sender sends in the measurement, ``GBps`` is bytes
  / time, per direction and per rank; ``GBps_total`` adds the directions.
  Every copy is checked (the receiver's region holds the sender's bytes).
- **nccl**: ``torch.distributed`` with the NCCL backend, initialised from the
  same mpi4py ranks (rank 0 picks MASTER_ADDR/PORT and broadcasts them),
  ``all_to_all_single`` of BF16 rows with the split sizes of a dispatch of
  the benchmark's shape: T tokens per rank, hidden H, top-k of E experts,
  the routing of ``cupyep.testing.global_routing(seed, [T] * R, E, k)``, rows
  from rank s to rank d = tokens of s whose top-k hits an expert of d (one
  row per token and rank, as normal mode sends;
  cupyep.reference.get_dispatch_layout). ``nccl_all_to_all_combine`` is the
  transpose. Without torch (or NCCL, or torch's CUDA) both kinds are
  recorded as skipped with the reason.
- **direct**: cupyep's normal mode on the direct transport at the same shape
  and routing (cupyep.lab.bench.normal.measure, strict timing): cached
  ``dispatch_bf16``, ``dispatch_bf16_notify`` and ``combine_bf16``, recorded
  as ``cupyep_<kind>_direct``.

Timing: CUDA events around each call, a GPU barrier before each call inside
the events (the ranks start together), ``time_us`` the slowest rank's median
over ``--iters`` calls (``--p2p-iters`` for the copies); NCCL and cupyep
calls flush L2 before each call as bench_normal's "strict" boundary does.
Per-rank rates of the all-to-alls: ``recv_GBps`` = bytes the rank receives
/ its median, mean over ranks; ``rank_GBps`` counts as
cupyep.lab.bench.normal does (rows the rank receives in the dispatch x row
bytes, for the combine the rows it sends back) so it compares with the
direct transport's records; ``remote_rank_GBps`` is ``rank_GBps`` times the
share of the rows that cross to another rank (a rank's rows to itself do not
cross NVLink), for NCCL and cupyep alike.

A last record (kind ``summary``) holds the speed-up of the direct transport
over NCCL (NCCL time / cupyep time, dispatch and combine) and each one's
GB/s per rank as a fraction of the all-pairs P2P copy (the issue's target:
0.8 or more).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

from cupyep.lab.bench import require_gpu

SCRIPT = "experiments/bench_multi_gpu_baselines.py"
BENCH = "multi_gpu_baselines"
PARTS = ("p2p", "nccl", "direct")
ENGINES = ("kernel", "copy_engine")
P2P_KINDS = ("p2p_uni", "p2p_bi", "p2p_ring", "p2p_all_pairs")
NCCL_KINDS = ("nccl_all_to_all_dispatch", "nccl_all_to_all_combine")
DIRECT_KINDS = ("dispatch_bf16", "dispatch_bf16_notify", "combine_bf16")
REFUSED_STATUS = 2
ALIGN = 256          # bytes: every copy's offset and size (the copy kernel needs 16)
TARGET_FRACTION = 0.8


# ------------------------------------------------------------ host logic ---

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="P2P copy roofline, NCCL all-to-all and the direct transport "
                                            "on several GPUs (one rank per GPU)")
    p.add_argument("--out", default="results/multi_gpu/baselines.jsonl")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--bytes", type=int, default=1 << 30, help="bytes each sender copies (p2p)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--kinds", nargs="+", choices=P2P_KINDS, default=list(P2P_KINDS), help="p2p kinds to run")
    p.add_argument("--pairs", choices=("all", "ring"), default="all",
                   help="pairs of p2p_uni / p2p_bi: every pair, or r -> r+1 only")
    p.add_argument("--shifts", type=int, nargs="+", default=None,
                   help="shifts of p2p_ring (default every shift 1 .. R-1)")
    p.add_argument("--blocks", type=int, default=None,
                   help="copy-kernel blocks per rank, shared by its concurrent copies (default 2 x SMs)")
    p.add_argument("--p2p-iters", type=int, default=20)
    p.add_argument("--iters", type=int, default=30, help="timed calls of the NCCL and cupyep measurements")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.bytes < ALIGN:
        p.error(f"--bytes must be at least {ALIGN}, got {a.bytes}")
    for name in ("p2p_iters", "iters", "tokens", "hidden", "experts", "topk"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.hidden % 8:
        p.error(f"--hidden must be a multiple of 8 (16-byte BF16 rows), got {a.hidden}")
    if a.topk > a.experts:
        p.error(f"--topk {a.topk} is more than --experts {a.experts}")
    if a.blocks is not None and a.blocks <= 0:
        p.error(f"--blocks must be positive, got {a.blocks}")
    if a.shifts is not None and any(s <= 0 for s in a.shifts):
        p.error(f"--shifts must be positive, got {a.shifts}")
    return a


def placement_problem(world_size: int, num_nodes: int, num_devices: int, ranks_per_gpu: int,
                      script: str = SCRIPT) -> str | None:
    """Why these ranks cannot run the benchmark (None when they can): it needs
    one rank per GPU, 2 or more GPUs, all on one node."""
    how = f"python -m cupyep.launcher -n G {script} with 2 <= G <= the node's GPU count"
    if num_nodes != 1:
        return (f"{script} needs its ranks on one node (the P2P copies go through CUDA IPC); "
                f"these {world_size} ranks span {num_nodes} nodes")
    if num_devices < 2:
        return (f"{script} needs one rank per GPU on 2 or more GPUs (NVLink P2P, NCCL); this node has "
                f"{num_devices} GPU{'s' if num_devices != 1 else ''}: run it on a machine with several GPUs")
    if world_size < 2:
        return f"{script} needs 2 or more ranks, one per GPU; got {world_size}: launch it as {how}"
    if ranks_per_gpu > 1:
        return (f"{script} needs one rank per GPU (NCCL refuses ranks sharing a GPU, and a shared GPU has no "
                f"NVLink between its ranks): {world_size} ranks on {num_devices} GPUs put {ranks_per_gpu} "
                f"on one GPU; launch it as {how}")
    return None


@dataclass(frozen=True)
class Copy:
    """One copy of a P2P measurement: ``nbytes`` from byte ``src_offset`` of
    rank ``src``'s source buffer to byte ``dst_offset`` of rank ``dst``'s
    receive buffer."""
    src: int
    dst: int
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class Measurement:
    kind: str
    label: dict
    copies: tuple  # of Copy, over all ranks

    def of_rank(self, rank: int) -> list:
        return [c for c in self.copies if c.src == rank]

    def into_rank(self, rank: int) -> list:
        return [c for c in self.copies if c.dst == rank]

    @property
    def senders(self) -> list:
        return sorted({c.src for c in self.copies})

    def bytes_per_sender(self) -> int:
        """Bytes each sender sends (the same for every sender)."""
        sent = {s: sum(c.nbytes for c in self.of_rank(s)) for s in self.senders}
        if len(set(sent.values())) != 1:
            raise ValueError(f"senders of {self.kind} send different bytes: {sent}")
        return next(iter(sent.values()))


def align_down(n: int, align: int = ALIGN) -> int:
    return n // align * align


def all_pairs_chunk(nbytes: int, num_ranks: int) -> int:
    """Bytes to each peer in p2p_all_pairs: 1/(R-1) of ``nbytes``, aligned down."""
    if num_ranks < 2:
        raise ValueError(f"all pairs needs 2 or more ranks, got {num_ranks}")
    chunk = align_down(nbytes // (num_ranks - 1))
    if chunk <= 0:
        raise ValueError(f"{nbytes} bytes do not make an aligned share for each of {num_ranks - 1} peers")
    return chunk


def sender_slot(src: int, dst: int) -> int:
    """Index of ``src`` among the R-1 ranks that send to ``dst``."""
    if src == dst:
        raise ValueError("a rank does not send to itself")
    return src if src < dst else src - 1


def uni_pairs(num_ranks: int, pairs: str = "all") -> list:
    """Ordered (src, dst) pairs of p2p_uni."""
    if pairs == "all":
        return [(s, d) for s in range(num_ranks) for d in range(num_ranks) if s != d]
    if pairs == "ring":
        return list(dict.fromkeys((r, (r + 1) % num_ranks) for r in range(num_ranks)))
    raise ValueError(f"pairs must be 'all' or 'ring', got {pairs!r}")


def bi_pairs(num_ranks: int, pairs: str = "all") -> list:
    """Unordered (a, b) pairs, a < b, of p2p_bi."""
    if pairs == "all":
        return [(a, b) for a in range(num_ranks) for b in range(a + 1, num_ranks)]
    if pairs == "ring":
        return sorted({tuple(sorted((r, (r + 1) % num_ranks))) for r in range(num_ranks)})
    raise ValueError(f"pairs must be 'all' or 'ring', got {pairs!r}")


def p2p_measurements(kind: str, num_ranks: int, nbytes: int, pairs: str = "all", shifts=None) -> list:
    """The measurements of a P2P kind, each with the copies of every rank."""
    R, n = num_ranks, align_down(nbytes)
    if R < 2:
        raise ValueError(f"P2P copies need 2 or more ranks, got {R}")
    if n <= 0:
        raise ValueError(f"{nbytes} bytes is less than one aligned block of {ALIGN}")
    if kind == "p2p_uni":
        return [Measurement(kind, {"src": s, "dst": d}, (Copy(s, d, 0, 0, n),)) for s, d in uni_pairs(R, pairs)]
    if kind == "p2p_bi":
        return [Measurement(kind, {"pair": f"{a}-{b}"}, (Copy(a, b, 0, 0, n), Copy(b, a, 0, 0, n)))
                for a, b in bi_pairs(R, pairs)]
    if kind == "p2p_ring":
        shifts = list(range(1, R)) if shifts is None else list(dict.fromkeys(s % R for s in shifts))
        if 0 in shifts:
            raise ValueError(f"a shift that is a multiple of {R} sends to itself")
        return [Measurement(kind, {"shift": s}, tuple(Copy(r, (r + s) % R, 0, 0, n) for r in range(R)))
                for s in shifts]
    if kind == "p2p_all_pairs":
        chunk = all_pairs_chunk(n, R)
        copies = tuple(Copy(r, (r + j) % R, (j - 1) * chunk, sender_slot(r, (r + j) % R) * chunk, chunk)
                       for r in range(R) for j in range(1, R))
        return [Measurement(kind, {"bytes_per_peer": chunk}, copies)]
    raise ValueError(f"kind must be one of {P2P_KINDS}, got {kind!r}")


def dispatch_split_matrix(topk_idx_per_rank, num_experts: int) -> np.ndarray:
    """[R, R] int64: rows rank s sends rank d in a normal-mode dispatch (its
    tokens with an expert of d among their top-k, once per token and rank)."""
    from cupyep.reference import get_dispatch_layout
    R = len(topk_idx_per_rank)
    return np.stack([get_dispatch_layout(np.asarray(idx), num_experts, R).num_tokens_per_rank.astype(np.int64)
                     for idx in topk_idx_per_rank])


def all_to_all_splits(splits: np.ndarray, rank: int, direction: str) -> tuple:
    """(input_split_sizes, output_split_sizes) of ``rank``'s all_to_all_single:
    the dispatch sends row ``rank`` of ``splits`` and receives its column; the
    combine is the transpose."""
    row, col = [int(v) for v in splits[rank]], [int(v) for v in splits[:, rank]]
    if direction == "dispatch":
        return row, col
    if direction == "combine":
        return col, row
    raise ValueError(f"direction must be 'dispatch' or 'combine', got {direction!r}")


def remote_share(splits: np.ndarray) -> float:
    """Fraction of a dispatch's rows that cross to another rank (not the
    rows a rank sends itself), over all ranks."""
    total = int(splits.sum())
    return (total - int(np.trace(splits))) / total if total else 0.0


def block_code(src: int, dst: int, num_ranks: int) -> int:
    """Value (exact in BF16) filling the rows ``src`` sends ``dst``, to check arrival."""
    return (src * num_ranks + dst) % 251 + 1


def _stats(values) -> dict:
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return {}
    return {"min": float(a.min()), "median": float(np.median(a)), "max": float(a.max())}


def summarize(records) -> dict:
    """The summary record of one run's records: P2P GB/s over pairs, the
    direct transport's speed-up over NCCL and the fractions of the all-pairs
    P2P copy bandwidth reached (flat: scalars only; None where a part is
    missing)."""
    recs = [r for r in records if r.get("bench") == BENCH and not r.get("skipped")]
    out = {"bench": BENCH, "kind": "summary"}
    for kind in P2P_KINDS:
        for engine in ENGINES:
            st = _stats(r["GBps"] for r in recs if r["kind"] == kind and r.get("engine") == engine)
            for k, v in st.items():
                out[f"{kind}_{engine}_GBps_{k}"] = v
    ref = None
    for engine in ENGINES:  # the SMs' copy first: the direct transport writes with the SMs
        ref = next((r for r in recs if r["kind"] == "p2p_all_pairs" and r.get("engine") == engine), None)
        if ref is not None:
            break
    out["p2p_ref"] = f"p2p_all_pairs/{ref['engine']}" if ref else None
    out["p2p_ref_GBps"] = ref["GBps"] if ref else None
    by_kind = {r["kind"]: r for r in recs}
    for direction, cupyep_kind in (("dispatch", "cupyep_dispatch_bf16_direct"),
                                   ("combine", "cupyep_combine_bf16_direct")):
        nccl, ours = by_kind.get(f"nccl_all_to_all_{direction}"), by_kind.get(cupyep_kind)
        out[f"speedup_over_nccl_{direction}"] = nccl["time_us"] / ours["time_us"] if nccl and ours else None
        for who, r in (("direct", ours), ("nccl", nccl)):
            for field, tag in (("rank_GBps", ""), ("remote_rank_GBps", "_remote")):
                frac = r[field] / ref["GBps"] if r and ref and r.get(field) is not None else None
                out[f"p2p_fraction{tag}_{who}_{direction}"] = frac
        frac = out[f"p2p_fraction_direct_{direction}"]
        out[f"meets_target_{direction}"] = None if frac is None else bool(frac >= TARGET_FRACTION)
    out["target_fraction"] = TARGET_FRACTION
    return out


# ------------------------------------------------------------ GPU parts ---

def _slowest(comm, t, active: bool) -> dict:
    """Slowest active rank's median (and its p10 / p90), every rank's median."""
    meds = comm.allgather(t.median_s if active else None)
    rows = comm.allgather((t.median_s, t.p10_s, t.p90_s) if active else None)
    slow = max((r for r in rows if r is not None), key=lambda r: r[0])
    return {"time_us": slow[0] * 1e6, "p10_us": slow[1] * 1e6, "p90_us": slow[2] * 1e6,
            "rank_us": [None if m is None else m * 1e6 for m in meds]}


class _PlanRunner:
    """Enqueues one rank's copies of a measurement on the current stream
    (several copies: each on its own stream, forked from and joined into the
    current one)."""

    def __init__(self, copies, src, recv_views, engine: str, blocks: int, streams):
        import cupy
        self.copies, self.engine = copies, engine
        self.blocks = max(1, blocks // max(1, len(copies)))
        self.jobs = [(src[c.src_offset:c.src_offset + c.nbytes],
                      recv_views[c.dst][c.dst_offset:c.dst_offset + c.nbytes]) for c in copies]
        self.streams = streams[:len(copies)]
        self.fork = cupy.cuda.Event(disable_timing=True)
        self.joins = [cupy.cuda.Event(disable_timing=True) for _ in copies]

    def _copy(self, s, d, stream):
        import cupy
        if self.engine == "kernel":
            from cupyep.lab.bench.copy import device_copy
            with stream:
                device_copy(s, d, self.blocks)
        else:
            rt = cupy.cuda.runtime
            rt.memcpyAsync(d.data.ptr, s.data.ptr, s.nbytes, rt.memcpyDefault, stream.ptr)

    def __call__(self):
        import cupy
        main = cupy.cuda.get_current_stream()
        if len(self.jobs) == 1:
            self._copy(*self.jobs[0], main)
            return
        self.fork.record(main)
        for (s, d), stream, join in zip(self.jobs, self.streams, self.joins):
            stream.wait_event(self.fork)
            self._copy(s, d, stream)
            join.record(stream)
            main.wait_event(join)


def p2p_plan(args, num_ranks: int) -> list:
    """Every P2P measurement of the run, in order (raises on a bad argument
    before anything runs)."""
    return [m for kind in args.kinds for m in p2p_measurements(kind, num_ranks, args.bytes, args.pairs, args.shifts)]


def run_p2p(group, args, out, bar, plan) -> list:
    import cupy

    from cupyep.lab.bench.timing import time_fn
    from cupyep.ipc import SymmetricBuffer
    R, me, comm = group.local_size, group.local_rank, group.comm
    n = align_down(args.bytes)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    blocks = args.blocks or 2 * sms
    records = []
    main = cupy.cuda.Stream(non_blocking=True)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(R - 1)]
    src = cupy.full(n, me + 1, dtype=np.uint8)
    recv = SymmetricBuffer(group, n)
    try:
        views = {p: recv.view(0, (n,), np.uint8, peer=None if p == me else p) for p in range(R)}
        mine = views[me]
        with main:
            for m in plan:
                for engine in args.engines:
                    copies = m.of_rank(me)
                    mine.fill(0)
                    main.synchronize()
                    comm.Barrier()  # every receive buffer cleared before any copy
                    fn = _PlanRunner(copies, src, views, engine, blocks, streams)
                    t = time_fn(fn, iters=args.p2p_iters, warmup=args.warmup, flush=False, before=bar)
                    main.synchronize()
                    comm.Barrier()  # every copy into this rank done
                    ok = all(bool((mine[c.dst_offset:c.dst_offset + c.nbytes] == c.src + 1).all())
                             for c in m.into_rank(me))
                    nbytes = m.bytes_per_sender()
                    rec = {"bench": BENCH, "kind": m.kind, "engine": engine, **m.label, "ranks": R,
                           "gpus": group.num_devices, "senders": len(m.senders), "bytes": nbytes,
                           **_slowest(comm, t, bool(copies)), "iters": args.p2p_iters,
                           "streams_per_rank": max(len(m.of_rank(r)) for r in range(R)),
                           "blocks": blocks if engine == "kernel" else None,
                           "verified": bool(comm.allreduce(ok, op=_land()))}
                    rec["GBps"] = nbytes / rec["time_us"] / 1e3
                    rec["GBps_total"] = rec["GBps"] * len(m.senders)
                    out.write(rec)
                    records.append(rec)
            main.synchronize()
    finally:
        recv.destroy()
        del src
        cupy.get_default_memory_pool().free_all_blocks()
    return records


def _land():
    from mpi4py import MPI
    return MPI.LAND


def torch_problem():
    """Why the NCCL baseline cannot run in this process (None when it can)."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # ImportError, or a torch broken at import
        return f"torch is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA (torch.cuda.is_available() is False)"
    if not dist.is_available() or not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL backend (torch.distributed.is_nccl_available() is False)"
    return None


def _nccl_version(torch) -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_all_to_all(torch, dist, group, args, bar, in_split, out_split):
    """(Timing, rows arrived as sent) of all_to_all_single with these splits,
    on the current (torch and cupy) stream."""
    import cupy

    from cupyep.lab.bench.timing import time_fn
    R, me, H = group.local_size, group.local_rank, args.hidden
    send = torch.empty((sum(in_split), H), dtype=torch.bfloat16, device="cuda")
    recv = torch.empty((sum(out_split), H), dtype=torch.bfloat16, device="cuda")
    off = 0
    for d, n in enumerate(in_split):
        send[off:off + n].fill_(block_code(me, d, R))
        off += n

    def call():
        dist.all_to_all_single(recv, send, out_split, in_split)

    call()
    cupy.cuda.get_current_stream().synchronize()
    off, ok = 0, True
    for s, n in enumerate(out_split):
        if n:
            ok = ok and bool((recv[off:off + n] == block_code(s, me, R)).all().item())
        off += n
    group.comm.Barrier()
    t = time_fn(call, iters=args.iters, warmup=args.warmup, before=bar)
    cupy.cuda.get_current_stream().synchronize()
    return t, ok


def run_nccl(group, args, out, bar, splits) -> list:
    from datetime import timedelta

    import cupy
    R, me, comm, H = group.local_size, group.local_rank, group.comm, args.hidden
    problems = comm.allgather(torch_problem())
    bad = next(((r, p) for r, p in enumerate(problems) if p), None)
    shape = {"ranks": R, "gpus": group.num_devices, "tokens": args.tokens, "hidden": H, "topk": args.topk,
             "experts": args.experts, "seed": args.seed}
    if bad is not None:
        recs = [{"bench": BENCH, "kind": k, **shape, "skipped": f"rank {bad[0]}: {bad[1]}"} for k in NCCL_KINDS]
        for r in recs:
            out.write(r)
        return recs
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(group.device_id)
    addr_port = comm.bcast(("127.0.0.1", _free_port()) if me == 0 else None)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr_port[0], str(addr_port[1])
    dist.init_process_group("nccl", rank=group.rank, world_size=group.world_size,
                            timeout=timedelta(seconds=max(60.0, 3 * group.timeout_s)))
    row = 2 * H
    records = []
    stream = cupy.cuda.Stream(non_blocking=True)
    tstream = torch.cuda.ExternalStream(stream.ptr)
    try:
        for kind in NCCL_KINDS:
            direction = kind.rsplit("_", 1)[1]
            in_split, out_split = all_to_all_splits(splits, me, direction)
            with torch.cuda.stream(tstream), stream:
                t, ok = _time_all_to_all(torch, dist, group, args, bar, in_split, out_split)
            recv_bytes, sent_bytes = sum(out_split) * row, sum(in_split) * row
            # rows as cupyep counts them: those the rank receives in the dispatch
            ours = int(splits[:, me].sum()) * row
            med = t.median_s
            rec = {"bench": BENCH, "kind": kind, **shape, **_slowest(comm, t, True), "iters": args.iters,
                   "timing": "strict", "bytes": int(round(comm.allreduce(recv_bytes) / R)),
                   "bytes_total": int(comm.allreduce(recv_bytes)), "rank_recv_bytes": comm.allgather(recv_bytes),
                   "rank_sent_bytes": comm.allgather(sent_bytes),
                   "recv_GBps": comm.allreduce(recv_bytes / med) / R / 1e9,
                   "rank_GBps": comm.allreduce(ours / med) / R / 1e9,
                   "verified": bool(comm.allreduce(ok, op=_land())),
                   "torch": torch.__version__, "nccl": _nccl_version(torch)}
            rec["remote_rank_GBps"] = rec["rank_GBps"] * remote_share(splits)
            rec["GBps"] = rec["rank_GBps"]
            out.write(rec)
            records.append(rec)
    finally:
        dist.destroy_process_group()
        torch.cuda.empty_cache()
    return records


def run_direct(group, args, out, bar, idx, w, splits) -> list:
    import cupy

    import cupyep
    from cupyep.lab.bench.copy import copy_bandwidth
    from cupyep.lab.bench.normal import measure
    from cupyep.normal.direct_kernels import DirectConfig
    from cupyep.testing import payload_bf16
    R, me, comm = group.local_size, group.local_rank, group.comm
    copy_bw = comm.bcast(copy_bandwidth(2 << 30) if me == 0 else 0.0)
    x = cupy.asarray(payload_bf16(me, np.arange(args.tokens), args.hidden))
    topk_idx, topk_w = cupy.asarray(idx[me]), cupy.asarray(w[me])
    buf = cupyep.Buffer(group, cupyep.Buffer.size_hint(R, args.hidden, max(args.topk, 16)), max_tokens=args.tokens,
                        hidden=args.hidden, num_topk=args.topk)
    records = []
    try:
        for kind in DIRECT_KINDS:
            rec = measure(group, buf, bar, kind, x, None, topk_idx, topk_w, args.experts, DirectConfig(), None,
                          "direct", "strict", args.iters, copy_bw)
            rec = {**rec, "bench": BENCH, "normal_kind": rec["kind"], "kind": f"cupyep_{rec['kind']}",
                   "gpus": group.num_devices, "seed": args.seed, "iters": args.iters,
                   "remote_rank_GBps": rec["rank_GBps"] * remote_share(splits)}
            rec["GBps"] = rec["rank_GBps"]
            out.write(rec)
            records.append(rec)
    finally:
        buf.destroy()
    return records


def main(argv=None):
    require_gpu(__file__)
    args = parse_args(argv)
    import cupyep
    from cupyep.barrier import GpuBarrier
    from cupyep.lab.bench.report import JsonlWriter
    from cupyep.testing import global_routing
    group = cupyep.init(require_mps=False)  # ranks sharing a GPU are refused below, before any kernel
    problem = placement_problem(group.world_size, group.num_nodes, group.num_devices, group.ranks_per_gpu)
    if problem:
        if group.rank == 0:
            print(problem, file=sys.stderr, flush=True)
        group.destroy()
        sys.exit(REFUSED_STATUS)
    R = group.local_size
    out = JsonlWriter(args.out, group)
    idx, w = global_routing(args.seed, [args.tokens] * R, args.experts, args.topk)
    splits = dispatch_split_matrix(idx, args.experts)
    plan = p2p_plan(args, R) if "p2p" in args.parts else []
    bar = GpuBarrier(group)
    records = []
    try:
        if "p2p" in args.parts:
            records += run_p2p(group, args, out, bar, plan)
        if "nccl" in args.parts:
            records += run_nccl(group, args, out, bar, splits)
        if "direct" in args.parts:
            records += run_direct(group, args, out, bar, idx, w, splits)
        out.write(summarize(records))
    finally:
        bar.destroy()
        group.destroy()


if __name__ == "__main__":
    main()
