#!/usr/bin/env bash
# H200: where the ~5-12 ms of jit dispatch per engine step goes. The same decode steps
# (bench_step.py) under XLA's default command buffers, with them off, and with every
# command type and no minimum graph size.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
quiet() { grep -v "^WARNING\|rematerialization\|^W0000\|^I0000\|^W1\|^I1\|^E1"; }
i=0
for flags in "" "--xla_gpu_enable_command_buffer=" \
  "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"; do
  i=$((i+1))
  echo "== XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 170 python3 scripts/bench_step.py --model llama-2-7b --batch 1 256 \
    --context 700 --reps 10 --output-json "$OUT/step_$i.json" 2>&1 | quiet | grep -v "^{" | tail -4
done
