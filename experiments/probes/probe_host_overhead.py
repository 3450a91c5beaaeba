"""The host's share of a notified normal-mode dispatch, per route: where the
call's time goes when the kernels are short.

    python -m cupyep.launcher -n 2 experiments/probes/probe_host_overhead.py --out host_overhead.json
    python -m cupyep.launcher -n 8 --ranks-per-node 4 experiments/probes/probe_host_overhead.py --out host_2x4.json

Routes: within a node the queue transport, the direct one (fused, the
default) and the direct one unfused; across nodes the two-hop and the direct
route. After warm-up, ``--iters`` calls each start after a device
synchronisation and a host barrier. Per call:

- ``host_us``: until dispatch returns;
- ``wait_us``: the part of it the host spends in its bounded waits for the
  GPU (the counts of the notify pass, or the whole call across nodes);
- ``host_work_us`` = host_us - wait_us: the host's own work, the figure the
  target of at most 50 us is about;
- ``gpu_us``: CUDA events on the caller's stream around the call (the call's
  GPU span, as the caller's stream sees it);
- ``total_us``: until the device is idle again;
- ``python_calls``: Python function calls made during the call (a
  ``sys.setprofile`` counter, on a separate pass of calls so that the
  counting does not slow the timed ones);
- with ``--phases N``: ``phases``, the inclusive time of each of PHASES
  per call (wrapped timers, about a microsecond each; nested phases are
  inside their callers' figures), and with ``--trace`` / ``--profile`` /
  ``--sample`` the line tracer, cProfile and a sampling thread, each on
  passes of their own.

Each record holds the medians over calls, the slowest rank's (max over
ranks), in microseconds.
"""
import argparse
import sys
import time

import numpy as np

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import write_document
from cupyep.normal.direct_kernels import DirectConfig
from cupyep.testing import global_routing, payload_bf16


class WaitClock:
    """Time spent inside the host's bounded waits for the GPU: the group's
    ``wait`` and ``wait_word`` (a mapped word a kernel publishes), the fused
    direct dispatch's status wait and the engines' kernel waits across
    nodes, wrapped for this probe (a wait inside another counts once)."""

    def __init__(self, group):
        self.seconds = 0.0
        self._depth = 0
        self._wrap(group, "wait")
        self._wrap(group, "wait_word")
        from cupyep.normal.direct import DirectRoute
        self._wrap(DirectRoute, "_wait_host_status")
        if group.num_nodes > 1:
            from cupyep.normal.internode_kernels import TwoHopDispatch
            self._wrap(TwoHopDispatch, "_launch")  # launch, then (counted calls) wait for the kernel

    def _wrap(self, owner, name):
        inner = getattr(owner, name)
        clock = self

        def timed(*args, **kw):
            t0 = time.perf_counter()
            clock._depth += 1
            try:
                return inner(*args, **kw)
            finally:
                clock._depth -= 1
                if not clock._depth:
                    clock.seconds += time.perf_counter() - t0
        setattr(owner, name, timed)


