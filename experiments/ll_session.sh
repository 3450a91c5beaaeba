#!/usr/bin/env bash
# One device-machine session for low-latency mode: the whole GPU test suite
# at 2, 4 and 8 ranks, then the low-latency benchmark at 2, 4 and 8 ranks
# (isolated cold calls, hook halves, back to back, and a per-block trace).
# Logs and JSONL go to $OUT.
#   OUT=dir bash experiments/ll_session.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
timeout 450 python3 -m cupyep.gpu_tests --ranks 2 4 8 --timeout 150 > "$OUT/gpu_tests.log" 2>&1; echo "gpu_tests rc=$?"
grep -E "passed|failed|== " "$OUT/gpu_tests.log" | sort | uniq -c | head -20
for n in 8 4 2; do
  timeout 80 python3 -m cupyep.launch -n $n --timeout 75 experiments/bench_low_latency.py --iters 200 --back-to-back \
    --trace 20 --out "$OUT/low_latency.jsonl" 2>&1 | grep -c bench
done
# Large grid with few waiters at 8 ranks: each rank's send half alone is short, the ranks run one after another.
timeout 80 python3 -m cupyep.launch -n 8 --timeout 75 experiments/bench_low_latency.py --tokens 128 --iters 200 \
  --num-blocks 132 --num-waiters 8 --trace 20 --out "$OUT/low_latency_grid.jsonl" 2>&1 | grep -c bench
