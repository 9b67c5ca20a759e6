"""The server's front door: one ASGI middleware that every HTTP request passes before any route.

Owns, in this order: a request id (the `X-Request-Id` response header; 500s and the log name it); the Host
allow-list (loopback names and the bound host by default, so a DNS-rebinding page can't reach the server
under its own name); the Origin check (a browser request from another origin is refused unless that origin
is on the CORS allow-list; CORS itself is starlette's middleware, off by default); the API key on every route
but the public ones (/health, GET /, /static/*: the playground page asks for the key itself); and JSON-only
POST bodies (415 otherwise, so an HTML form or a `text/plain` fetch can't drive the API). Refusals are
OpenAI-shaped error bodies. Also owns which cache scope a request's key puts it in (`cache_scope`): a proposer that
keeps earlier outputs (method suffix) guesses a request only from outputs of its own scope. Knows no routes beyond
those public paths, and nothing of the engine.
"""
from __future__ import annotations

import hashlib
import hmac
import uuid

from starlette.datastructures import Headers

from draftwise.server.errors import error_response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
CACHE_SCOPES = ("key", "global")  # --suffix-cache-scope


def cache_scope(authorization: str, mode: str = "key") -> str:
    """The cache scope of a request with this Authorization header: "key" mode, one scope per bearer token (a hash
    of it: the proposer never holds a key; no token: one scope for all such requests); "global": one for every
    request (the operator's opt-in). Why per key by default: speculation never changes a token, but a request whose
    guesses come from another tenant's outputs runs measurably faster when it repeats them, so acceptance timing
    would tell one tenant what another generated."""
    if mode == "global":
        return "global"
    if mode != "key":
        raise ValueError(f"suffix cache scope must be one of {CACHE_SCOPES}, got {mode!r}")
    scheme, _, token = authorization.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    return "key:" + (hashlib.sha256(token.encode()).hexdigest()[:32] if token else "")


def _public(method: str, path: str) -> bool:
    return path == "/health" or (path == "/" and method in ("GET", "HEAD")) or path.startswith("/static/")


def _hostname(host: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    def __init__(self, app, api_key: str | None = None, allowed_hosts=LOOPBACK_HOSTS, allowed_origins=()):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.any_host = "*" in allowed_hosts
        self.hosts = {h.strip().lower().strip("[]") for h in allowed_hosts}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        refusal = self._check(scope)
        if refusal is not None:
            return await refusal(scope, receive, send_with_id)
        return await self.app(scope, receive, send_with_id)

    def _check(self, scope):
        headers = Headers(scope=scope)
        method, path = scope["method"], scope["path"]
        host = headers.get("host", "")
        if not self.any_host and _hostname(host) not in self.hosts:
            return error_response(400, f"the Host header {host[:100]!r} is not allowed (see --allowed-hosts)",
                                  code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            return error_response(403, f"requests from the origin {origin[:100]!r} are not allowed "
                                       f"(see --allowed-origins)", code="origin_not_allowed")
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if preflight:  # browsers send no credentials on a preflight; CORS (if on) answers it
            return None
        if self.api_key is not None and not _public(method, path):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return error_response(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if method == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                return error_response(415, f"the request body must be JSON (Content-Type: application/json), got "
                                           f"{media[:100]!r}", code="unsupported_media_type")
        return None

    def _origin_ok(self, origin: str, host: str) -> bool:
        o = origin.rstrip("/").lower()
        if self.any_origin or o in self.origins:
            return True
        # same origin: the page was served by this server under the Host the request names
        return o.partition("://")[2] == host.strip().lower() and bool(host)
