#!/usr/bin/env bash
# One H200 call (~9 minutes): RESULTS row (e) (ShareGPT, cache on vs off), then the engine
# benchmark (issues 4 and 6: cache + cascade vs cache off, 128 output tokens, TTFT).
# Needs bench_data/sharegpt_smollm2_1000.json (scripts/datasets.py sharegpt, made on the CPU
# machine; bench_data/ is ignored, so run with carry=["bench_data"]). The two processes
# share one persistent compilation cache.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jprefix-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
quiet() { grep -v "^WARNING\|rematerialization\|^W1\|^I1\|^E1\|^If this\|^Current"; }
timeout ${E_T:-220} python3 scripts/bench_throughput.py --model llama-2-7b --load-format dummy \
  --dataset bench_data/sharegpt_smollm2_1000.json --num-prompts 200 --compare-caching \
  --output-json "$OUT/e_sharegpt.json" 2>&1 | quiet > "$OUT/e_sharegpt.log"
echo "bench_throughput exit: ${PIPESTATUS[0]}"
tail -8 "$OUT/e_sharegpt.log"
timeout ${ENGINE_T:-290} python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 \
  --ttft-reps 3 --output-json "$OUT/engine.json" 2>&1 | quiet > "$OUT/engine.log"
tail -8 "$OUT/engine.log"
