#!/usr/bin/env bash
# One H200 call: step + engine benchmarks (issue 4), then the policy comparison (issue 5 b).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
M="--model llama-2-7b --load-format dummy"
timeout ${STEP_T:-120} python3 scripts/bench_step.py --model llama-2-7b --batch 1 64 256 \
  --context 700 --output-json "$OUT/step.json" 2>&1 | grep -v "^WARNING" | tee "$OUT/step.log"
timeout ${ENGINE_T:-300} python3 scripts/bench_engine.py --model llama-2-7b \
  --output-json "$OUT/engine.json" 2>&1 | grep -v "^WARNING" | tee "$OUT/engine.log"
timeout ${POLICY_T:-150} python3 scripts/bench_throughput.py $M --num-prompts 256 \
  --num-prefixes 32 --input-len 1088 --prefix-len 1024 --output-len 64 --num-kv-blocks 3072 \
  --policy fcfs greedy:max_wait=120 lpm:max_wait=120 --output-json "$OUT/b_policies.json" \
  2>&1 | grep -v "^WARNING" | tee "$OUT/b_policies.log"
