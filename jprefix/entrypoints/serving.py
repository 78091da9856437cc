"""One completion or chat request served: validated off the event loop, run, answered as one
JSON body or as server-sent events; a client that leaves aborts its request. A request of
n > 1 samples runs them as one group (`LLM.generate_group`); a completion of several
prompts runs one group per prompt, choice `index` = prompt * n + sample (as OpenAI and
vLLM number them). Streamed, the engine's DELTA outputs interleave, each chunk naming its
choice. The text, stop strings and logprobs come from the engine's outputs: nothing is
detokenised here but an echoed prompt given as token ids.

At shutdown (`ServingConfig.shutdown`) new requests get 503; once the drain time is over
the requests still running are aborted: a stream ends with a chunk whose finish reason
is "abort", a plain request gets a 503 error."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jprefix.core.outputs import RequestOutput, RequestOutputKind
from jprefix.core.sampling_params import MAX_LOGPROBS, SamplingParams
from jprefix.engine.input_processor import render_chat
from jprefix.engine.parallel_sampling import SampleGroup
from jprefix.entrypoints.guided import FIELDS, grammar_error, structured_params
from jprefix.entrypoints.llm import LLM
from jprefix.entrypoints.protocol import ChatRequest, CompletionRequest, RequestError
from jprefix.entrypoints.serving_control import ABORTED, Shutdown, interleaved, until_done
from jprefix.entrypoints.serving_format import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    merged_body,
)

# vLLM's default for /v1/completions; chat defaults to the rest of the context
COMPLETION_MAX_TOKENS = 16
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServingConfig:
    """What the server's flags say about serving a request."""

    name: str
    response_role: str = "assistant"
    max_logprobs: int = MAX_LOGPROBS
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # generation config
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids
    log_requests: bool = False  # --enable-log-requests: ids and parameters, never text
    shutdown: Shutdown = dataclasses.field(default_factory=Shutdown)


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def prompt_list(llm: LLM, req: CompletionRequest | ChatRequest) -> list[Any]:
    """The prompts to make sequences of: a chat rendered to token ids (in a worker thread:
    tokenising a long conversation must not stall the event loop), or a completion's
    strings or ids (tokenised later, also off the loop)."""
    if isinstance(req, CompletionRequest):
        return req.prompts()
    messages = [m.for_template() for m in req.messages]
    return [await asyncio.to_thread(render_chat, llm.tokenizer, messages)]


def engine_error(exc: ValueError, chat: bool, field: str | None) -> ValueError:
    """An engine ValueError as a RequestError naming the request field (the engine names
    its own: `prefix_len` is the server's `prefix_pos`, a chat's prompt its messages)."""
    if isinstance(exc, RequestError):
        return exc
    message = str(exc)
    if field is not None and message.startswith("structured_outputs."):
        return grammar_error(exc, field)
    prompt = "messages" if chat else "prompt"
    if message.startswith("prompt of "):
        return RequestError(message, prompt, 400, "context_length_exceeded")
    word = message.split(" ", 1)[0]
    if word == "prefix_len":
        return RequestError("prefix_pos" + message[len(word):], "prefix_pos")
    if word in ("prompt", "messages"):
        return RequestError(message, prompt)
    return RequestError(message, word if word in ("logit_bias", "stop_token_ids") else None)


def _check_logprobs(cfg: ServingConfig, sp: SamplingParams, chat: bool) -> None:
    for value, name in ((sp.logprobs, "top_logprobs" if chat else "logprobs"),
                        (sp.prompt_logprobs, "prompt_logprobs")):
        if value is not None and value > cfg.max_logprobs:
            raise RequestError(f"{name} {value} is more than this server's --max-logprobs "
                               f"{cfg.max_logprobs}", name)


