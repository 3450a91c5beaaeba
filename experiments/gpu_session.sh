#!/usr/bin/env bash
# One device-machine session: the GPU test suite at 2, 4 and 8 ranks, then the
# normal-mode benchmark. Logs and JSONL go to $OUT (the device tool's folder).
#   bash experiments/gpu_session.sh            # tests + benchmark at 2, 4, 8 ranks
#   bash experiments/gpu_session.sh --sweep    # + queue depth x chunk x threads sweep at 8 ranks
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
timeout 300 python3 -m cupyep.gpu_tests --ranks 2 4 8 --timeout 130 > "$OUT/gpu_tests.log" 2>&1; echo "gpu_tests rc=$?"
grep -E "passed|failed" "$OUT/gpu_tests.log" | sort | uniq -c | head -20
for n in 2 4 8; do
  timeout 60 python3 -m cupyep.launch -n $n --timeout 55 experiments/bench_normal.py --out "$OUT/normal.jsonl" 2>&1 | grep bench | cut -c1-200
done
if [ "${1:-}" = "--sweep" ]; then
  timeout 200 python3 -m cupyep.launch -n 8 --timeout 195 experiments/bench_normal.py --sweep \
    --out "$OUT/normal_sweep.jsonl" 2>&1 | grep -c bench
fi
