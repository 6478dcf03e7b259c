"""OpenAI error objects and the ASGI middlewares that answer with them (API key, body size).

Every error the server sends is ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status in ``code`` (:class:`APIError`); a 429 carries ``Retry-After``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.server.openai_types import ErrorInfo, ErrorResponse, escape_line_separators

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
RETRY_AFTER_S = 1
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class LineSafeJSONResponse(JSONResponse):
    """The app's default JSON response: U+0085, U+2028 and U+2029 escaped like every other body
    the server writes (:func:`~pdserve.server.protocol.escape_line_separators`)."""

    def render(self, content: Any) -> bytes:
        return escape_line_separators(json.dumps(
            content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))).encode()


class APIError(Exception):
    """An error answered with HTTP ``status`` and an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None) -> None:
        message = message.encode("utf-8", "backslashreplace").decode()  # no lone surrogates
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.param = param

    def body(self) -> str:
        return escape_line_separators(ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                            code=self.status)).model_dump_json())

    def response(self) -> Response:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return Response(self.body(), status_code=self.status, media_type="application/json",
                        headers=headers)


def param_of(message: str, fields: set[str]) -> str | None:
    """The request field a validation message starts with (``'top_p must be ...'``)."""
    word = message.split(" ", 1)[0]
    return word if word in fields else None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg")
        return APIError(400, f"request body is not valid JSON: {detail}")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    path_parts = [p for i, p in enumerate(loc)
                  if i == 0 or not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                   for i, p in enumerate(path_parts))
    msgs = [str(e.get("msg", "")).removeprefix("Value error, ") for e in errors
            if [p for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    msg = " or ".join(dict.fromkeys(msgs))
    param = str(loc[0]) if loc and isinstance(loc[0], str) else None
    if not path:
        if first.get("type") == "missing":
            return APIError(400, "request body is required")
        fields = {"top_logprobs", "logprobs", "prompt", "messages"}
        return APIError(400, msg, param=param_of(msg, fields))
    if first.get("type") == "missing":
        return APIError(400, f"'{path}' is required", param=param)
    return APIError(400, f"invalid value for '{path}': {msg}", param=param)


OPEN_PATHS = frozenset({"/health", "/ping", "/version"})  # never behind a key


def _bearer_digest(key: str) -> bytes:
    return hashlib.sha256(b"Bearer " + key.encode("utf-8")).digest()


class APIKeyMiddleware:
    """With ``api_key``, requires ``Authorization: Bearer <key>`` on every path but
    ``OPEN_PATHS``; ``/admin`` paths take ``admin_key`` instead when one is set. The header's raw
    bytes (any, non-ASCII too) are hashed and the SHA-256 digests compared in constant time, so
    neither the key's length nor its prefix leaks through timing."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_key: str | None = None) -> None:
        self.app = app
        self.api = _bearer_digest(api_key) if api_key else None
        self.admin = _bearer_digest(admin_key) if admin_key else self.api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            admin = scope["path"] == "/admin" or scope["path"].startswith("/admin/")
            want = self.admin if admin else self.api
            if want is not None:
                got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"),
                           b"")
                if not hmac.compare_digest(hashlib.sha256(got).digest(), want):
                    which = "admin key" if admin and want is not self.api else "API key"
                    err = APIError(401, f"invalid or missing {which} (send 'Authorization: "
                                        f"Bearer <key>')")
                    await err.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 to a request body over ``max_bytes`` (by its ``Content-Length`` at once, or
    while a chunked body arrives)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._error().response()(scope, receive, send)
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # FastAPI passes HTTPException through body parsing
                    raise StarletteHTTPException(413, self._error().message)
            return message

        await self.app(scope, limited, send)
