"""Online latency: Poisson arrivals at --request-rate against the engine, stepped in a loop
that adds each request when its arrival time passes. Reports time to first token (TTFT),
inter-token latency (ITL, every gap between a request's tokens) and end-to-end latency
percentiles, and the QPS achieved. A sweep (--latency-bound-ms) finds the highest request
rate whose mean or p90 end-to-end latency stays within the bound.

Before measuring, the same trace runs once untimed (compiles the shape buckets); the
prefix cache is reset before every measured trace. Workload flags are bench_throughput's.

    PYTHONPATH=$PWD python scripts/bench_latency.py --model llama-2-7b --load-format dummy \
        --input-len 700 --prefix-len 596 --output-len 16 --num-prompts 200 \
        --request-rate 8 --latency-bound-ms 320
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import numpy as np

from jprefix import load
from scripts.bench_throughput import (
    add_workload_args,
    build_requests,
    check_args,
    format_table,
    make_llm,
    make_seq,
    replicas,
    run_once,
    write_json,
)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n requests arrives (Poisson process)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_trace(llm, reqs: list, arrivals: list[float]) -> dict:
    """Replays the arrivals; returns per-request token timestamps (seconds, monotonic)."""
    engine, nxt, active = llm.engine, 0, {}
    times: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    start = time.monotonic()
    while nxt < len(reqs) or active:
        now = time.monotonic()
        while nxt < len(reqs) and start + arrivals[nxt] <= now:
            group = make_seq(llm, reqs[nxt])
            seq = group.seqs[0]  # (its scheduling state: read for the token times)
            seq.arrival_time = now
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


def percentiles(values: list[float]) -> dict:
    if not values:
        return dict(mean=None, p50=None, p90=None, p99=None)
    a = np.asarray(values) * 1e3
    return dict(mean=float(a.mean()), p50=float(np.percentile(a, 50)),
                p90=float(np.percentile(a, 90)), p99=float(np.percentile(a, 99)))


def summarize(trace: dict, rate: float) -> dict:
    sent, times = trace["sent"], trace["times"]
    ttft = [times[r][0] - sent[r] for r in sent if times[r]]
    e2e = [times[r][-1] - sent[r] for r in sent if times[r]]
    itl = [b - a for r in sent for a, b in zip(times[r], times[r][1:], strict=False)]
    span = max(t[-1] for t in times.values() if t) - min(sent.values())
    n_out = sum(len(t) for t in times.values())
    return dict(request_rate=rate, requests=len(sent), achieved_qps=len(sent) / span,
                output_tokens_per_s=n_out / span, duration_s=span,
                ttft_ms=percentiles(ttft), itl_ms=percentiles(itl), e2e_ms=percentiles(e2e))


def measure(llm, reqs: list, rate: float, seed: int, retries: int = 2) -> dict:
    """One trace at rate; measured again (up to retries times) if it had to compile a
    new shape bucket, so no trial reports a compilation stall."""
    shapes = [r.runner.shapes_seen for r in replicas(llm)]
    for _ in range(retries + 1):
        if not llm.reset_prefix_cache():
            raise RuntimeError("prefix cache still in use after a finished trace")
        seen = sum(map(len, shapes))
        result = summarize(run_trace(llm, reqs, arrival_times(len(reqs), rate, seed)), rate)
        result["compiled_during_trace"] = sum(map(len, shapes)) > seen
        if not result["compiled_during_trace"]:
            break
        print(f"rate {rate:.3f}: new shape buckets compiled, measuring again", flush=True)
    return result


def within(result: dict, bound_ms: float, metric: str) -> bool:
    return result["e2e_ms"][metric] <= bound_ms


def sweep(llm, reqs: list, args) -> tuple[list[dict], float | None, float | None]:
    """Doubles (or halves) the rate from the first --request-rate until the bound is
    bracketed, then bisects; returns (trials, highest rate within the bound, lowest rate
    over it), either None when not found between --min- and --max-request-rate."""
    trials, lo, hi = [], None, None

    def trial(rate: float) -> bool:
        trials.append(measure(llm, reqs, rate, args.seed))
        ok = within(trials[-1], args.latency_bound_ms, args.latency_metric)
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


COLUMNS = [("policy", "policy", "{}"), ("cache", "enable_prefix_caching", "{}"),
           ("rate", "request_rate", "{:.2f}"), ("QPS", "achieved_qps", "{:.2f}"),
           ("TTFT p50", "ttft_p50", "{:.1f}"), ("TTFT p90", "ttft_p90", "{:.1f}"),
           ("TTFT p99", "ttft_p99", "{:.1f}"), ("ITL p50", "itl_p50", "{:.1f}"),
           ("ITL p99", "itl_p99", "{:.1f}"), ("E2E mean", "e2e_mean", "{:.1f}"),
           ("E2E p50", "e2e_p50", "{:.1f}"), ("E2E p90", "e2e_p90", "{:.1f}"),
           ("E2E p99", "e2e_p99", "{:.1f}")]


def flat_row(r: dict) -> dict:
    row = {k: v for k, v in r.items() if not k.endswith("_ms")}
    for name in ("ttft", "itl", "e2e"):
        for stat, v in r[f"{name}_ms"].items():
            row[f"{name}_{stat}"] = float("nan") if v is None else v
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--request-rate", type=float, nargs="+", default=[4.0],
                    help="requests per second; several values: one trace each")
    ap.add_argument("--latency-bound-ms", type=float, default=None,
                    help="sweep from the first --request-rate for the highest rate within it")
    ap.add_argument("--latency-metric", default="mean", choices=["mean", "p90"])
    ap.add_argument("--min-request-rate", type=float, default=0.1)
    ap.add_argument("--max-request-rate", type=float, default=1024.0)
    ap.add_argument("--sweep-steps", type=int, default=3)
    args = ap.parse_args(argv)
    check_args(args)
    model = load(args.model, args.dtype, args.load_format)
    reqs = build_requests(args, model)
    llm = make_llm(model, args, args.policy, args.enable_prefix_caching)
    run_once(llm, reqs)  # compiles the buckets of a full batch, then of the trace
    run_trace(llm, reqs, arrival_times(len(reqs), max(args.request_rate), args.seed))
    best = over = None
    if args.latency_bound_ms is not None:
        trials, best, over = sweep(llm, reqs, args)
    else:
        trials = [measure(llm, reqs, rate, args.seed) for rate in args.request_rate]
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
    print(f"\n{args.model} ({args.load_format}), dataset {args.dataset}, {len(reqs)} requests"
          " per trace; latencies in ms")
    print(format_table([flat_row(t) for t in trials], COLUMNS))
    if args.latency_bound_ms is not None:
        print(f"highest rate with {args.latency_metric} E2E <= {args.latency_bound_ms} ms: "
              f"{best if best is not None else 'none tried'} req/s"
              + (f" (achieved {result['at_bound']['achieved_qps']:.2f} QPS)" if best else "")
              + ("" if over else "; the bound was not reached up to --max-request-rate"))
    return result


if __name__ == "__main__":
    main()
