"""One completion or chat request served: validated off the event loop, run, answered as one
JSON body or as server-sent events; a client that leaves aborts its request. A request of
n > 1 samples runs them as one group (`LLM.generate_group`); streamed, the engine's DELTA
outputs of its samples interleave, each choice with its `index`. The text, stop strings
and logprobs come from the engine's outputs: nothing is detokenised here but an echoed
prompt given as token ids."""

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

from jprefix.core.outputs import RequestOutput, RequestOutputKind
from jprefix.engine.input_processor import render_chat
from jprefix.engine.parallel_sampling import SampleGroup
from jprefix.entrypoints.guided import FIELDS, grammar_error, structured_params
from jprefix.entrypoints.llm import LLM
from jprefix.entrypoints.protocol import ChatRequest, CompletionRequest, RequestError
from jprefix.entrypoints.serving_format import (
    chat_logprobs,
    completion_logprobs,
    response_body,
)

# vLLM's default for /v1/completions; chat defaults to the rest of the context
COMPLETION_MAX_TOKENS = 16


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
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    sp = dataclasses.replace(sp, structured_outputs=grammar or sp.structured_outputs,
                             output_kind=kind)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        group = await llm.make_request_async(prompt, sp, req.prefix_pos, rid, req.cache_salt)
    except ValueError as exc:
        raise grammar_error(exc, field) if field is not None else exc from None
    echo = None
    if not chat and req.echo:  # the prompt's text, before each sample's
        echo = prompt if isinstance(prompt, str) else _decode(llm, group.prompt_token_ids)
    if req.stream:  # validated by now, before the stream's 200 is sent
        events = _stream_events(llm, name, group, chat, req.include_usage, echo)
        return StreamingResponse(events, media_type="text/event-stream")
    out = await until_disconnected(request, llm.generate_group(group))
    if out is None:  # the client left: the request was aborted, nobody reads this
        return JSONResponse(status_code=499, content={})
    if any(s.finish_reason == "error" for s in out.outputs):  # could not finish: not a 200
        raise RequestError(f"request {out.request_id} could not be completed", None, 500)
    return response_body(name, out, chat, sp.logprobs, echo, int(time.time()),
                         lambda t: _decode(llm, [t]))


def _decode(llm: LLM, ids: list[int]) -> str:
    """The text of `ids` (a model without a tokenizer: "token_id:<id>" per token, as the
    logprobs name tokens then)."""
    if llm.tokenizer is None:
        return "".join(f"token_id:{t}" for t in ids)
    return llm.tokenizer.decode(ids, skip_special_tokens=False)


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


class _Choice:
    """One sample's stream: where its completion logprobs' text offsets are."""

    def __init__(self, chat: bool, k: int | None, offset: int):
        self.chat, self.k, self.offset = chat, k, offset

    def logprobs(self, out: RequestOutput) -> Any:
        """A delta's logprobs in the endpoint's format (None when not asked for)."""
        if self.k is None or not out.token_ids or out.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(out.logprobs, out.token_ids, self.k)
        body = completion_logprobs(out.logprobs, out.token_ids, self.offset)
        self.offset += sum(len(t) for t in body["tokens"])
        return body


async def _stream_events(llm: LLM, name: str, group: SampleGroup, chat: bool,
                         include_usage: bool, echo: str | None) -> AsyncIterator[str]:
    """The stream of a DELTA request: each engine delta is one chunk of its sample's
    choice (text, logprobs, and on the last its finish reason)."""
    head = {"id": group.request_id, "object": "chat.completion.chunk" if chat else
            "text_completion", "created": int(time.time()), "model": name}
    index = {rid: i for i, rid in enumerate(group.request_ids)}
    choices = [_Choice(chat, group.sampling_params.logprobs, len(echo or ""))
               for _ in index]

    def chunk(i: int, delta: str, finish: str | None = None, first: bool = False,
              logprobs: Any = None) -> str:
        if chat:
            body = {"content": delta} | ({"role": "assistant"} if first else {})
            choice = {"index": i, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta, "finish_reason": finish, "logprobs": logprobs}
        return _sse(head | {"choices": [choice]} | ({"usage": None} if include_usage else {}))

    for i in range(len(choices)):
        yield chunk(i, echo or "", first=True)
    completion, cached = 0, 0
    async for out in llm.stream_group(group):
        i = index[out.request_id]
        completion += len(out.token_ids)
        cached = out.num_cached_tokens if i == 0 else cached
        logprobs = choices[i].logprobs(out)
        if out.text or logprobs is not None or out.finished:
            yield chunk(i, out.text, out.finish_reason, logprobs=logprobs)
    if include_usage:
        prompt = len(group.prompt_token_ids)
        yield _sse(head | {"choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}})
    yield _sse("[DONE]")
