"""Where an engine step's time goes: device kernels, device idle gaps, host work.

Runs the engine benchmark's shared-prefix workload (dummy weights), traces a window of
steady full-batch decode steps and a batch-1 request with `jax.profiler` (Perfetto JSON),
and summarizes the trace: device busy time and idle gaps per step, the kernels that take
the time, and the host's share. Each configuration (async scheduling on/off, cascade
on/off) runs in the same process over the same compiled steps.

    python scripts/profile_engine.py --model llama-2-7b --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import collections
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402

from jprefix import LLM, SamplingParams, load  # noqa: E402
from jprefix.benchmarks.common import add_fp8_flags, fp8_kwargs, write_json  # noqa: E402
from jprefix.benchmarks.datasets import make_prompts  # noqa: E402
from scripts.device_trace import (  # noqa: E402
    device_pids,
    load_trace,
    perfetto_file,
    union_length,
)

STEP_MARK = "jprefix_engine_step"


def summarize(events: list[dict], top: int = 15) -> dict:
    """Device busy/idle time inside the traced engine steps, top kernels, host marks."""
    devices = device_pids(events)
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == STEP_MARK)
    if not steps:
        return {"error": "no engine steps in the trace"}
    lo, hi = steps[0][0], steps[-1][1]
    kernels = [e for e in spans if e["pid"] in devices and lo <= e["ts"] <= hi]
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    host_dispatch, last_end = [], float("-inf")
    for e in sorted((e for e in spans if e["name"].startswith("PjitFunction(step)")
                     and lo <= e["ts"] <= hi), key=lambda e: e["ts"]):
        if e["ts"] >= last_end:  # outermost of the nested dispatch events
            host_dispatch.append(e["dur"])
            last_end = e["ts"] + e["dur"]
    # host-side events (XLA's thunks on the launching thread, CUDA API calls), by name
    # with instance numbers dropped (custom-call.32 -> custom-call)
    api: dict[str, list[float]] = collections.defaultdict(list)
    for e in spans:
        if e["pid"] not in devices and lo <= e["ts"] <= hi:
            api[re.sub(r"([._]\d+)+(_remat\d*)?$", "", e["name"])[:80]].append(e["dur"])
    copies: dict[str, float] = collections.defaultdict(float)
    for e in kernels:
        if way := copy_direction(e["name"]):
            copies[way] += e["dur"]
    n = len(steps)
    return dict(
        steps=n,
        window_ms=(hi - lo) / 1e3,
        per_step_ms=(hi - lo) / 1e3 / n,
        device_busy_per_step_ms=busy / 1e3 / n,
        device_idle_share=1 - busy / (hi - lo),
        kernels_per_step=len(kernels) / n,
        copy_ms_per_step={k: v / 1e3 / n for k, v in sorted(copies.items())},
        engine_step_call_ms=[round((b - a) / 1e3, 3) for a, b in steps],
        jit_dispatch_ms=[round(d / 1e3, 3) for d in host_dispatch],
        top_kernels=[dict(name=k[:120], calls_per_step=len(v) / n,
                          ms_per_step=sum(v) / 1e3 / n) for k, v in ranked[:top]],
        host_events=[dict(name=k, calls_per_step=len(v) / n, ms_per_step=sum(v) / 1e3 / n)
                     for k, v in sorted(api.items(), key=lambda kv: -sum(kv[1]))[:25]],
    )


def copy_direction(name: str) -> str | None:
    """"h2d", "d2h" or "d2d" for a device trace's memory copy event (CUPTI's
    MemcpyH2D, "Memcpy HtoD (Pinned -> Device)", ...), None for anything else."""
    n = name.lower().replace(" ", "")
    if "memcpy" not in n:
        return None
    for way, marks in (("h2d", ("h2d", "htod")), ("d2h", ("d2h", "dtoh")),
                       ("d2d", ("d2d", "dtod"))):
        if any(m in n for m in marks):
            return way
    return None


TOP_KERNELS = 15  # kernels listed per traced config (--top-kernels)


def traced_steps(llm: LLM, num_steps: int, keep_dir: str | None, tag: str) -> dict:
    def steps() -> None:
        for _ in range(num_steps):
            llm.engine.step()

    return traced(llm, steps, keep_dir, tag)


def traced(llm: LLM, run: Any, keep_dir: str | None, tag: str) -> dict:
    """`run()` under `jax.profiler` until the device is done, every engine step it makes
    (on any thread) marked STEP_MARK, summarised (`summarize`); keep_dir: where the
    Perfetto file is kept, as TAG.perfetto.json.gz."""
    engine, step = llm.engine, llm.engine.step

    def marked(*a: Any, **k: Any) -> Any:
        with jax.profiler.TraceAnnotation(STEP_MARK):
            return step(*a, **k)

    trace_dir = tempfile.mkdtemp(prefix="jprefix-trace-")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # XLA's and the annotated host events, not every call
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
    engine.step = marked
    try:
        run()
        jax.block_until_ready(engine.runner.kv_cache)
    finally:
        del engine.step  # (the class's again)
        jax.profiler.stop_trace()
    summary = summarize(load_trace(trace_dir), TOP_KERNELS)
    if keep_dir:
        os.makedirs(keep_dir, exist_ok=True)
        shutil.copy(perfetto_file(trace_dir), os.path.join(keep_dir, f"{tag}.perfetto.json.gz"))
    shutil.rmtree(trace_dir, ignore_errors=True)
    return summary


def drain(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def profile_prefill(llm: LLM, prompts, prefix_len: int, output_len: int, num_steps: int,
                    keep_dir: str | None, tag: str) -> dict:
    """The first steps of the throughput workload: the shared prefix and every prompt's
    own tokens, in chunks of the token budget (with the first decodes)."""
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()
    for p in prompts:
        llm.engine.add_request(None, p, sp, prefix_len)
    summary = traced_steps(llm, num_steps, keep_dir, tag)
    drain(llm)
    return summary


def profile_decode(llm: LLM, prompts, prefix_len: int, output_len: int, warm_steps: int,
                   num_steps: int, keep_dir: str | None, tag: str) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()
    for p in prompts:
        llm.engine.add_request(None, p, sp, prefix_len)
    while True:  # until every request decodes
        llm.engine.step()
        running = llm.engine.scheduler.running.values()
        if len(running) == len(prompts) and all(s.num_output_tokens > 0 for s in running):
            break
    for _ in range(warm_steps):
        llm.engine.step()
    summary = traced_steps(llm, num_steps, keep_dir, tag)
    drain(llm)
    return summary


def _traced_request(llm: LLM, prompt, prefix_len: int, sp: SamplingParams, cached: bool,
                    num_steps: int, keep_dir, tag) -> dict:
    """Runs one request (its prefix cached first, or not) twice: the first pass untraced,
    compiling its buckets; traces the second's first `num_steps` engine steps."""
    for traced in (False, True):
        llm.reset_prefix_cache()
        if cached:
            llm.generate([prompt[:prefix_len] + [11]], SamplingParams(max_tokens=1),
                         prefix_pos=prefix_len, use_tqdm=False)
        llm.engine.add_request(None, prompt, sp, prefix_len)
        if traced:
            summary = traced_steps(llm, num_steps, keep_dir, tag)
        else:
            for _ in range(num_steps):
                llm.engine.step()
        drain(llm)
    return summary


