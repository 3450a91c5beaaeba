#!/usr/bin/env bash
# One device-machine session for low-latency mode, within one 10-minute
# command: the low-latency GPU tests at 8 ranks (nothing else runs if they
# fail; a fresh machine compiles the kernels here), the low-latency benchmark
# at 8, 4 and 2 ranks (isolated calls in decode order, pushed and pulled
# combines, zero-copy, hook halves, back to back, per-block traces), at 8
# ranks again with plain launches, then the whole GPU suite at 2 ranks. Logs
# and JSONL go to $OUT. (experiments/ll_bisect.sh has the ablations and the
# bare row scatter.)
#   OUT=dir bash experiments/ll_session.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
timeout 250 python3 -m cupyep.gpu_tests --ranks 8 -k low_latency --timeout 245 > "$OUT/gpu_tests_ll8.log" 2>&1
rc=$?; echo "low-latency tests at 8 ranks rc=$rc"; grep -E "passed|failed" "$OUT/gpu_tests_ll8.log" | tail -1
[ $rc -eq 0 ] || { grep -E "^E |Error" "$OUT/gpu_tests_ll8.log" | head -20; exit $rc; }
for n in 8 4 2; do
  timeout 110 python3 -m cupyep.launch -n $n --timeout 105 experiments/bench_low_latency.py --iters 200 --back-to-back \
    --trace 20 --zero-copy --out "$OUT/low_latency.jsonl" 2>&1 | grep -c bench
done
timeout 80 python3 -m cupyep.launch -n 8 --timeout 75 experiments/bench_low_latency.py --iters 200 --no-hook \
  --zero-copy --plain-launch --out "$OUT/low_latency_plain_launch.jsonl" 2>&1 | grep -c bench
timeout 100 python3 -m cupyep.gpu_tests --ranks 2 --timeout 95 > "$OUT/gpu_tests.log" 2>&1; echo "gpu_tests 2 rc=$?"
grep -E "passed|failed|== " "$OUT/gpu_tests.log" | sort | uniq -c | head
