"""jprefix: LLM inference on JAX with prefix (system-prompt) KV caching.

  jprefix generate    answer several prompts that share a system prompt, in one batch,
                      and show how much of the prompts the prefix cache served
  jprefix serve       an OpenAI-compatible HTTP server (`vllm serve`'s command line)
  jprefix bench       benchmarks: throughput, latency, serve (`vllm bench`'s)

The default model is the embedded SmolLM2-135M-Instruct, a 4-bit Q4_1 GGUF dequantised at
load: small and quantised, so its answers say little about the engine. `jprefix
<command> --help` lists a command's flags.
"""

from __future__ import annotations

import argparse
import os
import sys

# (before anything imports transformers: its "PyTorch was not found" advisory is noise
# here, jprefix runs no torch model)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import jprefix  # noqa: E402  (its names load lazily: nothing heavy is imported)
from jprefix.benchmarks.cli import add_bench_parser, run_bench  # noqa: E402
from jprefix.entrypoints.cli_args import add_fp8_flags  # noqa: E402
from jprefix.entrypoints.cli_args import fp8_kwargs as fp8_kwargs  # noqa: E402  (re-exported)
from jprefix.entrypoints.cli_generate import add_generate_parser, run_generate  # noqa: E402
from jprefix.entrypoints.cli_serve import add_serve_parser, run_serve  # noqa: E402

VERSION = jprefix.__version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jprefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jprefix {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(sub, add_fp8_flags)
    add_serve_parser(sub, VERSION)
    add_bench_parser(sub)
    return parser


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
