#!/usr/bin/env bash
# The bare scatter probe (experiments/probes/probe_scatter.py): every destination
# layout with warm and cold address translations (one destination region
# versus two alternating ones; an L2 flush that also evicts translations),
# 8 processes on one GPU and the same rows from one process (one address space).
#   OUT=dir bash experiments/probes/probe_scatter.sh
export PYTHONPATH=$PWD
OUT=${OUT:-results/session}
mkdir -p "$OUT"
p() { timeout 100 python3 -m cupyep.launcher --timeout 95 "$@" --out "$OUT/probe_scatter.jsonl" 2>&1 | grep -c probe_scatter; }
p -n 8 experiments/probes/probe_scatter.py --sets 1 2 --flush write pages
p -n 8 experiments/probes/probe_scatter.py --sets 1 2 --flush write --row-bytes 7168 --patterns dispatch_expert_major dispatch_source_major dispatch_slot_major dispatch_packed
p -n 1 experiments/probes/probe_scatter.py --virtual 8 --sets 1 2 --flush write
