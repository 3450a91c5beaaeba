"""Where a notified dispatch's period goes on the GPU's clock, calls back to
back (DeepEP's timing boundary): the layout and notify kernels, the GPU's
idle wait for the host between the counts and the send, and the send.

    python -m cupyep.launcher -n 4 experiments/probes/probe_queue_gap.py --out queue_gap_4ranks.json

CUDA events are recorded on the communication stream around the route's
launches (``Node.notify_launch``, the notify pass with its allocation, and
the send's: the queue route's ``jit.ArgTemplate.launch`` outside the notify
pass, the direct route's ``direct_kernels.launch_send``, wrapped in this
probe). Per call and rank, in us:

- ``notify_us``: the stream reaching the layout to the notify kernel's end
  (layout and notify, including waiting for the peers' notify);
- ``host_gap_us``: the notify kernel's end to the stream reaching the event
  recorded just before the send's launch: the GPU idles while the host reads
  the counts, allocates and launches (0 when the host was ahead);
- ``send_us``: the send kernel, from that event to the one after it;
- ``period_us``: one call's layout event to the next call's.

``--transport`` picks the route (queue, or direct with the fused kernel off,
whose notify and send are separate launches too). A cached dispatch of the
same routing is timed back to back as well (``cached_period_us``). Each
record holds the medians over calls, per rank and the slowest rank's.
"""
import argparse

import numpy as np

import cupyep
from cupyep.lab.bench import require_gpu
from cupyep.lab.bench.report import write_document
from cupyep.testing import global_routing, payload_bf16

QUANTITIES = ("notify_us", "host_gap_us", "send_us", "period_us")


class Marks:
    """Events recorded on the current stream around wrapped launch functions:
    ``marks`` collects (label, event) in call order."""

    def __init__(self):
        self.marks: list = []
        self._saved: list = []
        self._inside = 0  # wrapped calls under way: a launch inside another is not marked

    def wrap(self, owner, name: str, before: str | None, after: str | None, outermost: bool = False) -> None:
        """Mark the calls of ``owner.name``; with ``outermost``, only those
        made outside another wrapped call (the notify pass launches from a
        plan too)."""
        import cupy
        inner = getattr(owner, name)
        marks = self.marks
        probe = self

        def marked(*args, **kw):
            if outermost and probe._inside:
                return inner(*args, **kw)
            probe._inside += 1
            try:
                return marked_call(*args, **kw)
            finally:
                probe._inside -= 1

        def marked_call(*args, **kw):
            if before:
                ev = cupy.cuda.Event()
                ev.record()
                marks.append((before, ev))
            out = inner(*args, **kw)
            if after:
                ev = cupy.cuda.Event()
                ev.record()
                marks.append((after, ev))
            return out
        self._saved.append((owner, name, inner))
        setattr(owner, name, marked)

    def remove(self) -> None:
        for owner, name, inner in reversed(self._saved):
            setattr(owner, name, inner)
        self._saved.clear()


def per_call(marks: list) -> list[dict]:
    """The quantities of each call from its marks (labels "start", "notified",
    "send_begin", "send_end"), the period to the next call's start."""
    import cupy
    calls, cur = [], {}
    for label, ev in marks:
        if label == "start" and cur:
            calls.append(cur)
            cur = {}
        cur.setdefault(label, ev)
    calls.append(cur)
    ms = cupy.cuda.get_elapsed_time
    out = []
    for i, c in enumerate(calls):
        if not {"start", "notified", "send_begin", "send_end"} <= c.keys():
            continue
        rec = {"notify_us": ms(c["start"], c["notified"]) * 1e3,
               "host_gap_us": ms(c["notified"], c["send_begin"]) * 1e3,
               "send_us": ms(c["send_begin"], c["send_end"]) * 1e3}
        if i + 1 < len(calls) and "start" in calls[i + 1]:
            rec["period_us"] = ms(c["start"], calls[i + 1]["start"]) * 1e3
        out.append(rec)
    return out


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
    p.add_argument("--transport", default="queue", choices=("queue", "direct"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group = cupyep.init()
    R, me = group.world_size, group.rank
    T, H, E = args.tokens, args.hidden, args.experts
    idx, w = global_routing(0, [T] * R, E, args.topk)
    x = cupy.asarray(payload_bf16(me, np.arange(T), H))
    ids, ws = cupy.asarray(idx[me]), cupy.asarray(w[me])
    buf = cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=args.topk)
    kw = {"transport": args.transport}
    if args.transport == "direct":
        from cupyep.normal.direct_kernels import DirectConfig
        kw["config"] = DirectConfig(fused=False)

    def call():
        return buf.dispatch(x, ids, ws, num_experts=E, validate=False, **kw)

    from cupyep import jit
    from cupyep.normal import direct_kernels
    from cupyep.normal.node import Node
    m = Marks()
    m.wrap(Node, "notify_launch", "start", "notified")
    if args.transport == "queue":  # the send launches from its plan (the notify pass's, inside notify_launch, too)
        m.wrap(jit.ArgTemplate, "launch", "send_begin", "send_end", outermost=True)
    else:
        m.wrap(direct_kernels, "launch_send", "send_begin", "send_end")
    for _ in range(3):
        call()
    buf.synchronize()
    m.marks.clear()
    group.comm.Barrier()
    for _ in range(args.iters):  # back to back; a result lives until the next one is made
        last = call()
    buf.synchronize()
    rows = per_call(m.marks)
    m.remove()
    # The cached dispatch of the same routing, back to back.
    handle = last.handle
    group.comm.Barrier()
    evs = []
    for _ in range(args.iters):
        ev = cupy.cuda.Event()
        ev.record(buf.comm_stream)
        evs.append(ev)
        buf.dispatch(x, handle=handle, validate=False)
    buf.synchronize()
    cached = [cupy.cuda.get_elapsed_time(a, b) * 1e3 for a, b in zip(evs, evs[1:])]
    del last, handle
    med = {q: float(np.median([r[q] for r in rows if q in r])) for q in QUANTITIES}
    med["cached_period_us"] = float(np.median(cached))
    per_rank = group.comm.gather(med, root=0)
    if me == 0:
        worst = {q: max(r[q] for r in per_rank) for q in per_rank[0]}
        write_document({"probe": "queue_gap", "transport": args.transport, "ranks": R, "tokens": T, "hidden": H,
                        "experts": E, "topk": args.topk, "iters": args.iters, "per_rank": per_rank,
                        "worst": worst}, args.out)
    buf.synchronize()
    group.comm.Barrier()
    buf.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
