export PYTHONPATH=$PWD
timeout 200 python3 -m cupyep.launch -n 8 --timeout 195 experiments/bench_normal.py --sweep --depths 16 32 64 --chunks 4 8 --threads 512 768 --out $OUT/normal.jsonl 2>&1 | grep bench | cut -c1-100
timeout 100 python3 -m cupyep.gpu_tests --ranks 8 --timeout 95 > $OUT/gpu_tests.log 2>&1; echo "gpu_tests rc=$?"; grep -E "passed|failed" $OUT/gpu_tests.log | sort | uniq -c | head -3