def profile_single(llm: LLM, prompt, prefix_len: int, num_steps: int, keep_dir, tag) -> dict:
    """One request, prefix cached: its first (prefill) step, then decode steps."""
    sp = SamplingParams(temperature=0, max_tokens=num_steps + 4, ignore_eos=True)
    return _traced_request(llm, prompt, prefix_len, sp, True, num_steps, keep_dir, tag)


def profile_ttft(llm: LLM, prompt, prefix_len: int, cached: bool, keep_dir, tag) -> dict:
    """The one engine step that prefills one request and returns its first token, traced
    with synchronous scheduling (so the step's window holds dispatch, device work and the
    fetch), prefix cached or not."""
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    was_async = llm.engine.args.async_scheduling
    llm.engine.args.async_scheduling = False
    try:
        return _traced_request(llm, prompt, prefix_len, sp, cached, 1, keep_dir, tag)
    finally:
        llm.engine.args.async_scheduling = was_async


def main(argv: list[str] | None = None) -> dict:
    global TOP_KERNELS
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=596)
    ap.add_argument("--unique-len", type=int, default=104)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--trace-steps", type=int, default=10)
    ap.add_argument("--configs", default="async+cascade,sync+cascade,async",
                    help="comma-separated; each a '+'-joined subset of async, cascade")
    ap.add_argument("--keep-traces", default=None, help="folder for the Perfetto files")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--dtype", default="auto")
    add_fp8_flags(ap)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--prefill-steps", type=int, default=5,
                    help="traced first steps of the throughput workload (its prefill)")
    ap.add_argument("--top-kernels", type=int, default=TOP_KERNELS,
                    help="kernels listed per config, by device time")
    ap.add_argument("--only", default="decode,prefill,single,ttft",
                    help="comma-separated parts to trace: decode, prefill, single, ttft")
    args = ap.parse_args(argv)
    TOP_KERNELS = args.top_kernels
    parts = set(args.only.split(","))
    if parts - {"decode", "prefill", "single", "ttft"}:
        ap.error(f"--only {args.only!r}: parts are decode, prefill, single, ttft")

    model = load(args.model, dtype=args.dtype, load_format="dummy")
    llm = LLM(model=model, num_kv_blocks=args.num_kv_blocks, **fp8_kwargs(args))
    prompts = make_prompts(args.num_prompts, args.prefix_len, args.unique_len,
                          model.config.vocab_size, 0)
    result = dict(model=args.model, device=str(jax.devices()[0]), jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d"), configs={})
    if args.keep_traces:
        os.makedirs(args.keep_traces, exist_ok=True)
    for config in args.configs.split(","):
        flags = set(config.split("+"))
        llm.engine.args.async_scheduling = "async" in flags
        llm.engine.args.enable_cascade = "cascade" in flags
        t = time.perf_counter()
        out = {}
        if parts & {"decode", "prefill"}:
            # the first pass compiles this configuration's buckets; the second is traced
            profile_decode(llm, prompts, args.prefix_len, args.output_len, 0, 1, None, "warm")
        if "decode" in parts:
            out["decode"] = profile_decode(llm, prompts, args.prefix_len, args.output_len,
                                           args.warm_steps, args.trace_steps,
                                           args.keep_traces, f"decode-{config}")
        if "prefill" in parts:
            out["prefill"] = profile_prefill(llm, prompts, args.prefix_len, args.output_len,
                                             args.prefill_steps, args.keep_traces,
                                             f"prefill-{config}")
        if "single" in parts:
            out["single"] = profile_single(llm, prompts[0], args.prefix_len, args.trace_steps,
                                           args.keep_traces, f"single-{config}")
        for kind in ("cached", "uncached") if "ttft" in parts else ():
            out[f"ttft_{kind}"] = profile_ttft(llm, prompts[0], args.prefix_len,
                                               kind == "cached", args.keep_traces,
                                               f"ttft-{kind}-{config}")
        result["configs"][config] = dict(**out, wall_s=time.perf_counter() - t)
        print(f"== {config}", json.dumps(result["configs"][config], indent=1), flush=True)
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
