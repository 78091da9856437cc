"""SamplingParams: how one request samples and when it stops (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jprefix.core.outputs import RequestOutputKind
from jprefix.core.structured_outputs import StructuredOutputsParams

# the most top-k logprobs a request may ask for per token (vLLM's default max_logprobs):
# the device computes this many for every row of a step that needs any
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """vLLM's sampling parameters. `temperature=0` is greedy; `top_k=-1` and `top_p=1` are
    off. A request stops at EOS (unless `ignore_eos`), at any of `stop_token_ids` or `stop`
    strings (both only after `min_tokens`), or after `max_tokens` generated tokens.

    Logits processing, in vLLM's order: `logit_bias` (token id -> value added, in
    [-100, 100]), then the penalties: `repetition_penalty` (> 0, 1 = off) divides a
    positive logit (multiplies a negative one) of every token seen in the prompt or the
    output; `frequency_penalty` subtracts itself times the token's count in the output,
    `presence_penalty` itself once per token present in the output (both in [-2, 2]).
    Temperature-0 rows take the argmax of the processed logits; the others sample after
    temperature, `min_p` (drop tokens below `min_p` times the top token's probability),
    top-k and top-p.

    `logprobs` k: each generated token's log-probability with the k most likely tokens'
    (0..MAX_LOGPROBS); `prompt_logprobs` k: the same for each prompt token after the
    first. Both are of the model's raw distribution (log_softmax of the logits, before
    any processing), as vLLM reports by default. `n` samples are returned of `best_of`
    (default n) generated, the best by cumulative logprob."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    # the grammar the output must follow (json schema, json_object, regex or choice)
    structured_outputs: StructuredOutputsParams | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # what the request's RequestOutputs hold (FINAL_ONLY: the finished output only; the
    # streaming entry points ask for DELTA)
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got "
                                 f"{self.logit_bias!r:.80}")
            self.logit_bias = dict(self.logit_bias) or None
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid value."""
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens", "min_tokens", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0 or self.top_k >= 2**31:
            raise ValueError(f"top_k must be -1 (off) or in [1, 2**31), got {self.top_k}")
        if not 1 <= self.max_tokens < 2**31:
            raise ValueError(f"max_tokens must be in [1, 2**31), got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"{self.output_kind!r:.40}")
        self._validate_processing()
        self._validate_samples()

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got "
                                 f"{token!r:.40}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got "
                                 f"{bias!r:.40}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got "
                                 f"{value!r}")

    def _validate_samples(self) -> None:
        if not 1 <= self.n <= 128:
            raise ValueError(f"n must be in [1, 128], got {self.n}")
        if self.best_of is not None and (isinstance(self.best_of, bool)
                                         or not isinstance(self.best_of, int)
                                         or not self.n <= self.best_of <= 128):
            raise ValueError(f"best_of must be None or an int in [n={self.n}, 128], got "
                             f"{self.best_of!r}")

    @property
    def num_samples(self) -> int:
        """How many sequences the request generates (`best_of`, default `n`)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, min_p or logit bias changes the logits or the sampling."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or self.min_p != 0
                or self.logit_bias is not None)
