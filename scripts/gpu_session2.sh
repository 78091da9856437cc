#!/usr/bin/env bash
# H200 call: profile the engine step (async scheduling / cascade), then the engine bench.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
[ -d .jax_cache ] && cp -r .jax_cache "$OUT/jax_cache"
export JAX_COMPILATION_CACHE_DIR=$OUT/jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5
quiet() { grep -v "^WARNING\|rematerialization\|^W0000\|^I0000"; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/smi.txt"
timeout 300 python3 scripts/profile_engine.py --model llama-2-7b \
  --configs async+cascade,sync+cascade,async --keep-traces "$OUT/traces" \
  --output-json "$OUT/profile.json" 2>&1 | quiet > "$OUT/profile.log"
tail -c 3000 "$OUT/profile.log"
timeout 240 python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 \
  --compare-cascade --ttft-reps 5 --output-json "$OUT/engine.json" 2>&1 | quiet | tee "$OUT/engine.log" | tail -12
du -sh "$JAX_COMPILATION_CACHE_DIR"
