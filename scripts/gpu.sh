#!/usr/bin/env bash
# The H200 benchmark jobs, several per device call:  bash scripts/gpu.sh JOB [JOB ...]
#
#   kernels   bench_kernels.py: decode vs JAX's paged attention, prefill vs cuDNN,
#             prefix-cached prefill, write_kv                                  ~4 min
#   cascade   bench_cascade.py: cascade vs plain decode attention              ~2 min
#   sweep     sweep_attention.py $SWEEP_ARGS (e.g. --only "llama3-8b B64")
#   engine    bench_engine.py: cache + cascade vs cache off, TTFT              ~4 min
#   engine_cascade  bench_engine.py --compare-cascade --skip-off               ~3 min
#   profile   profile_engine.py async+cascade: decode step, batch-1, TTFT step ~3 min
#             ($PROFILE_ARGS, e.g. --top-kernels 60)
#   ttft      bench_engine.py --ttft-only, XLA command buffers off / on with fixed
#             input buffers / on with fresh ones                              ~4 min
#   ttft_gemm TTFT with XLA's exhaustive GEMM tiling search; its autotune results
#             loaded into a second process                                    ~8 min
#   gemm      bench_gemm.py: few-row matmuls of a 7B layer, skinny_matmul's tiling
#             sweep vs XLA ($GEMM_ARGS, e.g. --rows 128 --only o,down)        ~5 min
#   host      bench_host.py on this machine's CPU, cascade planning on and off  ~1 min
#   step      bench_step.py: one jitted step at batch 1 / 64 / 256             ~2 min
#   step_sampling  bench_step.py --sampling both: the plain step vs every row with
#             penalties, min_p, logit bias and 5 logprobs (the extra variant)  ~3 min
#   engine_sampling  bench_engine.py plain, then --sampling-only: the same, whole engine ~3 min
#   engine_structured  bench_engine.py on SmolLM2 shapes with its tokenizer: plain, then
#             every request under a regex grammar (a costly and a cheap mask), masks
#             overlapped (async) and with the synchronous engine; needs carry
#             ["bench_data"] holding smollm2_tokenizer/ (`python scripts/workloads.py
#             tokenizer --output bench_data/smollm2_tokenizer`) and llguidance    ~6 min
#   hf        bench_hf.py: HF transformers generate, the in-run peer          ~2 min
#   fp8_kernels  bench_kernels.py --sections fp8 (decode, bf16 vs fp8 cache, 11 knob
#             sets each) and bench_gemm.py --xla-only --quantization fp8       ~6 min
#   fp8_native   bench_gemm.py --fp8-native: the few-row kernel's fp8 x fp8 dot swept
#             per projection at 16 / 128 / 256 rows vs XLA's fp8 and bf16 dots   ~5 min
#   fp8_suffix   sweep_attention.py --kv-cache-dtype fp8 on the cascade suffix shapes,
#             bench_cascade.py bf16 vs fp8 at 256 x (592 + 232)                ~4 min
#   fp8_engine   bench_engine.py --skip-off: bf16, fp8 KV, fp8 weights; both with the
#             cache off too                                                    ~11 min
#   fp8_sharegpt bench_throughput.py on ShareGPT, Llama-3-8B, bf16 vs both fp8
#             (needs carry ["bench_data"])                                     ~6 min
#   b c d e   docs/RESULTS.md rows (b) policies, (c) trie vs flat, (d) chat latency,
#             (e) ShareGPT (needs carry ["bench_data"])
#   spec_verify  bench_spec.py --verify: a (k+1)-token verify vs a decode step, batch 1 /
#             8 / 64, k 1..8, Llama-2-7B, with the CPU's accepted lengths         ~3 min
#   window_kv    bench_window_kv.py: Gemma 3 12B, 8k shared document, hybrid KV cache vs
#             one table under one KV budget                                     ~5 min
#   moe       bench_moe.py (Qwen3-30B-A3B layer: grouped GEMM vs ragged_dot), then the
#             qwen3-30b-a3b seed workload with its cache-off peer               ~6 min
#   tier      bench_offload.py (Llama-2-7B bring-back vs recompute), the seed workload
#             with the host tier unused vs off                                  ~4 min
#   tier_loads  the host tier's load tests on the GPU (in-stream and staged), then
#             bench_offload.py on Llama-3-8B: in-stream vs staged loads vs a pinned
#             device_put of the same bytes                                      ~5 min
#   models    issue 37's models (MODELS="qwen3-8b gemma-3-12b qwen3-30b-a3b"; add
#             mixtral-8x7b on an H200): the seed workload with the cache off too, then
#             ShareGPT 1,000 prompts (needs carry ["bench_data"]); SEED=0 or SHAREGPT=0
#             leaves one out                                          ~4 min a model
#   multiturn bench_multiturn.py: Llama-3-8B chat at 4x oversubscription, tier off / on /
#             an unbounded pool                                               ~5 min
#   multiturn_sharegpt  the same on 128 ShareGPT conversations, 128-token replies (needs
#             carry ["bench_data"] with its conversations file: the job says)
#             (both: STEP_TOKENS=N adds a mode on:N, the tier on with at most N
#             tokens brought back per step; SCHEDULE=continuous sends each turn once its
#             conversation's reply is back instead of in batches; TRACE=on replays
#             mode "on" once more under the profiler: device time, copies by direction)
#   mgpu_prefill  the Mosaic GPU prefill attention: a one-case smoke test, then (if it
#             passed) its tests                                               ~5 min
#   mgpu_bench    bench_mgpu_prefill.py --alibi against Triton and cuDNN         ~9 min
#
# The one-off probes in scripts/probes/ (README.md there) run directly, not from here.
# Logs and JSON go to $OUT (default out/); the processes share one persistent compilation
# cache, so a second process on the same shapes skips most of its compiles.
# Each job's time limit can be lowered with T_<job>=seconds.
set -u
export PYTHONUNBUFFERED=1  # (each script puts its checkout first on sys.path itself)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jprefix-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
M=(--model llama-2-7b --load-format dummy)

