"""One engine step in isolation: decode at several batch sizes against its floor.

Runs the jitted step on fake sequences (random tokens, shuffled block tables, context
`--context` each, its last `--output-tokens` counted as generated) and reports ms per
step next to the memory floor (weights + the K/V the step reads, at the copy bandwidth),
plus the in-place check of the KV cache. `--sampling both` times each batch twice: plain
(greedy) rows, then rows that each set every sampling feature (temperature, top-p,
repetition / presence / frequency penalties, min_p, a logit bias, 5 logprobs): the
step's extra variant, against the plain path.

    python scripts/bench_step.py --model llama-2-7b --sampling both
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jprefix import LLM, SamplingParams, load  # noqa: E402
from jprefix.benchmarks.common import add_fp8_flags, fp8_kwargs  # noqa: E402
from scripts.memcheck import (  # noqa: E402
    compile_step,
    step_memory_report,
    synthetic_rows,
)

COPY_BW = 4.3e12  # bytes/s: the H200's device-to-device copy bandwidth (the floor's rate)


# every sampling feature at once (`--sampling extra`): the step's extra variant
EXTRA = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=1, repetition_penalty=1.1,
                       presence_penalty=0.2, frequency_penalty=0.2, min_p=0.05,
                       logit_bias={11: 1.0, 12: -1.0}, logprobs=5)


def fake_decode_batch(batch: int, context: int, block_size: int, num_blocks: int, rng,
                      sampling_params: SamplingParams | None = None, output_tokens: int = 0):
    per_seq = -(-context // block_size)
    if batch * per_seq >= num_blocks:
        raise ValueError(f"batch {batch} x {per_seq} blocks exceeds the {num_blocks}-block cache")
    ids = rng.permutation(np.arange(1, num_blocks))[: batch * per_seq].reshape(batch, per_seq)
    contexts = rng.integers(10, 1000, (batch, context)).tolist()
    rows = synthetic_rows(contexts, ids.tolist(), [1] * batch, sampling_params,
                          seeds=list(range(batch)))
    for row in rows:  # (the penalties count the output tokens, the prompt's apart)
        row.seq.prompt_token_ids = row.seq.prompt_token_ids[: context - output_tokens]
    return rows


def time_step(runner, scheduled, reps: int) -> dict:
    """Median ms of: a whole step (dispatch + wait), the dispatch alone (host time until
    the step is enqueued), and a step when `reps` steps are dispatched back to back (the
    device time, once the host keeps ahead)."""
    t = time.perf_counter()
    runner.execute(scheduled)
    print(f"first call (compile) {time.perf_counter() - t:.1f} s", flush=True)
    for _ in range(2):
        runner.execute(scheduled)
    whole, dispatch = [], []
    for _ in range(reps):
        t = time.perf_counter()
        handle = runner.dispatch(scheduled)
        dispatch.append(time.perf_counter() - t)
        runner.fetch(handle)
        whole.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(reps):
        handle = runner.dispatch(scheduled)
    runner.fetch(handle)
    pipelined = (time.perf_counter() - t) / reps
    return dict(step_ms=statistics.median(whole) * 1e3,
                dispatch_ms=statistics.median(dispatch) * 1e3, pipelined_ms=pipelined * 1e3)


def command_buffers(runner, scheduled) -> int:
    """Command buffers (CUDA graphs) XLA formed in the compiled step."""
    return compile_step(runner, scheduled).as_text().count("command_buffer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sampling", choices=("plain", "extra", "both"), default="plain",
                    help="greedy rows, rows with every sampling feature (EXTRA), or both")
    ap.add_argument("--output-tokens", type=int, default=128,
                    help="of each context, the tokens counted as generated (penalties)")
    ap.add_argument("--output-json", default=None)
    add_fp8_flags(ap)
    args = ap.parse_args()

    model = load(args.model, dtype="bfloat16", load_format="dummy")
    llm = LLM(model, gpu_memory_utilization=0.85, **fp8_kwargs(args))
    runner = llm.engine.runner
    cfg = model.config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    rng = np.random.default_rng(0)
    rows = []
    kinds = {"plain": [None], "extra": [EXTRA], "both": [None, EXTRA]}[args.sampling]
    for b in args.batch:
        for sp in kinds:
            sched = fake_decode_batch(b, args.context, runner.block_size,
                                      runner.kv_cache[0].shape[2], rng, sp, args.output_tokens)
            timing = time_step(runner, sched, args.reps)
            floor = (weight_bytes + b * args.context * kv_per_token) / COPY_BW * 1e3
            rows.append(dict(batch=b, context=args.context, floor_ms=floor, **timing,
                             sampling="plain" if sp is None else "extra",
                             command_buffer_mentions=(command_buffers(runner, sched)
                                                      if sp is None else None),
                             xla_flags=os.environ.get("XLA_FLAGS", "")))
            print(rows[-1], flush=True)
    mem = step_memory_report(runner)
    print(f"\n{args.model} decode step, backend {runner.backend}, jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}")
    print(f"KV cache {mem['kv_bytes'] / 1e9:.1f} GB, aliased {mem['alias_bytes'] / 1e9:.1f} GB, "
          f"step temp {mem['temp_bytes'] / 1e9:.2f} GB")
    for r in rows:
        print(f"{r['sampling']:5s} batch {r['batch']:4d} ctx {r['context']}: "
              f"{r['step_ms']:7.2f} ms, dispatch "
              f"{r['dispatch_ms']:.2f} ms, back to back {r['pipelined_ms']:.2f} ms "
              f"(floor {r['floor_ms']:.2f} ms, {r['floor_ms'] / r['pipelined_ms']:.0%} of "
              f"roofline)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(rows=rows, memory=mem), f, indent=1)


if __name__ == "__main__":
    main()
