"""Request guards as ASGI middleware, so that they run before anything reads the request body:
the API-key check for /v1 routes (an unauthenticated client learns nothing, not even that its
JSON is malformed) and the request size limit (HTTP 413)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.errors import APIError


def check_authorization(header: str | None, api_key: str) -> APIError | None:
    if not header:
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                        code="invalid_api_key")
    scheme, _, token = header.partition(" ")
    # compare_digest: the time taken must not tell how much of a guessed key was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode()):
        return APIError(401, "invalid API key", code="invalid_api_key")
    return None


class APIKeyMiddleware:
    # the API and its description (FastAPI's /docs, /redoc, /openapi.json); /health and
    # /metrics stay open for probes and scrapers, the static chat page (/ and /static/, see
    # webchat.py) for browsers: its JS sends the key it is given
    GUARDED = ("/v1", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")

    def __init__(self, app: ASGIApp, api_key: str, prefix: tuple[str, ...] = GUARDED) -> None:
        self.app = app
        self.api_key = api_key
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            headers = dict(scope.get("headers") or [])
            raw = headers.get(b"authorization")
            error = check_authorization(raw.decode("latin-1") if raw else None, self.api_key)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a request whose Content-Length exceeds max_bytes with 413, before reading it. A
    body without one (chunked transfer encoding) is read here, counted as it arrives, refused
    with 413 as soon as it passes max_bytes (the rest is never read), else handed on."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_bytes:
                error = APIError(413, f"request body is {int(length)} bytes, more than the "
                                      f"server's limit of {self.max_bytes} (--max-request-bytes)")
                await error.response()(scope, receive, send)
                return
            if not length:
                body = await self._read_capped(receive)
                if body is None:
                    error = APIError(413, f"request body is more than the server's limit of "
                                          f"{self.max_bytes} bytes (--max-request-bytes)")
                    await error.response()(scope, receive, send)
                    return
                receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _read_capped(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes max_bytes."""
        parts, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return b"".join(parts)
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives the app the body read already, then the connection's own
    messages (a disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
