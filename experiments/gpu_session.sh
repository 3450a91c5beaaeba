#!/usr/bin/env bash
# One device-machine session: the whole GPU test suite at 2, 4 and 8 ranks,
# then the normal-mode and low-latency benchmarks. Logs and JSONL go to $OUT.
#   bash experiments/gpu_session.sh            # tests + benchmarks
#   bash experiments/gpu_session.sh --sweep    # + queue depth x chunk x threads sweep at 8 ranks
#   BENCH=0 bash experiments/gpu_session.sh    # tests only
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
timeout 540 python3 -m cupyep.gpu_tests --ranks 2 4 8 --timeout 300 > "$OUT/gpu_tests.log" 2>&1; echo "gpu_tests rc=$?"
grep -E "passed|failed|== " "$OUT/gpu_tests.log" | sort | uniq -c | head -20
[ "${BENCH:-1}" = "0" ] && exit 0
for n in 2 4 8; do
  timeout 90 python3 -m cupyep.launch -n $n --timeout 85 experiments/bench_normal.py --l2 0 2 --out "$OUT/normal.jsonl" 2>&1 | grep -c bench
  timeout 90 python3 -m cupyep.launch -n $n --timeout 85 experiments/bench_low_latency.py --out "$OUT/low_latency.jsonl" 2>&1 | grep -c bench
done
if [ "${1:-}" = "--sweep" ]; then
  timeout 200 python3 -m cupyep.launch -n 8 --timeout 195 experiments/bench_normal.py --sweep \
    --out "$OUT/normal_sweep.jsonl" 2>&1 | grep -c bench
fi
