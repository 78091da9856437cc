"""One completion or chat request served: validated off the event loop, run, answered as one
JSON body or as server-sent events; a client that leaves aborts its request. A request of
n > 1 samples runs them as one group (`LLM.generate_group`); streamed, their chunks
interleave, each choice with its `index`."""

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
from jprefix.core.sequence import Sequence
from jprefix.engine.detokenizer import IncrementalDetokenizer
from jprefix.engine.input_processor import render_chat
from jprefix.engine.logprobs import position_dicts
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
        group = await llm.make_request_async(prompt, sp, req.prefix_pos, rid, req.cache_salt)
    except ValueError as exc:
        raise grammar_error(exc, field) if field is not None else exc from None
    echo = None
    if not chat and req.echo:  # the prompt's text, before each sample's
        echo = prompt if isinstance(prompt, str) else _decode(llm, group.seqs[0].prompt_token_ids)
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
    """One sample's stream: its text (stop strings held back, `TextStream`) and its
    logprobs, read from the sequence as its tokens arrive (attached before they are
    posted), or from the final output for the rest."""

    def __init__(self, llm: LLM, seq: Sequence, chat: bool, k: int | None, offset: int):
        self.llm, self.seq, self.chat, self.k = llm, seq, chat, k
        self.text = TextStream(llm.tokenizer, seq.sampling_params.stop,
                               seq.sampling_params.min_tokens)
        self.sent_ids: list[int] = []
        self.offset = offset  # completions' text_offset of the next token

    def logprobs(self, ids: list[int], positions: list | None = None) -> Any:
        if self.k is None or not ids:
            return None
        if positions is None:
            start = len(self.sent_ids)
            positions = position_dicts(self.seq.output_logprobs[start : start + len(ids)],
                                       self.llm.tokenizer)
        self.sent_ids += ids
        if self.chat:
            return chat_logprobs(positions, ids, self.k)
        out = completion_logprobs(positions, ids, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


async def _merged(llm: LLM, seqs: list[Sequence]) -> AsyncIterator[tuple[int, Any]]:
    """(sample index, item) of every sample's stream as they come; closing it (the client
    left) cancels every stream, which aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, seq: Sequence) -> None:
        try:
            async for item in llm.stream_sequence(seq):
                queue.put_nowait((i, item))
        except Exception as exc:  # (reaches the client's stream, as a single sample's)
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, seq)) for i, seq in enumerate(seqs)]
    try:
        for _ in range(len(seqs)):
            while True:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield i, item
                if isinstance(item, RequestOutput):
                    break
    finally:
        for task in tasks:
            task.cancel()


async def _stream_events(llm: LLM, name: str, group: SampleGroup, chat: bool,
                         include_usage: bool, echo: str | None) -> AsyncIterator[str]:
    head = {"id": group.request_id, "object": "chat.completion.chunk" if chat else
            "text_completion", "created": int(time.time()), "model": name}
    k = group.sampling_params.logprobs
    choices = [_Choice(llm, seq, chat, k, len(echo or "")) for seq in group.seqs]

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
    finals: dict[int, RequestOutput] = {}
    async for i, item in _merged(llm, group.seqs):
        c = choices[i]
        if isinstance(item, RequestOutput):
            rest = item.token_ids[len(c.sent_ids):]
            positions = None if item.logprobs is None else item.logprobs[len(c.sent_ids):]
            yield chunk(i, c.text.finish(item.text), item.finish_reason,
                        logprobs=c.logprobs(rest, positions))
            finals[i] = item
        else:
            delta = c.text.push(item)
            logprobs = c.logprobs(item)
            if delta or logprobs is not None:
                yield chunk(i, delta, logprobs=logprobs)
    if include_usage:
        prompt = len(finals[0].prompt_token_ids)
        completion = sum(len(o.token_ids) for o in finals.values())
        yield _sse(head | {"choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": finals[0].num_cached_tokens}}})
    yield _sse("[DONE]")
