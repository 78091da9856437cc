"""`jprefix generate`: a shared system prompt, several user prompts, one batch."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jprefix.benchmarks.cli import add_bench_parser, run_bench
from jprefix.entrypoints.cli_args import DTYPES, HELP, add_engine_args

DEFAULT_SYSTEM = (
    "You are a helpful, concise assistant for a company's customer-service team. Answer in "
    "one or two sentences, stay polite, never invent order numbers, and when you are unsure "
    "say so and suggest contacting a human agent. Our store sells books, music and games, "
    "ships worldwide within five business days, and accepts returns within thirty days."
)
# (openai_server imports fastapi, which `jprefix generate` does not need)
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "How long does shipping to Japan take?",
    "Can I return a game I bought three weeks ago?",
    "Write a haiku about autumn.",
]


def add_fp8_flags(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype and --quantization (vLLM's names), for the CLI and the benchmark
    scripts; `fp8_kwargs` turns them into LLM keyword arguments."""
    from jprefix.engine.args import KV_CACHE_DTYPES

    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the KV cache's format: auto = the model dtype; fp8 = fp8_e4m3 "
                             "(per-row scales)")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="fp8: the linear layers' weights quantised at load time")


def fp8_kwargs(args: argparse.Namespace) -> dict:
    return dict(kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jprefix", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts that share a system prompt")
    gen.add_argument("--model", default="smollm2-135m", help="path, GGUF, hub id or preset")
    gen.add_argument("--dtype", default="auto", choices=DTYPES, help=HELP["dtype"])
    gen.add_argument("--load-format", default="auto", help=HELP["load_format"])
    gen.add_argument("--tokenizer", default=None, help=HELP["tokenizer"])
    gen.add_argument("--system", default=None, help="system prompt text")
    gen.add_argument("--system-file", type=Path, default=None)
    gen.add_argument("--prompt", action="append", default=[], help="a user prompt (repeatable)")
    gen.add_argument("--prompts-file", type=Path, default=None, help="one user prompt a line")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument(
        "--prefix-mode", choices=["auto", "explicit", "off"], default="explicit",
        help="explicit: share the system prompt's whole blocks (prefix_pos); auto: every full "
        "prompt block; off: no prefix cache",
    )
    add_fp8_flags(gen)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--model", default="smollm2-135m", help="path, GGUF, hub id or preset")
    srv.add_argument("--served-model-name", default=None,
                     help="the name requests' `model` must carry (default: --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require Authorization: Bearer <key> (default: $JPREFIX_API_KEY)")
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                     help="larger request bodies get HTTP 413")
    add_engine_args(srv)
    add_bench_parser(sub)
    return parser


def run_serve(args) -> int:
    from jprefix import LLM
    from jprefix.entrypoints.cli_args import engine_kwargs
    from jprefix.entrypoints.openai_server import serve

    llm = LLM(args.model, **engine_kwargs(args))
    serve(llm, args.host, args.port, model_name=args.served_model_name or args.model,
          api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    return 0


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


def run_generate(args) -> int:
    from jprefix import LLM, SamplingParams

    system, users = _read_inputs(args)
    llm = LLM(
        args.model, dtype=args.dtype, load_format=args.load_format, tokenizer=args.tokenizer,
        block_size=args.block_size, enable_prefix_caching=args.prefix_mode != "off",
        **fp8_kwargs(args),
    )
    if llm.tokenizer is None:  # (the prompts here are text)
        raise SystemExit(f"jprefix generate: model {args.model!r} has no tokenizer (its "
                         "prompts are text): pass --tokenizer")
    prompts = [_render(llm.tokenizer, system, u) for u in users]
    system_ids = _render(llm.tokenizer, system, None)
    prefix_pos = None
    if args.prefix_mode == "explicit":
        shared = min(_common_prefix(system_ids, p) for p in prompts)
        prefix_pos = shared // args.block_size * args.block_size
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, prefix_pos=prefix_pos, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for user, out in zip(users, outs, strict=True):
        print(f"### {user}\n{out.text.strip()}\n")
    _print_table(outs, elapsed, prefix_pos)
    return 0


def _print_table(outs, elapsed: float, prefix_pos) -> None:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    out_tokens = sum(len(o.token_ids) for o in outs)
    rows = [
        ("requests", f"{len(outs)}"),
        ("prefix_pos", "auto" if prefix_pos is None else f"{prefix_pos}"),
        ("prompt tokens", f"{prompt_tokens}"),
        ("served from prefix cache", f"{cached}"),
        ("hit rate", f"{cached / max(prompt_tokens, 1):.1%}"),
        ("output tokens", f"{out_tokens}"),
        ("wall time (s, incl. compile)", f"{elapsed:.2f}"),
        ("tokens/s (prompt + output)", f"{(prompt_tokens + out_tokens) / elapsed:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value:>10}")


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "bench":
        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
