"""What a finished request returns (vLLM's RequestOutput, flattened for n = 1)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """One request's result; `outputs[0]` mirrors the flat fields, as in vLLM."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
