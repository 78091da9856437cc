#!/usr/bin/env bash
# One H200 call for issue 6: cascade kernel benchmark, then the engine with cascade on/off.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout ${CASCADE_T:-100} python3 scripts/bench_cascade.py --output-json "$OUT/cascade.json" \
  2>&1 | grep -v "^WARNING\|rematerialization" | tee "$OUT/cascade.log"
timeout ${ENGINE_T:-230} python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 \
  --skip-off --compare-cascade --ttft-reps 5 --output-json "$OUT/engine_cascade.json" \
  2>&1 | grep -v "^WARNING\|rematerialization" | tee "$OUT/engine_cascade.log"
