"""Errors in the OpenAI envelope: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


def log_refusal(request: Request, status: int, message: str, param: str | None) -> None:
    """The server log says why a request was refused (the client got the same message)."""
    request_id = getattr(request.state, "request_id", None)
    logger.info(
        "%d %s %s (request %s)%s: %s",
        status,
        request.method,
        request.url.path,
        request_id,
        f" param {param}" if param else "",
        message,
    )


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    log_refusal(request, exc.status, exc.message, exc.param)
    return JSONResponse(exc.body(), status_code=exc.status)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _param(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        param = None
    else:
        message = "; ".join(_describe(e) for e in errors[:5])
    log_refusal(request, 400, message, param)
    return JSONResponse(error_body(400, message, param=param), status_code=400)


def _describe(error: Any) -> str:
    where = _param(error.get("loc", ())) or "body"
    if error.get("type") == "extra_forbidden":
        return f"{where}: unknown field (this server does not know or support it)"
    return f"{where}: {error.get('msg')}"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``, without pydantic's union
    member tags (``"str"``, ``"list[int]"``)."""
    parts = [
        str(p)
        for p in loc
        if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))
    ]
    return ".".join(parts) or None


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)


async def internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Anything no other handler caught: a bug. Logged with its traceback; the client still gets
    the envelope, never a bare text 500."""
    logger.error("unhandled error", exc_info=exc)
    return JSONResponse(
        error_body(500, f"internal server error: {type(exc).__name__}"), status_code=500
    )
