export PYTHONPATH=$PWD
timeout 300 python3 -m cupyep.gpu_tests --ranks 2 4 8 --timeout 130 > $OUT/gpu_tests.log 2>&1; echo "gpu_tests rc=$?"
grep -E "passed|failed" $OUT/gpu_tests.log | sort | uniq -c | head -20
for n in 2 4 8; do timeout 60 python3 -m cupyep.launch -n $n --timeout 55 experiments/bench_normal.py --out $OUT/normal.jsonl 2>&1 | grep bench | cut -c1-200; done
