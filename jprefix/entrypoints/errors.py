"""The server's errors in OpenAI's shape: `{"error": {"message", "type", "param",
"code"}}`, `param` naming the request field at fault (`messages[0].content[1].type`)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class RequestError(ValueError):
    """A bad request: HTTP `status` with OpenAI's error JSON naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """OpenAI's error JSON (a lone surrogate echoed from the request is escaped: the body
    is UTF-8)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


def field_name(loc: tuple[Any, ...]) -> str:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    """A person's sentence for one of pydantic's errors, and the field it names."""
    param = field_name(tuple(err.get("loc", ()))) or None
    kind, msg = err.get("type", ""), str(err.get("msg", ""))
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, RequestError):
        return str(cause), cause.param
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({err.get('ctx', {}).get('error')})", None
    if param is None or kind == "model_attributes_type":
        return "the request body must be a JSON object", None
    if kind == "missing":
        return f"{param} is required", param
    if kind == "extra_forbidden":
        return f"{param} is not a field of this request", param
    msg = msg.removeprefix("Value error, ")
    if kind != "value_error":
        msg = f"{msg[:1].lower()}{msg[1:]}, got {err.get('input')!r:.80}"
    return f"{param}: {msg}", param


def lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """(the field, the message) of the first string in a JSON value (keys included) that
    UTF-8 cannot encode (a lone surrogate, which JSON's \\ud800 escapes can carry)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, (f"{path or 'the body'} is not valid Unicode: character {e.start} "
                          "is a lone surrogate")
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = lone_surrogate(key, path) or lone_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None
