"""What a finished request returns (vLLM's RequestOutput; its flat fields mirror the first
sample, `outputs[0]`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What a request's RequestOutputs hold (vLLM's names): FINAL_ONLY one output when it
    finishes; DELTA one per step that added something, with only the new text, tokens
    and logprobs (they concatenate to the final output), the last with the finish
    reason; CUMULATIVE the same with everything so far."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution, its rank in it
    (1 = the most likely token) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position's logprobs: token id -> Logprob (the chosen token and the top-k tokens)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one dict per token of token_ids


@dataclass
class RequestOutput:
    """One request's result, or (DELTA / CUMULATIVE requests) a step's part of it:
    `finished` says which. `outputs` holds its n samples (n > 1: `samples`); the flat
    fields (text, token_ids, finish_reason, logprobs, cumulative_logprob) are the first
    sample's, as `outputs[0]`. `prompt_logprobs`: None, or one entry per prompt token,
    the first None (nothing predicts it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    samples: list[CompletionOutput] | None = None  # n > 1: every sample, index order

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self.samples is not None:
            return self.samples
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason,
                                 self.cumulative_logprob, self.logprobs)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
