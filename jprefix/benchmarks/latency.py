"""`jprefix bench latency`: online latency against the engine in this process. Requests
arrive at --request-rate (a Poisson process, or gamma with --burstiness: `arrivals.py`)
and are added to the engine, stepped in a loop, as their arrival times pass. Reports time
to first token (TTFT), inter-token latency (ITL, every gap between a request's tokens) and
end-to-end latency (E2E) statistics (`metrics.py`), and the QPS achieved. A sweep
(--latency-bound-ms) finds the highest request rate whose mean or p90 end-to-end latency
stays within the bound. (vLLM's `bench latency` times one batch; this is the engine-side
twin of `jprefix bench serve`, without HTTP.)

Before measuring, the same trace runs once untimed (compiles the shape buckets); the
prefix cache is reset before every measured trace. Model, engine and dataset flags are
`jprefix bench throughput`'s.

    jprefix bench latency --model llama-2-7b --load-format dummy --input-len 700 \
        --prefix-len 596 --output-len 16 --num-prompts 200 --request-rate 8 \
        --latency-bound-ms 320
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from jprefix.benchmarks.arrivals import arrival_times
from jprefix.benchmarks.common import format_table, replicas, write_json
from jprefix.benchmarks.metrics import (
    DEFAULT_METRIC_PERCENTILES,
    latency_stats,
    parse_percentiles,
    percentile_key,
)
from jprefix.benchmarks.throughput import (
    add_cli_args,
    load_model,
    make_llm,
    make_request,
    run_once,
)
from jprefix.benchmarks.workload import build_requests


def run_trace(llm, reqs: list, arrivals: list[float]) -> dict:
    """Replays the arrivals; returns per-request token timestamps (seconds, monotonic)."""
    engine, nxt, active = llm.engine, 0, {}
    times: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    start = time.monotonic()
    while nxt < len(reqs) or active:
        now = time.monotonic()
        while nxt < len(reqs) and start + arrivals[nxt] <= now:
            group = make_request(llm, reqs[nxt])  # (arrives now: made now)
            seq = group.seqs[0]  # (its scheduling state: read for the token times)
            engine.add(group)
            active[seq.request_id], sent[seq.request_id] = seq, now
            times[seq.request_id] = []
            nxt += 1
        if not active:
            time.sleep(max(0.0, start + arrivals[nxt] - time.monotonic()))
            continue
        finished = engine.step()
        now = time.monotonic()
        for rid, seq in active.items():
            while len(times[rid]) < seq.num_output_tokens:
                times[rid].append(now)
        for out in finished:
            active.pop(out.request_id, None)
    return dict(sent=sent, times=times, start=start)


def summarize(trace: dict, rate: float, percentiles: list[float]) -> dict:
    sent, times = trace["sent"], trace["times"]
    ttft = [times[r][0] - sent[r] for r in sent if times[r]]
    e2e = [times[r][-1] - sent[r] for r in sent if times[r]]
    itl = [b - a for r in sent for a, b in zip(times[r], times[r][1:], strict=False)]
    span = max(t[-1] for t in times.values() if t) - min(sent.values())
    n_out = sum(len(t) for t in times.values())
    return dict(request_rate=rate, requests=len(sent), achieved_qps=len(sent) / span,
                output_tokens_per_s=n_out / span, duration_s=span,
                ttft_ms=latency_stats(ttft, percentiles), itl_ms=latency_stats(itl, percentiles),
                e2e_ms=latency_stats(e2e, percentiles))


def measure(llm: Any, reqs: list, rate: float, args: argparse.Namespace,
            retries: int = 2) -> dict:
    """One trace at rate; measured again (up to retries times) if it had to compile a
    new shape bucket, so no trial reports a compilation stall."""
    shapes = [r.runner.shapes_seen for r in replicas(llm)]
    arrivals = arrival_times(len(reqs), rate, args.burstiness, args.seed)
    for _ in range(retries + 1):
        if not llm.reset_prefix_cache():
            raise RuntimeError("prefix cache still in use after a finished trace")
        seen = sum(map(len, shapes))
        result = summarize(run_trace(llm, reqs, arrivals), rate, args.percentiles)
        result["compiled_during_trace"] = sum(map(len, shapes)) > seen
        if not result["compiled_during_trace"]:
            break
        print(f"rate {rate:.3f}: new shape buckets compiled, measuring again", flush=True)
    return result


def sweep(llm: Any, reqs: list, args: argparse.Namespace
          ) -> tuple[list[dict], float | None, float | None]:
    """Doubles (or halves) the rate from the first --request-rate until the bound is
    bracketed, then bisects; returns (trials, highest rate within the bound, lowest rate
    over it), either None when not found between --min- and --max-request-rate."""
    trials: list[dict] = []
    lo = hi = None

    def trial(rate: float) -> bool:
        trials.append(measure(llm, reqs, rate, args))
        ok = trials[-1]["e2e_ms"][args.latency_metric] <= args.latency_bound_ms
        print(f"rate {rate:.3f}: {'within' if ok else 'over'} the bound", flush=True)
        return ok

    rate = args.request_rate[0]
    while (lo is None or hi is None) and args.min_request_rate <= rate <= args.max_request_rate:
        if trial(rate):
            lo, rate = rate, rate * 2
        else:
            hi, rate = rate, rate / 2
        if lo is not None and hi is not None and lo > hi:
            break  # noisy trials disagree: keep the best rate within the bound
    for _ in range(args.sweep_steps if lo is not None and hi is not None and lo < hi else 0):
        rate = (lo + hi) / 2
        lo, hi = (rate, hi) if trial(rate) else (lo, rate)
    return trials, lo, hi


def columns(percentiles: list[float]) -> list[tuple[str, str, str]]:
    """The table: the configuration, then each latency's mean and percentiles (ms)."""
    out = [("policy", "policy", "{}"), ("cache", "enable_prefix_caching", "{}"),
           ("rate", "request_rate", "{:.2f}"), ("QPS", "achieved_qps", "{:.2f}")]
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E")):
        for stat in ["mean"] + [percentile_key(p) for p in percentiles]:
            out.append((f"{label} {stat}", f"{name}_{stat}", "{:.1f}"))
    return out


