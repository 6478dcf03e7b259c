"""OpenAI-compatible HTTP API over a :class:`~pdserve.cluster.protocol.ServingRuntime`.

``build_app(runtime)`` serves ``/v1/completions``, ``/v1/chat/completions`` (streaming as
server-sent events, one chunk per generated token), ``/v1/models``, ``/tokenize``,
``/detokenize``, ``/health`` and ``/metrics``. Every error is an OpenAI error object. A client
that goes away closes the runtime's output iterator, which aborts the request everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.cluster.protocol import QueueFullError, RequestFailedError, ServingRuntime
from pdserve.request import RequestOutput, SamplingParams
from pdserve.server.metrics import RequestTracker, ServerMetrics
from pdserve.server.protocol import (
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseFormat,
    TokenizeRequest,
    TokenizeResponse,
    dump_json,
)
from pdserve.tokenizer import apply_chat_template

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """An error answered with HTTP ``status`` and an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.param = param

    def body(self) -> str:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.status)
                             ).model_dump_json()

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json")


def _param_of(message: str, fields: set[str]) -> str | None:
    """The request field a validation message starts with (``'top_p must be ...'``)."""
    word = message.split(" ", 1)[0]
    return word if word in fields else None


def _validation_error(exc: RequestValidationError) -> APIError:
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
        fields = {"top_logprobs", "prompt", "messages"}
        return APIError(400, msg, param=_param_of(msg, fields))
    if first.get("type") == "missing":
        return APIError(400, f"'{path}' is required", param=param)
    return APIError(400, f"invalid value for '{path}': {msg}", param=param)


