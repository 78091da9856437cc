"""Probe: where the time of one cached time-to-first-token request goes, without a
profiler (whose tracer inflates host spans). Host clock stamps, median over reps:

  dispatch    generate() called -> runner.dispatch entered (validate, schedule)
  pack        dispatch entered -> returned (pack the step, queue its launch)
  handoff     dispatch returned -> the jitted step called on the launch thread
  enqueue     the jitted step call (argument handling, transfer, every kernel launched)
  wait        jit call returned -> tokens on the host (device work still queued + D2H)
  finish      tokens on the host -> generate() returns (postprocess, outputs)

Variants in one process: as shipped; with Python's thread switch interval at 50 us
(`sys.setswitchinterval`, default 5 ms: the launch thread waits for the GIL while the
engine thread runs Python).

    python scripts/probes/probe_ttft.py --model llama-2-7b --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import functools
import statistics
import time

import jprefix.worker.model_runner as runner_mod
from jprefix import LLM, SamplingParams, load
from jprefix.benchmarks.common import workload_parser, write_json
from jprefix.benchmarks.datasets import make_prompts
from scripts.bench_engine import timed_request

SPANS = ("dispatch", "pack", "handoff", "enqueue", "wait", "finish")


class Stamps:
    """Wraps the runner's dispatch and fetch and the module's jitted step to stamp them."""

    def __init__(self, runner):
        self.t: dict[str, float] = {}
        step = runner_mod.step
        runner_mod.step = self._stamped(step, "call", "called")
        runner.dispatch = self._stamped(runner.dispatch, "dispatch", "dispatched")
        runner.fetch = self._stamped(runner.fetch, None, "fetched")
        self.restore = functools.partial(self._restore, runner, step)

    def _stamped(self, fn, before: str | None, after: str):
        """fn, stamping the host clock as `before` and `after` its first call since the
        stamps were cleared."""
        def wrapper(*args, **kwargs):
            if before:
                self.t.setdefault(before, time.perf_counter())
            out = fn(*args, **kwargs)
            self.t.setdefault(after, time.perf_counter())
            return out
        return wrapper

    @staticmethod
    def _restore(runner, step) -> None:
        """Puts the module's jitted step and the runner's own methods back."""
        runner_mod.step = step
        del runner.dispatch, runner.fetch  # (the instance attributes shadowed the methods)

    def spans(self, start: float, end: float) -> dict[str, float]:
        names = ("dispatch", "dispatched", "call", "called", "fetched")
        t = [start, *(self.t[n] for n in names), end]
        return {name: (b - a) * 1e3 for name, a, b in zip(SPANS, t, t[1:], strict=False)}


def measure(llm: LLM, stamps: Stamps, prompt, prefix_len: int, reps: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for i in range(reps + 2):
        timed_request(llm, prompt, prefix_len, sp, True, i)  # caches the prefix (and warms)
        stamps.t.clear()
        start = time.perf_counter()
        out = llm.generate([prompt], sp, prefix_pos=prefix_len, use_tqdm=False)[0]
        end = time.perf_counter()
        assert out.num_cached_tokens > 0
        if i >= 2:
            rows.append({"total": (end - start) * 1e3, **stamps.spans(start, end)})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> dict:
    ap = workload_parser(__doc__.split("\n\n")[0], prompts=False)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    model = load(args.model, load_format=args.load_format)
    prompt = make_prompts(1, args.prefix_len, args.unique_len, model.config.vocab_size, 0)[0]
    llm = LLM(model, num_kv_blocks=2048, max_num_seqs=256)
    stamps = Stamps(llm.engine.runner)
    results = {"model": args.model}
    default = sys.getswitchinterval()
    try:
        for name, interval in (("shipped", None), ("switch_50us", 5e-5),
                               ("shipped_again", None)):
            sys.setswitchinterval(interval or default)
            results[name] = measure(llm, stamps, prompt, args.prefix_len, args.reps)
            print(name, " ".join(f"{k} {v:.2f}" for k, v in results[name].items()),
                  flush=True)
    finally:
        sys.setswitchinterval(default)
        stamps.restore()
    write_json(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
