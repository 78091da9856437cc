"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models;
/stats, /metrics (Prometheus), /tokenize, /detokenize, /version, /ping (`info_routes`).

Every error is OpenAI's error JSON (`protocol.error_response`) with a message naming the
bad value; the engine keeps serving everyone else. A request body over `max_request_bytes`
is refused before it is read whole; with an API key every route but /health and /ping
needs `Authorization: Bearer <key>` (the scheme in any case). Requests are tokenised off
the event loop, so /health and other requests stay responsive while a long prompt is
processed. `prefix_pos` (the shareable prompt prefix) and `cache_salt` are accepted as
extensions; usage reports `prompt_tokens_details.cached_tokens` as OpenAI does.

    jprefix serve smollm2-135m --port 8000

`serve` runs it under uvicorn (`server_run`: the shutdown's bound and signals).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from jprefix.entrypoints.errors import RequestError, error_response, validation_message
from jprefix.entrypoints.info_routes import add_info_routes, model_card
from jprefix.entrypoints.llm import LLM
from jprefix.entrypoints.protocol import ChatRequest, CompletionRequest
from jprefix.entrypoints.serving import ServingConfig, serve_request

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # (= cli.py's): a 128k-token prompt
API_KEY_ENV = "JPREFIX_API_KEY"
logger = logging.getLogger(__name__)
_OPEN_PATHS = frozenset({"/health", "/ping"})


class RequestGate:
    """ASGI middleware in front of every route: the API key (constant-time compare) and
    the body-size bound, checked on Content-Length and again on the bytes received (a
    chunked body has no length), both answered in OpenAI's error JSON."""

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int):
        self.app, self.max_bytes = app, max_request_bytes
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        if self.key is not None and scope.get("path") not in _OPEN_PATHS and not \
                self._authorized(headers.get(b"authorization", b"")):
            return await self._refuse(scope, receive, send, 401, "invalid or missing API key: "
                                      "send the header Authorization: Bearer <key>",
                                      "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        received = 0

        async def bounded_receive() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # (the route's error handler answers it)
                raise HTTPException(413, self._too_large_message())
            return message

        await self.app(scope, bounded_receive, send)

    def _authorized(self, header: bytes) -> bool:
        """`Bearer <key>`, the scheme in any case (RFC 9110: schemes are
        case-insensitive); the key compared in constant time."""
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def _too_large_message(self) -> str:
        return (f"the request body is larger than {self.max_bytes} bytes (the server's "
                "--max-request-bytes)")

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        await self._refuse(scope, receive, send, 413, self._too_large_message(),
                           "request_too_large")

    @staticmethod
    async def _refuse(scope, receive, send, status, message, code, headers=None) -> None:
        await error_response(status, message, None, code, headers)(scope, receive, send)


def build_app(llm: LLM, model_name: str | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_origins: list[str] | None = None, docs: bool = True,
              root_path: str = "", **serving: Any) -> FastAPI:
    """The FastAPI app serving `llm` as `model_name` (default: the model's name): requests
    naming another model get 404. `api_key` (default: $JPREFIX_API_KEY) guards every route
    but /health and /ping. `allowed_origins`: CORS (off unless given); `docs`: the
    /docs and /redoc pages (they load their assets from a CDN); `serving`:
    ServingConfig's fields (response_role, max_logprobs, defaults, tokens_as_ids)."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    app = FastAPI(title="jprefix", root_path=root_path,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    name = model_name or llm.engine.model.name
    cfg = ServingConfig(name, **serving)
    app.state.serving = cfg  # (`server_run` reaches the shutdown state through it)
    app.add_middleware(RequestGate, api_key=api_key or os.environ.get(API_KEY_ENV) or None,
                       max_request_bytes=max_request_bytes)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    _add_error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name, created, llm)]}

    add_info_routes(app, llm, name, _check_model, created)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(req.model, name)
        return await serve_request(llm, cfg, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        _check_model(req.model, name)
        return await serve_request(llm, cfg, req, request)

    return app


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise RequestError(f"the model {requested!r} does not exist: this server serves "
                           f"{served!r}", "model", 404, "model_not_found")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_request, exc: RequestError):
        return error_response(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(ValueError)
    async def _bad_value(_request, exc: ValueError):
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request, exc: RequestValidationError):
        found = [validation_message(e) for e in exc.errors()]
        return error_response(400, "; ".join(m for m, _ in found), found[0][1] if found else None)

    @app.exception_handler(Exception)
    async def _bug(_request, exc: Exception):  # (a defect: logged with its traceback)
        logger.error("unexpected error serving a request", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}", None,
                              "internal_error")

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        if exc.status_code == 404:
            message = f"no route {request.url.path}: see /v1/models, /v1/completions, " \
                      "/v1/chat/completions, /tokenize, /detokenize, /stats, /metrics, /health, " \
                      "/ping, /version"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(exc.status_code, message, None, code, exc.headers)


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Runs the server until stopped (`server_run.run`: uvicorn, a bounded shutdown);
    `kwargs`: build_app's and run's."""
    import inspect

    from jprefix.entrypoints.server_run import run

    names = set(inspect.signature(run).parameters)
    app = build_app(llm, **{k: v for k, v in kwargs.items() if k not in names})
    run(app, llm, host, port, **{k: v for k, v in kwargs.items() if k in names})
