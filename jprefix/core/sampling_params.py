"""SamplingParams: how one request samples and when it stops (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jprefix.core.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """vLLM's sampling parameters. `temperature=0` is greedy; `top_k=-1` and `top_p=1` are
    off. A request stops at EOS (unless `ignore_eos`), at any of `stop_token_ids` or `stop`
    strings (both only after `min_tokens`), or after `max_tokens` generated tokens."""

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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid value."""
        for name in ("temperature", "top_p"):
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
        if self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported), got {self.n}")
