#!/usr/bin/env bash
# The H200 runs this session could not make (device time spent). One call, ~9 minutes:
# engine re-run after the two-buffer transfer, HF static-cache peer, RESULTS rows (b) at
# 1,024 KV blocks, (d), (e).
# ShareGPT for (e) is pre-tokenized on the CPU machine first (it travels with the tree):
#   python scripts/datasets.py sharegpt --num-prompts 1000 --output bench_data/sharegpt_smollm2_1000.json
# then run with carry=["bench_data"].
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
M="--model llama-2-7b --load-format dummy"
quiet() { grep -v "^WARNING\|rematerialization"; }
timeout 200 python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 \
  --compare-cascade --ttft-reps 5 --output-json "$OUT/engine.json" 2>&1 | quiet | tee "$OUT/engine.log"
timeout 120 python3 scripts/bench_hf.py --model llama-2-7b --num-prompts 64 --batch-size 64 \
  --output-len 128 --static --output-json "$OUT/hf.json" 2>&1 | tail -2 | tee "$OUT/hf.log"
for cache in "" "--no-enable-prefix-caching"; do
  timeout 90 python3 scripts/bench_latency.py $M --input-len 700 --prefix-len 596 --output-len 16 \
    --num-prompts 150 --request-rate 16 --latency-bound-ms 320 --latency-metric mean \
    --sweep-steps 2 $cache --output-json "$OUT/d${cache:+_off}.json" 2>&1 | quiet | tail -8
done
timeout 150 python3 scripts/bench_throughput.py $M --num-prompts 256 --num-prefixes 32 \
  --input-len 1088 --prefix-len 1024 --output-len 64 --num-kv-blocks 1024 \
  --policy fcfs greedy:max_wait=120 lpm:max_wait=120 --output-json "$OUT/b_1024.json" 2>&1 | quiet | tail -6
timeout 100 python3 scripts/bench_throughput.py $M --dataset bench_data/sharegpt_smollm2_1000.json \
  --num-prompts 200 --compare-caching --output-json "$OUT/e_sharegpt.json" 2>&1 | quiet | tail -6
