#!/usr/bin/env bash
# One H200 call for issues 3 and 6 (~6 minutes): the kernel table (bench_kernels.py: decode
# vs JAX's own paged attention, prefill vs cuDNN, prefix-cached prefill, write_kv), then
# cascade vs plain decode attention with its suffix/prefix breakdown (bench_cascade.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
quiet() { grep -v "^WARNING\|rematerialization\|^W1\|^I1"; }
timeout ${KERNELS_T:-330} python3 scripts/bench_kernels.py --output-json "$OUT/kernels.json" \
  2>&1 | quiet > "$OUT/kernels.log"
tail -14 "$OUT/kernels.log"
timeout ${CASCADE_T:-150} python3 scripts/bench_cascade.py --output-json "$OUT/cascade.json" \
  2>&1 | quiet > "$OUT/cascade.log"
tail -6 "$OUT/cascade.log"
