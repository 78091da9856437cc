"""SpeculativeConfig: vLLM's `speculative_config` keys, validated (pure Python).

`method` "ngram" proposes from the request's own tokens (`core.ngram_proposer`);
"draft_model" (also implied by a `model` key without a method) proposes with a smaller
model sharing the target's tokenizer. `num_speculative_tokens` (k) is how many tokens a
sequence may propose per step; the verify row then computes 1 + k tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jprefix.core.config import json_object

METHODS = ("ngram", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative configuration (`parse` builds one from vLLM's dict)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    model: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not one of "
                             f"{', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens {k!r} must be an int "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name} {v!r} must be an int >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min {self.prompt_lookup_min} "
                             f"exceeds prompt_lookup_max {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs a 'model'")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config method 'ngram' takes no model "
                             f"(got {self.model!r})")

    @classmethod
    def parse(cls, raw: Any) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict with vLLM's keys or its JSON text -> a
        config (None: speculation off). Unknown keys are refused by name."""
        if raw is None or isinstance(raw, cls):
            return raw
        raw = json_object("speculative_config", raw, _KEYS)
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config needs num_speculative_tokens")
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method is None:
            raise ValueError("speculative_config needs a method ('ngram' or "
                             "'draft_model') or a model")
        return cls(**(dict(raw) | {"method": method}))
