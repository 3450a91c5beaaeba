#!/usr/bin/env bash
# Low-latency grid at 8 ranks on one GPU: blocks that send (num_blocks) x blocks
# that also wait and receive (num_waiters), T = 128, with a per-block trace.
#   OUT=dir bash experiments/ll_grid_sweep.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
for gw in "16 16" "32 8" "64 8" "128 8" "48 16" "128 16"; do
  set -- $gw
  timeout 60 python3 -m cupyep.launch -n 8 --timeout 55 experiments/bench_low_latency.py --tokens 128 --iters 100 \
    --no-hook --trace 20 --num-blocks $1 --num-waiters $2 --out "$OUT/ll_grid.jsonl" 2>&1 | grep -c '"bench"'
done
