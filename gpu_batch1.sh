#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=/tmp/logs; mkdir -p $L $OUT/results
T0=$(date +%s)
el() { echo "$1 rc=$2 t=$(( $(date +%s)-T0 ))"; }
timeout 250 python3 -m cupyep.launcher.gpu_tests --ranks 2 8 -k "deep_ep or packed_layout or moe or zero_copy" -- --maxfail=20 > $L/t2_8.log 2>&1; el t2_8 $?
grep -E "^== |AssertionError|Error:" $L/t2_8.log | sort | uniq -c | head -20
for n in 1 2 8; do
  timeout 50 python3 -m cupyep.launcher -n $n experiments/bench_deep_ep_adapter.py --out $OUT/results/adapter_$n.json > $L/adapter_$n.log 2>&1; el adapter$n $?
  grep " us " $L/adapter_$n.log | head -20
done
tar czf $OUT/logs.tgz -C $L .
