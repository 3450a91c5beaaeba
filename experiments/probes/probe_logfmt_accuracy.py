"""Accuracy of a low-latency combine whose rows travel in LogFMT-10.

    python experiments/probes/probe_logfmt_accuracy.py --out results/logfmt/accuracy.json
    python experiments/probes/probe_logfmt_accuracy.py --table results/logfmt/accuracy.json

Each token's k expert outputs (BF16 rows of H values) are reduced with its
top-k weights in FP32 and rounded to BF16, as cupyep's low-latency combine
does. The probe does this twice, with the rows as they are and with each row
through cupyep.reference.logfmt (encode, then decode), and compares the two
combined outputs with DeepEP's similarity measure (calc_diff; its bounds are
5e-6 for BF16 paths and 9e-4 with FP8 in the path) and the largest error
relative to the token's largest output. It also gives, per value, the largest
relative error of the format itself, the share of nonzero values sent to
zero, and the bytes against BF16. Several row distributions, three seeds
each; NumPy only, no GPU.
"""
import argparse
import json
import os
import platform
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from cupyep.reference import calc_diff  # noqa: E402
from cupyep.reference import logfmt as L  # noqa: E402

BF16 = ml_dtypes.bfloat16


def bf16(a):
    return np.asarray(a, dtype=np.float32).astype(BF16).astype(np.float32)


def rows(kind: str, rng, n: int, h: int) -> np.ndarray:
    """[n, h] BF16 values (as float32) of one distribution of expert outputs."""
    if kind == "normal 0.05":
        x = rng.standard_normal((n, h)) * 0.05
    elif kind == "normal 1":
        x = rng.standard_normal((n, h))
    elif kind == "student-t 3, 0.05":
        x = rng.standard_t(3, (n, h)) * 0.05
    elif kind == "swiglu":  # silu(a) * b of unit normals, the FFN's inner product's shape
        a, b = rng.standard_normal((n, h)), rng.standard_normal((n, h))
        x = a / (1 + np.exp(-a)) * b * 0.1
    elif kind == "bit hash":  # the GPU tests' rows: random BF16 bit patterns below 1, every exponent alike
        from cupyep.testing import bf16_to_f32, payload_bf16
        return bf16_to_f32(payload_bf16(int(rng.integers(64)), np.arange(n), h))
    else:
        raise ValueError(kind)
    return bf16(x)


KINDS = ("normal 0.05", "normal 1", "student-t 3, 0.05", "swiglu", "bit hash")


def one(kind: str, seed: int, tokens: int, hidden: int, topk: int) -> dict:
    rng = np.random.default_rng(seed)
    y = rows(kind, rng, tokens * topk, hidden)
    w = rng.random((tokens, topk)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    codes, lo, hi = L.encode(y)
    yl = L.decode(codes, lo, hi)
    exact = bf16((y.reshape(tokens, topk, hidden) * w[..., None]).sum(axis=1, dtype=np.float32))
    logfmt = bf16((yl.reshape(tokens, topk, hidden) * w[..., None]).sum(axis=1, dtype=np.float32))
    nz = y != 0
    rel = np.abs(yl[nz] - y[nz]) / np.abs(y[nz])
    scale = np.abs(exact).max(axis=1, keepdims=True)
    return {"kind": kind, "seed": seed, "calc_diff": float(calc_diff(logfmt, exact)),
            "max_error_of_token_max": float((np.abs(logfmt - exact) / np.where(scale > 0, scale, 1)).max()),
            "value_max_relative_error": float(rel.max()), "value_median_relative_error": float(np.median(rel)),
            "flushed_to_zero": float(((yl == 0) & nz).sum() / nz.sum()),
            "group_octaves_median": float(np.median(hi - lo)),
            "bytes_vs_bf16": L.payload_bytes(tokens * topk, hidden) / (tokens * topk * hidden * 2)}


def table(path) -> str:
    doc = json.loads(open(path).read())
    lines = ["| rows | calc_diff: median [min, max] | largest error / token max | value: largest relative error | "
             "value: median relative error | nonzero values to zero | group range (octaves, median) | bytes vs BF16 |",
             "|" + " --- |" * 8]
    for kind in doc["kinds"]:
        rs = [r for r in doc["runs"] if r["kind"] == kind]
        d = [r["calc_diff"] for r in rs]
        lines.append(f"| {kind} | {np.median(d):.2e} [{min(d):.2e}, {max(d):.2e}] | "
                     f"{max(r['max_error_of_token_max'] for r in rs):.2e} | "
                     f"{max(r['value_max_relative_error'] for r in rs) * 100:.2f} % | "
                     f"{np.median([r['value_median_relative_error'] for r in rs]) * 100:.3f} % | "
                     f"{max(r['flushed_to_zero'] for r in rs):.1e} | "
                     f"{np.median([r['group_octaves_median'] for r in rs]):.1f} | {rs[0]['bytes_vs_bf16']:.3f} |")
    return "\n".join(lines)


def main():
    if sys.argv[1:2] == ["--table"]:
        for path in sys.argv[2:]:
            print(table(path))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/logfmt/accuracy.json")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args()
    runs = [one(kind, seed, args.tokens, args.hidden, args.topk) for kind in KINDS for seed in args.seeds]
    doc = {"probe": "logfmt_accuracy", "tokens": args.tokens, "hidden": args.hidden, "topk": args.topk,
           "kinds": list(KINDS), "runs": runs,
           "env": {"python": platform.python_version(), "numpy": np.__version__, "host": platform.node()}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(table(args.out))


if __name__ == "__main__":
    main()