quiet() { grep -v "^WARNING\|rematerialization\|^W0000\|^I0000\|^W1\|^I1\|^E1\|^If this\|^Current"; }

# run NAME DEFAULT_SECONDS CMD...: CMD's output to $OUT/NAME.log, its exit code and tail
# here; returns CMD's exit code
run() {
  local name=$1 limit=$2 var="T_${1//[^A-Za-z0-9_]/_}"; shift 2
  echo "== $name ($(date +%T))"
  timeout "${!var:-$limit}" "$@" 2>&1 | quiet > "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "exit $rc"
  tail -n "${TAIL:-10}" "$OUT/$name.log"
  return "$rc"
}

job_kernels() { run kernels 330 python3 scripts/bench_kernels.py --output-json "$OUT/kernels.json"; }
job_cascade() { run cascade 150 python3 scripts/bench_cascade.py --output-json "$OUT/cascade.json"; }
job_sweep() {  # SWEEP_ARGS is shell words, quotes honoured: --only "llama3-8b B64"
  eval "run sweep 300 python3 scripts/sweep_attention.py ${SWEEP_ARGS:-} --output-json \"\$OUT/sweep.json\""
}
job_engine() {
  run engine 290 python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 \
    --ttft-reps 9 --output-json "$OUT/engine.json"
}
job_engine_cascade() {
  run engine_cascade 230 python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 \
    --skip-off --compare-cascade --ttft-reps 9 --output-json "$OUT/engine_cascade.json"
}
job_ttft() {  # TTFT and batch-1 decode: command buffers off (jprefix's default), then
  # on with the step's inputs refilled in place (fixed addresses), then on with fresh inputs
  local a=(python3 scripts/bench_engine.py --model llama-2-7b --ttft-only --skip-off
           --ttft-reps ${TTFT_REPS:-9})
  run ttft_cb_off 200 "${a[@]}" --output-json "$OUT/ttft_cb_off.json"
  JPREFIX_XLA_COMMAND_BUFFERS=1 run ttft_cb_fixed 200 "${a[@]}" --fixed-inputs on \
    --output-json "$OUT/ttft_cb_fixed.json"
  JPREFIX_XLA_COMMAND_BUFFERS=1 run ttft_cb_fresh 200 "${a[@]}" --fixed-inputs off \
    --output-json "$OUT/ttft_cb_fresh.json"
}
job_ttft_gemm() {  # TTFT with XLA's exhaustive GEMM tiling search, then its autotune
  # results loaded into a second process (picks that do not change between processes)
  local a=(python3 scripts/bench_engine.py --model llama-2-7b --ttft-only --skip-off
           --ttft-reps ${TTFT_REPS:-9})
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_exhaustive_tiling_search=true \
    --xla_gpu_dump_autotune_results_to=$OUT/autotune.txt" JAX_COMPILATION_CACHE_DIR= \
    run ttft_exhaustive 400 "${a[@]}" --output-json "$OUT/ttft_exhaustive.json"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_load_autotune_results_from=$OUT/autotune.txt" \
    JAX_COMPILATION_CACHE_DIR= run ttft_loaded 200 "${a[@]}" \
    --output-json "$OUT/ttft_loaded.json"
}
job_gemm() {
  run gemm 420 python3 scripts/bench_gemm.py ${GEMM_ARGS:-} --output-json "$OUT/gemm.json"
}
job_profile() {
  run profile 240 python3 scripts/profile_engine.py --model llama-2-7b --configs async+cascade \
    ${PROFILE_ARGS:-} --output-json "$OUT/profile.json"
}
job_host() {
  local flag i
  echo "== host ($(date +%T))"
  for flag in "" "--no-cascade"; do
    for i in 1 2 3; do
      JAX_PLATFORMS=cpu timeout 60 python3 scripts/bench_host.py $flag 2>&1 | tail -1
    done
  done | tee "$OUT/host.log"
}
job_step() {
  run step 150 python3 scripts/bench_step.py --model llama-2-7b --batch 1 64 256 --context 700 \
    --output-json "$OUT/step.json"
}
job_step_sampling() {
  run step_sampling 200 python3 scripts/bench_step.py --model llama-2-7b --batch 1 64 256 \
    --context 700 --sampling both --output-json "$OUT/step_sampling.json"
}
job_engine_sampling() {  # one engine per process: plain, then every feature on
  local a=(python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 --skip-off
           --ttft-reps 0)
  run engine_plain 150 "${a[@]}" --output-json "$OUT/engine_plain.json"
  run engine_sampling 150 "${a[@]}" --sampling-only --output-json "$OUT/engine_sampling.json"
}
job_engine_structured() {  # one engine per process; the costly mask is ~0.35 ms a row
  local a=(python3 scripts/bench_engine.py --model smollm2-135m --output-len 128 --skip-off
           --ttft-reps 0 --tokenizer bench_data/smollm2_tokenizer)
  run structured_plain 90 "${a[@]}" --output-json "$OUT/structured_plain.json"
  local g rx
  for g in costly cheap; do
    rx='[a-z ]{1024,}'; [ $g = cheap ] && rx='[a-z ]{64}[a-z ]*'
    run "structured_$g" 90 "${a[@]}" --structured-regex "$rx" \
      --output-json "$OUT/structured_$g.json"
    run "structured_${g}_sync" 90 "${a[@]}" --structured-regex "$rx" --no-async-scheduling \
      --output-json "$OUT/structured_${g}_sync.json"
  done
}
job_hf() {
  run hf 150 python3 scripts/bench_hf.py --model llama-2-7b --num-prompts 64 --batch-size 64 \
    --output-len 128 --output-json "$OUT/hf.json"
}
job_fp8_kernels() {
  run fp8_kernels 330 python3 scripts/bench_kernels.py --sections fp8 \
    --output-json "$OUT/fp8_kernels.json"
  run fp8_gemm 200 python3 scripts/bench_gemm.py --xla-only --quantization fp8 \
    --rows 1 16 128 256 4096 --output-json "$OUT/fp8_gemm.json"
}
job_fp8_native() {
  run fp8_native 330 python3 scripts/bench_gemm.py --xla-only --quantization fp8 --fp8-native \
    --rows 16 128 256 --output-json "$OUT/fp8_native.json"
}
job_fp8_suffix() {
  run fp8_suffix 280 python3 scripts/sweep_attention.py --kv-cache-dtype fp8 --profile --reps 5 \
    --only "cascade suffix,short suffix" --output-json "$OUT/fp8_suffix.json"
  local d
  for d in auto fp8; do
    run "cascade_$d" 90 python3 scripts/bench_cascade.py --seqs 256 --prefix 592 \
      --kv-cache-dtype $d --output-json "$OUT/cascade_$d.json"
  done
}
job_fp8_engine() {  # same process family, one mode per process; KV capacity in the JSON
  local both=(python3 scripts/bench_engine.py "${M[@]}" --output-len 128 --ttft-reps 9)
  local a=("${both[@]}" --skip-off)
  run fp8_engine_bf16 230 "${a[@]}" --output-json "$OUT/fp8_engine_bf16.json"
  run fp8_engine_kv 230 "${a[@]}" --kv-cache-dtype fp8 --output-json "$OUT/fp8_engine_kv.json"
  run fp8_engine_w 230 "${a[@]}" --quantization fp8 --output-json "$OUT/fp8_engine_w.json"
  # both fp8 modes with the cache off too (issue 17's on/off ratio)
  run fp8_engine_both 330 "${both[@]}" --kv-cache-dtype fp8 --quantization fp8 \
    --output-json "$OUT/fp8_engine_both.json"
}
job_fp8_sharegpt() {
  local e=(python3 scripts/bench_throughput.py --model llama-3-8b --load-format dummy
           --dataset-name sharegpt --dataset-path bench_data/sharegpt_smollm2_1000.json
           --num-prompts 1000)
  run fp8_sharegpt_bf16 300 "${e[@]}" --output-json "$OUT/fp8_sharegpt_bf16.json"
  run fp8_sharegpt_both 300 "${e[@]}" --kv-cache-dtype fp8 --quantization fp8 \
    --output-json "$OUT/fp8_sharegpt_both.json"
}
job_b() {
  run b_policies 300 python3 scripts/bench_throughput.py "${M[@]}" --num-prompts 256 \
    --num-prefixes 32 --input-len 1088 --prefix-len 1024 --output-len 64 --num-kv-blocks 1024 \
    --policy fcfs greedy:max_wait=120 lpm:max_wait=120 --output-json "$OUT/b_policies.json"
}
job_c() {
  local c=("${M[@]}" --num-prompts 64 --num-prefixes 8 --prefix-levels 3 --overlap 0.3
           --input-len 1040 --prefix-len 1024 --output-len 16)
  run c_trie 200 python3 scripts/bench_throughput.py "${c[@]}" --output-json "$OUT/c_trie.json"
  run c_flat 200 python3 scripts/bench_throughput.py "${c[@]}" --flat-prefixes \
    --output-json "$OUT/c_flat.json"
}
job_d() {
  local d=("${M[@]}" --input-len 700 --prefix-len 596 --output-len 16 --num-prompts 120
           --request-rate 16 --latency-bound-ms 320 --latency-metric mean --sweep-steps 1)
  run d_on 280 python3 scripts/bench_latency.py "${d[@]}" --output-json "$OUT/d_on.json"
  run d_off 280 python3 scripts/bench_latency.py "${d[@]}" --no-enable-prefix-caching \
    --output-json "$OUT/d_off.json"
}
job_e() {
  run e_sharegpt 220 python3 scripts/bench_throughput.py "${M[@]}" \
    --dataset-name sharegpt --dataset-path bench_data/sharegpt_smollm2_1000.json \
    --num-prompts 200 --compare-caching \
    --output-json "$OUT/e_sharegpt.json"
}

