#!/usr/bin/env bash
# H200 call (second session): decode-step dispatch with command buffers off and on, the
# engine profile (async scheduling, cascade), then the engine benchmark.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
quiet() { grep -v "^WARNING\|rematerialization\|^W0000\|^I0000\|^W1\|^I1\|^E1"; }
for cb in 0 1; do
  JPREFIX_XLA_COMMAND_BUFFERS=$cb timeout 150 python3 scripts/bench_step.py --model llama-2-7b \
    --batch 1 256 --context 700 --reps 10 --output-json "$OUT/step_cb$cb.json" 2>&1 | quiet | grep "^batch"
done
timeout 240 python3 scripts/profile_engine.py --model llama-2-7b \
  --configs async+cascade,sync+cascade --keep-traces "$OUT/traces" \
  --output-json "$OUT/profile.json" 2>&1 | quiet > "$OUT/profile.log"
python3 - "$OUT/profile.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c, v in d["configs"].items():
    for k in ("decode", "single"):
        x = v[k]
        print(c, k, "period %.2f ms, device busy %.2f ms, idle %.0f%%, kernels %.0f, dispatch %s"
              % (x["per_step_ms"], x["device_busy_per_step_ms"], 100 * x["device_idle_share"],
                 x["kernels_per_step"], x["jit_dispatch_ms"][2:6]))
PY
timeout 270 python3 scripts/bench_engine.py --model llama-2-7b --output-len 128 32 \
  --compare-cascade --ttft-reps 5 --output-json "$OUT/engine.json" 2>&1 | quiet | tee "$OUT/engine.log" | tail -8
