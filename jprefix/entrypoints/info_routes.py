"""The server's routes besides generation: /v1/models/{id}, /stats, /metrics, /tokenize,
/detokenize, /version and /ping (vLLM's request and response shapes). Tokenising runs
off the event loop, as for generation requests."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Response

import jprefix
from jprefix.engine.input_processor import check_text, check_token_ids, render_chat
from jprefix.entrypoints.llm import LLM
from jprefix.entrypoints.metrics import (
    CONTENT_TYPE,
    engine_snapshot,
    metrics_registry,
    render_metrics,
)
from jprefix.entrypoints.protocol import Body, ChatMessage, RequestError


class TokenizeRequest(Body):
    """vLLM's /tokenize body: a `prompt`, or chat `messages` rendered by the chat template
    (special tokens come from the template, so `add_special_tokens` defaults to False
    for chat and True for a prompt)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


def _tokenize(llm: LLM, req: TokenizeRequest) -> list[int]:
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise RequestError("this model has no tokenizer", None)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("send exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        messages = [m.for_template() for m in req.messages]
        ids = render_chat(tokenizer, messages, req.add_generation_prompt)
        if req.add_special_tokens and tokenizer.bos_token_id is not None \
                and ids[:1] != [tokenizer.bos_token_id]:
            ids = [tokenizer.bos_token_id, *ids]
        return ids
    check_text(req.prompt, "prompt")
    special = True if req.add_special_tokens is None else req.add_special_tokens
    return tokenizer(req.prompt, add_special_tokens=special).input_ids


def model_card(name: str, created: int, llm: LLM) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "jprefix",
            "max_model_len": llm.engine.max_model_len}


def add_info_routes(app: FastAPI, llm: LLM, name: str, check_model: Any, created: int
                    ) -> None:
    """Adds the routes; `check_model(requested, served)` raises 404 for another model;
    `created`: the model's timestamp in /v1/models."""
    registry = metrics_registry(llm, name)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id, name)
        return model_card(name, created, llm)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": jprefix.__version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # (SageMaker's health check, as vLLM answers it)
        return Response(status_code=200)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return engine_snapshot(llm)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(registry), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model, name)
        ids = await asyncio.to_thread(_tokenize, llm, req)
        strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.engine.max_model_len,
                "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model, name)
        if llm.tokenizer is None:
            raise RequestError("this model has no tokenizer", None)
        try:
            ids = check_token_ids(req.tokens, llm.engine.inputs.vocab_size, "tokens")
        except ValueError as exc:
            raise RequestError(str(exc), "tokens") from None
        return {"prompt": await asyncio.to_thread(llm.tokenizer.decode, ids)}
