#!/usr/bin/env bash
# One device-machine session for low-latency mode, within one 10-minute
# command: the low-latency benchmark at 8, 4 and 2 ranks (isolated cold calls,
# hook halves, back to back, per-block traces), a large grid with few waiters
# at 8 ranks, the low-latency GPU tests at 8 ranks, then the whole GPU suite at
# 2 and 4 ranks. Logs and JSONL go to $OUT.
#   OUT=dir bash experiments/ll_session.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
for n in 8 4 2; do
  timeout 70 python3 -m cupyep.launch -n $n --timeout 65 experiments/bench_low_latency.py --iters 200 --back-to-back \
    --trace 20 --out "$OUT/low_latency.jsonl" 2>&1 | grep -c bench
done
# Large grid with few waiters: each rank's send half alone is short, the ranks run one after another.
timeout 60 python3 -m cupyep.launch -n 8 --timeout 55 experiments/bench_low_latency.py --tokens 128 --iters 200 \
  --num-blocks 132 --num-waiters 8 --trace 20 --out "$OUT/low_latency_grid.jsonl" 2>&1 | grep -c bench
timeout 150 python3 -m cupyep.gpu_tests --ranks 8 -k low_latency --timeout 145 > "$OUT/gpu_tests_ll8.log" 2>&1
echo "low-latency tests at 8 ranks rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests_ll8.log" | tail -1
timeout 280 python3 -m cupyep.gpu_tests --ranks 2 4 --timeout 138 > "$OUT/gpu_tests.log" 2>&1; echo "gpu_tests 2 4 rc=$?"
grep -E "passed|failed|== " "$OUT/gpu_tests.log" | sort | uniq -c | head
