"""The scheduler's configuration (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits, named as vLLM names them.

    `eos_token_ids` end a request (unless its `ignore_eos`); `policy` orders the waiting
    queue ("fcfs"); `max_model_len` is informational here (the engine validates requests).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    policy: str = "fcfs"
    max_model_len: int | None = None

    def __post_init__(self):
        _check_positive(self, "max_num_batched_tokens", "max_num_seqs", "max_model_len")
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))
