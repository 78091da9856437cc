"""Engine benchmark: shared-prefix throughput, TTFT, host share, KV memory.

Workload: N requests of `prefix` shared + `unique` own random tokens, `--output-len` new
tokens each (ignore_eos), dummy weights of a real architecture. Each configuration runs
the workload twice and reports the second run (the first compiles every shape bucket);
the prefix cache is reset in between, so the cached run still computes its prefix once.

    python scripts/bench_engine.py --model llama-2-7b --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gc
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402

from jprefix import LLM, SamplingParams, StructuredOutputsParams, load  # noqa: E402
from jprefix.benchmarks.common import fp8_kwargs, replicas, workload_parser  # noqa: E402
from jprefix.benchmarks.datasets import make_prompts  # noqa: E402
from models.loader import model_config  # noqa: E402


def sampling_features(output_len: int) -> SamplingParams:
    """Every sampling feature on at once (`--sampling-only`): temperature, top-p,
    min-p, the three penalties, a logit bias and 5 logprobs per token."""
    return SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          presence_penalty=0.2, frequency_penalty=0.2,
                          logit_bias={11: 1.0, 12: -1.0}, logprobs=5, seed=0,
                          max_tokens=output_len, ignore_eos=True)


def request_params(tag: str, output_len: int, regex: str | None) -> SamplingParams:
    """The requests' sampling: greedy (plain), every sampling feature (`--sampling-only`)
    or greedy under a regex grammar (`--structured-regex`)."""
    if tag == "on_sampling":
        return sampling_features(output_len)
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(regex=regex)
                          if tag == "on_structured" else None)


def run_throughput(llm: LLM, prompts, prefix_len, sp: SamplingParams) -> dict:
    best = None
    for _ in range(2):  # the first run compiles
        llm.reset_prefix_cache()
        llm.engine.step_stats.clear()
        blocks = [r.scheduler.block_manager for r in replicas(llm)]
        peak = 0
        start = time.perf_counter()
        llm.engine.step_stats.clear()
        for group in [llm.engine.make_request(p, sp, prefix_len) for p in prompts]:
            llm.engine.add(group)
        done = out_tokens = 0
        while done < len(prompts):
            outs = llm.engine.step()
            done += len(outs)
            out_tokens += sum(len(o.token_ids) for o in outs)  # (a grammar may end one early)
            peak = max(peak, sum(b.num_blocks - 1 - b.num_free_blocks for b in blocks))
        elapsed = time.perf_counter() - start
        best = dict(elapsed_s=elapsed, peak_used_blocks=peak, stats=list(llm.engine.step_stats),
                    output_tokens=out_tokens)
    stats = best.pop("stats")
    decode = [s for s in stats if s[0] >= len(prompts) * 0.9 and s[1] == s[0]]
    host_share = (
        sum(s[2] for s in decode) / sum(s[3] for s in decode) if decode else float("nan")
    )
    return dict(
        **best,
        output_tok_s=best["output_tokens"] / best["elapsed_s"],
        steps=len(stats),
        full_batch_decode_steps=len(decode),
        full_batch_step_ms=1e3 * statistics.median([s[3] for s in decode]) if decode else None,
        host_share_full_batch=host_share,
        prefill_tokens=sum(s[1] for s in stats) - sum(s[0] for s in stats if s[1] == s[0]),
        # the steps that are not full-batch decodes: rows, tokens, period ms, host ms
        other_steps=[(s[0], s[1], round(s[3] * 1e3, 2), round(s[2] * 1e3, 2))
                     for s in stats if s[1] != s[0] or s[0] < len(prompts) * 0.9],
    )


def timed_request(llm: LLM, prompt: list[int], prefix_len: int, sp: SamplingParams,
                  cached: bool, i: int):
    """(seconds, output) of one request alone, its prefix cached first (by a request of
    the prefix and a token of its own, `i`-th of a series) or the cache empty."""
    llm.reset_prefix_cache()
    if cached:
        llm.generate([prompt[:prefix_len] + [11 + i]], SamplingParams(
            temperature=0, max_tokens=1, ignore_eos=True), prefix_pos=prefix_len,
            use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate([prompt], sp, prefix_pos=prefix_len, use_tqdm=False)[0]
    return time.perf_counter() - start, out


def run_ttft(llm: LLM, prompt: list[int], prefix_len: int, cached: bool, reps: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(reps + 2):
        seconds, out = timed_request(llm, prompt, prefix_len, sp, cached, i)
        if i >= 2:
            times.append(seconds)
            block = llm.engine.args.block_size
            expect = prefix_len // block * block if cached else 0
            assert out.num_cached_tokens == expect, (out.num_cached_tokens, expect)
    return statistics.median(times) * 1e3


def run_tpot(llm: LLM, prompt: list[int], prefix_len: int, output_len: int, reps: int) -> float:
    """Milliseconds per output token after the first, one request alone (batch-1 decode):
    the median over `reps` of (time for output_len tokens - time for 1) / (output_len - 1),
    with the prefix cached both times."""
    per_token = []
    for i in range(reps + 1):  # the first compiles the decode step
        times = []
        for n in (1, output_len):
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            seconds, out = timed_request(llm, prompt, prefix_len, sp, True, i)
            assert len(out.token_ids) == n
            times.append(seconds)
        if i:
            per_token.append((times[1] - times[0]) / (output_len - 1))
    return statistics.median(per_token) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = workload_parser(__doc__)
    ap.add_argument("--output-len", type=int, nargs="+", default=[128, 32])
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--ttft-reps", type=int, default=10)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context length (default: the model's; a long-context model "
                         "whose context outgrows the KV cache needs one)")
    ap.add_argument("--skip-off", action="store_true", help="skip the cache-off runs")
    ap.add_argument("--compare-cascade", action="store_true",
                    help="also run cache on with cascade decode off")
    ap.add_argument("--sampling-only", action="store_true",
                    help="run only cache on, with every sampling feature on each request "
                         "(penalties, min_p, logit bias, 5 logprobs: the step's extra "
                         "variant); compare with a plain run in another process (a second "
                         "full-memory engine in one process can fail to place its cache)")
    ap.add_argument("--structured-regex", default=None, metavar="REGEX",
                    help="run only cache on, every request greedy under this regex grammar "
                         "(the model needs its tokenizer); with --no-async-scheduling the "
                         "synchronous engine's figure for the same outputs")
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer directory or hub id for the model (dummy weights have "
                         "none; --structured-regex needs one)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="schedule each step after the one before has finished")
    ap.add_argument("--ttft-only", action="store_true",
                    help="measure time to first token only (no throughput runs)")
    ap.add_argument("--fixed-inputs", choices=("auto", "on", "off"), default="auto",
                    help="step inputs in device buffers refilled in place (auto: where "
                         "XLA records command buffers)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="engine replicas, one device each (requests routed by prefix)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="devices the model is split over (> 1: loaded sharded by the engine)")
    ap.add_argument("--coordinator-address", default=None,
                    help="multi-host (with --num-processes, --process-id): process 0's "
                         "host:port; one engine only (--skip-off, no --compare-cascade)")
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    args = ap.parse_args(argv)
    if args.ttft_only and args.ttft_reps < 1:
        ap.error("--ttft-only measures nothing with --ttft-reps < 1")

    multi = dict(coordinator_address=args.coordinator_address,
                 num_processes=args.num_processes, process_id=args.process_id)
    fixed = {"auto": None, "on": True, "off": False}[args.fixed_inputs]
    modes = [("on", True, True)]  # (tag, prefix caching, cascade decode)
    if args.compare_cascade:
        modes.append(("on_nocascade", True, False))
    if not args.skip_off:
        modes.append(("off", False, False))
    if args.sampling_only:
        modes = [("on_sampling", True, True)]
    if args.structured_regex is not None:
        modes = [("on_structured", True, True)]
    sharded = args.tensor_parallel_size > 1 or any(v is not None for v in multi.values())
    if sharded or (len(modes) == 1 and args.tokenizer is None):
        # the engine loads the model by name (sharded over its mesh), as `LLM(name)` does:
        # it owns the weights, so the loaded copy is freed once its layout is made, and
        # the KV capacity is what a user gets
        model = args.model
        vocab_size = model_config(args.model, args.load_format).vocab_size
        engine_kw = dict(dtype=args.dtype, load_format=args.load_format,
                         tensor_parallel_size=args.tensor_parallel_size, **multi)
    else:  # one load for several engines (the caller keeps the loaded weights)
        model = load(args.model, dtype=args.dtype, load_format=args.load_format,
                     tokenizer=args.tokenizer)
        vocab_size, engine_kw = model.config.vocab_size, {}
    prompts = make_prompts(args.num_prompts, args.prefix_len, args.unique_len, vocab_size, 0)
    results: dict = {"model": args.model, "num_prompts": args.num_prompts,
                     "prefix_len": args.prefix_len, "unique_len": args.unique_len,
                     "xla_flags": os.environ.get("XLA_FLAGS", ""),
                     "data_parallel_size": args.data_parallel_size,
                     "async_scheduling": not args.no_async_scheduling,
                     "structured_regex": args.structured_regex, **fp8_kwargs(args)}
    num_blocks = args.num_kv_blocks  # fixed after the first engine: same shapes, no recompile
    for tag, caching, cascade in modes:
        llm = LLM(model, enable_prefix_caching=caching, num_kv_blocks=num_blocks,
                  enable_cascade=cascade, fixed_inputs=fixed,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
                  max_model_len=args.max_model_len,
                  data_parallel_size=args.data_parallel_size,
                  async_scheduling=not args.no_async_scheduling, **engine_kw,
                  **fp8_kwargs(args))
        first = replicas(llm)[0]
        results[f"fixed_inputs_{tag}"] = first.runner.fixed_inputs is not None
        num_blocks = first.scheduler.block_manager.num_blocks
        results[f"num_kv_blocks_{tag}"] = num_blocks
        for out_len in [] if args.ttft_only else args.output_len:
            r = run_throughput(llm, prompts, args.prefix_len,
                               request_params(tag, out_len, args.structured_regex))
            results[f"throughput_{tag}_out{out_len}"] = r
            stats = jax.local_devices()[0].memory_stats() or {}
            results[f"device_memory_{tag}"] = {k: stats[k] for k in (
                "bytes_limit", "bytes_in_use", "peak_bytes_in_use") if k in stats}
            print(f"cache {tag} out {out_len}: {r}", flush=True)
        if tag not in ("on_nocascade", "on_sampling", "on_structured") and args.ttft_reps > 0:
            # (single requests never cascade)
            results[f"ttft_ms_{tag}_cached" if caching else "ttft_ms_off"] = run_ttft(
                llm, prompts[0], args.prefix_len, caching, args.ttft_reps)
            if caching:
                results["ttft_ms_on_uncached"] = run_ttft(
                    llm, prompts[0], args.prefix_len, False, args.ttft_reps)
                results["tpot_ms_on"] = run_tpot(llm, prompts[0], args.prefix_len, 64,
                                                 max(1, args.ttft_reps // 3))
        del llm, first  # (each holds the engine, its weights and its KV cache)
        gc.collect()  # free its KV cache before the next engine sizes its own
        if args.output_json:  # after every engine: a timeout keeps what was measured
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=1)
    print_table(results, args)
    return results


def print_table(r: dict, args) -> None:
    weights = "dummy weights" if args.load_format == "dummy" else "checkpoint weights"
    print(f"\n{args.model} {weights}, {args.num_prompts} x ({args.prefix_len} shared + "
          f"{args.unique_len}) tokens, kv cache {args.kv_cache_dtype}, weights "
          f"{args.quantization or 'model dtype'}")
    for out_len in [] if args.ttft_only else args.output_len:
        on = r.get(f"throughput_on_out{out_len}")
        off = r.get(f"throughput_off_out{out_len}")
        nc = r.get(f"throughput_on_nocascade_out{out_len}")
        feat = r.get(f"throughput_on_sampling_out{out_len}")
        grammar = r.get(f"throughput_on_structured_out{out_len}")
        line = f"out {out_len:4d}:"
        if on:
            line += f" cache on {on['output_tok_s']:9.0f} tok/s"
        if nc:
            line += (f" | cascade off {nc['output_tok_s']:9.0f} tok/s (step "
                     f"{nc['full_batch_step_ms']:.1f} ms)")
        if feat:
            line += (f" | every sampling feature {feat['output_tok_s']:9.0f} tok/s (step "
                     f"{feat['full_batch_step_ms']:.1f} ms, host "
                     f"{feat['host_share_full_batch']:.1%})")
        if grammar:
            line += (f" structured {grammar['output_tok_s']:9.0f} tok/s "
                     f"({grammar['output_tokens']} tokens, step "
                     f"{grammar['full_batch_step_ms'] or float('nan'):.1f} ms, async "
                     f"scheduling {'on' if r['async_scheduling'] else 'off'})")
        if off:
            line += (f" | off {off['output_tok_s']:9.0f} tok/s | on/off "
                     f"{on['output_tok_s'] / off['output_tok_s']:.2f}x | peak blocks on/off "
                     f"{on['peak_used_blocks']}/{off['peak_used_blocks']}")
        if on:
            line += (f" | full-batch step {on['full_batch_step_ms']:.1f} ms, host work "
                     f"{on['host_share_full_batch']:.1%} of it (overlapping the device "
                     f"under async scheduling: scripts/profile_engine.py measures the "
                     f"device's idle)")
        print(line)
    for key in ("ttft_ms_on_cached", "ttft_ms_on_uncached", "ttft_ms_off", "tpot_ms_on"):
        if key in r:
            print(f"{key}: {r[key]:.1f} ms")


if __name__ == "__main__":
    main()
