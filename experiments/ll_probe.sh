#!/usr/bin/env bash
# What bounds low-latency mode at 8 ranks on one GPU: the same call with the
# same bytes but fewer experts (fewer distinct pages touched per call), without
# the L2 flush between calls, and with more threads per block.
#   OUT=dir bash experiments/ll_probe.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
run() { timeout 100 python3 -m cupyep.launch -n 8 --timeout 90 experiments/bench_low_latency.py --tokens 128 --iters 100 \
          --out "$OUT/ll_probe.jsonl" "$@" 2>&1 | grep -c '"bench"'; }
for e in 32 64 128 256; do run --experts $e; done
run --no-flush
run --threads 1024
