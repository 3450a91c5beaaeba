"""Precision of the combine's per-rank partials: BF16 against FP32.

    python experiments/probes/probe_partials_precision.py --out results/direct/partials_precision.json

An expert rank reduces, in FP32, the weighted outputs of a token's experts
that it owns (expert-major combine: ``cupyep.normal.expert_major.reduce``)
and sends one partial per (token, rank) to the token's owner, which sums the
partials in FP32 in rank order and rounds to BF16. The partial can travel as
BF16 (what cupyep sends: half the bytes) or FP32. This replays both in NumPy
with the kernels' rounding (FP32 accumulation in slot order, then rank order;
BF16 round-to-nearest-even), for random BF16 expert outputs and the top-k
weights of ``cupyep.routing``, and compares each with the exact (float64)
weighted sum by DeepEP's similarity measure (``calc_diff``; its BF16 bound is
5e-6) and by the largest relative error. Also given: the same exact sum
rounded once to BF16, the floor any BF16 output has. Needs no GPU.

Also counted ("bytes"): the combine rows of the normal-mode benchmark's
routing (``cupyep.testing.global_routing(0, [4096] * R, 256, 8)``) with one
partial per (token, rank) against one row per (token, expert) slot.
"""
import argparse
import json
import os
import platform
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from cupyep import routing  # noqa: E402
from cupyep.reference import calc_diff  # noqa: E402

BF16 = ml_dtypes.bfloat16


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to BF16 (nearest even), back as float32."""
    return np.asarray(a, dtype=np.float32).astype(BF16).astype(np.float32)


def combine_paths(idx: np.ndarray, w: np.ndarray, y: np.ndarray, num_ranks: int, num_experts: int) -> dict:
    """Outputs of one rank's tokens by each path.

    Arguments:
        idx: [T, k] int64 expert ids (-1: none); w: [T, k] float32 weights.
        y: [T, k, H] float32 holding BF16 values, the expert outputs per slot.

    Returns:
        {"exact": float64 [T, H], "bf16_partials", "fp32_partials",
        "exact_rounded": float32 [T, H] (BF16 values)}.
    """
    T, k, H = y.shape
    per_rank = num_experts // num_ranks
    owner = np.where(idx >= 0, idx // per_rank, -1)
    exact = np.einsum("tk,tkh->th", w.astype(np.float64) * (idx >= 0), y.astype(np.float64))
    part = np.zeros((num_ranks, T, H), dtype=np.float32)  # FP32 partial per (rank, token), slot order
    for j in range(k):
        for d in range(num_ranks):
            sel = owner[:, j] == d
            part[d, sel] += w[sel, j, None] * y[sel, j]  # float32
    visited = np.stack([(owner == d).any(axis=1) for d in range(num_ranks)])  # [R, T]
    out = {}
    for name, p in (("bf16_partials", bf16(part)), ("fp32_partials", part)):
        acc = np.zeros((T, H), dtype=np.float32)
        for d in range(num_ranks):  # rank order
            acc = np.where(visited[d][:, None], (acc + p[d]).astype(np.float32), acc)
        out[name] = bf16(acc)
    out["exact"] = exact
    out["exact_rounded"] = bf16(exact.astype(np.float32))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, nargs="+", default=[8])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    records = []
    for R in args.ranks:
        for k in args.topk:
            for seed in range(args.seeds):
                idx, w = routing.make("uniform", seed, [args.tokens], args.experts, k)
                rng = np.random.default_rng(1000 + seed)
                y = bf16(rng.standard_normal((args.tokens, k, args.hidden), dtype=np.float32))
                out = combine_paths(idx[0], np.asarray(w[0], np.float32), y, R, args.experts)
                ex = out["exact"]
                rec = {"ranks": R, "topk": k, "seed": seed, "tokens": args.tokens, "hidden": args.hidden,
                       "experts": args.experts}
                for name in ("bf16_partials", "fp32_partials", "exact_rounded"):
                    rel = np.abs(out[name] - ex) / np.maximum(np.abs(ex), 1e-3)
                    rec[f"{name}_calc_diff"] = float(calc_diff(out[name], ex))
                    rec[f"{name}_max_rel_err"] = float(rel.max())
                records.append(rec)
                print(json.dumps(rec))
    from cupyep.testing import global_routing
    saved = []
    for R in args.ranks:
        ids, _ = global_routing(0, [4096] * R, 256, 8)
        per_rank = 256 // R
        slots = sum(int((a >= 0).sum()) for a in ids)
        pairs = sum(int(sum(((a // per_rank == d) & (a >= 0)).any(axis=1).sum() for d in range(R))) for a in ids)
        saved.append({"ranks": R, "token_expert_rows": slots, "token_rank_rows": pairs,
                      "bytes_saved_fraction": 1 - pairs / slots})
        print(json.dumps(saved[-1]))
    summary = {}
    for name in ("bf16_partials", "fp32_partials", "exact_rounded"):
        summary[name] = {"calc_diff_max": max(r[f"{name}_calc_diff"] for r in records),
                         "calc_diff_median": float(np.median([r[f"{name}_calc_diff"] for r in records]))}
    result = {"records": records, "summary": summary, "bound": 5e-6, "bytes": saved,
              "env": {"python": platform.python_version(), "numpy": np.__version__,
                      "ml_dtypes": ml_dtypes.__version__}}
    print(json.dumps(summary, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
