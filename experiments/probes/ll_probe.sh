#!/usr/bin/env bash
# What bounds low-latency mode at 8 ranks on one GPU. Every run records the
# ranks' start skew and the latency after the last rank started, plus a
# per-block trace of each phase (--trace), for: the default shape (also back
# to back); each way of going cold before a call (timing.flush_l2: data
# written, data read, address translations only, nothing); the same bytes with
# fewer experts (fewer distinct pages per call).
#   OUT=dir bash experiments/probes/ll_probe.sh [--all]    (--all: also 64/128 experts, 1024 threads)
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
run() { timeout 120 python3 -m cupyep.launcher -n 8 --timeout 110 experiments/bench_low_latency.py --tokens 128 --iters 100 \
          --trace 20 --out "$OUT/ll_probe.jsonl" "$@" 2>&1 | grep -c '"bench"'; }
run --back-to-back
for f in pages none; do run --flush $f --no-hook; done
run --experts 32 --no-hook
[ "${1:-}" = "--all" ] && { run --flush read --no-hook; for e in 64 128; do run --experts $e --no-hook; done; run --threads 1024 --no-hook; }
