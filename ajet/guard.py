"""What every ajet HTTP server checks before a request reaches its routes: the one place for the Host allow-list,
JSON-only POSTs and the secret, shared by the recording proxy, `ajet gateway`, `ajet serve` and `ajet view`.

    Host allow-list   a request whose `Host` header (port ignored) is not localhost, 127.0.0.1, [::1], the bind
                      host or an extra allowed name is refused with 403. A web page on attacker.example whose
                      name is made to resolve to 127.0.0.1 (DNS rebinding) still sends `Host: attacker.example`.
                      A server bound to every interface (0.0.0.0, ::) with no extra names accepts any Host: it
                      is reachable by any name, and its secret is what keeps others out.
    JSON-only POSTs   a POST (PUT, PATCH, DELETE) with a `Content-Type` other than `application/json` (or
                      `application/*+json`) is refused with 415, body or not, and so is one with a body but no
                      Content-Type. A browser sends a cross-origin request without a CORS preflight only with
                      text/plain, application/x-www-form-urlencoded or multipart/form-data (or no type at all):
                      those never reach a route with a body. No ajet server answers CORS (no
                      Access-Control-Allow-* header, ever), so a page cannot read an answer or send JSON either.
    secret            the one place that reads it: `server_secret(configured)` (the section's `secret`, else
                      AJET_SECRET, else generated), `bearer_token(scope)` and `api_key(scope)` (what a client's
                      SDK sends: `Authorization: Bearer`, `x-api-key`, `x-goog-api-key`, and `?key=` only where
                      the caller allows it; the proxy's episode tokens too), `secret_matches(given, secret)` in
                      constant time.
    scoped keys       `KeyRing`: named keys, each `client` or `admin` (`gateway.keys`), identified in constant
                      time (`KeyRing.identify` -> `Caller`); `new_key()` makes one.

`Guard` is the ASGI middleware doing the first two; `check(scope, ...)` raises `Refused` for servers that answer
in an error shape of their own (the gateway's dialects).
"""

from __future__ import annotations

import ipaddress
import math
import os
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs

from starlette._utils import parse_host_header
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")


class Refused(Exception):
    """A request the guard refuses: HTTP `status` (401, 403, 415), machine-readable `code`, a `message` saying
    what to do instead."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def is_loopback(host: str) -> bool:
    """Whether bind address `host` is reachable only from this machine ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def finite_number(v: Any, name: str) -> float:
    """`v` as a finite float.

    Raises:
        ValueError: (pydantic's 400) a non-number (a bool or string included), NaN, +-Infinity, or an integer too
            large for a float (a 400-digit reward: OverflowError in `float`); the message names `name`.
    """
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a JSON number")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{name} is too large ({len(str(v))} digits): send a finite float") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number, got {v}")
    return f


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> list[str] | None:
    """The Host names a server bound to `bind_host` answers (lower-case; IPv6 literals in brackets): localhost,
    127.0.0.1, [::1], the bind host and `extra`. None (any Host) for a wildcard bind without `extra`."""
    extra = [_bracketed(h) for h in extra]
    if bind_host in WILDCARD_HOSTS:
        return [*LOCAL_HOSTS, *extra] if extra else None
    return [*LOCAL_HOSTS, _bracketed(bind_host), *extra]


def _bracketed(host: str) -> str:
    return (f"[{host}]" if ":" in host and not host.startswith("[") else host).lower()


def check_host(scope: dict[str, Any], allowed: list[str] | None, hint: str) -> None:
    """Raise `Refused` 403 `host_not_allowed` when the request's Host header is not one of `allowed` (None: any).
    `hint` ends the message (e.g. "open the address `ajet view` printed")."""
    if allowed is None:
        return
    header = Headers(scope=scope).get("host")
    parsed = parse_host_header(header)
    if parsed is not None and parsed.host.lower().rstrip(".") in allowed:
        return
    shown = "(none)" if header is None else repr(header[:100])
    raise Refused(403, "host_not_allowed", f"this server answers only requests for {', '.join(sorted(allowed))} "
                                           f"(any port); the Host header was {shown}: {hint}")