def count_calls(fn) -> int:
    """Python function calls made while ``fn()`` runs."""
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def profile(fn, calls: int, top: int = 45) -> list:
    """The ``top`` functions by cumulative time over ``calls`` calls of ``fn``
    (cProfile): [name, calls per call, own us per call, cumulative us per
    call]. C functions (CuPy's, the CUDA runtime's through them) appear as
    their own rows, so a CUDA call's cost is not charged to its caller."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    for _ in range(calls):
        pr.enable()
        fn()
        pr.disable()
    st = pstats.Stats(pr).stats
    rows = sorted(st.items(), key=lambda kv: -kv[1][3])[:top]
    return [[f"{f.rsplit('/', 2)[-1] if '/' in f else f}:{line}:{name}", round(nc / calls, 2),
             round(tt / calls * 1e6, 2), round(ct / calls * 1e6, 2)] for (f, line, name), (_, nc, tt, ct, _) in rows]


def sample(fn, calls: int, period_s: float = 2e-5) -> dict:
    """Where the host's time goes in ``fn``, by a sampling thread (no tracing,
    so the calls run at full speed, but the thread takes the interpreter lock
    every few us, which inflates the lines that release it: CUDA calls): the innermost cupyep frame of the
    calling thread's stack every ``period_s``. Returns {"file:line function":
    us per call} (the call's time split by the share of samples), and
    "_samples"."""
    import threading
    me = threading.get_ident()
    hits, done = {}, threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(period_s / 4)

    def run():
        while not done.is_set():
            frame = sys._current_frames().get(me)
            where = "idle"
            while frame is not None:  # the innermost frame in the package
                name = frame.f_code.co_filename
                if "/cupyep/" in name and "/probes/" not in name:
                    where = f"{name.rsplit('/cupyep/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
                    break
                frame = frame.f_back
            hits[where] = hits.get(where, 0) + 1
            time.sleep(period_s)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    done.set()
    t.join()
    sys.setswitchinterval(interval)
    total = sum(hits.values()) or 1
    per_call_us = elapsed / calls * 1e6
    out = {k: round(v / total * per_call_us, 1) for k, v in sorted(hits.items(), key=lambda kv: -kv[1])[:40]}
    out["_samples"], out["_per_call_us"] = total, round(per_call_us, 1)
    return out


def trace_lines(fn, calls: int, top: int = 40) -> dict:
    """Where the host's time goes in ``fn``, line by line (a ``sys.settrace``
    tracer on cupyep's own frames, in this thread only): the wall time from
    each traced line to the next event, with the tracer's own work left out,
    so a line's figure includes the C calls it makes (CuPy, the CUDA driver)
    and any untraced Python it calls. Returns {"file:line function": us per
    call} for the ``top`` lines, "_traced_us" (their sum over all lines per
    call) and "_per_call_us" (the calls' wall time, tracer included)."""
    clock = time.perf_counter_ns
    acc: dict = {}
    state = {"key": None, "t": 0}

    def where(frame):
        return f"{frame.f_code.co_filename.rsplit('/cupyep/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"

    def charge(now):
        key = state["key"]
        if key is not None:
            acc[key] = acc.get(key, 0) + now - state["t"]

    def local(frame, event, arg):
        charge(clock())
        if event == "return":
            back = frame.f_back
            state["key"] = where(back) if back is not None and "/cupyep/" in back.f_code.co_filename else None
        else:
            state["key"] = where(frame)
        state["t"] = clock()
        return local

    def on_call(frame, event, arg):
        name = frame.f_code.co_filename
        if "/cupyep/" not in name or "/probes/" in name:
            return None
        return local(frame, event, arg)

    t0 = time.perf_counter()
    for _ in range(calls):
        state["key"] = None
        sys.settrace(on_call)
        try:
            fn()
        finally:
            sys.settrace(None)
    elapsed = time.perf_counter() - t0
    out = {k: round(v / calls / 1e3, 1) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:top]}
    out["_traced_us"] = round(sum(acc.values()) / calls / 1e3, 1)
    out["_per_call_us"] = round(elapsed / calls * 1e6, 1)
    return out


# Where a notified dispatch's host time goes, by phase: (label, module, attribute) of the callables
# timed, each where its callers look it up (a function imported by name is wrapped in the importing module).
PHASES = (
    ("Buffer.dispatch (the whole call)", "cupyep.normal.buffer", "Buffer.dispatch"),
    ("CommStream.begin", "cupyep.streams", "CommStream.begin"),
    ("CommStream.end", "cupyep.streams", "CommStream.end"),
    ("DirectRoute.dispatch", "cupyep.normal.direct", "DirectRoute.dispatch"),
    ("DirectRoute._dispatch_fused", "cupyep.normal.direct", "DirectRoute._dispatch_fused"),
    ("DirectRoute._wait_host_status (wait)", "cupyep.normal.direct", "DirectRoute._wait_host_status"),
    ("direct_kernels.send_args", "cupyep.normal.direct_kernels", "send_args"),
    ("direct_kernels.launch_fused", "cupyep.normal.direct_kernels", "launch_fused"),
    ("direct_kernels.launch_send", "cupyep.normal.direct_kernels", "launch_send"),
    ("QueueRoute.dispatch", "cupyep.normal.queue", "QueueRoute.dispatch"),
    ("queue_kernels.launch_dispatch (cached calls)", "cupyep.normal.queue_kernels", "launch_dispatch"),
    ("QueueRoute._guess_arrays", "cupyep.normal.queue", "QueueRoute._guess_arrays"),
    ("jit.ArgTemplate.launch (a plan's launch)", "cupyep.jit", "ArgTemplate.launch"),
    ("Node._notify_plan", "cupyep.normal.node", "Node._notify_plan"),
    ("Node.notify_handle", "cupyep.normal.node", "Node.notify_handle"),
    ("Node.with_expert_major", "cupyep.normal.node", "Node.with_expert_major"),
    ("Node.notify (launch, wait, handle)", "cupyep.normal.node", "Node.notify"),
    ("Node.notify_launch (layout and notify)", "cupyep.normal.node", "Node.notify_launch"),
    ("Node.wait_counts (wait)", "cupyep.normal.node", "Node.wait_counts"),
    ("carve (in queue)", "cupyep.normal.queue", "carve"),
    ("copy (in direct)", "cupyep.normal.direct", "copy"),
    ("SymmetricBuffer.view", "cupyep.ipc", "SymmetricBuffer.view"),
    ("dispatch_result (in direct)", "cupyep.normal.direct", "dispatch_result"),
    ("dispatch_result (in queue)", "cupyep.normal.queue", "dispatch_result"),
    ("jit.pack", "cupyep.jit", "pack"),
)


class PhaseClock:
    """Inclusive wall time of named callables (``phases``: (label, module,
    "attr" or "Class.attr")), each wrapped in a timer that costs about a
    microsecond per call, so that the phases of a call add up to its time
    without a profiler's distortion. :meth:`install` wraps, :meth:`remove`
    restores; per measured call, :meth:`take` returns {label: [us, calls]}
    and starts the next."""

    def __init__(self, phases=PHASES):
        self.phases = phases
        self._saved: list = []
        self._acc: dict = {}

    def install(self) -> "PhaseClock":
        import importlib
        for label, module, attr in self.phases:
            owner = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            inner = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self._saved.append((owner, name, inner))
            setattr(owner, name, self._timed(label, inner))
        return self

    def _timed(self, label: str, inner):
        acc, clock = self._acc, time.perf_counter_ns

        def timed(*args, **kw):
            t0 = clock()
            try:
                return inner(*args, **kw)
            finally:
                cell = acc.setdefault(label, [0, 0])
                cell[0] += clock() - t0
                cell[1] += 1
        return timed

    def remove(self) -> None:
        for owner, name, inner in reversed(self._saved):
            setattr(owner, name, inner)
        self._saved.clear()

    def take(self) -> dict:
        out = {label: [ns / 1e3, n] for label, (ns, n) in self._acc.items()}
        self._acc.clear()
        return out


def phase_times(fn, calls: int, clock: PhaseClock, before=None) -> dict:
    """{label: [median us per call, calls per call]} of ``calls`` calls of
    ``fn`` under ``clock`` (installed), each after ``before()``."""
    per_call = []
    for _ in range(calls):
        if before is not None:
            before()
        clock.take()
        fn()
        per_call.append(clock.take())
    labels = {label for rec in per_call for label in rec}
    return {label: [round(float(np.median([rec.get(label, [0.0, 0])[0] for rec in per_call])), 1),
                    float(np.median([rec.get(label, [0.0, 0])[1] for rec in per_call]))]
            for label in sorted(labels, key=lambda l: -np.median([r.get(l, [0.0])[0] for r in per_call]))}


def merge_profiles(profiles: list) -> list:
    """The median row of each function over single-call profiles."""
    by = {}
    for prof in profiles:
        for name, nc, tt, ct in prof:
            by.setdefault(name, []).append((nc, tt, ct))
    rows = [[name, *map(lambda c: float(np.median(c)), zip(*v))] for name, v in by.items() if len(v) == len(profiles)]
    return sorted(rows, key=lambda r: -r[3])[:120]


def pin_rank() -> None:
    """Pin this process to one CPU: the (rank * stride)-th of those it may run
    on, stride spreading the node's ranks over them (before cupyep.init, from
    the launcher's rank variables)."""
    import os
    cpus = sorted(os.sched_getaffinity(0))
    rank = int(next((os.environ[v] for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_RANK")
                     if v in os.environ), 0))
    size = int(next((os.environ[v] for v in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_SIZE")
                     if v in os.environ), 1))
    stride = max(1, len(cpus) // max(1, size))
    os.sched_setaffinity(0, {cpus[(rank * stride) % len(cpus)]})


def cpu_facts() -> dict:
    """The CPUs this rank may run on, the cgroup's CPU limit, and the CPU it is on."""
    import os
    facts = {"affinity": sorted(os.sched_getaffinity(0)), "cpu_count": os.cpu_count()}
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            with open(path) as f:
                facts[path] = f.read().strip()
        except OSError:
            pass
    try:
        with open("/proc/self/stat") as f:
            facts["on_cpu"] = int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        pass
    return facts


def routes(group) -> dict:
    if group.num_nodes > 1:
        return {"two_hop": {"transport": None}, "direct": {"transport": "direct"}}
    return {"queue": {"transport": "queue"}, "direct_fused": {"transport": "direct"},
            "direct_unfused": {"transport": "direct", "config": DirectConfig(fused=False)}}


def main():
    require_gpu(__file__)
    import cupy
    from mpi4py import MPI
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--sample", type=int, default=0,
                   help="also sample this many calls per route on rank 0's host (a sampling thread)")
    p.add_argument("--phases", type=int, default=0,
                   help="also time this many calls per route by phase (PHASES, wrapped timers; rank 0's kept)")
    p.add_argument("--trace", type=int, default=0,
                   help="also time this many calls per route line by line (sys.settrace, rank 0's kept)")
    p.add_argument("--profile", type=int, default=0,
                   help="also profile this many calls per route (cProfile, rank 0's; slows them)")
    p.add_argument("--pin", action="store_true",
                   help="pin each rank to one CPU of its own (the i-th of the CPUs it may run on, spread out)")
    p.add_argument("--gc-off", action="store_true",
                   help="freeze the objects made so far and turn Python's cyclic collector off while timing")
    args = p.parse_args()
    if args.pin:
        pin_rank()
    if args.gc_off:
        import gc
        gc.collect()
        gc.freeze()
        gc.disable()
    group = cupyep.init()
    R, me = group.world_size, group.rank
    T, H, E = args.tokens, args.hidden, args.experts
    idx, w = global_routing(0, [T] * R, E, args.topk)
    x = cupy.asarray(payload_bf16(me, np.arange(T), H))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    buf = cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=args.topk)
    clock = WaitClock(group)
    out = {"probe": "host_overhead", "ranks": R, "ranks_per_node": group.local_size, "tokens": T, "hidden": H,
           "experts": E, "topk": args.topk, "iters": args.iters, "pin": args.pin, "gc_off": args.gc_off,
           "cpus": group.comm.gather(cpu_facts(), root=0), "routes": {}}
    worst = lambda v: group.comm.allreduce(float(np.median(v)) * 1e6, op=MPI.MAX)  # noqa: E731
    for name, kw in routes(group).items():
        def call():
            return buf.dispatch(x, ids, ws, num_experts=E, validate=False, **kw)
        for _ in range(3):
            call()
        samples = {k: [] for k in ("host", "wait", "gpu", "total")}
        for _ in range(args.iters):
            cupy.cuda.runtime.deviceSynchronize()
            group.comm.Barrier()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            clock.seconds = 0.0
            t0 = time.perf_counter()
            start.record()
            call()
            t1 = time.perf_counter()
            end.record()
            cupy.cuda.runtime.deviceSynchronize()
            t2 = time.perf_counter()
            samples["host"].append(t1 - t0)
            samples["wait"].append(clock.seconds)
            samples["gpu"].append(cupy.cuda.get_elapsed_time(start, end) * 1e-3)
            samples["total"].append(t2 - t0)
        calls = []
        for _ in range(3):
            cupy.cuda.runtime.deviceSynchronize()
            group.comm.Barrier()
            calls.append(count_calls(call))
        rec = {f"{k}_us": worst(v) for k, v in samples.items()}
        rec["host_work_us"] = worst(np.subtract(samples["host"], samples["wait"]))
        rec["python_calls"] = int(group.comm.allreduce(int(np.median(calls)), op=MPI.MAX))
        if args.sample:
            group.comm.Barrier()
            rec["samples"] = sample(call, args.sample)  # every rank calls; rank 0's is kept
        if args.phases:  # a clock of its own (the wait clock above times the next route's waits)
            phases = PhaseClock().install()
            try:
                def settle():
                    cupy.cuda.runtime.deviceSynchronize()
                    group.comm.Barrier()
                rec["phases"] = phase_times(call, args.phases, phases, settle)  # rank 0's is kept
            finally:
                phases.remove()
        if args.trace:
            group.comm.Barrier()
            rec["lines"] = trace_lines(call, args.trace)  # every rank calls; rank 0's is kept
        if args.profile:
            for _ in range(args.profile):  # every rank calls; rank 0's profile is kept
                cupy.cuda.runtime.deviceSynchronize()
                group.comm.Barrier()
                prof = profile(call, 1, top=300)
                if me == 0:
                    rec.setdefault("_profiles", []).append(prof)
            if me == 0:
                rec["profile"] = merge_profiles(rec.pop("_profiles"))
        out["routes"][name] = rec
    if me == 0:
        write_document(out, args.out)
    buf.synchronize()
    group.comm.Barrier()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
