"""API-key check for /v1 routes, as ASGI middleware so that it runs before anything reads the
request body (an unauthenticated client learns nothing, not even that its JSON is malformed)."""

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