class EventStreamResponse(StreamingResponse):
    """A plain ``text/event-stream`` response that watches for the client leaving under every
    ASGI spec version and always closes its body iterator (which aborts the request)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left while we wrote
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def _close(outputs: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: BaseModel, include_usage: bool) -> bytes:
    return b"data: " + dump_json(body, include_usage).encode() + b"\n\n"


class OpenAIServer:
    """The endpoints' logic, independent of routing."""

    def __init__(self, runtime: ServingRuntime, model_name: str) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(runtime, model_name)

    @property
    def tokenizer(self) -> Any:
        return self.runtime.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{self.model_name}`).", param="model")

    # ----------------------------------------------------------------- generation endpoints
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompt = body.prompt
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        params = self._params(body, prompt_ids, body.max_tokens, "prompt")
        fmt = CompletionFormat(self.model_name, self.tokenizer, len(prompt_ids), params.logprobs)
        return await self._generate(raw, body.stream, body.include_usage, body.return_timeline,
                                    prompt_ids, params, fmt)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompt_ids = self._chat_prompt(body.messages)
        params = self._params(body, prompt_ids, body.requested_max_tokens, "messages")
        fmt = ChatFormat(self.model_name, self.tokenizer, len(prompt_ids), params.logprobs)
        return await self._generate(raw, body.stream, body.include_usage, body.return_timeline,
                                    prompt_ids, params, fmt)

    def _chat_prompt(self, messages: list[Any]) -> list[int]:
        try:
            return apply_chat_template(self.tokenizer, [m.to_template_dict() for m in messages])
        except Exception as e:  # a template may raise anything (jinja errors, ValueError)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e

    def _params(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                max_tokens: int | None, prompt_field: str) -> SamplingParams:
        """Sampling parameters, with the context-length checks OpenAI clients expect."""
        limit, n = self.runtime.max_model_len, len(prompt_ids)
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                                f"the prompt has {n} tokens, which leaves no room to generate. "
                                "Please shorten the prompt.", param=prompt_field)
        if max_tokens is None:
            max_tokens = limit - n
        try:
            params = body.to_sampling_params(max_tokens)
        except (ValueError, TypeError) as e:
            param = _param_of(str(e), set(type(body).model_fields))
            if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
                param = "max_completion_tokens"
            raise APIError(400, str(e), param=param) from e
        if n + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                                f"However, you requested {n + max_tokens} tokens ({n} in the "
                                f"prompt, {max_tokens} for the completion). Please reduce the "
                                "prompt or max_tokens.", param="max_tokens")
        return params

    def _runtime_error(self, e: Exception, prompt_field: str) -> APIError:
        """The API error for an exception from the runtime (``prompt_field`` names the prompt
        in the request: ``prompt`` or ``messages``)."""
        if isinstance(e, QueueFullError):
            return APIError(429, str(e) or "the server is busy; retry later")
        if isinstance(e, ValueError):
            param = _param_of(str(e), {"prompt", "max_tokens", "temperature", "top_p", "top_k",
                                       "min_p", "seed", "stop", "logprobs"})
            return APIError(400, str(e), param=prompt_field if param == "prompt" else param)
        if isinstance(e, RequestFailedError):
            return APIError(503, str(e) or "the request could not be completed")
        return APIError(500, f"internal error: {type(e).__name__}: {e}")

    async def _generate(self, raw: Request, stream: bool, include_usage: bool,
                        with_timeline: bool, prompt_ids: list[int], params: SamplingParams,
                        fmt: ResponseFormat) -> Response:
        try:
            outputs = self.runtime.generate(fmt.id, prompt_ids, params)
        except (QueueFullError, ValueError, RequestFailedError) as e:
            raise self._runtime_error(e, fmt.prompt_field) from e
        tracker = self.metrics.tracker(len(prompt_ids))
        if stream:
            return EventStreamResponse(
                self._stream(outputs, tracker, fmt, include_usage, with_timeline))
        try:
            final = await self._collect(raw, outputs, tracker)
        except Exception as e:
            tracker.close("error")
            raise self._runtime_error(e, fmt.prompt_field) from e
        if final is None:  # the client is gone; nobody will read this
            return Response(status_code=499)
        if final.finish_reason == "error":
            raise APIError(500, final.error or "the request failed")
        timeline = final.timeline.to_dict() if with_timeline else None
        return Response(dump_json(fmt.response(final, timeline)), media_type="application/json")

    async def _collect(self, raw: Request, outputs: AsyncIterator[RequestOutput],
                       tracker: RequestTracker) -> RequestOutput | None:
        """The final output, or ``None`` if the client disconnected first (request aborted).
        Exceptions from the runtime propagate."""

        async def consume() -> RequestOutput:
            async for out in outputs:
                tracker.observe(out)
                if out.finished:
                    return out
            raise RuntimeError("the runtime ended the output stream without a final output")

        task = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            with anyio.CancelScope(shield=True):
                gone.cancel()
                task.cancel()
                await asyncio.wait((task, gone))
                await _close(outputs)
        if task.cancelled():
            tracker.close()
            return None
        return task.result()

    async def _stream(self, outputs: AsyncIterator[RequestOutput], tracker: RequestTracker,
                      fmt: ResponseFormat, include_usage: bool,
                      with_timeline: bool) -> AsyncIterator[bytes]:
        """SSE frames: one chunk per delta (= per token), the finish reason on the last, the
        usage chunk if asked, then ``[DONE]``. Errors become one error chunk."""
        try:
            final = None
            try:
                async for out in outputs:
                    tracker.observe(out)
                    if out.finished and out.finish_reason == "error":
                        err = APIError(500, out.error or "the request failed")
                        yield b"data: " + err.body().encode() + b"\n\n"
                        break
                    if out.new_token_ids or out.finished:
                        timeline = (out.timeline.to_dict()
                                    if out.finished and with_timeline else None)
                        yield _sse(fmt.chunk(out, timeline), include_usage)
                    if out.finished:
                        final = out
                        break
                else:
                    raise RuntimeError("the runtime ended the output stream without a final "
                                       "output")
                if final is not None and include_usage:
                    yield _sse(fmt.usage_chunk(final), True)
            except Exception as e:
                tracker.close("error")
                err = self._runtime_error(e, fmt.prompt_field)
                yield b"data: " + err.body().encode() + b"\n\n"
            yield DONE
        finally:
            tracker.close()
            await _close(outputs)

    # ----------------------------------------------------------------- other endpoints
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         root=self.runtime.model_name,
                                         max_model_len=self.runtime.max_model_len)])

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if body.messages is not None:
            ids = self._chat_prompt(body.messages)
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        ids = list(ids)
        return TokenizeResponse(tokens=ids, count=len(ids),
                                max_model_len=self.runtime.max_model_len)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        vocab = _tokenizer_vocab_size(self.tokenizer)
        for t in body.tokens:
            if t < 0 or (vocab is not None and t >= vocab):
                raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab})",
                               param="tokens")
        try:
            return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))
        except Exception as e:
            raise APIError(400, f"cannot decode tokens: {e}", param="tokens") from e

    def health(self) -> Response:
        statuses = self.runtime.instance_status()
        roles = sorted({s.role for s in statuses})
        down = [r for r in roles if not any(s.alive for s in statuses if s.role == r)]
        if not roles or down:
            what = ", ".join(down) if down else "any role"
            return APIError(503, f"no live instance for {what}").response()
        return Response("{}", media_type="application/json")


def _tokenizer_vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return getattr(tokenizer, "vocab_size", None)


class _APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every ``/v1`` path."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(got, self.expected):
                err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                                    "<key>')")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(runtime: ServingRuntime, served_model_name: str | None = None,
              api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``runtime`` (already started) under ``served_model_name``
    (default: the runtime's model name). ``api_key`` protects the ``/v1`` endpoints."""
    server = OpenAIServer(runtime, served_model_name or runtime.model_name)
    app = FastAPI(title="pdserve", description="OpenAI-compatible LLM serving")
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await server.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(body, raw)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return server.models()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return server.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
