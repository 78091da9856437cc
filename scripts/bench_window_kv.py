"""Gemma 3's hybrid KV cache on a long-context shared-prefix workload: KV memory held and
output tok/s with window-aware freeing vs one block table keeping every layer's blocks.

`--questions` requests share one `--doc-tokens` document (a prefix-cache hit after the
first) and each adds a `--question-tokens` question and `--max-tokens` of output. Both
modes run in this process over the same weights and the same KV budget (`--kv-gib`
GiB): "hybrid" (the default engine: a table per layer group, window pages freed once
out of the window, `core.kv_groups`) and "one_table" (`disable_hybrid_kv_cache_manager`:
the in-run peer). Per mode: KV MiB held (peak and mean over steps, from the block
manager's pages in use), the most sequences running at once, preemptions, the prefix
hit rate and output tok/s over the timed run (the document computed and every step
shape compiled by a warm-up of the same workload first).

    python scripts/bench_window_kv.py --output-json window_kv.json
    python scripts/bench_window_kv.py --tiny   # a CPU smoke run on tiny-gemma3
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jprefix import LLM, SamplingParams, load  # noqa: E402
from jprefix.benchmarks.common import write_json  # noqa: E402
from jprefix.core.kv_groups import kv_cache_groups  # noqa: E402
from jprefix.worker.kv_cache import kv_block_bytes  # noqa: E402

TINY = dict(model="tiny-gemma3", dtype="float32", doc_tokens=200, questions=6,
            question_tokens=8, max_tokens=24, block_size=8, kv_gib=0.0002)
GIB = 1 << 30


def workload(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    doc = rng.integers(10, vocab - 10, args.doc_tokens).tolist()
    return [doc + rng.integers(10, vocab - 10, args.question_tokens).tolist()
            for _ in range(args.questions)]


def page_bytes(model, block_size: int, hybrid: bool) -> int:
    """Bytes of one block of the cache (a hybrid cache's page holds `page_layers`)."""
    cfg = model.config
    groups = kv_cache_groups(cfg.layer_windows) if hybrid else None
    return kv_block_bytes(cfg, block_size, model.params.embed.dtype,
                          groups.page_layers if groups else None)


def run_mode(model, args, prompts: list[list[int]], hybrid: bool) -> dict:
    per_block = page_bytes(model, args.block_size, hybrid)
    num_blocks = int(args.kv_gib * GIB) // per_block
    llm = LLM(model, block_size=args.block_size, num_kv_blocks=num_blocks,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.batched_tokens,
              max_model_len=args.doc_tokens + args.question_tokens + args.max_tokens + 1,
              disable_hybrid_kv_cache_manager=not hybrid, enable_cascade=False)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = llm.engine
    t0 = time.perf_counter()
    drive(engine, prompts, sp, "w")  # warm-up: the document cached, every shape compiled
    print(f"  {'hybrid' if hybrid else 'one_table'}: warm-up (the document, every step "
          f"shape compiled) took {time.perf_counter() - t0:.0f} s", flush=True)
    engine.scheduler.prefix_pool.reset_counters()
    preempted = engine.stats.num_preemptions
    row = drive(engine, prompts, sp, "r")
    row.update(mode="hybrid" if hybrid else "one_table", num_blocks=num_blocks,
               block_mib=round(per_block / 2**20, 4),
               preemptions=engine.stats.num_preemptions - preempted,
               hit_rate=round(engine.prefix_pool.stats().hit_rate, 4))
    row["kv_mib_peak"] = round(row.pop("peak_blocks") * per_block / 2**20, 3)
    row["kv_mib_mean"] = round(row.pop("mean_blocks") * per_block / 2**20, 3)
    del llm, engine
    gc.collect()
    return row


def drive(engine, prompts, sp, tag: str) -> dict:
    """Steps the engine over the workload; the blocks in use and running sequences are
    read after every step."""
    bm, sched = engine.scheduler.block_manager, engine.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, sp)
    used, running, tokens = [], 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids) if out.finished else 0
        used.append(bm.num_used_blocks)
        running = max(running, len(sched.running))
    wall = time.perf_counter() - t0
    return dict(wall_s=round(wall, 3), output_tokens=tokens,
                output_tok_s=round(tokens / wall, 1), steps=len(used), max_running=running,
                peak_blocks=max(used), mean_blocks=float(np.mean(used)))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-12b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--doc-tokens", type=int, default=8192)
    ap.add_argument("--questions", type=int, default=256)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-gib", type=float, default=8.0, help="the KV budget of each mode")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--modes", default="hybrid,one_table")
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke run: " + str(TINY))
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    model = load(args.model, dtype=args.dtype, load_format=args.load_format)
    prompts = workload(args, model.config.vocab_size)
    print(f"{args.model} on {jax.devices()[0].device_kind}: {args.questions} questions on a "
          f"{args.doc_tokens}-token document, {args.kv_gib} GiB of KV", flush=True)
    rows = []
    for mode in args.modes.split(","):  # (each row printed once done: a cut run keeps it)
        rows.append(run_mode(model, args, prompts, mode == "hybrid"))
        print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    write_json(args.output_json, {"args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
