#!/usr/bin/env bash
# The H200 call the third session left for the next (~8 minutes): host work per step on
# the GPU machine's own CPU (bench_host; the third session's cut was measured on the dev
# CPU only) and in the engine (bench_engine's host share), the engine's decode-step
# breakdown after the per-key-gather kernel (profile_engine), and the noisy GQA batch-64
# decode row of issue 3 with 40 repetitions.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
quiet() { grep -v "^WARNING\|rematerialization\|^W0000\|^I0000\|^W1\|^I1\|^E1"; }
for flag in "" "--no-cascade"; do
  for i in 1 2 3; do
    JAX_PLATFORMS=cpu timeout 60 python3 scripts/bench_host.py $flag 2>&1 | tail -1
  done
done | tee "$OUT/host.log"
timeout 150 python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 --skip-off \
  --ttft-reps 0 --output-json "$OUT/engine.json" 2>&1 | quiet > "$OUT/engine.log"
tail -3 "$OUT/engine.log"
timeout 200 python3 scripts/profile_engine.py --model llama-2-7b --configs async+cascade \
  --output-json "$OUT/profile.json" 2>&1 | quiet > "$OUT/profile.log"
tail -4 "$OUT/profile.log"
timeout 120 python3 scripts/sweep_attention.py --only "llama3-8b B64" --reps 40 \
  --output-json "$OUT/sweep_gqa64.json" 2>&1 | quiet > "$OUT/sweep_gqa64.log"
tail -8 "$OUT/sweep_gqa64.log"
