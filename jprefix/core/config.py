"""The scheduler's configuration (pure Python)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


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


def json_object(name: str, raw: Any, known: Iterable[str]) -> dict[str, Any]:
    """A config option given as a dict or its JSON text, checked: a JSON object whose keys
    are all `known` (else ValueError naming `name` and the offending value or keys)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{name} {raw!r} is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name} {raw!r} is not a JSON object")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown} (supported: {', '.join(known)})")
    return raw
