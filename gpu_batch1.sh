#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=/tmp/logs; mkdir -p $L $OUT/results
T0=$(date +%s)
el() { echo "$1 rc=$2 t=$(( $(date +%s)-T0 ))"; }
timeout 330 python3 -m cupyep.launcher.gpu_tests --ranks 2 4 8 -k "deep_ep or shrink or pull_and_push or bad_input or logfmt or packed_layout" > $L/t1.log 2>&1; el t1 $?
grep -E "^== |passed|failed|FAILED|Error" $L/t1.log | head -40
timeout 70 python3 tests/gpu/test_deep_ep_gpu.py --ranks 2 > $L/spawn2.log 2>&1; el spawn2 $?
tail -5 $L/spawn2.log
timeout 70 python3 tests/gpu/test_deep_ep_gpu.py --kill --ranks 4 > $L/kill4.log 2>&1; el kill4 $?
tail -15 $L/kill4.log
for n in 1 2 8; do
  left=$(( 570 - ($(date +%s)-T0) )); [ $left -lt 30 ] && break
  timeout $left python3 -m cupyep.launcher -n $n experiments/bench_deep_ep_adapter.py --out $OUT/results/adapter_$n.json > $L/adapter_$n.log 2>&1; el adapter$n $?
  grep " us " $L/adapter_$n.log | head -20
done
tar czf $OUT/logs.tgz -C $L .
