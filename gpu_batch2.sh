#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
L=/tmp/logs; mkdir -p $L $OUT/results
T0=$(date +%s)
el() { echo "$1 rc=$2 t=$(( $(date +%s)-T0 ))"; }
for run in 1 2 3; do
  timeout 120 python3 -m cupyep.launcher -n 8 --ranks-per-node 4 --sm-share experiments/study_balance.py --traces hot_expert:hot_fraction=0.8 zipf:s=1.2 drift:s=1.2,period=4 --groups 8 --comm-sms 4 --timeout-s 30 --out $OUT/results/study_2x4_run$run.jsonl > $L/study_2x4_run$run.log 2>&1; el study$run $?
done
timeout 150 python3 -m cupyep.launcher.gpu_tests --ranks 2 4 8 -k deep_ep --timeout 60 > $L/deep_ep_mpi_2_4_8.log 2>&1; el deep_ep $?
grep -E "^== " $L/deep_ep_mpi_2_4_8.log
for n in 2 8; do
  timeout 60 python3 -m cupyep.launcher -n $n experiments/bench_deep_ep_adapter.py --out $OUT/results/adapter_$n.json > $L/adapter_$n.log 2>&1; el adapter$n $?
  grep " us " $L/adapter_$n.log
done
left=$(( 440 - ($(date +%s)-T0) ))
if [ $left -gt 60 ]; then
  timeout $left python3 -m cupyep.launcher.gpu_tests --ranks 8 -k "low_latency" --timeout $((left-5)) > $L/low_latency_8.log 2>&1; el ll8 $?
  grep -E "^== " $L/low_latency_8.log
fi
tar czf $OUT/logs.tgz -C $L .
