"""Probe: the engine thread's host work in full-batch decode steps on the real runner
(scripts/bench_host.py runs the same engine over a packing stub, without the device, the launch
thread or the jitted call). Runs the shared-prefix workload, then cProfiles the engine
thread over `--steps` decode steps and prints the functions by own time, with the
engine's own host-share figure for the same steps.

    python scripts/probes/probe_host.py --model llama-2-7b
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cProfile
import io
import pstats

from jprefix import LLM, SamplingParams, load
from jprefix.benchmarks.common import workload_parser, write_json
from jprefix.benchmarks.datasets import make_prompts


def main(argv: list[str] | None = None) -> dict:
    ap = workload_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    model = load(args.model, load_format=args.load_format)
    prompts = make_prompts(args.num_prompts, args.prefix_len, args.unique_len,
                           model.config.vocab_size, 0)
    llm = LLM(model, max_num_seqs=256)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True)
    results = {}
    for run in ("warm", "profiled"):
        llm.reset_prefix_cache()
        for p in prompts:
            engine.add_request(None, p, sp, args.prefix_len)
        for _ in range(10_000):  # prefill and the first decode steps
            if len(engine.scheduler.running) == args.num_prompts and all(
                    s.num_output_tokens >= 8 for s in engine.scheduler.running.values()):
                break
            engine.step()
        else:
            raise RuntimeError("the prompts never all ran at once (too few KV blocks?)")
        engine.step_stats.clear()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        stats = list(engine.step_stats)
        host = sum(s[2] for s in stats) / len(stats) * 1e3
        period = sum(s[3] for s in stats) / len(stats) * 1e3
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        results[run] = {"host_ms": host, "period_ms": period, "profile": text.getvalue()}
        while engine.has_unfinished_requests():
            engine.step()
    print(results["profiled"]["profile"])
    for run, r in results.items():
        print(f"{run}: host {r['host_ms']:.3f} ms per step of {r['period_ms']:.2f} ms "
              f"({r['host_ms'] / r['period_ms']:.1%}; cProfile on)")
    write_json(args.output_json, results)
    return results


if __name__ == "__main__":
    main()
