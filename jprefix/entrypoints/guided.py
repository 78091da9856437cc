"""A request's structured-output fields -> StructuredOutputsParams, naming the field used.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
`guided_json` / `guided_regex` / `guided_choice` extensions and its `structured_outputs`
object (json, json_object, regex, choice). At most one of them may be set.
"""

from __future__ import annotations

from typing import Any

from jprefix.core.structured_outputs import KINDS, StructuredOutputsParams
from jprefix.entrypoints.protocol import RequestError

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
          "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        got = value.get("type") if isinstance(value, dict) else value
        raise RequestError(f"response_format.type must be one of {list(RESPONSE_FORMATS)}, "
                           f"got {got!r:.80}", "response_format")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise RequestError(f"response_format has unknown fields {sorted(extra)}",
                           "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise RequestError('response_format.json_schema must be an object with a "schema" '
                           '(and a "name")', "response_format.json_schema")
    return StructuredOutputsParams(json=spec["schema"])


def _from_field(name: str, value: Any) -> StructuredOutputsParams:
    if name == "guided_json":
        return StructuredOutputsParams(json=value)
    if name == "guided_regex":
        return StructuredOutputsParams(regex=value)
    if name == "guided_choice":
        return StructuredOutputsParams(choice=value)
    if not isinstance(value, dict) or set(value) - set(KINDS):
        raise RequestError(f"structured_outputs must be an object with one of {list(KINDS)}",
                           name)
    return StructuredOutputsParams(**value)


def structured_params(fields: dict[str, Any]) -> tuple[StructuredOutputsParams | None,
                                                        str | None]:
    """(the grammar, the request field that set it) from a request's FIELDS values
    (None where absent); RequestError naming the field for a bad or doubled one."""
    given = [k for k in FIELDS if fields.get(k) is not None]
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} each set a structured output: send one",
                           given[1])
    if not given:
        return None, None
    name = given[0]
    try:
        params = (_from_response_format(fields[name]) if name == "response_format"
                  else _from_field(name, fields[name]))
    except RequestError:
        raise
    except (ValueError, TypeError) as exc:
        raise RequestError(f"{name}: {exc}", name) from None
    return params, name


def grammar_error(exc: ValueError, field: str) -> ValueError:
    """The engine's grammar compile error (`structured_outputs.<kind> is invalid: ...`)
    told in terms of the request field that carried it; any other error unchanged."""
    message = str(exc)
    if not message.startswith("structured_outputs.") or " " not in message:
        return exc
    return RequestError(f"{field} {message.split(' ', 1)[1]}", field)
