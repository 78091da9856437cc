"""The OpenAI API's request bodies and error JSON, as the server accepts and answers them.

Every field a request may carry is declared: an unknown field, or a known OpenAI field
this server does not implement set to anything but its neutral value, is a 400 naming it
(never silently ignored). Errors use OpenAI's shape (`errors`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from jprefix.core.sampling_params import MAX_LOGPROBS, SamplingParams
from jprefix.engine.input_processor import ROLES, check_message
from jprefix.entrypoints.errors import RequestError, lone_surrogate

# OpenAI / vLLM fields not implemented here, with the values that mean "off" (accepted)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"),
    "guided_grammar": (None,),
}
# fields of the other endpoint: completions take `logprobs: k`, chat `top_logprobs: k`
COMPLETION_UNSUPPORTED = UNSUPPORTED | {"top_logprobs": (None, 0)}
CHAT_UNSUPPORTED = UNSUPPORTED | {"echo": (None, False), "prompt_logprobs": (None,)}


class Body(BaseModel):
    """A request body: unknown fields refused, and no string anywhere in it (a key, a
    value, nested) may hold a lone surrogate (a 400 naming its field, before any field
    is read)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = lone_surrogate(data) if isinstance(data, dict) else None
        if found:
            raise RequestError(found[1], found[0])
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(Body):
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # (unset: the server's default, then 1.0)
    top_p: float | None = None
    top_k: int | None = None
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
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # (vLLM's extension, as min_p)
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    return_token_ids: bool = False  # vLLM's extension: each choice's token ids

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key in [k for k in data if k in cls.unsupported]:
            if data[key] not in cls.unsupported[key]:
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

    def sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None
                        ) -> SamplingParams:
        """ValueError (naming the value) for a bad one; `stream_options` needs `stream`.
        `defaults` (the server's --generation-config: SamplingParams field -> value)
        stand in for the fields the request leaves unset."""
        d = defaults or {}
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true",
                               "stream_options")
        n = 1 if self.n is None else self.n
        if self.stream and self.best_of is not None and self.best_of != n:
            raise RequestError(f"best_of {self.best_of} must equal n ({n}) when streaming: "
                               "the best samples are known only at the end", "best_of")
        try:
            return SamplingParams(  # (normalises the stop lists and validates every value)
                temperature=_or(self.temperature, d.get("temperature", 1.0)),
                top_p=_or(self.top_p, d.get("top_p", 1.0)),
                top_k=_or(self.top_k, d.get("top_k", -1)),
                max_tokens=_or(self.max_tokens, d.get("max_tokens", default_max_tokens)),
                min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                seed=self.seed, ignore_eos=self.ignore_eos, n=n, best_of=self.best_of,
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty,
                                       d.get("repetition_penalty", 1.0)),
                min_p=_or(self.min_p, d.get("min_p", 0.0)), logit_bias=self._logit_bias(),
                **self._logprob_params(),
            )
        except ValueError as e:
            name = str(e).split(" ", 1)[0].split("[", 1)[0]
            raise RequestError(str(e), name if name in type(self).model_fields else None
                               ) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias (token ids as JSON object keys) with int keys."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                raise RequestError(f"logit_bias key {key!r:.40} is not a token id (an "
                                   "integer >= 0 written as a string)", "logit_bias")
            out[int(key)] = value
        return out

    def _logprob_params(self) -> dict[str, int | None]:
        return {}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class CompletionRequest(_Request):
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_UNSUPPORTED
    prompt: Any = None
    logprobs: int | None = None  # top-k logprobs per token (OpenAI: at most 5; here 20)
    echo: bool | None = None  # the prompt before the completion (its logprobs if asked)
    prompt_logprobs: int | None = None  # vLLM's extension: top-k per prompt token

    def _logprob_params(self) -> dict[str, int | None]:
        prompt = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt = max(self.logprobs, prompt or 0)
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt}

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or _is_ids(v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v)
                                          or all(_is_ids(p) for p in v)):
            return v
        raise ValueError("must be a string, a list of token ids, or a non-empty list of "
                         "strings or of token-id lists (several prompts)")

    def prompts(self) -> list[Any]:
        """The request's prompts: one, or several (each with its own choices)."""
        p = self.prompt
        return [p] if isinstance(p, str) or _is_ids(p) else list(p)

    @model_validator(mode="after")
    def _has_prompt(self) -> CompletionRequest:
        if self.prompt is None:
            raise RequestError("prompt is required", "prompt")
        return self


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in v)


class ChatMessage(Body):
    """One message: `content` a string or a list of text parts; the fields an assistant
    message carries when a client sends back the reply it got (`refusal`, `annotations`,
    `audio`, `function_call`, `tool_calls`) are accepted while null (or empty)."""

    role: str
    content: Any = None
    name: str | None = None  # OpenAI's participant name (plain text in the template)
    tool_call_id: str | None = None
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    tool_calls: Any = None

    @field_validator("refusal", "annotations", "audio", "function_call", "tool_calls")
    @classmethod
    def _null(cls, v: Any) -> Any:
        if v not in (None, []):
            raise ValueError(f"{v!r:.60} is not supported by this server (send null)")
        return v

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"must be one of {', '.join(ROLES)}, got {v!r:.40}")
        return v

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template takes it (`render_chat`)."""
        return self.model_dump(include={"role", "content", "name", "tool_call_id"},
                               exclude_none=True)


class ChatRequest(_Request):
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None  # each output token's logprob ...
    top_logprobs: int | None = None  # ... with this many most likely tokens'

    def _logprob_params(self) -> dict[str, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                               f"{self.top_logprobs}", "top_logprobs")
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        for i, m in enumerate(self.messages):
            try:
                check_message(i, m.for_template())
            except ValueError as exc:
                raise RequestError(str(exc), str(exc).split(" ", 1)[0]) from None
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise RequestError("max_tokens and max_completion_tokens differ: send one",
                                   "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        return self
