"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models.

Bad requests get HTTP 400 with the offending value named, and the engine keeps serving
everyone else. `prefix_pos` (the shareable prompt prefix) and `cache_salt` are accepted as
extensions; usage reports `prompt_tokens_details.cached_tokens` as OpenAI does.

    jprefix serve --model smollm2-135m --port 8000
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from jprefix.core.outputs import RequestOutput
from jprefix.core.sampling_params import SamplingParams
from jprefix.engine.detokenizer import IncrementalDetokenizer
from jprefix.engine.input_processor import render_chat
from jprefix.entrypoints.llm import LLM


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    n: int = 1
    prefix_pos: int | None = None
    cache_salt: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.n != 1:
            raise ValueError(f"n {self.n} is not supported: only n = 1")
        return SamplingParams(  # (normalises the stop lists: a string, a list or None)
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=16 if self.max_tokens is None else self.max_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": "invalid_request_error", "code": status}})


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _TextStream:
    """Turns token ids into text deltas, holding back text that may end in a stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.detokenizer, self.sent = IncrementalDetokenizer(tokenizer), ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, ids: list[int]) -> str:
        self.detokenizer.push(ids)
        text = self.detokenizer.text
        return self._emit(text[: len(text) - self.hold])

    def finish(self, final_text: str) -> str:
        return self._emit(final_text)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def build_app(llm: LLM, model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `llm`."""
    app = FastAPI(title="jprefix")
    name = model_name or llm.engine.model.name

    @app.exception_handler(ValueError)
    async def _bad_value(_request, exc: ValueError):
        return _error(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request, exc: RequestValidationError):
        return _error(400, "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "jprefix"}]}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        s = llm.prefix_pool.stats()
        return {k: getattr(s, k) for k in dir(s) if not k.startswith("_")
                and isinstance(getattr(s, k), int | float)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await _serve(llm, name, req, req.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        return await _serve(llm, name, req, _chat_prompt(llm, req.messages), chat=True)

    return app


def _chat_prompt(llm: LLM, messages: list[ChatMessage]) -> list[int]:
    return render_chat(llm.tokenizer, [m.model_dump() for m in messages])


async def _serve(llm: LLM, name: str, req: _Sampling, prompt: Any, chat: bool):
    sp = req.sampling_params()
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if req.stream:  # validated here, before the 200 of the stream is sent
        items = llm.stream_async(prompt, sp, req.prefix_pos, rid, req.cache_salt)
        events = _stream_events(llm, name, rid, items, sp, chat)
        return StreamingResponse(events, media_type="text/event-stream")
    out = await llm.generate_async(prompt, sp, req.prefix_pos, rid, req.cache_salt)
    return _response(name, out, chat)


def _response(name: str, out: RequestOutput, chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
        choice["token_ids"] = out.token_ids  # extension: useful without a tokenizer
    return {"id": out.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": name, "choices": [choice],
            "usage": _usage(out)}


async def _stream_events(llm: LLM, name: str, rid: str, items: AsyncIterator,
                         sp: SamplingParams, chat: bool) -> AsyncIterator[str]:
    text = _TextStream(llm.tokenizer, sp.stop)
    head = {"id": rid, "object": "chat.completion.chunk" if chat else
            "text_completion", "created": int(time.time()), "model": name}

    def chunk(delta: str, finish: str | None = None, first: bool = False) -> str:
        if chat:
            body = {"content": delta} | ({"role": "assistant"} if first else {})
            choice = {"index": 0, "delta": body, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        return _sse(head | {"choices": [choice]})

    yield chunk("", first=True)
    async for item in items:
        if isinstance(item, RequestOutput):
            yield chunk(text.finish(item.text), item.finish_reason)
            yield _sse(head | {"choices": [], "usage": _usage(item)})
        elif delta := text.push(item):
            yield chunk(delta)
    yield _sse("[DONE]")


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Runs the server until interrupted (uvicorn)."""
    import uvicorn

    uvicorn.run(build_app(llm), host=host, port=port, log_level="info")
