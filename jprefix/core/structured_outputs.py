"""StructuredOutputsParams: the grammar one request's output must follow (pure Python).

vLLM's names: exactly one of `json` (a JSON schema, as a dict or its JSON text),
`json_object` (any JSON object), `regex` or `choice` (one of a list of strings). The
engine compiles it into a token matcher (`jprefix.engine.structured_output`), which masks
every sampled token of the request and finishes it when the grammar is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self):
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {list(KINDS)}, "
                             f"got {set_ or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") \
                        from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {self.json_object!r}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {self.regex!r}")
        if self.choice is not None and (
                not isinstance(self.choice, list | tuple) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which of KINDS this request uses."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema (`json` parsed; {"type": "object"} for `json_object`), or None."""
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json, str):
            return json.loads(self.json)
        return self.json