async def serve_request(llm: LLM, cfg: ServingConfig, req: CompletionRequest | ChatRequest,
                        request: Request):
    if cfg.shutdown.draining:
        raise RequestError("the server is shutting down", None, 503, "server_shutting_down")
    chat = isinstance(req, ChatRequest)
    prompts = await prompt_list(llm, req)
    default = COMPLETION_MAX_TOKENS
    if chat and req.max_tokens is None:  # the rest of the context, as OpenAI and vLLM
        default = max(1, llm.engine.max_model_len - len(prompts[0]))
    sp = req.sampling_params(default, cfg.defaults)
    _check_logprobs(cfg, sp, chat)
    grammar, field = structured_params({k: getattr(req, k) for k in FIELDS})
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    sp = dataclasses.replace(sp, structured_outputs=grammar or sp.structured_outputs,
                             output_kind=kind)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    groups = []
    try:
        for p, prompt in enumerate(prompts):
            groups.append(await llm.make_request_async(
                prompt, sp, req.prefix_pos, rid if len(prompts) == 1 else f"{rid}-p{p}",
                req.cache_salt))
    except ValueError as exc:
        raise engine_error(exc, chat, field) from None
    if cfg.log_requests:
        logger.info("request %s: %d prompt(s) of %s tokens, %s", rid, len(groups),
                    "/".join(str(len(g.prompt_token_ids)) for g in groups), sp)
    echo = None
    if not chat and req.echo:  # the prompt's text, before each sample's
        echo = [p if isinstance(p, str) else _decode(llm, g.prompt_token_ids)
                for p, g in zip(prompts, groups, strict=True)]
    names = TokenNames(llm.tokenizer, cfg.tokens_as_ids)
    if req.stream:  # validated by now, before the stream's 200 is sent
        events = _stream_events(llm, cfg, rid, groups, chat, req, echo, names)
        return StreamingResponse(events, media_type="text/event-stream")
    outs = await until_done(request, _generate_all(llm, groups), cfg.shutdown.aborted())
    if outs is None:  # the client left: the request was aborted, nobody reads this
        return JSONResponse(status_code=499, content={})
    if outs is ABORTED:
        raise RequestError("the server shut down before the request finished (it was "
                           "aborted after --shutdown-timeout)", None, 503,
                           "server_shutting_down")
    if any(s.finish_reason == "error" for out in outs for s in out.outputs):
        if field is not None:  # (its matcher failed mid-output: the request's fault)
            raise RequestError(f"{field}: the grammar could not be followed to its end "
                               "(a limit of the grammar engine was reached while "
                               "generating)", field)
        raise RequestError(f"request {rid} could not be completed (it can never fit in the "
                           "KV cache)", None, 500)
    return merged_body(cfg.name, rid, outs, chat, sp.logprobs, echo, int(time.time()),
                       names, req.return_token_ids, cfg.response_role,
                       lambda t: _decode(llm, [t]))


async def _generate_all(llm: LLM, groups: list[SampleGroup]) -> list[RequestOutput]:
    """Each group's merged output (a coroutine, so cancelling its task aborts them all)."""
    return list(await asyncio.gather(*(llm.generate_group(g) for g in groups)))


def _decode(llm: LLM, ids: list[int]) -> str:
    """The text of `ids` (a model without a tokenizer: "token_id:<id>" per token, as the
    logprobs name tokens then)."""
    if llm.tokenizer is None:
        return "".join(f"token_id:{t}" for t in ids)
    return llm.tokenizer.decode(ids, skip_special_tokens=False)


class _Choice:
    """One sample's stream: where its completion logprobs' text offsets are."""

    def __init__(self, chat: bool, k: int | None, offset: int, names: TokenNames):
        self.chat, self.k, self.offset, self.names = chat, k, offset, names
        self.finished = False

    def logprobs(self, out: RequestOutput) -> Any:
        """A delta's logprobs in the endpoint's format (None when not asked for)."""
        if self.k is None or not out.token_ids or out.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(out.logprobs, out.token_ids, self.k, self.names)
        body = completion_logprobs(out.logprobs, out.token_ids, self.offset, self.names)
        self.offset += sum(len(t) for t in body["tokens"])
        return body


async def _stream_events(llm: LLM, cfg: ServingConfig, rid: str, groups: list[SampleGroup],
                         chat: bool, req: Any, echo: list[str] | None, names: TokenNames
                         ) -> AsyncIterator[str]:
    """The stream of DELTA requests: each engine delta is one chunk of its sample's
    choice (text, logprobs, and on the last its finish reason)."""
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": cfg.name}
    n = len(groups[0].request_ids)
    index = {r: p * n + i for p, g in enumerate(groups) for i, r in enumerate(g.request_ids)}
    k = groups[0].sampling_params.logprobs
    choices = [_Choice(chat, k, len(echo[i // n]) if echo else 0, names) for i in index.values()]

    def chunk(i: int, delta: str, finish: str | None = None, first: bool = False,
              logprobs: Any = None, token_ids: list[int] | None = None) -> str:
        if chat:
            body = {"content": delta} | ({"role": cfg.response_role} if first else {})
            choice = {"index": i, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta, "finish_reason": finish, "logprobs": logprobs}
        if req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return _sse(head | {"choices": [choice]} | ({"usage": None} if req.include_usage
                                                    else {}))

    for i in range(len(choices)):
        yield chunk(i, echo[i // n] if echo else "", first=True)
    completion, cached = 0, [0] * len(groups)  # (each prompt's, as its first sample says)
    async for out in interleaved(llm, groups, cfg.shutdown.aborted()):
        i = index[out.request_id]
        completion += len(out.token_ids)
        if i % n == 0:
            cached[i // n] = out.num_cached_tokens
        logprobs = choices[i].logprobs(out)
        choices[i].finished = out.finished
        if out.text or logprobs is not None or out.finished:
            yield chunk(i, out.text, out.finish_reason, logprobs=logprobs,
                        token_ids=out.token_ids)
    for i, choice in enumerate(choices):  # (the server aborted them at shutdown)
        if not choice.finished:
            yield chunk(i, "", "abort")
    if req.include_usage:
        prompt = sum(len(g.prompt_token_ids) for g in groups)
        yield _sse(head | {"choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached)}}})
    yield _sse("[DONE]")
