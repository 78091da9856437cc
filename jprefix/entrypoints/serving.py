"""One completion or chat request served: validated off the event loop, run, answered as one
JSON body or as server-sent events; a client that leaves aborts its request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jprefix.core.outputs import RequestOutput
from jprefix.core.sampling_params import SamplingParams
from jprefix.engine.detokenizer import IncrementalDetokenizer
from jprefix.engine.input_processor import render_chat
from jprefix.entrypoints.guided import FIELDS, grammar_error, structured_params
from jprefix.entrypoints.llm import LLM
from jprefix.entrypoints.protocol import ChatRequest, CompletionRequest, RequestError

# vLLM's default for /v1/completions; chat defaults to the rest of the context
COMPLETION_MAX_TOKENS = 16


class TextStream:
    """Token ids in, text deltas out; the deltas concatenate to the request's final text.

    Text is sent only where it is certain to be in the final text: before the first stop
    string found, and short of the last `len(longest stop) - 1` characters (a stop string
    starting there may still complete)."""

    def __init__(self, tokenizer: Any, stop: list[str], min_tokens: int = 0):
        self.detokenizer, self.sent, self.stop = IncrementalDetokenizer(tokenizer), "", stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.cut: int | None = None  # where the first stop string starts, once seen
        self.min_tokens, self.num_tokens = min_tokens, 0  # stops count from min_tokens on

    def push(self, ids: list[int]) -> str:
        self.detokenizer.push(ids)
        self.num_tokens += len(ids)
        text = self.detokenizer.text
        if self.cut is None and self.stop and self.num_tokens >= self.min_tokens:
            since = max(0, len(self.sent) - self.hold)
            hits = [i for i in (text.find(s, since) for s in self.stop) if i >= 0]
            self.cut = min(hits) if hits else None
        end = max(0, len(text) - self.hold) if self.cut is None else self.cut
        return self._emit(text[:end])

    def finish(self, final_text: str) -> str:
        return self._emit(final_text)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def prompt_ids(llm: LLM, req: CompletionRequest | ChatRequest) -> Any:
    """The prompt to make a sequence of: a chat rendered to token ids (in a worker thread:
    tokenising a long conversation must not stall the event loop), or a completion's
    string or ids (tokenised later, also off the loop)."""
    if isinstance(req, CompletionRequest):
        return req.prompt
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    return await asyncio.to_thread(render_chat, llm.tokenizer, messages)


async def serve_request(llm: LLM, name: str, req: CompletionRequest | ChatRequest,
                        request: Request):
    chat = isinstance(req, ChatRequest)
    prompt = await prompt_ids(llm, req)
    default = COMPLETION_MAX_TOKENS
    if chat and req.max_tokens is None:  # the rest of the context, as OpenAI and vLLM
        default = max(1, llm.engine.max_model_len - len(prompt))
    sp = req.sampling_params(default)
    grammar, field = structured_params({k: getattr(req, k) for k in FIELDS})
    if grammar is not None:
        sp = dataclasses.replace(sp, structured_outputs=grammar)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        seq = await llm.make_sequence_async(prompt, sp, req.prefix_pos, rid, req.cache_salt)
    except ValueError as exc:
        raise grammar_error(exc, field) if field is not None else exc from None
    if req.stream:  # validated by now, before the stream's 200 is sent
        events = _stream_events(llm, name, rid, llm.stream_sequence(seq), sp, chat,
                                req.include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    out = await until_disconnected(request, llm.generate_sequence(seq))
    if out is None:  # the client left: the request was aborted, nobody reads this
        return JSONResponse(status_code=499, content={})
    return _response(name, out, chat)


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or None after cancelling it when the client disconnects first
    (cancelling a generation aborts its request and frees its blocks)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read by now, so the server's next
    message for this request is its disconnect, sent once the client goes away)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _response(name: str, out: RequestOutput, chat: bool) -> dict[str, Any]:
    if out.finish_reason == "error":  # the engine could not finish it: say so, not a 200
        raise RequestError(f"request {out.request_id} could not be completed", None, 500)
    choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
        choice["token_ids"] = out.token_ids  # extension: useful without a tokenizer
    return {"id": out.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": name, "choices": [choice],
            "usage": usage(out)}


async def _stream_events(llm: LLM, name: str, rid: str, items: AsyncIterator,
                         sp: SamplingParams, chat: bool, include_usage: bool
                         ) -> AsyncIterator[str]:
    text = TextStream(llm.tokenizer, sp.stop, sp.min_tokens)
    head = {"id": rid, "object": "chat.completion.chunk" if chat else
            "text_completion", "created": int(time.time()), "model": name}

    def chunk(delta: str, finish: str | None = None, first: bool = False) -> str:
        if chat:
            body = {"content": delta} | ({"role": "assistant"} if first else {})
            choice = {"index": 0, "delta": body, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        return _sse(head | {"choices": [choice]} | ({"usage": None} if include_usage else {}))

    yield chunk("", first=True)
    async for item in items:
        if isinstance(item, RequestOutput):
            yield chunk(text.finish(item.text), item.finish_reason)
            if include_usage:
                yield _sse(head | {"choices": [], "usage": usage(item)})
        elif delta := text.push(item):
            yield chunk(delta)
    yield _sse("[DONE]")
