"""`jprefix bench throughput`: offline throughput, after vLLM's benchmark_throughput. Every
request is queued at once and the engine runs until all finish; one row per (policy,
prefix caching) configuration.

Each configuration runs the workload twice and reports the second run (the first compiles
every shape bucket); the prefix cache is reset in between, so the measured run computes
each prefix once. Requests use greedy sampling with ignore_eos (fixed output lengths).

    jprefix bench throughput --model llama-2-7b --load-format dummy --input-len 700 \
        --prefix-len 596 --output-len 128 --num-prompts 256 --compare-caching
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

from jprefix.benchmarks.common import format_table, replicas, write_json
from jprefix.benchmarks.workload import add_dataset_args, build_requests
from jprefix.entrypoints.cli_args import add_engine_args, engine_kwargs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The model, the engine's flags (`jprefix serve`'s), the dataset flags and
    --output-json; shared with `jprefix bench latency`. `parser` must resolve conflicts
    (`conflict_handler="resolve"`): a benchmark may redefine an engine flag (--policy)."""
    parser.add_argument("--model", default="llama-2-7b", help="path, GGUF, hub id or preset")
    add_engine_args(parser)
    add_dataset_args(parser)
    parser.add_argument("--output-json", default=None, help="write the results here")


def load_model(args: argparse.Namespace) -> tuple[Any, int, Any]:
    """(what LLM takes as its model, vocabulary size, a tokenizer getter). One load serves
    every configuration; a sharded or multi-host engine loads its own (by name)."""
    # the KV cache is sized from the device memory free after JAX's pool is reserved:
    # a larger pool than JAX's 75% default (set before jax starts its backend)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    from jprefix import load
    from jprefix.benchmarks.sharegpt import load_tokenizer
    from models.loader import model_config

    def fallback() -> Any:
        return load_tokenizer(args.tokenizer or "smollm2-135m")

    if args.tensor_parallel_size > 1 or args.num_processes is not None:
        return args.model, model_config(args.model, args.load_format).vocab_size, fallback
    model = load(args.model, args.dtype, args.load_format, tokenizer=args.tokenizer)
    return model, model.config.vocab_size, lambda: model.tokenizer or fallback()


def make_llm(model: Any, args: argparse.Namespace, policy: str, caching: bool) -> Any:
    from jprefix import LLM

    return LLM(model, **(engine_kwargs(args) | dict(policy=policy,
                                                    enable_prefix_caching=caching)))


def make_request(llm: Any, req) -> Any:
    """One benchmark request made (validated, not queued; greedy, ignore_eos): its handle,
    a `SampleGroup` of one sequence."""
    from jprefix import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True)
    return llm.engine.make_request(req.prompt, sp, req.prefix_len, cache_salt=req.salt)


def run_once(llm: Any, reqs: list) -> dict:
    """Queues every request, steps until all finish; counts tokens, blocks and time."""
    engine = llm.engine
    blocks = [r.scheduler.block_manager for r in replicas(llm)]
    engine.step_stats.clear()
    before = llm.stats()["replicas"]
    start = time.perf_counter()
    groups = [make_request(llm, r) for r in reqs]
    for group in groups:
        engine.add(group)
    seqs = [g.seqs[0] for g in groups]  # (their scheduling state: preemptions)
    done, peak, outs = 0, 0, []
    while done < len(seqs):
        finished = engine.step()
        outs += finished
        done += len(finished)
        peak = max(peak, sum(b.num_used_blocks for b in blocks))
    elapsed = time.perf_counter() - start
    computed = sum(s[1] for s in engine.step_stats)
    out_tokens = sum(len(o.token_ids) for o in outs)
    return dict(
        requests=len(outs),
        prompt_tokens=sum(len(r.prompt) for r in reqs),
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        output_tokens=out_tokens,
        prefill_tokens_computed=computed - (out_tokens - len(outs)),  # incl. recompute
        elapsed_s=elapsed,
        requests_per_s=len(outs) / elapsed,
        output_tokens_per_s=out_tokens / elapsed,
        total_tokens_per_s=(out_tokens + sum(len(r.prompt) for r in reqs)) / elapsed,
        peak_kv_blocks=peak,
        prefix_cache_blocks=sum(len(r.scheduler.prefix_pool.trie) for r in replicas(llm)),
        num_preemptions=sum(s.num_preemptions for s in seqs),
        steps=len(engine.step_stats),
        errors=sum(o.finish_reason == "error" for o in outs),
        **replica_counters(before, llm.stats()["replicas"]),
    )