def flat_row(r: dict) -> dict:
    row = {k: v for k, v in r.items() if not k.endswith("_ms")}
    for name in ("ttft", "itl", "e2e"):
        for stat, v in r[f"{name}_ms"].items():
            row[f"{name}_{stat}"] = float("nan") if v is None else v
    return row


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[4.0],
                        help="requests per second; several values: one trace each")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier")
    parser.add_argument("--metric-percentiles", default=DEFAULT_METRIC_PERCENTILES,
                        help="comma-separated percentiles reported for each latency")
    parser.add_argument("--latency-bound-ms", type=float, default=None,
                        help="sweep from the first --request-rate for the highest rate "
                             "within it")
    parser.add_argument("--latency-metric", default="mean",
                        help="the E2E statistic the bound applies to: mean or a "
                             "percentile of --metric-percentiles (p90)")
    parser.add_argument("--min-request-rate", type=float, default=0.1)
    parser.add_argument("--max-request-rate", type=float, default=1024.0)
    parser.add_argument("--sweep-steps", type=int, default=3)


def main(args: argparse.Namespace) -> dict:
    """Measures each --request-rate (or sweeps for the bound); prints the table; returns
    (and with --output-json writes) the trials."""
    args.percentiles = parse_percentiles(args.metric_percentiles)
    stats = ["mean"] + [percentile_key(p) for p in args.percentiles]
    if args.latency_metric not in stats:
        raise ValueError(f"--latency-metric {args.latency_metric!r} is not one of "
                         f"{', '.join(stats)}")
    model, vocab_size, tokenizer = load_model(args)
    reqs = build_requests(args, vocab_size, tokenizer)
    llm = make_llm(model, args, args.policy, args.enable_prefix_caching)
    run_once(llm, reqs)  # compiles the buckets of a full batch, then of the trace
    run_trace(llm, reqs, arrival_times(len(reqs), max(args.request_rate), args.burstiness,
                                       args.seed))
    best = over = None
    if args.latency_bound_ms is not None:
        trials, best, over = sweep(llm, reqs, args)
    else:
        trials = [measure(llm, reqs, rate, args) for rate in args.request_rate]
    conf = dict(policy=args.policy, enable_prefix_caching=args.enable_prefix_caching,
                data_parallel_size=args.data_parallel_size, routing_policy=args.routing_policy)
    trials = [{**conf, **t} for t in trials]
    result = dict(benchmark="latency", model=args.model, args=vars(args), trials=trials,
                  latency_bound_ms=args.latency_bound_ms, latency_metric=args.latency_metric,
                  max_rate_within_bound=best, min_rate_over_bound=over, **conf)
    if best is not None:
        result["at_bound"] = next(t for t in trials if t["request_rate"] == best)
    write_json(args.output_json, result)
    del llm
    gc.collect()
    print(f"\n{args.model} ({args.load_format}), dataset {args.dataset_name}, {len(reqs)} "
          "requests per trace; latencies in ms")
    print(format_table([flat_row(t) for t in trials], columns(args.percentiles)))
    if args.latency_bound_ms is not None:
        print(f"highest rate with {args.latency_metric} E2E <= {args.latency_bound_ms} ms: "
              f"{best if best is not None else 'none tried'} req/s"
              + (f" (achieved {result['at_bound']['achieved_qps']:.2f} QPS)" if best else "")
              + ("" if over else "; the bound was not reached up to --max-request-rate"))
    return result
