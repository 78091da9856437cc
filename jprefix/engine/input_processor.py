"""Input processing: a request's prompt and parameters become validated Sequences.

Every bad input raises ValueError naming it, before anything is scheduled. The chat
template is rendered here and nowhere else (`render_chat`: the CLI and the server).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jprefix.core.sampling_params import SamplingParams
from jprefix.core.sequence import Sequence
from jprefix.engine.parallel_sampling import SampleGroup, fan_out


def check_token_ids(token_ids: Any, vocab_size: int, what: str = "prompt") -> list[int]:
    """Returns the ids as a list of ints; rejects empty, non-integer or out-of-vocab ids."""
    ids = list(token_ids)
    if not ids:
        raise ValueError(f"{what} is empty: at least one token is needed")
    # fast path, plain ints in range (on the time to first token, so whole-list checks);
    # anything else is checked one by one
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ValueError(f"{what} token {i} is {t!r}: token ids must be integers")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what} token {i} is {t}: must be in [0, {vocab_size})")
    return [int(t) for t in ids]


def check_prefix_len(prefix_len: Any, prompt_len: int) -> int | None:
    """None (automatic mode) or an int in [0, prompt_len]."""
    if prefix_len is None:
        return None
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int | np.integer):
        raise ValueError(f"prefix_len {prefix_len!r} must be an int or None")
    if not 0 <= prefix_len <= prompt_len:
        raise ValueError(f"prefix_len {prefix_len} is outside [0, {prompt_len}], the prompt length")
    return int(prefix_len)


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_tokens {max_tokens} = "
            f"{prompt_len + max_tokens} exceeds the model context of {max_model_len} tokens"
        )


def broadcast(value: Any, n: int, name: str) -> list[Any]:
    """A scalar (or None) for all n prompts, or a list of exactly n values."""
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts")
        return list(value)
    return [value] * n


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string or a token-id list) or a list of them -> list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int | np.integer):
        return [list(prompts)]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    return prompts


def is_token_list(prompt: Any) -> bool:
    return isinstance(prompt, Seq) and not isinstance(prompt, str)


def check_text(text: str, what: str) -> str:
    """Rejects text that UTF-8 cannot encode (a lone surrogate, which JSON's \\ud800
    escapes can carry): no tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {text[e.start]!r} at character "
                         f"{e.start} is a lone surrogate") from None
    return text


# the roles OpenAI's chat API defines: any other role string would reach the template
ROLES = ("system", "developer", "user", "assistant", "tool")
# stands in for field j of message i while the template renders (private-use characters:
# no template or tokenizer gives them a meaning); the spaces around it show whether the
# template trims the field
_MARK = re.compile("( ?)\ue000jprefix-(\\d+)-(\\d+)\ue001( ?)")


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of parts
    (`[{"type": "text", "text": ...}]`, joined with newlines as vLLM joins them); any
    other part (an image, audio, a file) is refused, naming it."""
    if isinstance(content, str):
        return check_text(content, where)
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"{where}[{j}].type is {kind!r:.40}: this server takes text "
                             'parts only ({"type": "text", "text": ...})')
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise ValueError(f'{where}[{j}] must be {{"type": "text", "text": <a string>}}')
        texts.append(check_text(part["text"], f"{where}[{j}].text"))
    return "\n".join(texts)


def check_message(i: int, m: Any) -> dict[str, Any]:
    """Message i with its content as text; ValueError naming a bad role or field."""
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}] must be an object with a role and a content")
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                         f"{role!r:.40}")
    out = dict(m, content=message_text(m.get("content"), f"messages[{i}].content"))
    for key, value in out.items():
        if isinstance(value, str):
            check_text(value, f"messages[{i}].{key}")
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` ({"role", "content"} dicts, content a string or a list
    of text parts; string fields such as `name` allowed) under the tokenizer's chat
    template, ending with the assistant's turn opened if `add_generation_prompt`.

    Only the template's own markup is tokenised with its special tokens: every string a
    client typed (content, name, any other field) is tokenised as plain text
    (`split_special_tokens`), and the role must be one of ROLES, so a `<|im_start|>`
    typed anywhere stays text and cannot open a forged turn."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: send a plain prompt instead")
    if not messages:
        raise ValueError("messages is empty")
    messages = [check_message(i, m) for i, m in enumerate(messages)]
    fields: list[list[str]] = []  # per message, the names of its marked fields
    marked = []
    for i, m in enumerate(messages):
        names = [k for k, v in m.items() if k != "role" and isinstance(v, str)]
        fields.append(names)
        marked.append(m | {k: f" \ue000jprefix-{i}-{j}\ue001 " for j, k in enumerate(names)})
    text = tokenizer.apply_chat_template(marked, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    ids, pos = [], 0
    for mark in _MARK.finditer(text):
        ids += _tokens(tokenizer, text[pos:mark.start()], plain=False)
        i, j = int(mark.group(2)), int(mark.group(3))
        value = messages[i][fields[i][j]]
        value = value if mark.group(1) else value.lstrip()
        value = value if mark.group(4) else value.rstrip()
        ids += _tokens(tokenizer, value, plain=True)
        pos = mark.end()
    return ids + _tokens(tokenizer, text[pos:], plain=False)


def _tokens(tokenizer: Any, text: str, plain: bool) -> list[int]:
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, split_special_tokens=plain).input_ids


class InputProcessor:
    """Turns requests into Sequences for one model: tokenizes, validates against the
    vocabulary and the context length, and assigns request ids and sampling seeds."""

    def __init__(self, tokenizer: Any, model_name: str, vocab_size: int, max_model_len: int,
                 seed: int = 0):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()

    def tokenize(self, prompt: Any) -> list[int]:
        """A prompt's token ids: a string through the tokenizer, or checked token ids."""
        if is_token_list(prompt):
            return check_token_ids(prompt, self.vocab_size)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {prompt!r} must be a string or a list of token ids")
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        check_text(prompt, "prompt")
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer: pass token ids")
        return self.tokenizer(prompt, add_special_tokens=True).input_ids

    def make_request(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        prefix_len: int | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> SampleGroup:
        """Validates one request and builds the sequences that generate it (one, or one
        per sample when it draws several: `parallel_sampling.fan_out`); nothing is
        scheduled yet. The request keeps its own copy of the sampling parameters:
        changing the caller's object afterwards does not reach a request already made."""
        # (replace re-runs __post_init__: copies the stop lists and validates)
        sp = dataclasses.replace(sampling_params) if sampling_params else SamplingParams()
        ids = self.tokenize(prompt)
        check_context(len(ids), sp.max_tokens, self.max_model_len)
        for token in sp.logit_bias or ():
            if token >= self.vocab_size:
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        for token in sp.stop_token_ids or ():
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"stop_token_ids token id {token} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        prefix_len = check_prefix_len(prefix_len, len(ids))
        if request_id is None:
            request_id = f"jprefix-{next(self._ids)}"  # itertools.count: thread-safe
        # the device's sampling stream takes a 32-bit seed: larger seeds are folded
        seed = sp.seed % 2**32 if sp.seed is not None else int(self._rng.integers(2**31))
        seq = Sequence(request_id, ids, sp, prefix_len=prefix_len, cache_salt=cache_salt,
                       seed=seed)
        return fan_out(seq, prompt if isinstance(prompt, str) else None)
