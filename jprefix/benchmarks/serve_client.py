"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Backends (vLLM's names): `openai` posts to /v1/completions with the prompt as token ids
(jprefix and vLLM take them; the counts are then exact); `openai-chat` posts to
/v1/chat/completions with the prompt's text as one user message. Both stream with
`stream_options.include_usage`, so the last chunk carries the server's usage: prompt and
completion tokens, and `prompt_tokens_details.cached_tokens` (prompt tokens served from
the prefix cache).

A token chunk is one whose choice carries text (`text`, or `delta.content` for chat),
logprobs or the finish reason (a server streams no text for a model without a tokenizer,
but still sends logprobs when asked: `--logprobs`); the role-only or empty chunk a server
may send first is none. The first token chunk's arrival is the time to first token, the
gaps between the next ones are the inter-token latencies (a chunk may hold several
tokens, as in vLLM's benchmark).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    """What one request measured; times in seconds from its send."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens (else the ids sent)
    output_tokens: int = 0  # usage.completion_tokens
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    chunks: int = 0  # token chunks received
    ttft: float | None = None  # None: no token chunk came
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    text: str = ""


def request_body(backend: str, model: str, prompt: list[int] | str, max_tokens: int,
                 ignore_eos: bool, logprobs: int | None = None) -> dict[str, Any]:
    """The JSON body of one greedy streamed request (`logprobs`: top log-probabilities
    per token, None: none)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # (a vLLM extension jprefix takes too)
    if backend == "openai":
        body["prompt"] = prompt
        if logprobs is not None:
            body["logprobs"] = logprobs
    elif backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": logprobs}
    else:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return body


def token_chunk(event: dict[str, Any]) -> str | None:
    """The text of a streamed chunk that carries tokens ("" when they have no text yet);
    None for any other chunk (no choice, as the usage one; or an empty first one)."""
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get(
        "content")
    if text or choice.get("logprobs") or choice.get("finish_reason"):
        return text or ""
    return None


async def send_request(client: Any, url: str, body: dict[str, Any],
                       headers: dict[str, str] | None = None) -> RequestResult:
    """Posts `body` to `url` with an httpx.AsyncClient and reads the event stream to
    [DONE]; a failure (HTTP status, broken stream, no usage) is recorded, not raised."""
    result = RequestResult()
    start = last = time.perf_counter()
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {detail[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                text = token_chunk(event)
                if text is None:
                    continue
                now = time.perf_counter()
                if result.chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.chunks += 1
                result.text += text
    except Exception as e:  # (the benchmark goes on; the error is reported)
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if usage is None:
        result.error = "the stream ended without usage (stream_options.include_usage)"
        return result
    result.prompt_len = usage.get("prompt_tokens", 0)
    result.output_tokens = usage.get("completion_tokens", 0)
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    result.success = True
    return result
