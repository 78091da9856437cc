#!/usr/bin/env bash
# One H200 call for issue 4: step micro-benchmark, engine benchmark, HF peer.
# Usage (device): bash scripts/gpu_engine.sh  (writes logs and JSON under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
timeout ${STEP_T:-150} python3 scripts/bench_step.py --model llama-2-7b --batch 1 64 256 \
  --context 700 --output-json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | grep -v "^WARNING"
timeout ${ENGINE_T:-330} python3 scripts/bench_engine.py --model llama-2-7b \
  --output-json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log" | grep -v "^WARNING"
timeout ${HF_T:-100} python3 scripts/bench_hf.py --model llama-2-7b --num-prompts 64 \
  --batch-size 64 --output-len 128 --output-json "$OUT/hf.json" 2>&1 | tee "$OUT/hf.log" | tail -3
