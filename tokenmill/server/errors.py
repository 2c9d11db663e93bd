"""OpenAI-style errors: APIError for handlers to raise, and exception handlers that turn every
failure (bad JSON, wrong types, unknown routes, bugs) into an {"error": {...}} JSON body."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("tokenmill.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(error: ValueError | str, param: str | None = None,
                default_param: str | None = None) -> APIError:
    """A 400 from a ValueError. Engine and SamplingParams messages start with the name of the
    parameter at fault ("top_p must be in (0, 1]"), which becomes `param`."""
    message = str(error)
    if param is None:
        m = re.match(r"([a-z_]+) (must|is|are) ", message)
        param = m.group(1) if m else default_param
    return APIError(400, message, param=param)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, named by its field path."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {reason}".rstrip(": "))
    if not loc:
        return APIError(400, f"request body: {first.get('msg', 'invalid')}")
    param = loc[0]
    fields = {tuple(e.get("loc", ()))[:2] for e in errors}
    if len(errors) > 1 and len(fields) == 1:  # a union (e.g. prompt): every branch failed
        return APIError(400, f"{param}: has the wrong type (got {_short(first.get('input'))})",
                        param=param)
    return APIError(400, f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}", param=param)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = APIError(exc.status_code, str(exc.detail)).response()
        response.headers.update(exc.headers or {})  # e.g. the Allow header of a 405
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
