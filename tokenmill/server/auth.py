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
    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1") -> None:
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
    """Refuses a request whose Content-Length exceeds max_bytes with 413, before reading it."""

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
        await self.app(scope, receive, send)
