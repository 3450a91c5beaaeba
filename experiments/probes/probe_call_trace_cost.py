"""Cost of the per-call record (cupyep.launcher.calls.traced_call) on the CPU.

Times, per call, a plain method, the same method decorated while no record
is open (returned unchanged: no cost by construction) and decorated with a
record open, with positional and keyword arguments as the buffers' methods
take them; also the cost of decorating a nested function per call (what
LowLatencyBuffer's receive hooks pay).  Best of several rounds of
``--calls`` calls each; prints one JSON line per case and appends them to
``--out`` (JSONL).  Needs no GPU and no MPI:

    python experiments/probes/probe_call_trace_cost.py --out results/call_trace_cost.jsonl
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from cupyep.launcher import calls  # noqa: E402


class Plain:
    def combine(self, x, topk_idx, topk_weights, handle, *, zero_copy=False, out=None):
        return x


def best_ns_per_call(fn, n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200_000, help="calls per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", help="JSONL file to append to")
    args = p.parse_args(argv)

    untraced = type("Untraced", (), {"combine": calls.traced_call("Probe.untraced")(Plain.combine)})
    assert untraced.combine is Plain.combine  # no record open: unchanged
    with tempfile.TemporaryDirectory() as d:
        calls.open_record(d, rank=0)
        traced = type("Traced", (), {"combine": calls.traced_call("Probe.combine")(Plain.combine)})

        def make_hook():
            @calls.traced_call("Probe.hook")
            def hook(kernel_time_ns=None):
                return kernel_time_ns
            return hook

        objs = {"plain": Plain(), "traced": traced()}
        cases = {
            "plain method": lambda: objs["plain"].combine(1, 2, 3, 4, zero_copy=True),
            "traced method": lambda: objs["traced"].combine(1, 2, 3, 4, zero_copy=True),
            "make plain hook": lambda: (lambda kernel_time_ns=None: kernel_time_ns),
            "make traced hook": make_hook,
        }
        res = {name: best_ns_per_call(fn, args.calls, args.rounds) for name, fn in cases.items()}
        rec = calls.read_record(os.path.join(d, f"{os.getpid()}{calls.SUFFIX}"))
        calls.close_record()
    expected = args.calls * args.rounds
    assert rec.counts["Probe.combine"] == expected, rec.counts
    records = [
        {"case": "traced_call per call", "ns": round(res["traced method"] - res["plain method"], 1),
         "plain_ns": round(res["plain method"], 1), "traced_ns": round(res["traced method"], 1)},
        {"case": "traced hook creation", "ns": round(res["make traced hook"] - res["make plain hook"], 1)},
    ]
    env = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
           "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for r in records:
        line = json.dumps({"probe": "call_trace_cost", **r, "calls": args.calls, "rounds": args.rounds, "env": env})
        print(line)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
