"""Wire-level pieces every API of the proxy shares: the error answer, JSON in and out, the request body.

`ProxyError` is the one error type of the request path; each API writes it in its own shape (OpenAI
`{"error": {...}}` for Chat Completions and Responses, Anthropic `{"type": "error", "error": {...}}` for
Messages). `load_json` turns a body into plain JSON data or a 400: never a RecursionError (nesting is
bounded by `MAX_JSON_DEPTH`), never a string that cannot be encoded back (a lone surrogate, whether a
`\\ud800` escape or raw surrogate bytes), and never more objects and arrays than `MAX_JSON_ITEMS` (so the
work one request costs the prepare pool is bounded before it starts).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ajet.proxy.schema import short_repr

MAX_JSON_DEPTH = 100   # nesting levels a request body may have (deeper: a 400, never a RecursionError)
# objects + arrays one request body may hold (more: a 400 before validating, rendering or tokenizing it).
# Each costs ~10 us through the request path, so the cap bounds one request's work to ~0.2 s; 200k tiny
# messages in three requests held both prepare threads, and every other episode's calls, for 17-21 s
# (benchmarks/proxy_big_requests.py).
# A long agent conversation holds a few thousand (a message, its content list, a tool call, its arguments).
MAX_JSON_ITEMS = 20_000

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class ProxyError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type, offending param, code.

    `retry_after` (seconds) becomes a `Retry-After` header; a 503 always carries one (1 s unless given),
    so clients with retries (the OpenAI SDK) back off and try again. `details` goes into the Anthropic
    body's `error.details` (the SDKs read `error_code` there, e.g. to stop sending `thread`).
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None,
                 details: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.details = details
        self.retry_after = retry_after if retry_after is not None or status != 503 else 1

    def response(self, headers: dict[str, str] | None = None) -> Response:
        """The JSON body (see `body`) with this status."""
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return json_response(self.body(), self.status, headers)

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}`, as an answer or a streamed error event."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """`{"type": "error", "error": {"type", "message"(, "details")}}`: the Anthropic Messages API's error shape."""
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        error = {"type": kind, "message": self.message}
        if self.details is not None:
            error["details"] = self.details
        return {"type": "error", "error": error}

    def anthropic_response(self) -> Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return json_response(self.anthropic_body(), self.status, headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response (orjson-encoded)."""
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


class ClientGone(ClientDisconnect):
    """The client closed its connection before its request body arrived in full (an agent killed or timed out
    mid-upload): there is nobody to answer. Not a server error: `log_client_gone` writes one warning line,
    and no response is sent. The message says how much of the body arrived."""


def log_client_gone(log: logging.Logger, server: str, scope: dict[str, Any], exc: BaseException) -> None:
    """One warning line (no traceback) for a request whose client went away mid-upload.

    Args:
        log: the server's logger; server: its name in the line ("proxy", "episode API").
        scope: the ASGI scope (method, path); exc: the ClientDisconnect (or ClientGone) raised.
    """
    log.warning("%s: %s %s: %s; nothing was answered", server, scope.get("method"), redacted_path(scope.get("path")),
                str(exc) or "the client closed the connection before sending its whole body")


_EPISODE_TOKEN = re.compile(r"(/ep/)[^/]+")


def redacted_path(path: Any, limit: int = 200) -> str:
    """A request path fit for a log line: the episode token of an `/ep/<token>/...` path (an episode's api key)
    replaced by `<token>`, the whole cut to `limit` characters. `/ep/ajet-AbC.../v1/chat/completions` ->
    `/ep/<token>/v1/chat/completions`."""
    return _EPISODE_TOKEN.sub(r"\1<token>", str(path))[:limit]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes. Raises ProxyError 413 when the Content-Length or the bytes
    actually sent (a chunked body has no Content-Length) exceed it, 400 for a malformed Content-Length,
    ClientGone when the client closes the connection before the body is complete."""
    too_large = ProxyError(413, f"the request body is larger than this proxy's limit of {limit} bytes: "
                                "shorten the conversation or raise max_body_bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not re.fullmatch(r"\s*[0-9]{1,20}\s*", declared):
            raise ProxyError(400, "the Content-Length header is not a non-negative integer", code="invalid_request")
        if int(declared) > limit:
            raise too_large
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
    except ClientDisconnect:
        of = f"the {int(declared)}" if declared is not None else "a chunked body's"
        raise ClientGone(f"the client closed the connection after {size} of {of} body bytes") from None
    return b"".join(parts)


def _lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string (key or value) holding a lone UTF-16 surrogate, else None.
    JSON `\\ud800` escapes decode to such strings, which cannot be encoded as UTF-8 (tokenizer, response)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                if not _utf8_ok(k):
                    return printable(cut(p, 200))
                stack.append((p, x))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
        elif isinstance(v, str) and not _utf8_ok(v):
            return printable(cut(path, 200))
    return None


def printable(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes (so that it can be sent as UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shape_problem(data: Any, max_depth: int, max_items: int) -> tuple[str, str] | None:
    """`(message, param)` when `data` nests deeper than `max_depth` objects/arrays or holds more than
    `max_items` of them, else None. Iterative (no recursion however deep `data` is) and stops at the
    first problem, so it costs O(min(size, max_items)). A count over the cap names the top-level field
    holding the most of them (of those seen: the walk stops as soon as the cap is certainly exceeded)."""
    stack: list[tuple[Any, int, str]] = [(x, 1, str(k)) for k, x in data.items() if type(x) in (dict, list)]
    per_field: dict[str, int] = {}
    n = 1
    while stack:
        v, depth, field = stack.pop()
        if depth >= max_depth:
            where = _trace(data, v)
            return (f"{where}: the value is nested more than {max_depth} levels deep (objects and arrays): "
                    "flatten it"), where
        n += 1
        per_field[field] = per_field.get(field, 0) + 1
        for x in v.values() if type(v) is dict else v:
            if type(x) in (dict, list):
                stack.append((x, depth + 1, field))
                if n + len(stack) > max_items:     # each one stacked will be counted: over the cap already
                    per_field[field] += len(stack)
                    where = printable(cut(max(per_field, key=per_field.get), 200))
                    return (f"{where}: the request holds more than {max_items} JSON objects and arrays (most of "
                            f"them in {where}), more than this proxy accepts in one request: send fewer messages, "
                            "content parts or tools"), where
    return None


def _trace(data: Any, target: Any) -> str:
    """The dotted path from `data` to the object `target` (found by identity)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, v = stack.pop()
        if v is target:
            return printable(cut(path, 200))
        items = v.items() if type(v) is dict else enumerate(v) if type(v) is list else ()
        stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in items if type(x) in (dict, list))
    return ""


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (plus "..." when cut)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def load_json(raw: bytes, max_items: int = MAX_JSON_ITEMS) -> dict[str, Any]:
    """The body as a JSON object. Raises ProxyError 400 for anything malformed (not JSON, not an object,
    nested deeper than MAX_JSON_DEPTH, more than `max_items` objects and arrays, lone surrogates), naming
    where."""
    fallback = False
    try:   # orjson for speed; the standard parser for what it refuses (it gives the precise error, or accepts)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            fallback = True
            data = json.loads(raw)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, >4300-digit ints, nesting
        raise ProxyError(400, f"the request body is not valid JSON: {cut(str(exc), 200)}",
                         code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ProxyError(400, "the request body must be a JSON object", code="invalid_json")
    # nesting and size: the bracket count (counted in C) bounds both, so only a body with many brackets is
    # walked, and the walk stops at the first problem; a body over 16 KiB is walked without counting (an agent's
    # such body, with its tools, nearly always has more than MAX_JSON_DEPTH brackets: the count would be spent)
    if ((len(raw) > 16384 or raw.count(b"[") + raw.count(b"{") > min(MAX_JSON_DEPTH, max_items))
            and (problem := _shape_problem(data, MAX_JSON_DEPTH, max_items))):
        message, where = problem
        raise ProxyError(400, message, param=where, code="invalid_value")
    # lone surrogates: orjson refuses them (a `\ud800` escape, or raw surrogate bytes that the standard
    # parser decodes with "surrogatepass"), so only a body the standard parser accepted can hold one
    if fallback and (where := _lone_surrogate_path(data)) is not None:
        raise ProxyError(400, f"{where}: the string holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape, or "
                              "its bytes), which is not valid Unicode text", param=where, code="invalid_value")
    return data


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """`model.model_validate(data)`, or a ProxyError 400 naming the first offending field and quoting at
    most ~200 characters of its value (`unsupported_parameter` for a field the model forbids)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = cut(".".join(str(p) for p in err["loc"]), 200)
        extra = err["type"] == "extra_forbidden"
        msg = "unsupported parameter" if extra else cut(err["msg"].removeprefix("Value error, "), 300)
        got = "" if extra or err["type"] == "missing" else f" (got {short_repr(err['input'], 200)})"
        raise ProxyError(400, f"{param}: {msg}{got}", param=param,
                         code="unsupported_parameter" if extra else "invalid_value") from exc
