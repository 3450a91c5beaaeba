#!/usr/bin/env bash
# Low-latency GPU tests at the given rank counts, then the benchmark at 8 ranks.
#   OUT=dir bash experiments/ll_session.sh [ranks...]
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
for n in ${@:-2 8}; do
  timeout 240 python3 -m cupyep.launch -n $n --timeout 230 -- -m pytest -m gpu -x -q --color=no -p no:cacheprovider \
    tests/gpu/test_low_latency_gpu.py > "$OUT/ll_tests_$n.log" 2>&1
  echo "ll tests $n ranks rc=$?"; grep -E "passed|failed|Error" "$OUT/ll_tests_$n.log" | sort | uniq -c | head -8
done
