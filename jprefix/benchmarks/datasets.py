"""Benchmark workloads of token ids: synthetic shared-prefix and multi-level (trie)
prompts of random tokens, plain random prompts, and pre-tokenized request files
(`save_requests`; ShareGPT is read in `sharegpt`).

A `Request` is what every benchmark sends: prompt ids, output length, the shareable prefix
length (explicit `prefix_len`, or None for automatic prefix caching), its prefix group and
cache salt. Ids are drawn from [10, vocab) so no special token (EOS, BOS) appears.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class Request:
    """One benchmark request: prompt token ids, output length, explicit shareable prefix
    length (None: automatic mode), its prefix group (-1: none) and cache salt."""

    prompt: list[int]
    output_len: int
    prefix_len: int | None = None
    group: int = -1
    salt: str | None = None


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


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    seed: int = 0) -> list[Request]:
    """Prompts of input_len random tokens each, nothing shared (vLLM's `random` dataset
    at a fixed length)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"need num_prompts, input_len, output_len >= 1, got {num_prompts}, "
                         f"{input_len}, {output_len}")
    rng = random.Random(seed)
    return [Request([rng.randrange(10, vocab_size) for _ in range(input_len)], output_len)
            for _ in range(num_prompts)]


def make_prompts(n: int, prefix: int, unique: int, vocab: int, seed: int) -> list[list[int]]:
    """The engine benchmarks' workload: n prompts of `prefix` shared random tokens, then
    `unique` random tokens of their own."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(10, vocab, prefix).tolist()
    return [shared + rng.integers(10, vocab, unique).tolist() for _ in range(n)]


def _save_tagged(path: str, key: str, rows: list, meta: dict) -> None:
    """Writes `{key: rows, "meta": meta}` as JSON (the key first: `_load_tagged` tells the
    file by it), creating its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({key: rows, "meta": meta}, f)


def _load_tagged(path: str, key: str) -> list | None:
    """The rows `_save_tagged` wrote under `key`; None if the file is not such a file (its
    head does not name the key: a raw ShareGPT file, say)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(64)
    if f'"{key}"' not in head:
        return None
    with open(path) as f:
        return json.load(f)[key]


def save_requests(path: str, requests: list[Request], meta: dict) -> None:
    """Writes a pre-tokenized request file (`load_requests` reads it back)."""
    _save_tagged(path, "jprefix_requests", [asdict(r) for r in requests], meta)


def save_conversations(path: str, conversations: list[list[list[int]]], meta: dict) -> None:
    """Writes a pre-tokenized multi-turn file: per conversation its user turns' token ids
    (`load_conversations` reads it back)."""
    _save_tagged(path, "jprefix_conversations", conversations, meta)


def load_conversations(path: str) -> list[list[list[int]]] | None:
    """The user turns of a pre-tokenized multi-turn file; None if the file is not one."""
    return _load_tagged(path, "jprefix_conversations")


def load_requests(path: str, vocab_size: int) -> list[Request] | None:
    """The requests of a pre-tokenized file (ids folded into vocab_size); None if the
    file is not one (a raw ShareGPT file, say)."""
    rows = _load_tagged(path, "jprefix_requests")
    if rows is None:
        return None
    reqs = [Request(**r) for r in rows]
    for r in reqs:
        r.prompt = [t % vocab_size for t in r.prompt]
    return reqs


