"""`jprefix generate`: a shared system prompt, several user prompts, one batch.

It says what it does while it works (loading, compiling with a count of programs,
generating), streams the answers as the engine produces them (the first prompt's live,
the others' as soon as the ones before them are printed; `--no-stream`: all at the end),
then prints a table with the load, compile and generate times apart."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jprefix.entrypoints.cli_args import DTYPES, HELP, add_spec_flag
from jprefix.entrypoints.cli_progress import (
    CompileWatch,
    StatusLine,
    describe,
    load_error,
    quiet_third_parties,
)

DEFAULT_SYSTEM = (
    "You are a helpful, concise assistant for a company's customer-service team. Answer in "
    "one or two sentences, stay polite, never invent order numbers, and when you are unsure "
    "say so and suggest contacting a human agent. Our store sells books, music and games, "
    "ships worldwide within five business days, and accepts returns within thirty days."
)
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "How long does shipping to Japan take?",
    "Can I return a game I bought three weeks ago?",
    "Write a haiku about autumn.",
]


def add_generate_parser(sub: Any, add_fp8_flags: Any) -> None:
    gen = sub.add_parser("generate", help="generate for prompts that share a system prompt",
                         description=__doc__.split("\n\n")[0])
    gen.add_argument("--model", default="smollm2-135m",
                     help="path, GGUF, hub id or preset (default: the embedded SmolLM2-135M-"
                          "Instruct, a 4-bit Q4_1 GGUF dequantised at load)")
    gen.add_argument("--dtype", default="auto", choices=DTYPES, help=HELP["dtype"])
    gen.add_argument("--load-format", default="auto", help=HELP["load_format"])
    gen.add_argument("--tokenizer", default=None, help=HELP["tokenizer"])
    gen.add_argument("--system", default=None, help="system prompt text")
    gen.add_argument("--system-file", type=Path, default=None)
    gen.add_argument("--prompt", action="append", default=[], help="a user prompt (repeatable)")
    gen.add_argument("--prompts-file", type=Path, default=None, help="one user prompt a line")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument(
        "--prefix-mode", choices=["auto", "explicit", "off"], default="explicit",
        help="explicit: share the system prompt's whole blocks (prefix_pos); auto: every full "
        "prompt block; off: no prefix cache",
    )
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print the answers as they are generated (default)")
    gen.add_argument("--progress-bar", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bars (default: only when stderr is a terminal)")
    samp = gen.add_argument_group("sampling (vLLM's names)")
    samp.add_argument("--max-tokens", type=int, default=48)
    samp.add_argument("--temperature", type=float, default=0.0)
    samp.add_argument("--seed", type=int, default=None)
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--top-k", type=int, default=-1)
    samp.add_argument("--min-p", type=float, default=0.0)
    samp.add_argument("--repetition-penalty", type=float, default=1.0)
    samp.add_argument("--presence-penalty", type=float, default=0.0)
    samp.add_argument("--frequency-penalty", type=float, default=0.0)
    samp.add_argument("--stop", action="append", default=None,
                      help="a stop string (repeatable)")
    add_fp8_flags(gen)
    add_spec_flag(gen)


def sampling_params(args: argparse.Namespace) -> Any:
    """The sampling flags as SamplingParams; SystemExit naming the flag of a bad value."""
    from jprefix import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, stop=args.stop)
    except ValueError as exc:
        word, _, rest = str(exc).partition(" ")
        raise SystemExit(f"jprefix generate: --{word.replace('_', '-')} {rest}") from None


def _read_inputs(args) -> tuple[str, list[str]]:
    system = args.system_file.read_text() if args.system_file else args.system
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [ln for ln in args.prompts_file.read_text().splitlines() if ln.strip()]
    return (system or DEFAULT_SYSTEM), (prompts or DEFAULT_PROMPTS)


def _render(tokenizer, system: str, user: str | None) -> list[int]:
    """The chat-templated prompt (the system prompt alone when `user` is None); the plain
    text where the tokenizer has no chat template."""
    from jprefix.engine.input_processor import render_chat

    messages = [{"role": "system", "content": system}]
    if user is not None:
        messages.append({"role": "user", "content": user})
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, messages, add_generation_prompt=user is not None)
    return tokenizer(system + ("\n\n" + user if user else ""), add_special_tokens=True).input_ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Answer:
    """What the table needs of one request's outputs."""

    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def add(self, out: Any, delta: bool) -> None:
        self.text = self.text + out.text if delta else out.text
        self.output_tokens = self.output_tokens + len(out.token_ids) if delta \
            else len(out.token_ids)
        self.prompt_tokens, self.cached_tokens = len(out.prompt_token_ids), \
            out.num_cached_tokens


def _load(args) -> Any:
    from jprefix import LLM

    try:
        return LLM(args.model, dtype=args.dtype, load_format=args.load_format,
                   tokenizer=args.tokenizer, block_size=args.block_size,
                   enable_prefix_caching=args.prefix_mode != "off",
                   kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                   speculative_config=args.speculative_config)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise SystemExit(f"jprefix generate: {load_error(exc, args.model)}") from None


