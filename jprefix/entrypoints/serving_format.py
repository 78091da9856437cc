"""The OpenAI response bodies of finished requests and its stream's chunks: choices (one
per sample, `index` = its place), usage, and logprobs in each endpoint's format.

Completions: `logprobs: {tokens, token_logprobs, top_logprobs, text_offset}` (`echo`
puts the prompt's tokens first, the first with no logprob). Chat: `logprobs: {content:
[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, `bytes` the token's
own bytes (a byte-fallback token's single byte, not U+FFFD's three). A logprob JSON
cannot carry (-inf) is sent as -9999.0, as OpenAI does.
"""

from __future__ import annotations

import re
from typing import Any

from jprefix.core.outputs import PositionLogprobs, RequestOutput

_FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (a printable character for each byte) -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenNames:
    """How tokens are named in logprobs: their decoded text (or "token_id:<id>" with
    --return-tokens-as-token-ids, or without a tokenizer) and their own UTF-8 bytes."""

    def __init__(self, tokenizer: Any, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = _byte_level_alphabet() if "ByteLevel" in type(decoder).__name__ \
            else None

    def text(self, token: int, lp: Any) -> str:
        if self.as_ids or lp.decoded_token is None:
            return f"token_id:{token}"
        return lp.decoded_token

    def bytes(self, token: int, text: str) -> list[int]:
        """The token's bytes: a piece that is not whole UTF-8 (its text decodes to U+FFFD)
        from the vocabulary's own spelling of it."""
        if "\ufffd" not in text or self.tokenizer is None or self.as_ids:
            return list(text.encode())
        piece = self.tokenizer.convert_ids_to_tokens(token)
        match = _BYTE_PIECE.fullmatch(piece or "")
        if match:
            return [int(match.group(1), 16)]
        if self._byte_level is not None and piece and all(c in self._byte_level
                                                          for c in piece):
            return [self._byte_level[c] for c in piece]
        return list(text.encode())


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """Each prompt's tokens once, the completion tokens of every returned sample."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(s.token_ids) for out in outs for s in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens
                                                           for o in outs)}}


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def completion_logprobs(positions: list[PositionLogprobs | None], token_ids: list[int],
                        offset: int, names: TokenNames, decode: Any = None
                        ) -> dict[str, list[Any]]:
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
            tokens.append(names.text(token, position[token]))
            token_lps.append(_lp(position[token].logprob))
            tops.append({names.text(t, lp): _lp(lp.logprob) for t, lp in position.items()})
        offsets.append(offset)
        offset += len(tokens[-1] or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], k: int,
                  names: TokenNames) -> dict[str, list[Any]]:
    """OpenAI chat logprobs: per token its text, logprob, bytes and the k most likely
    tokens' (by rank)."""
    def entry(token: int, lp: Any) -> dict[str, Any]:
        text = names.text(token, lp)
        return {"token": text, "logprob": _lp(lp.logprob), "bytes": names.bytes(token, text)}

    content = []
    for token, position in zip(token_ids, positions, strict=True):
        top = sorted(position.items(), key=lambda item: item[1].rank or 0)[:k]
        content.append(entry(token, position[token])
                       | {"top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def merged_body(name: str, rid: str, outs: list[RequestOutput], chat: bool,
                num_logprobs: int | None, echo: list[str] | None, created: int,
                names: TokenNames, token_ids: bool = False, role: str = "assistant",
                decode: Any = None) -> dict[str, Any]:
    """The whole response of finished requests (one per prompt): one choice per sample,
    `index` = prompt * n + sample. `echo` (a completion with echo): each prompt's text,
    put before its samples' text; `token_ids`: each choice's token ids (vLLM's
    `return_token_ids`); `role`: the chat reply's role."""
    choices = []
    for p, out in enumerate(outs):
        for sample in out.outputs:
            choice: dict[str, Any] = {"index": p * len(out.outputs) + sample.index,
                                      "finish_reason": sample.finish_reason,
                                      "logprobs": None}
            if chat:
                choice["message"] = {"role": role, "content": sample.text}
                if num_logprobs is not None:
                    choice["logprobs"] = chat_logprobs(sample.logprobs or [],
                                                       sample.token_ids, num_logprobs, names)
            else:
                _completion_choice(choice, out, sample, echo[p] if echo else None,
                                   num_logprobs, names, decode)
            if token_ids:
                choice["token_ids"] = list(sample.token_ids)
            choices.append(choice)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": name, "choices": choices, "usage": usage(outs)}
    if token_ids:
        body["prompt_token_ids"] = (outs[0].prompt_token_ids if len(outs) == 1
                                    else [o.prompt_token_ids for o in outs])
    return body


def _completion_choice(choice: dict[str, Any], out: RequestOutput, sample: Any,
                       echo_text: str | None, num_logprobs: int | None, names: TokenNames,
                       decode: Any) -> None:
    choice["text"] = (echo_text or "") + sample.text
    if num_logprobs is not None:
        choice["logprobs"] = _echoed_logprobs(out, sample, echo_text, names, decode)
    if out.prompt_logprobs is not None:  # (vLLM's extension field)
        choice["prompt_logprobs"] = [None if p is None else {
            str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                     "decoded_token": lp.decoded_token} for t, lp in p.items()}
            for p in out.prompt_logprobs]


def _echoed_logprobs(out: RequestOutput, sample: Any, echo_text: str | None,
                     names: TokenNames, decode: Any) -> dict[str, list[Any]]:
    if echo_text is None:
        return completion_logprobs(sample.logprobs or [], sample.token_ids, 0, names)
    prompt = completion_logprobs(out.prompt_logprobs or [None] * len(out.prompt_token_ids),
                                 out.prompt_token_ids, 0, names, decode)
    own = completion_logprobs(sample.logprobs or [], sample.token_ids, len(echo_text), names)
    return {key: prompt[key] + own[key] for key in prompt}