def replica_counters(before: list[dict], after: list[dict]) -> dict:
    """Per replica over one run: requests routed there and its prefix-cache hit rate."""
    def delta(key: str) -> list[int]:
        return [a[key] - b[key] for b, a in zip(before, after, strict=True)]

    hits, queried = delta("num_hit_tokens"), delta("num_queried_tokens")
    return dict(replica_requests=delta("requests"),
                replica_hit_rate=[round(h / q, 4) if q else 0.0
                                  for h, q in zip(hits, queried, strict=True)])


def bench_config(model, reqs: list, args, policy: str, caching: bool) -> dict:
    llm = make_llm(model, args, policy, caching)
    for _ in range(2):  # the first run compiles
        if not llm.reset_prefix_cache():
            raise RuntimeError("prefix cache still in use after a finished run")
        result = run_once(llm, reqs)
    num_blocks = replicas(llm)[0].scheduler.block_manager.num_blocks
    del llm
    gc.collect()  # frees the KV cache before the next configuration allocates its own
    return dict(policy=policy, enable_prefix_caching=caching, num_kv_blocks=num_blocks,
                data_parallel_size=args.data_parallel_size, routing_policy=args.routing_policy,
                tensor_parallel_size=args.tensor_parallel_size, **result)



COLUMNS = [("policy", "policy", "{}"), ("cache", "enable_prefix_caching", "{}"),
           ("requests", "requests", "{}"), ("prompt tok", "prompt_tokens", "{}"),
           ("cached tok", "cached_tokens", "{}"), ("prefill tok", "prefill_tokens_computed", "{}"),
           ("output tok", "output_tokens", "{}"), ("elapsed s", "elapsed_s", "{:.2f}"),
           ("req/s", "requests_per_s", "{:.2f}"), ("out tok/s", "output_tokens_per_s", "{:.0f}"),
           ("peak KV blk", "peak_kv_blocks", "{}"), ("preempt", "num_preemptions", "{}"),
           ("DP", "data_parallel_size", "{}"), ("routing", "routing_policy", "{}")]


def main(args: argparse.Namespace) -> dict:
    """Runs every configuration; prints a JSON line per run and the table; returns (and
    with --output-json writes, after every run) the results."""
    model, vocab_size, tokenizer = load_model(args)
    reqs = build_requests(args, vocab_size, tokenizer)
    modes = [args.enable_prefix_caching] + ([not args.enable_prefix_caching]
                                            if args.compare_caching else [])
    runs: list[dict] = []
    for caching in modes:
        for policy in args.policy:
            runs.append(bench_config(model, reqs, args, policy, caching))
            print(json.dumps(runs[-1]), flush=True)
            result = dict(benchmark="throughput", model=args.model, args=vars(args), runs=runs)
            write_json(args.output_json, result)  # after every run: a timeout keeps them
    print(f"\n{args.model} ({args.load_format}), dataset {args.dataset_name}, "
          f"{len(reqs)} requests")
    print(format_table(runs, COLUMNS))
    return result


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser)
    parser.add_argument("--policy", nargs="+", default=["fcfs"],
                        help="fcfs, greedy, lpm (options: 'lpm:fcfs_threshold=128,"
                             "max_wait=30'); several: one run each")
    parser.add_argument("--compare-caching", action="store_true",
                        help="also run every policy with prefix caching off")
