"""`jprefix bench serve`: drives a running `jprefix serve` (or any OpenAI-compatible server)
with a dataset, as vLLM's `vllm bench serve` does, and reports what a client sees.

Requests are sent at --request-rate (gamma arrivals of --burstiness, `arrivals.py`; inf:
all at once), at most --max-concurrency in flight, each streamed (`serve_client.py`).
Reported: completed and failed requests, prompt / output / cached tokens (the server's
usage; the cached share is the prompt tokens its prefix cache served), request and token
throughput over the run, and TTFT, TPOT, ITL, E2EL statistics (`metrics.py`).

    jprefix serve --model smollm2-135m &
    jprefix bench serve --model smollm2-135m --dataset-name shared-prefix \\
        --input-len 400 --prefix-len 320 --output-len 32 --num-prompts 64 \\
        --request-rate 4 --save-result
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from jprefix.benchmarks.arrivals import arrival_times
from jprefix.benchmarks.common import write_json
from jprefix.benchmarks.metrics import (
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_PERCENTILE_METRICS,
    latency_stats,
    parse_percentile_metrics,
    parse_percentiles,
    tpot,
)
from jprefix.benchmarks.serve_client import BACKENDS, RequestResult, request_body, send_request
from jprefix.benchmarks.workload import add_dataset_args, build_requests


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags (those this benchmark has) and the dataset flags."""
    parser.add_argument("--backend", default="openai", choices=sorted(BACKENDS))
    parser.add_argument("--base-url", default=None,
                        help="the server's URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None,
                        help="API path (default: /v1/completions; openai-chat: "
                             "/v1/chat/completions)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="the served model: its vocabulary sizes the random prompts")
    parser.add_argument("--served-model-name", default=None,
                        help="the `model` field of each request (default: --model)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizes ShareGPT text and decodes prompts for openai-chat "
                             "(default: --model's, else smollm2-135m)")
    add_dataset_args(parser, seed=True)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate --output-len tokens whatever the model says")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="log-probabilities per token to ask for (default: none)")
    parser.add_argument("--percentile-metrics", default=DEFAULT_PERCENTILE_METRICS,
                        help="comma-separated, of ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", default=DEFAULT_METRIC_PERCENTILES,
                        help="comma-separated percentiles, e.g. 50,90,99")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true", help="write the JSON result")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None,
                        help="default: {backend}-{rate}qps-{model}-{date}.json")
    parser.add_argument("--request-timeout", type=float, default=3600.0,
                        help="seconds one request may take")


def _tokenizer_getter(args: argparse.Namespace) -> Any:
    cache: list[Any] = []

    def get() -> Any:
        if not cache:
            from jprefix.benchmarks.sharegpt import load_tokenizer
            from models.config import PRESETS

            name = args.tokenizer or (args.model if args.model not in PRESETS
                                      else "smollm2-135m")
            cache.append(load_tokenizer(name))
        return cache[0]

    return get


def vocab_size(args: argparse.Namespace, tokenizer: Any) -> int:
    """The served model's vocabulary: --tokenizer's, else --model's config (a preset's
    without loading anything)."""
    from models.config import PRESETS
    from models.loader import model_config

    if args.tokenizer:
        return len(tokenizer())
    return model_config(args.model, "dummy" if args.model in PRESETS else "auto").vocab_size


async def run_requests(args: argparse.Namespace, bodies: list[dict[str, Any]]
                       ) -> tuple[list[RequestResult], float]:
    """Sends the bodies at their arrival times, at most --max-concurrency in flight;
    returns each one's result and the run's duration (first send to last answer)."""
    import httpx
    from tqdm import tqdm

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base + (args.endpoint or BACKENDS[args.backend])
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    times = arrival_times(len(bodies), args.request_rate, args.burstiness, args.seed)
    bar = tqdm(total=len(bodies), disable=args.disable_tqdm)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        async def one(body: dict[str, Any]) -> RequestResult:
            if limit is None:
                result = await send_request(client, url, body, headers)
            else:
                async with limit:
                    result = await send_request(client, url, body, headers)
            bar.update(1)
            return result

        start, tasks = time.perf_counter(), []
        for body, at in zip(bodies, times, strict=True):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration: float, metrics: list[str],
              percentiles: list[float]) -> dict[str, Any]:
    """The run's counts, throughputs and latency statistics (vLLM's field names)."""
    ok = [r for r in results if r.success]
    prompt = sum(r.prompt_len for r in ok)
    output = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if r.ttft is not None
                 and (t := tpot(r.latency, r.ttft, r.output_tokens)) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = dict(
        duration=duration, completed=len(ok), failed=len(results) - len(ok),
        total_input_tokens=prompt, total_output_tokens=output, total_cached_tokens=cached,
        cached_token_share=cached / prompt if prompt else 0.0,
        request_throughput=len(ok) / duration, output_throughput=output / duration,
        total_token_throughput=(prompt + output) / duration,
        errors=sorted({r.error for r in results if not r.success})[:5])
    for name in metrics:
        out[f"{name}_ms"] = latency_stats(samples[name], percentiles)
    return out


def print_summary(s: dict[str, Any]) -> None:
    rows = [("Successful requests", s["completed"], "{}"), ("Failed requests", s["failed"], "{}"),
            ("Benchmark duration (s)", s["duration"], "{:.2f}"),
            ("Total input tokens", s["total_input_tokens"], "{}"),
            ("Total cached input tokens", s["total_cached_tokens"], "{}"),
            ("Cached token share", s["cached_token_share"], "{:.1%}"),
            ("Total generated tokens", s["total_output_tokens"], "{}"),
            ("Request throughput (req/s)", s["request_throughput"], "{:.2f}"),
            ("Output token throughput (tok/s)", s["output_throughput"], "{:.2f}"),
            ("Total token throughput (tok/s)", s["total_token_throughput"], "{:.2f}")]
    for key, value in s.items():
        if key.endswith("_ms"):
            rows += [(f"{key[:-3].upper()} {stat} (ms)", v, "{:.2f}")
                     for stat, v in value.items() if v is not None]
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for label, value, fmt in rows:
        print(f"{label:<40}{fmt.format(value):>26}")
    for error in s["errors"]:
        print(f"error: {error}")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark; prints the summary; returns (with --save-result writes) it."""
    if importlib.util.find_spec("httpx") is None:
        raise SystemExit("jprefix bench serve needs httpx: pip install 'jprefix[bench]'")
    metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    tokenizer = _tokenizer_getter(args)
    reqs = build_requests(args, vocab_size(args, tokenizer), tokenizer)
    model = args.served_model_name or args.model
    bodies = [request_body(args.backend, model, r.prompt if args.backend == "openai"
                           else tokenizer().decode(r.prompt), r.output_len, args.ignore_eos,
                           args.logprobs)
              for r in reqs]
    results, duration = asyncio.run(run_requests(args, bodies))
    summary = summarize(results, duration, metrics, percentiles)
    print_summary(summary)
    result = dict(date=datetime.now().strftime("%Y%m%d-%H%M%S"), backend=args.backend,
                  model=model, dataset_name=args.dataset_name, num_prompts=len(reqs),
                  request_rate=args.request_rate, burstiness=args.burstiness,
                  max_concurrency=args.max_concurrency, **summary)
    if args.save_result:
        name = args.result_filename or (f"{args.backend}-{args.request_rate}qps-"
                                        f"{Path(model).name}-{result['date']}.json")
        write_json(str(Path(args.result_dir) / name), result)
    return result
