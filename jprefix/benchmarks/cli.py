"""`jprefix bench`'s subcommands, registered on the `jprefix` command line."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

COMMANDS = {
    "throughput": "offline throughput: every request queued at once (the engine in-process)",
    "latency": "offline latency at a request rate (the engine in-process, no HTTP)",
    "serve": "online: drive a running OpenAI-compatible server at a rate / concurrency",
}


def _arg_adders() -> dict[str, Callable[[argparse.ArgumentParser], None]]:
    """Each benchmark's function adding its flags to a parser."""
    from jprefix.benchmarks.latency import add_latency_args
    from jprefix.benchmarks.serve import add_serve_args
    from jprefix.benchmarks.throughput import add_throughput_args

    return {"throughput": add_throughput_args, "latency": add_latency_args,
            "serve": add_serve_args}


def add_bench_parser(sub: Any) -> None:
    """Adds `bench` with its three subcommands to the `jprefix` subparsers `sub`."""
    bench = sub.add_parser("bench", help="benchmarks, as `vllm bench`")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, add in _arg_adders().items():
        # (resolve: a benchmark may redefine an engine flag, e.g. throughput's --policy)
        add(kinds.add_parser(name, help=COMMANDS[name], description=COMMANDS[name],
                             conflict_handler="resolve"))


def run_script(name: str, argv: list[str] | None = None) -> dict:
    """`scripts/bench_NAME.py`'s entry point: `jprefix bench NAME`'s flags parsed from
    argv (the benchmark module's summary as the description), then the benchmark;
    returns its result."""
    module = importlib.import_module(f"jprefix.benchmarks.{name}")
    parser = argparse.ArgumentParser(description=module.__doc__.split("\n\n")[0],
                                     conflict_handler="resolve")
    _arg_adders()[name](parser)
    return module.main(parser.parse_args(argv))


def run_bench(args: argparse.Namespace) -> int:
    """Runs the parsed `jprefix bench` subcommand; a ValueError (a bad flag value) exits
    with its message."""
    from jprefix.benchmarks import latency, serve, throughput

    run = {"throughput": throughput.main, "latency": latency.main, "serve": serve.main}
    try:
        run[args.bench_command](args)
    except ValueError as e:
        raise SystemExit(f"jprefix bench {args.bench_command}: {e}") from None
    return 0
