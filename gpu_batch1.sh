#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=/tmp/logs; mkdir -p $L $OUT/results
T0=$(date +%s)
el() { echo "$1 rc=$2 t=$(( $(date +%s)-T0 ))"; }
for n in 1 2 8; do
  timeout 90 python3 -m cupyep.launcher -n $n experiments/bench_deep_ep_adapter.py --out $OUT/results/adapter_$n.json > $L/adapter_$n.log 2>&1; el adapter$n $?
  grep " us \|allocations" $L/adapter_$n.log | head -20
done
timeout 80 python3 tests/gpu/test_deep_ep_gpu.py --ranks 4 > $L/spawn4.log 2>&1; el spawn4 $?
tail -2 $L/spawn4.log
left=$(( 560 - ($(date +%s)-T0) ))
timeout $left python3 -m cupyep.launcher.gpu_tests --ranks 8 -k "low_latency or logfmt" -- --maxfail=20 > $L/ll8.log 2>&1; el ll8 $?
grep -E "^== |passed|failed|AssertionError: \(" $L/ll8.log | sort | uniq -c | head -20
tar czf $OUT/logs.tgz -C $L .
