"""The OpenAI API's request bodies and error JSON, as the server accepts and answers them.

Every field a request may carry is declared: an unknown field, or a known OpenAI field
this server does not implement set to anything but its neutral value, is a 400 naming it
(never silently ignored). Errors use OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from jprefix.core.sampling_params import SamplingParams

# OpenAI / vLLM fields not implemented here, with the values that mean "off" (accepted)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
    "echo": (None, False), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_p": (None, 0), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"), "n": (None, 1),
    "guided_grammar": (None,),
}


class RequestError(ValueError):
    """A bad request: HTTP `status` with OpenAI's error JSON naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


def field_name(loc: tuple[Any, ...]) -> str:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    """A person's sentence for one of pydantic's errors, and the field it names."""
    param = field_name(tuple(err.get("loc", ()))) or None
    kind, msg = err.get("type", ""), str(err.get("msg", ""))
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, RequestError):
        return str(cause), cause.param
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({err.get('ctx', {}).get('error')})", None
    if param is None or kind == "model_attributes_type":
        return "the request body must be a JSON object", None
    if kind == "missing":
        return f"{param} is required", param
    if kind == "extra_forbidden":
        return f"{param} is not a field of this request", param
    msg = msg.removeprefix("Value error, ")
    if kind != "value_error":
        msg = f"{msg[:1].lower()}{msg[1:]}, got {err.get('input')!r:.80}"
    return f"{param}: {msg}", param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 0
    stop: Any = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: an opaque label, no effect on sampling
    prefix_pos: int | None = None  # extension: the shareable prompt prefix
    cache_salt: str | None = None  # extension: requests share cached blocks only per salt
    # structured output (`entrypoints.guided` reads them): OpenAI's and vLLM's fields
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key in [k for k in data if k in UNSUPPORTED]:
            if data[key] not in UNSUPPORTED[key]:
                raise RequestError(f"{key} {data[key]!r:.80} is not supported by this server "
                                   f"(leave it out)", key)
            del data[key]
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (
                isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("must be a string or a list of strings")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """ValueError (naming the value) for a bad one; `stream_options` needs `stream`."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true",
                               "stream_options")
        return SamplingParams(  # (normalises the stop lists and validates every value)
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            seed=self.seed, ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str) or (isinstance(v, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in v)):
            return v
        raise ValueError("must be a string or a list of token ids")

    @model_validator(mode="after")
    def _has_prompt(self) -> CompletionRequest:
        if self.prompt is None:
            raise RequestError("prompt is required", "prompt")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str
    name: str | None = None  # OpenAI's participant name: the chat template does not use it


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise RequestError("max_tokens and max_completion_tokens differ: send one",
                                   "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        return self