def run_generate(args) -> int:
    quiet_third_parties(args.progress_bar)
    params = sampling_params(args)
    system, users = _read_inputs(args)
    status = StatusLine()
    status.show(f"loading {args.model} ...", force=True)
    compiles = CompileWatch(lambda n, s: status.show(f"compiling: {n} programs ({s:.1f} s)"))
    try:  # (the watch listens to jax's compile events process-wide: always removed)
        return _generate(args, params, system, users, status, compiles)
    finally:
        compiles.close()


def _generate(args, params, system, users, status, compiles) -> int:
    t0 = time.perf_counter()
    llm = _load(args)
    load_s = time.perf_counter() - t0 - compiles.seconds
    status.done(f"loaded in {load_s:.1f} s: {describe(llm)}")
    if llm.tokenizer is None:  # (the prompts here are text)
        raise SystemExit(f"jprefix generate: model {args.model!r} has no tokenizer (its "
                         "prompts are text): pass --tokenizer")
    prompts = [_render(llm.tokenizer, system, u) for u in users]
    system_ids = _render(llm.tokenizer, system, None)
    prefix_pos = None
    if args.prefix_mode == "explicit":
        shared = min(_common_prefix(system_ids, p) for p in prompts)
        prefix_pos = shared // args.block_size * args.block_size
    before = compiles.seconds
    status.show(f"generating {len(prompts)} answers (the first steps compile) ...", force=True)
    start = time.perf_counter()
    if args.stream:
        answers = asyncio.run(_stream(llm, prompts, params, prefix_pos, users, status))
        llm.wait_idle()  # (a step may still be in flight: never exit under it)
    else:
        outs = llm.generate(prompts, params, prefix_pos=prefix_pos,
                            use_tqdm=args.progress_bar is not False and sys.stderr.isatty())
        status.done()
        answers = []
        for user, out in zip(users, outs, strict=True):
            answers.append(Answer())
            answers[-1].add(out, delta=False)
            print(f"### {user}\n{out.text.strip()}\n")
    wall = time.perf_counter() - start
    compile_s = compiles.seconds - before
    _print_table(answers, load_s, compile_s, compiles.count, wall - compile_s, prefix_pos)
    return 0


async def _stream(llm, prompts, params, prefix_pos, users, status) -> list[Answer]:
    """Runs every prompt at once and prints the answers in prompt order: the one being
    printed as its text comes, each later one from what arrived meanwhile."""
    answers = [Answer() for _ in prompts]
    queue: asyncio.Queue = asyncio.Queue()

    async def consume(i: int) -> None:
        async for out in llm.stream_async(prompts[i], params, prefix_pos=prefix_pos):
            answers[i].add(out, delta=True)
            queue.put_nowait((i, out.text, out.finished))

    tasks = [asyncio.ensure_future(consume(i)) for i in range(len(prompts))]
    pending: list[list[str]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    current, started, printed = 0, False, False
    while current < len(prompts):
        if not started:
            status.done()
            print(f"### {users[current]}", flush=True)
            started, printed = True, _write("".join(pending[current]), False)
        if finished[current]:
            print("\n", flush=True)
            current, started = current + 1, False
            continue
        i, text, done = await queue.get()
        if i == current:
            printed = _write(text, printed)
        else:
            pending[i].append(text)
        finished[i] = finished[i] or done
    await asyncio.gather(*tasks)
    return answers


def _write(text: str, printed: bool) -> bool:
    """Prints an answer's next text (its leading blanks dropped while nothing of it is
    printed); whether anything of it is printed now."""
    text = text if printed else text.lstrip()
    sys.stdout.write(text)
    sys.stdout.flush()
    return printed or bool(text)


def _print_table(answers: list[Answer], load_s: float, compile_s: float, programs: int,
                 generate_s: float, prefix_pos) -> None:
    prompt_tokens = sum(a.prompt_tokens for a in answers)
    cached = sum(a.cached_tokens for a in answers)
    out_tokens = sum(a.output_tokens for a in answers)
    generate_s = max(generate_s, 1e-9)
    rows = [
        ("requests", f"{len(answers)}"),
        ("prefix_pos", "auto" if prefix_pos is None else f"{prefix_pos}"),
        ("prompt tokens", f"{prompt_tokens}"),
        ("served from prefix cache", f"{cached}"),
        ("hit rate", f"{cached / max(prompt_tokens, 1):.1%}"),
        ("output tokens", f"{out_tokens}"),
        ("load (s)", f"{load_s:.2f}"),
        (f"compile (s, {programs} programs)", f"{compile_s:.2f}"),
        ("generate (s, excl. compile)", f"{generate_s:.2f}"),
        ("tokens/s (prompt + output)", f"{(prompt_tokens + out_tokens) / generate_s:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value:>10}")