def check_json_post(scope: dict[str, Any]) -> None:
    """Raise `Refused` 415 `unsupported_media_type` for a POST, PUT, PATCH or DELETE whose Content-Type is not
    JSON (`application/json`, `application/<x>+json`; parameters such as charset allowed); a request without a
    Content-Type passes only when it has no body (no Transfer-Encoding, Content-Length absent or 0)."""
    if scope.get("method") not in BODY_METHODS:
        return
    headers = Headers(scope=scope)
    header = headers.get("content-type")
    kind = (header or "").split(";", 1)[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return
    if header is None and "transfer-encoding" not in headers and headers.get("content-length", "0").strip() == "0":
        return                                    # no body at all (e.g. POST /v1/sessions/ID/close)
    shown = "none" if header is None else repr(header[:100])
    raise Refused(415, "unsupported_media_type", f"request bodies must be JSON: send `Content-Type: application/json` "
                                                 f"(the Content-Type was {shown})")


def check(scope: dict[str, Any], allowed: list[str] | None, hint: str) -> None:
    """`check_host` then `check_json_post`: raises `Refused`."""
    check_host(scope, allowed, hint)
    check_json_post(scope)


def bearer_token(scope: dict[str, Any]) -> str | None:
    """The token of the request's `Authorization: Bearer <token>` header (scheme case-insensitive, the token
    stripped); None without one. The one parser of that header for every ajet server."""
    auth = Headers(scope=scope).get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def api_key(scope: dict[str, Any], query: bool = True) -> str:
    """The api key the request carries: `Authorization: Bearer`, `x-api-key`, `x-goog-api-key` or, with `query`,
    the query's `key` (what the OpenAI, Anthropic and Gemini SDKs send); "" when none."""
    headers = Headers(scope=scope)
    found = bearer_token(scope) or headers.get("x-api-key") or headers.get("x-goog-api-key")
    if found or not query:
        return found or ""
    return query_key(scope)


def query_key(scope: dict[str, Any]) -> str:
    """The `key` parameter of the request's URL query ("" when none): a key there ends up in browser history,
    Referer headers and proxy logs, so servers accept it only when configured to."""
    return (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key") or [""])[0]


def configured_secret(configured: str | None) -> str | None:
    """The secret a server is configured with: `configured` (its section's `secret`), else the environment variable
    AJET_SECRET, else None."""
    return configured or os.environ.get("AJET_SECRET") or None


def server_secret(configured: str | None) -> tuple[str, bool]:
    """The secret a server checks, and whether it was generated: `configured_secret(configured)`, else a new
    random one (24 bytes, URL-safe base64) that the server prints for its clients."""
    secret = configured_secret(configured)
    return (secret, False) if secret is not None else (secrets.token_urlsafe(24), True)


def secret_beside(configured: str | None, keys: Iterable[tuple[str, str, str]]) -> tuple[str | None, bool]:
    """The secret of a server that also has named `keys` ((name, key, scope) each), and whether it was generated:
    (None, False) when no secret is configured (`configured_secret`) and an admin key is among `keys` (then they
    are the only admin keys), else `server_secret(configured)`."""
    if configured_secret(configured) is None and any(scope == "admin" for _, _, scope in keys):
        return None, False
    return server_secret(configured)


def secret_matches(given: str, secret: str) -> bool:
    """Whether `given` is `secret` (constant time)."""
    return secrets.compare_digest(given.encode(), secret.encode())


SCOPES = ("client", "admin")
NEW_KEY_BYTES = 32   # `new_key()`'s randomness: 256 bits, 43 URL-safe characters


def new_key() -> str:
    """A new random api key (`secrets.token_urlsafe`, NEW_KEY_BYTES bytes: 43 characters)."""
    return secrets.token_urlsafe(NEW_KEY_BYTES)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the `name` of the key it carried and that key's `scope` ("client" or "admin")."""

    name: str
    scope: str

    @property
    def admin(self) -> bool:
        """Whether the key is an admin key (every route, every session)."""
        return self.scope == "admin"


class KeyRing:
    """The api keys a server accepts, each with a name and a scope.

    Args:
        entries: (name, key, scope) triples; scope is "client" or "admin".

    Raises:
        ValueError: an empty name or key, a scope other than client/admin, two entries with one name, or one key
            given twice (under any names: it could not say who calls).
    """

    def __init__(self, entries: Iterable[tuple[str, str, str]]):
        self.entries = [(name, key.encode(), scope) for name, key, scope in entries]
        names = [n for n, _, _ in self.entries]
        for name, key, scope in self.entries:
            if not name or not key:
                raise ValueError("every key needs a name and a non-empty key")
            if scope not in SCOPES:
                raise ValueError(f"key {name!r}: scope must be client or admin, got {scope!r}")
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"two keys are named {dup[0]!r}: give each key its own name")
        keys = [k for _, k, _ in self.entries]
        if len(set(keys)) != len(keys):
            raise ValueError("one key is given twice (under two names, or also as the secret): give each its own key")

    def identify(self, given: str) -> Caller | None:
        """The caller whose key `given` is, None for an unknown (or empty) key. Every key is compared, each in
        constant time, whichever matches."""
        raw, found = given.encode(), None
        for name, key, scope in self.entries:
            if secrets.compare_digest(raw, key) and given:
                found = Caller(name, scope)
        return found


def openai_error(err: Refused) -> Response:
    """`err` as an OpenAI-style error answer `{"error": {"message", "type", "param", "code"}}`."""
    kind = {401: "authentication_error", 403: "permission_error"}.get(err.status, "invalid_request_error")
    return JSONResponse({"error": {"message": err.message, "type": kind, "param": None, "code": err.code}},
                        status_code=err.status)


class Guard:
    """ASGI middleware: `check` on every HTTP request (Host allow-list, JSON-only POSTs); a refusal is answered
    with `render(Refused)` (default: the OpenAI error shape) and never reaches `app`.

    Args:
        app: the ASGI app guarded.
        allowed: `allowed_hosts(...)`'s list of Host names (None: any Host).
        hint: what the 403 tells the client to do instead.
        render: `Refused -> Response`.
    """

    def __init__(self, app: Any, allowed: list[str] | None, hint: str = "call the address the server printed",
                 render: Callable[[Refused], Response] = openai_error):
        self.app, self.allowed, self.hint, self.render = app, allowed, hint, render

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        try:
            check_host(scope, self.allowed, self.hint)
            if scope["type"] == "http":
                check_json_post(scope)
        except Refused as err:
            return await self.render(err)(scope, receive, send)
        return await self.app(scope, receive, send)



SECRET_NAME = "secret"   # the name the secret's caller gets in a `KeyRing`; no configured key may take it


def key_ring(secret: str | None, keys: Iterable[tuple[str, str, str]]) -> KeyRing:
    """The `KeyRing` of a server: its secret (an admin key named `SECRET_NAME`; None: it has none) and its named
    `keys` ((name, key, scope) each).

    Raises:
        ValueError: what `KeyRing` refuses (two keys with one name, one key twice or also as the secret).
    """
    return KeyRing([*([(SECRET_NAME, secret, "admin")] if secret else []), *keys])


def describe_keys(keys: Iterable[tuple[str, str, str]]) -> list[str]:
    """The named keys by scope for a server's start line, e.g. ["2 client keys (alice, bob)", "1 admin key (ops)"]
    ([] without keys); the keys themselves are never shown."""
    keys, parts = list(keys), []
    for scope in SCOPES:
        names = [n for n, _, s in keys if s == scope]
        if names:
            parts.append(f"{len(names)} {scope} key{'s' if len(names) > 1 else ''} ({', '.join(names)})")
    return parts
