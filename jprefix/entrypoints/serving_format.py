"""The OpenAI response bodies of a finished request and its stream's chunks: choices (one
per sample, `index` = its place), usage, and logprobs in each endpoint's format.

Completions: `logprobs: {tokens, token_logprobs, top_logprobs, text_offset}` (`echo`
puts the prompt's tokens first, the first with no logprob). Chat: `logprobs: {content:
[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`. A logprob JSON
cannot carry (-inf) is sent as -9999.0, as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from jprefix.core.outputs import PositionLogprobs, RequestOutput

_FLOOR = -9999.0


def usage(out: RequestOutput) -> dict[str, Any]:
    """Prompt tokens once, completion tokens of every returned sample."""
    prompt = len(out.prompt_token_ids)
    completion = sum(len(s.token_ids) for s in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def _text(token: int, lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token}"


def completion_logprobs(positions: list[PositionLogprobs | None], token_ids: list[int],
                        offset: int, decode: Any = None) -> dict[str, list[Any]]:
    """OpenAI completions logprobs of tokens `token_ids` (their per-position dicts, the
    chosen token in each; a None position, the first prompt token, has no logprob and its
    text from `decode(token)`), the first token's text starting at character `offset` of
    the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, position in zip(token_ids, positions, strict=True):
        if position is None:
            tokens.append(decode(token) if decode is not None else f"token_id:{token}")
            token_lps.append(None)
            tops.append(None)
        else:
            tokens.append(_text(token, position[token]))
            token_lps.append(_lp(position[token].logprob))
            tops.append({_text(t, lp): _lp(lp.logprob) for t, lp in position.items()})
        offsets.append(offset)
        offset += len(tokens[-1] or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], k: int
                  ) -> dict[str, list[Any]]:
    """OpenAI chat logprobs: per token its text, logprob, UTF-8 bytes and the k most likely
    tokens' (by rank)."""
    def entry(token: int, lp: Any) -> dict[str, Any]:
        text = _text(token, lp)
        return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token, position in zip(token_ids, positions, strict=True):
        top = sorted(position.items(), key=lambda item: item[1].rank or 0)[:k]
        content.append(entry(token, position[token])
                       | {"top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def response_body(name: str, out: RequestOutput, chat: bool, num_logprobs: int | None,
                  echo_text: str | None, created: int, decode: Any = None) -> dict[str, Any]:
    """The whole response of a finished request: one choice per sample. `echo_text` (a
    completion with echo): the prompt's text, put before each sample's text; `decode`
    (token id -> text) names the echoed first prompt token."""
    choices = []
    for sample in out.outputs:
        choice: dict[str, Any] = {"index": sample.index, "finish_reason": sample.finish_reason,
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": sample.text}
            if num_logprobs is not None:
                choice["logprobs"] = chat_logprobs(sample.logprobs or [], sample.token_ids,
                                                   num_logprobs)
        else:
            prefix = echo_text or ""
            choice["text"] = prefix + sample.text
            choice["token_ids"] = sample.token_ids  # extension: useful without a tokenizer
            if num_logprobs is not None:
                choice["logprobs"] = _echoed_logprobs(out, sample, echo_text, decode)
            if out.prompt_logprobs is not None:  # (vLLM's extension field)
                choice["prompt_logprobs"] = [None if p is None else {
                    str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                             "decoded_token": lp.decoded_token} for t, lp in p.items()}
                    for p in out.prompt_logprobs]
        choices.append(choice)
    return {"id": out.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": name, "choices": choices, "usage": usage(out)}


def _echoed_logprobs(out: RequestOutput, sample: Any, echo_text: str | None, decode: Any
                     ) -> dict[str, list[Any]]:
    if echo_text is None:
        return completion_logprobs(sample.logprobs or [], sample.token_ids, 0)
    prompt = completion_logprobs(out.prompt_logprobs or [None] * len(out.prompt_token_ids),
                                 out.prompt_token_ids, 0, decode)
    own = completion_logprobs(sample.logprobs or [], sample.token_ids, len(echo_text))
    return {key: prompt[key] + own[key] for key in prompt}
