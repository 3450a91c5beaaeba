#!/usr/bin/env bash
# The bitmask position scan of the low-latency dispatch on the device machine,
# in one command: the low-latency GPU tests at 2 and 8 ranks
# (test_position_windows and the rest), then the benchmark at 8 ranks with
# programmatic launch and traces (compare the "prep" mark and dispatch_fp8
# with results/archive/low_latency.jsonl). JSONL and logs go to $OUT.
#   OUT=dir bash experiments/probes/ll_positions.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
timeout 230 python3 -m cupyep.launcher.gpu_tests --ranks 2 8 -k low_latency --timeout 225 > "$OUT/gpu_tests_ll.log" 2>&1
echo "low-latency tests rc=$?"; grep -E "passed|failed|== " "$OUT/gpu_tests_ll.log" | sort -u | tail -4
timeout 110 python3 -m cupyep.launcher -n 8 --timeout 105 experiments/bench_low_latency.py --iters 200 --no-hook \
  --trace 20 --zero-copy --out "$OUT/low_latency_positions.jsonl" 2>&1 | grep -c bench
