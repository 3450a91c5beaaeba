#!/usr/bin/env bash
# One device-machine command for the performance work on the existing modes:
# the low-latency GPU tests at 4 ranks (nothing else runs if they fail), the
# low-latency benchmark on both timing boundaries (strict and DeepEP's) at 2,
# 4 and 8 ranks, as built and, where $LL_AB is set (VAR=value), with that
# variable set too (A/B in one run; *_ab.jsonl), at 8 ranks also with 1024
# threads per block, then
# the normal-mode sweeps of FP8 dispatch and combine over SMs x depth x chunk
# at 2, 4 and 8 ranks. Logs and JSONL go to $OUT. PART=ll or PART=normal
# runs one half (each fits one 10-minute command). PART=combine times the
# normal-mode combine (both boundaries) at 4 and 8 ranks once per assignment
# in $COMBINE_AB (e.g. "CUPYEP_COMBINE_WORDS=1 CUPYEP_COMBINE_WORDS=0"), into
# normal_combine_<assignment>.jsonl.
#   OUT=dir [LL_AB=VAR=value] [PART=ll|normal|combine] bash experiments/perf_session.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results/session}
mkdir -p "$OUT"
if [ "${PART:-all}" = combine ]; then
  for v in ${COMBINE_AB:-X=0}; do
    for n in 8 4; do
      env $v timeout 100 python3 -m cupyep.launch -n $n --timeout 95 experiments/bench_normal.py --kinds combine_bf16 \
        --out "$OUT/normal_combine_${v//=/_}.jsonl" 2>&1 | grep -c bench
    done
  done
  exit 0
fi
if [ "${PART:-all}" != normal ]; then
[ -n "${SKIP_TESTS:-}" ] || {
timeout 150 python3 -m cupyep.gpu_tests --ranks 4 -k low_latency --timeout 145 > "$OUT/gpu_tests_ll4.log" 2>&1
rc=$?; echo "low-latency tests at 4 ranks rc=$rc"; grep -E "passed|failed" "$OUT/gpu_tests_ll4.log" | tail -1
[ $rc -eq 0 ] || { grep -E "^E |Error" "$OUT/gpu_tests_ll4.log" | head -20; exit $rc; }
}
for n in 8 4 2; do
  for v in "" ${LL_AB:+$LL_AB}; do
    env $v timeout 100 python3 -m cupyep.launch -n $n --timeout 95 \
      experiments/bench_low_latency.py --iters 100 --zero-copy --out "$OUT/low_latency${v:+_ab}.jsonl" 2>&1 | grep -c bench
  done
done
timeout 100 python3 -m cupyep.launch -n 8 --timeout 95 experiments/bench_low_latency.py --iters 100 --threads 1024 \
  --out "$OUT/low_latency_t1024.jsonl" 2>&1 | grep -c bench
fi
[ "${PART:-all}" = ll ] && exit 0
sms() { case $1 in 2) echo "24 32 48 64";; 4) echo "16 24 32";; 8) echo "8 12 16";; esac; }
for n in 4 8 2; do
  timeout 170 python3 -m cupyep.launch -n $n --timeout 165 experiments/bench_normal.py --sweep --iters 10 \
    --sweep-kinds dispatch_fp8 combine_bf16 --threads 512 --sms $(sms $n) --depths 16 32 64 --chunks 4 8 16 \
    --out "$OUT/normal_sweep.jsonl" > "$OUT/normal_sweep_$n.log" 2>&1; echo "sweep $n rc=$?"; grep -c bench "$OUT/normal_sweep_$n.log"
done