job_spec_verify() {
  run spec_verify 240 python3 scripts/bench_spec.py --verify --model llama-2-7b --dtype bfloat16 \
    --batch 1 8 64 --accepted-length 2:2.82 4:4.16 --budget-s 180 \
    --output-json "$OUT/spec_verify.json"
}
job_window_kv() {  # (an H100 did not finish the hybrid mode in 190 s: keep 420)
  run window_kv 420 python3 scripts/bench_window_kv.py --output-json "$OUT/window_kv.json"
}
job_moe() {
  run moe_gemm 150 python3 scripts/bench_moe.py --models qwen3-30b-a3b \
    --tokens 1 64 256 1024 8192 --out "$OUT/moe_gemm.json"
  run moe_engine 300 python3 scripts/bench_engine.py --model qwen3-30b-a3b --output-len 128 \
    --ttft-reps 0 --max-num-batched-tokens 2048 --output-json "$OUT/moe_engine.json"
}
job_models() {  # issue 37: the seed workload with its cache-off peer, then ShareGPT (needs
  # carry ["bench_data"]), per model of $MODELS (default the three that fit one H100 too)
  # (Gemma 3's 128k context outgrows an H100's KV cache: it runs at 16k; its seed run with
  # the cache-off peer outran 240 s twice on an H100, so it gets 480)
  local m len lim
  for m in ${MODELS:-qwen3-8b gemma-3-12b qwen3-30b-a3b}; do
    len=(); lim=240
    [ "$m" = gemma-3-12b ] && len=(--max-model-len 16384) && lim=480
    [ "${SEED:-1}" = 1 ] && run "seed_$m" "$lim" python3 scripts/bench_engine.py --model "$m" \
      --output-len 128 --ttft-reps 0 --max-num-batched-tokens 2048 "${len[@]}" \
      --output-json "$OUT/seed_$m.json"
    [ "${SHAREGPT:-1}" = 1 ] && [ -f bench_data/sharegpt_smollm2_1000.json ] && \
      run "sharegpt_$m" 240 python3 scripts/bench_throughput.py --model "$m" --load-format dummy \
      "${len[@]}" --dataset-name sharegpt --dataset-path bench_data/sharegpt_smollm2_1000.json \
      --num-prompts 1000 --output-json "$OUT/sharegpt_$m.json"
  done
}
job_tier() {
  local t=(python3 scripts/bench_throughput.py "${M[@]}" --input-len 700 --prefix-len 596
           --output-len 128 --num-prompts 256)
  run offload 120 python3 scripts/bench_offload.py "${M[@]}" --dtype bfloat16 \
    --prefix-len 2000 --kv-offloading-size 8 --repeats 9 --json "$OUT/offload.json"
  run tier_off 120 "${t[@]}" --output-json "$OUT/tier_off.json"
  run tier_unused 120 "${t[@]}" --kv-offloading-size 16 --output-json "$OUT/tier_unused.json"
}
job_tier_loads() {
  run tier_tests 300 python3 -m pytest -q -rf tests/test_kv_offload.py tests/test_host_rows.py \
    -k "not benchmark_scripts"
  run offload_llama3 150 python3 scripts/bench_offload.py --model llama-3-8b \
    --load-format dummy --dtype bfloat16 --prefix-len 2000 --kv-offloading-size 8 \
    --repeats 9 --load-pieces 1 2 --json "$OUT/offload_llama3_8b.json"
}
job_multiturn() {  # (RESULTS.md's full run is 256 conversations x 6 turns at concurrency 64;
  # this one fits a device call: 32 running histories fill the 4x-oversubscribed pool)
  run multiturn 540 python3 scripts/bench_multiturn.py --model llama-3-8b --load-format dummy \
    --dtype bfloat16 --dataset synthetic --num-conversations 128 --turns 4 --user-len 200 \
    --output-len 64 --concurrency 32 --max-num-seqs 32 --oversubscription 4 \
    --kv-offloading-size 24 \
    --modes "off,on${STEP_TOKENS:+,on:$STEP_TOKENS},unbounded" --schedule "${SCHEDULE:-rounds}" \
    ${TRACE:+--trace "$TRACE" --trace-dir "$OUT/traces"} --json "$OUT/multiturn.json"
}
job_multiturn_sharegpt() {  # the same on ShareGPT's conversations (user turns of a median
  # 17 tokens: the histories are mostly replies); needs carry ["bench_data"] holding
  # `scripts/workloads.py conversations --num-prompts 512 --turns 4 --output
  # bench_data/sharegpt_conversations_smollm2.json`
  run multiturn_sharegpt 540 python3 scripts/bench_multiturn.py --model llama-3-8b \
    --load-format dummy --dtype bfloat16 \
    --dataset bench_data/sharegpt_conversations_smollm2.json --num-conversations 128 \
    --turns 4 --output-len 128 --concurrency 32 --max-num-seqs 32 --oversubscription 4 \
    --kv-offloading-size 24 \
    --modes "off,on${STEP_TOKENS:+,on:$STEP_TOKENS},unbounded" --schedule "${SCHEDULE:-rounds}" \
    ${TRACE:+--trace "$TRACE" --trace-dir "$OUT/traces"} --json "$OUT/multiturn_sharegpt.json"
}
job_mgpu_prefill() {  # a barrier mistake hangs rather than fails: the smoke test goes first
  run mgpu_smoke 150 python3 -m pytest -x -q \
    "tests/test_mgpu_paged_prefill.py::test_kernel_matches_reference[case0-h4k4-wg2]" || return
  run mgpu_tests 300 python3 -m pytest -q -rf tests/test_mgpu_paged_prefill.py \
    tests/test_kernel_backend.py
}
job_mgpu_bench() {
  run mgpu_bench 560 python3 scripts/bench_mgpu_prefill.py --alibi \
    --output-json "$OUT/mgpu_prefill.json"
}

if [ $# -eq 0 ]; then awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 2; fi
for job in "$@"; do
  if ! declare -F "job_$job" > /dev/null; then echo "unknown job: $job" >&2; exit 2; fi
done
for job in "$@"; do "job_$job"; done
