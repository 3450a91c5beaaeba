"""The main job: the dispatch/combine benchmark on whatever this machine has.

    python -m cupyep.bench.main [--ranks N] [--out results/main]

With GPUs it launches N ranks (default: 2, 4 and 8 when there is one GPU,
else one per GPU) through ``cupyep.launch`` (which starts CUDA MPS when ranks
share a GPU), runs ``experiments/bench_normal.py`` at the standard shape
(4096 tokens per rank, hidden 7168, top-8 of 256 experts) and plots the
result, then ``experiments/bench_low_latency.py`` (128 and 1 tokens per rank,
pulled and zero-copy combines included). Without a GPU it runs the same
experiment at a small size on the NumPy reference, labelled as such in the
output and the plot, so that the toolkit can be seen working anywhere.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def reference_run(num_ranks: int, num_tokens: int, hidden: int, out: Path) -> list[dict]:
    """Dispatch + combine of every rank on the NumPy reference (CPU)."""
    import numpy as np

    from .. import reference as ref
    from ..testing import bf16_to_f32, global_routing, payload_bf16
    idx, w = global_routing(0, [num_tokens] * num_ranks, 256, 8)
    x = [payload_bf16(r, np.arange(num_tokens), hidden) for r in range(num_ranks)]
    t0 = time.perf_counter()
    res = ref.intranode_dispatch(x, idx, 256, topk_weights=w)
    t1 = time.perf_counter()
    comb = ref.intranode_combine([bf16_to_f32(r.recv_x) for r in res], res, [num_tokens] * num_ranks)
    t2 = time.perf_counter()
    visits = [ref.get_dispatch_layout(i, 256, num_ranks).is_token_in_rank.sum(1) for i in idx]
    ok = all(np.allclose(c, bf16_to_f32(xx) * v[:, None]) for c, xx, v in zip(comb, x, visits))
    recv_bytes = sum(r.recv_x.nbytes for r in res)
    records = [{"bench": "normal", "backend": "numpy-reference (no GPU)", "kind": kind, "ranks": num_ranks,
                "tokens": num_tokens, "hidden": hidden, "time_us": dt * 1e6,
                "rank_GBps": recv_bytes / num_ranks / dt / 1e9, "combine_check": bool(ok)}
               for kind, dt in (("dispatch_bf16", t1 - t0), ("combine_bf16", t2 - t1))]
    with out.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return records


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = sorted({r["kind"] for r in records})
    fig, ax = plt.subplots(figsize=(7, 4))
    ranks = sorted({r["ranks"] for r in records})
    width = 0.8 / max(1, len(kinds))
    for i, kind in enumerate(kinds):
        vals = [next((r["rank_GBps"] for r in records if r["kind"] == kind and r["ranks"] == n), 0) for n in ranks]
        ax.bar([j + i * width for j in range(len(ranks))], vals, width, label=kind)
    ax.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(ranks))], [f"{n} ranks" for n in ranks])
    ax.set_ylabel("GB/s per rank (received bytes / time)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from ..runtime import gpu_count
    p = argparse.ArgumentParser(prog="python -m cupyep.bench.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=None)
    p.add_argument("--out", default="results/main")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "normal.jsonl"
    ngpu = gpu_count()
    if ngpu == 0:
        print("no CUDA GPU found: running the small-size experiment on the NumPy reference (CPU), not the kernels")
        records = [r for n in (args.ranks or [2, 4]) for r in reference_run(n, 256, 1024, jsonl)]
        for r in records:
            print(json.dumps(r))
        plot(records, out / "normal.png", "NumPy reference on the CPU (no GPU): small size, not kernel speed")
        print(f"wrote {jsonl} and {out / 'normal.png'}")
        return 0
    ranks = args.ranks or ([2, 4, 8] if ngpu == 1 else [ngpu])
    ll_jsonl = out / "low_latency.jsonl"
    for n in ranks:
        for script, dest, extra in (("bench_normal.py", jsonl, []),
                                    ("bench_low_latency.py", ll_jsonl, ["--zero-copy"])):
            cmd = [sys.executable, "-m", "cupyep.launch", "-n", str(n), "--timeout", "600", "--",
                   str(ROOT / "experiments" / script), "--out", str(dest), *extra]
            print("==", " ".join(cmd), flush=True)
            rc = subprocess.call(cmd)
            if rc:
                return rc
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    plot([r for r in records if not r.get("sweep")], out / "normal.png",
         f"cupyep normal mode, {records[-1].get('env', {}).get('gpu', 'GPU')}")
    print(f"wrote {jsonl}, {out / 'normal.png'} and {ll_jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
