#!/usr/bin/env bash
# What the low-latency kernels spend at 8 ranks on one GPU beyond moving rows,
# in one device command: decode-order calls with each part of the work
# ablated (--ablate), the bare rows with and without what the kernels add
# (--scatter-probe: per-row tags, dynamic shared memory, four layouts), then
# the low-latency GPU tests at 8 ranks. JSONL and logs go to $OUT.
#   OUT=dir bash experiments/probes/ll_bisect.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
timeout 150 python3 -m cupyep.launcher -n 8 --timeout 145 experiments/bench_low_latency.py --tokens 128 1 --iters 100 \
  --no-hook --trace 10 --ablate rows tags scales --scatter-probe --out "$OUT/ll_bisect.jsonl" 2>&1 | grep -c '"bench"'
timeout 200 python3 -m cupyep.launcher.gpu_tests --ranks 8 -k low_latency --timeout 195 > "$OUT/gpu_tests_ll8.log" 2>&1
echo "low-latency tests at 8 ranks rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests_ll8.log" | tail -1
