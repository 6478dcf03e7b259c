"""OpenAI-compatible HTTP API over a :class:`~pdserve.cluster.serving_api.ServingRuntime`.

``build_app(runtime)`` serves ``/v1/completions``, ``/v1/chat/completions`` (streaming as
server-sent events, one chunk per generated token), ``/v1/models``, ``/tokenize``,
``/detokenize``, ``/health``, ``/ping``, ``/version`` and ``/metrics``. Every error is an OpenAI
error object, whatever the body (no input gives a 5xx); bodies over ``max_request_bytes`` get a
413. A client that goes away closes the runtime's output iterator, which aborts the request
everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pdserve import __version__
from pdserve.cluster.serving_api import (
    QueueFullError,
    RequestFailedError,
    ScalableRuntime,
    ServingRuntime,
)
from pdserve.request import RequestOutput, SamplingParams, derive_seed, validate_prompt
from pdserve.server.compile_pool import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS, CompilePool
from pdserve.server.errors import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIError,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    LineSafeJSONResponse,
    param_of,
    validation_error,
)
from pdserve.server.fanout import Fanout
from pdserve.server.formats import ChatFormat, CompletionFormat, ResponseFormat
from pdserve.server.metrics import ServerMetrics
from pdserve.server.openai_types import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    dump_json,
)
from pdserve.tokenizer import apply_chat_template

if TYPE_CHECKING:
    from pdserve.predict.data import PairLog

INLINE_TEXT = 256  # characters; shorter texts are tokenized on the loop (a few microseconds)
LARGE_TEXT = 1 << 16  # characters; longer texts are tokenized on their own thread
DONE = b"data: [DONE]\n\n"
INLINE_BODY = 64 << 10  # bytes; larger bodies are parsed and validated on a worker thread
# choices × max_tokens × (top logprobs + 1) a request may ask for: each entry is ~50 bytes of
# response (n=128, top_logprobs=20, max_tokens=1000 built 178 MB on the event loop)
MAX_LOGPROB_ENTRIES = 1 << 19

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


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


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(raw: Request, work: Awaitable[T]) -> T:
    """``work``'s result; cancelled (and the request answered 499, which nobody reads) when
    the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait((task, gone))
    if task.cancelled():
        raise APIError(499, "the client closed the request")
    return task.result()


def _sse(body: BaseModel, include_usage: bool) -> bytes:
    return b"data: " + dump_json(body, include_usage).encode() + b"\n\n"


def default_served_model_name(model: str) -> str:
    """The name a model directory is served under: ``org/name`` for a Hugging Face cache
    snapshot (``.../models--org--name/snapshots/<hash>``), else the directory's basename."""
    path = model.rstrip("/\\")
    m = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", path)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    return os.path.basename(path) or model


class OpenAIServer:
    """The endpoints' logic, independent of routing.

    Tokenization (of texts over ``INLINE_TEXT`` characters: shorter ones cost less than the
    hand-off), detokenization and chat templating run on a worker thread, structured-output
    conversion and compilation in worker processes (:class:`CompilePool`, time-limited), so
    the event loop (and ``/health``) never waits for them. Texts of
    more than ``LARGE_TEXT`` characters are tokenized on a thread of their own, so that one huge
    prompt does not hold up the others. A prompt with more characters than ``max_model_len``
    tokens could hold is refused before it is tokenized."""

    def __init__(self, runtime: ServingRuntime, model_name: str,
                 pair_log: PairLog | None = None,
                 compile_options: dict[str, Any] | None = None) -> None:
        self.runtime = runtime
        self.pair_log = pair_log  # (prompt, output length) of each finished choice
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(runtime, model_name, {} if pair_log is None else
                                     {"length_pairs": pair_log})
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenizer")
        self.large_text_pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenizer-l")
        self.compile_options = dict(compile_options or {})  # CompilePool's workers, timeout
        self.compile_pool: CompilePool | None = None  # started at the first constraint
        # parsing large bodies and building responses: off the loop, one at a time
        self.body_pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-body")
        self.response_pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-response")
        self._max_chars: int | None = None

    @property
    def tokenizer(self) -> Any:
        return self.runtime.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.runtime.model_name):
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{self.model_name}`).", param="model")

    # ----------------------------------------------------------------- off-loop work
    async def _off_loop(self, fn: Callable[..., Any], *args: Any, large: bool = False,
                        **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        pool = self.large_text_pool if large else self.tokenizer_pool
        return await loop.run_in_executor(pool, partial(fn, *args, **kwargs))

    async def max_chars(self) -> int:
        """Characters that ``max_model_len`` tokens can hold at most: the longest token's
        string (byte-level and SentencePiece token strings are at least as long as the text
        they decode to) times ``max_model_len``."""
        if self._max_chars is None:
            def longest() -> int:
                vocab = getattr(self.tokenizer, "get_vocab", None)
                return max((len(t) for t in vocab()), default=1) if vocab else 64

            self._max_chars = max(await self._off_loop(longest), 1) * self.runtime.max_model_len
        return self._max_chars

    async def _check_chars(self, text: str, field: str) -> None:
        limit = await self.max_chars()
        if len(text) > limit:
            raise APIError(400, f"This model's maximum context length is "
                                f"{self.runtime.max_model_len} tokens, and the prompt has "
                                f"{len(text)} characters, more than that many tokens can hold "
                                "(no token is longer than "
                                f"{limit // self.runtime.max_model_len} characters). Please "
                                "shorten the prompt.", param=field)

    async def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        await self._check_chars(text, field)
        try:
            if len(text) <= INLINE_TEXT:  # microseconds: cheaper than a thread hop
                ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            else:
                ids = await self._off_loop(self.tokenizer.encode, text,
                                           large=len(text) > LARGE_TEXT,
                                           add_special_tokens=add_special_tokens)
        except Exception as e:  # a tokenizer may reject text in its own ways
            raise APIError(400, f"cannot tokenize the {field}: {e}", param=field) from e
        return list(ids)

    async def decode(self, ids: list[int], field: str) -> str:
        vocab = _tokenizer_vocab_size(self.tokenizer)
        for t in ids:
            if t < 0 or (vocab is not None and t >= vocab):
                raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab})",
                               param=field)
        try:
            return await self._off_loop(self.tokenizer.decode, ids)
        except Exception as e:
            raise APIError(400, f"cannot decode tokens: {e}", param=field) from e

    async def parse(self, raw: Request, model: type[M]) -> M:
        """The request body as ``model``; bodies over ``INLINE_BODY`` bytes are parsed and
        validated on a worker thread (a 7 MiB token list takes a second of CPU)."""
        try:
            data = await raw.body()
        except ClientDisconnect:  # gone before its body arrived: nobody reads the answer, but
            # an exception escaping here is logged as a crash of the ASGI application
            raise APIError(400, "the client closed the connection before its body arrived"
                           ) from None
        if not data.strip():
            raise APIError(400, "request body is required")
        if len(data) <= INLINE_BODY:
            return _validate(model, data)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.body_pool, _validate, model, data)

    async def _chat_prompt(self, messages: list[Any]) -> list[int]:
        # bounded before the template runs: the turns' text together (templates only add)
        total = sum(len(m.content) for m in messages if isinstance(m.content, str))
        limit = await self.max_chars()
        if total > limit:
            raise APIError(400, f"This model's maximum context length is "
                                f"{self.runtime.max_model_len} tokens, and the messages have "
                                f"{total} characters together, more than that many tokens can "
                                f"hold (no token is longer than "
                                f"{limit // self.runtime.max_model_len} characters). Please "
                                "shorten the messages.", param="messages")
        try:
            ids = await self._off_loop(apply_chat_template, self.tokenizer,
                                       [m.to_template_dict() for m in messages])
        except Exception as e:  # a template may raise anything (jinja errors, ValueError)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        return list(ids)

    async def _output_regex(self, body: CompletionRequest | ChatCompletionRequest,
                            raw: Request) -> str | None:
        """The regular expression the output must match, or ``None``; compiled once in the
        :class:`CompilePool` (worker processes, time and memory limits) to check it, and
        cancelled if the client leaves meanwhile."""
        try:
            constraint = body.output_constraint()
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from e
        if constraint is None:
            return None
        kind, spec = constraint
        param = {"json_object": "response_format", "json": "response_format",
                 "regex": "guided_regex", "choice": "guided_choice"}[kind]
        if kind == "json" and body.guided_json is not None:
            param = "guided_json"
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None or not hasattr(self.tokenizer, "get_vocab"):
            raise APIError(400, "structured output needs a tokenizer with a vocabulary and an "
                                "EOS token", param=param)

        try:
            if self.compile_pool is None:
                self.compile_pool = CompilePool(self.tokenizer, eos, **self.compile_options)
                weakref.finalize(self, self.compile_pool.close)  # its worker processes
            regex = await _unless_gone(raw, self.compile_pool.compile(
                kind, None if kind == "json_object" else spec))
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e
        except RuntimeError as e:  # a worker process could not start
            raise APIError(503, f"cannot compile the output constraint now: {e}") from e
        return regex

    # ----------------------------------------------------------------- generation endpoints
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompts = body.prompts
        ids_list = [list(p) if isinstance(p, list) else await self.encode(p, "prompt")
                    for p in prompts]
        regex = await self._output_regex(body, raw)
        params = [self._params(body, ids, body.max_tokens, "prompt", regex) for ids in ids_list]
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else await self.decode(p, "prompt")
                    for p in prompts]
        fmt = CompletionFormat(self.model_name, self.tokenizer, [len(i) for i in ids_list],
                               body.n, params[0].logprobs, echo)
        return await self._generate(raw, body, ids_list, params, fmt)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompt_ids = await self._chat_prompt(body.messages)
        regex = await self._output_regex(body, raw)
        params = self._params(body, prompt_ids, body.requested_max_tokens, "messages", regex)
        fmt = ChatFormat(self.model_name, self.tokenizer, [len(prompt_ids)], body.n,
                         params.logprobs)
        return await self._generate(raw, body, [prompt_ids], [params], fmt)

    def _params(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                max_tokens: int | None, prompt_field: str, regex: str | None) -> SamplingParams:
        """Sampling parameters, with the context-length checks OpenAI clients expect."""
        limit, n = self.runtime.max_model_len, len(prompt_ids)
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                                f"the prompt has {n} tokens, which leaves no room to generate. "
                                "Please shorten the prompt.", param=prompt_field)
        if max_tokens is None:
            max_tokens = limit - n
        try:
            params = body.to_sampling_params(max_tokens, regex)
        except (ValueError, TypeError) as e:
            param = param_of(str(e), set(type(body).model_fields))
            if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
                param = "max_completion_tokens"
            raise APIError(400, str(e), param=param) from e
        vocab = _tokenizer_vocab_size(self.tokenizer)
        for t in (params.logit_bias or {}):
            if vocab is not None and t >= vocab:
                raise APIError(400, f"logit_bias token id {t} is outside the vocabulary "
                                    f"[0, {vocab})", param="logit_bias")
        if params.logprobs is not None:
            choices = body.n * (len(body.prompts) if isinstance(body, CompletionRequest) else 1)
            entries = choices * max_tokens * (params.logprobs + 1)
            if entries > MAX_LOGPROB_ENTRIES:
                field = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
                raise APIError(400, f"choices × max_tokens × ({field} + 1) = {choices} × "
                                    f"{max_tokens} × {params.logprobs + 1} = {entries} "
                                    f"log-probabilities, more than the {MAX_LOGPROB_ENTRIES} a "
                                    f"response may hold; lower n, max_tokens or {field}",
                               param=field)
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
            param = param_of(str(e), {"prompt", "max_tokens", "temperature", "top_p", "top_k",
                                       "min_p", "seed", "stop", "logprobs"})
            return APIError(400, str(e), param=prompt_field if param == "prompt" else param)
        if isinstance(e, RequestFailedError):
            return APIError(503, str(e) or "the request could not be completed")
        return APIError(500, f"internal error: {type(e).__name__}: {e}")

    async def _generate(self, raw: Request, body: CompletionRequest | ChatCompletionRequest,
                        ids_list: list[list[int]], params: list[SamplingParams],
                        fmt: ResponseFormat) -> Response:
        # the model's vocabulary (what /v1/models reports and the engine checks; a model's may be
        # larger than its tokenizer's), else the tokenizer's
        vocab = getattr(self.runtime, "vocab_size", None) or _tokenizer_vocab_size(self.tokenizer)
        for ids in ids_list:  # all prompts, before any is submitted
            try:
                validate_prompt(ids, self.runtime.max_model_len, vocab)
            except ValueError as e:
                raise self._runtime_error(e, fmt.prompt_field) from e
        self._admit(len(ids_list) * fmt.n)
        jobs = []
        for ids, p in zip(ids_list, params):
            for j in range(fmt.n):
                pj = p if j == 0 or p.seed is None else replace(p, seed=derive_seed(p.seed, j))
                jobs.append((ids, pj))
        fan = Fanout(self.runtime, self.metrics, fmt, jobs,
                     None if self.pair_log is None else self._log_pair)
        try:
            await fan.start()
        except (QueueFullError, ValueError, RequestFailedError) as e:
            raise self._runtime_error(e, fmt.prompt_field) from e
        if body.stream:
            return EventStreamResponse(
                self._stream(fan, fmt, body.include_usage, body.return_timeline))
        try:
            finals = await self._collect(raw, fan)
        except Exception as e:
            raise self._runtime_error(e, fmt.prompt_field) from e
        if finals is None:  # the client is gone; nobody will read this
            return Response(status_code=499)
        for out in finals:
            if out.finish_reason == "error":
                raise APIError(503, out.error or "the request failed")
        timeline = _timeline(finals) if body.return_timeline else None

        def build() -> str:  # logprobs of 128 choices: seconds of CPU, not on the loop
            return dump_json(fmt.response(finals, timeline))

        text = await asyncio.get_running_loop().run_in_executor(self.response_pool, build)
        return Response(text, media_type="application/json")

    def _admit(self, choices: int) -> None:
        """Refuse, before any sample runs, a request whose choices the waiting queue cannot
        take: 400 when it never could (more choices than the bound), 429 when it is full now.
        The runtime admits the later samples of an admitted request whatever the queue."""
        bound = self.runtime.max_waiting_requests
        if bound is None:
            return
        if 0 < bound < choices:  # (a bound of 0: a runtime that is full for now)
            raise APIError(400, f"the request has {choices} choices (prompts × n), more than "
                                f"the {bound} requests the server queues "
                                f"(--max-waiting-requests); lower n", param="n")
        waiting = self.runtime.num_waiting()
        if waiting + choices > bound:
            raise APIError(429, f"{waiting} requests are waiting (limit {bound}) and this one "
                                f"adds {choices}; retry later")

    def _log_pair(self, prompt_ids: list[int], out: RequestOutput) -> None:
        assert self.pair_log is not None
        self.pair_log.write(prompt_ids, len(out.token_ids))

    async def _collect(self, raw: Request, fan: Fanout) -> list[RequestOutput] | None:
        """The final outputs in choice order, or ``None`` if the client disconnected first
        (requests aborted). Exceptions from the runtime propagate."""

        async def consume() -> list[RequestOutput]:
            finals: list[Any] = [None] * len(fan.jobs)
            async for index, out in fan:
                if out.finished:
                    finals[index] = out
            return finals

        task = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            with anyio.CancelScope(shield=True):
                gone.cancel()
                task.cancel()
                await asyncio.wait((task, gone))
                await fan.aclose()
        if task.cancelled():
            return None
        return task.result()

    async def _stream(self, fan: Fanout, fmt: ResponseFormat, include_usage: bool,
                      with_timeline: bool) -> AsyncIterator[bytes]:
        """SSE frames: one chunk per delta (= per token) of each choice, each choice's finish
        reason on its last, the usage chunk if asked, then ``[DONE]``. Errors become one error
        chunk."""
        try:
            finals: list[Any] = [None] * len(fan.jobs)
            try:
                async for index, out in fan:
                    if out.finished and out.finish_reason == "error":
                        err = APIError(503, out.error or "the request failed")
                        yield b"data: " + err.body().encode() + b"\n\n"
                        break
                    if out.new_token_ids or out.finished:
                        timeline = (out.timeline.to_dict()
                                    if out.finished and with_timeline else None)
                        yield _sse(fmt.chunk(index, out, timeline), include_usage)
                    if out.finished:
                        finals[index] = out
                else:
                    if include_usage:
                        yield _sse(fmt.usage_chunk(finals), True)
            except Exception as e:
                err = self._runtime_error(e, fmt.prompt_field)
                yield b"data: " + err.body().encode() + b"\n\n"
            yield DONE
        finally:
            await fan.aclose()

    # ----------------------------------------------------------------- other endpoints
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         root=self.runtime.model_name,
                                         max_model_len=self.runtime.max_model_len,
                                         vocab_size=getattr(self.runtime, "vocab_size", None),
                                         num_gpus=getattr(self.runtime, "num_gpus", None))])

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if body.messages is not None:
            ids = await self._chat_prompt(body.messages)
        else:
            assert body.prompt is not None
            ids = await self.encode(body.prompt, "prompt", body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids),
                                max_model_len=self.runtime.max_model_len)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        return DetokenizeResponse(prompt=await self.decode(body.tokens, "tokens"))

    def health(self) -> Response:
        statuses = self.runtime.instance_status()
        roles = sorted({s.role for s in statuses})
        down = [r for r in roles if not any(s.alive for s in statuses if s.role == r)]
        if not roles or down:
            what = ", ".join(down) if down else "any role"
            return APIError(503, f"no live instance for {what}").response()
        return Response("{}", media_type="application/json")


ADMIN_ROLES = ("colocated", "prefill", "decode", "temporal")


class AdminInstancesRequest(BaseModel):
    """``POST /admin/instances``: ``{"action": "add", "role": ROLE[, "instance_id": ID]}`` or
    ``{"action": "remove", "instance_id": ID[, "drain_timeout": SECONDS]}`` (live scaling,
    replanning from outside)."""

    model_config = ConfigDict(extra="forbid")
    action: Literal["add", "remove"]
    role: Literal["colocated", "prefill", "decode", "temporal"] | None = None
    instance_id: str | None = Field(default=None, min_length=1, max_length=128)
    drain_timeout: float | None = Field(default=None, gt=0, le=86400)

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, v: Any) -> Any:
        if v is not None and v not in ADMIN_ROLES:
            raise ValueError(f"unknown role {v!r}; use {', '.join(ADMIN_ROLES[:-1])} or "
                             f"{ADMIN_ROLES[-1]}")
        return v


def _instances(runtime: ServingRuntime) -> list[dict[str, Any]]:
    return [{"instance_id": s.instance_id, "role": s.role, "alive": s.alive,
             "draining": s.draining} for s in runtime.instance_status()]


async def admin_instances(runtime: ServingRuntime, body: AdminInstancesRequest,
                          max_instances: int) -> dict[str, Any]:
    """Add or remove an instance through the runtime's :class:`ScalableRuntime` methods; a
    removal answers once the instance has drained (or its ``drain_timeout`` passed). At most
    ``max_instances`` instances run at once."""
    if not isinstance(runtime, ScalableRuntime):
        raise APIError(400, "this runtime cannot add or remove instances")
    if body.action == "add":
        if not body.role:
            raise APIError(400, "action 'add' needs a role", param="role")
        if body.drain_timeout is not None:
            raise APIError(400, "action 'add' takes no drain_timeout", param="drain_timeout")
        running = len(runtime.instance_status())
        if running >= max_instances:
            raise APIError(400, f"the server runs {running} instances, the most it may "
                                f"(--max-instances {max_instances}); remove one first",
                           param="action")
        try:
            iid = await runtime.add_instance(body.role, body.instance_id)
        except ValueError as e:
            raise APIError(400, str(e), param="role") from None
        except RuntimeError as e:  # e.g. the Ray cluster has no CPU/GPU left for the actor
            raise APIError(503, f"cannot start a {body.role} instance: {e}") from None
        return {"action": "add", "instance_id": iid, "instances": _instances(runtime)}
    if not body.instance_id:
        raise APIError(400, "action 'remove' needs an instance_id", param="instance_id")
    if body.role is not None:
        raise APIError(400, "action 'remove' takes an instance_id, not a role", param="role")
    try:
        rec = await runtime.remove_instance(body.instance_id, body.drain_timeout)
    except ValueError as e:
        raise APIError(400, str(e), param="instance_id") from None
    except RuntimeError as e:  # the server shut down while it drained
        raise APIError(503, str(e)) from None
    return {"action": "remove", "instance_id": rec.instance_id, "role": rec.role,
            "drain_seconds": rec.drained - rec.requested, "drain_timed_out": rec.timed_out,
            "pool": rec.pool, "instances": _instances(runtime)}


def _validate(model: type[M], data: bytes) -> M:
    """``data`` (JSON: the standard library's reading, lone surrogates included, which the
    models then refuse by name) as ``model``; ``APIError``/``RequestValidationError``."""
    try:
        value = json.loads(data)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg}") from None
    except ValueError as e:  # not UTF-8/16/32
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


ERROR_MEANINGS = {
    400: "a bad value (the error names the field) or a request over an admission bound",
    401: "a missing or wrong API key", 404: "an unknown model or route",
    413: "a body over --max-request-bytes", 429: "the queue is full (Retry-After: 1)",
    503: "no live instance for a role, or an instance failure caught the request"}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503)
SSE_SCHEMA = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "server-sent events: `data: <chunk JSON>` per token of "
    "each choice (the chunk has the response's shape with one choice delta), `data: <error "
    "object>` on a failure after the start, `data: [DONE]`"}}}


def _responses(ok: type[BaseModel] | None, errors: tuple[int, ...],
               stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses``: 200 (``ok``'s model, or the route's; with ``stream`` also an
    event stream) and each of ``errors`` with the OpenAI error object."""
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        out[200] = {"model": ok, "description": "the response (stream: false)"}
    if stream:
        out[200]["content"] = {"text/event-stream": {"schema": SSE_SCHEMA}}
    for code in errors:
        out[code] = {"model": ErrorResponse, "description": ERROR_MEANINGS[code]}
    return out


HEALTH = {200: {"description": "every role has a live instance",
                "content": {"application/json": {"schema": {"type": "object",
                                                            "maxProperties": 0}}}},
          503: {"model": ErrorResponse, "description": ERROR_MEANINGS[503]}}


class VersionResponse(BaseModel):
    version: str


REQUEST_MODELS: dict[str, type[BaseModel]] = {}


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of an endpoint that parses ``model`` itself (off the loop);
    :func:`_openapi` adds the model's schema to the components."""
    REQUEST_MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI, vocab: int | None, max_model_len: int) -> dict[str, Any]:
    """FastAPI's schema plus the request models the endpoints parse themselves, with this
    model's bounds: token ids (``x-token-id`` in the models' schemas) below the vocabulary,
    prompt token lists (``x-prompt``) and completion budgets (``x-budget``) below
    ``max_model_len``; one ``operationId`` per method."""
    if app.openapi_schema is None:
        import warnings

        from fastapi.openapi.utils import get_openapi

        with warnings.catch_warnings():  # GET and POST /ping share a route: renamed below
            warnings.filterwarnings("ignore", "Duplicate Operation ID")
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model in REQUEST_MODELS.items():
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps[name] = js
        stack: list[Any] = [comps]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.pop("x-token-id", False) and vocab:
                    node["maximum"] = vocab - 1
                if node.pop("x-prompt", False):
                    node["maxItems"] = max_model_len - 1  # one token left to generate
                if node.pop("x-budget", False):
                    node["maximum"] = max_model_len - 1
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        seen: set[str] = set()
        for path in schema.get("paths", {}).values():
            for method, op in path.items():
                if op.get("operationId") in seen:
                    op["operationId"] = f"{op['operationId']}_{method}"
                seen.add(op.get("operationId", ""))
        app.openapi_schema = schema
    return app.openapi_schema


def _timeline(finals: list[RequestOutput]) -> dict[str, Any]:
    """One choice's timeline, or ``{"choices": [...]}`` for several."""
    if len(finals) == 1:
        return finals[0].timeline.to_dict()
    return {"choices": [out.timeline.to_dict() for out in finals]}


def _tokenizer_vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return getattr(tokenizer, "vocab_size", None)


def build_app(runtime: ServingRuntime, served_model_name: str | None = None,
              api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              pair_log: PairLog | None = None, enable_admin: bool = False,
              admin_key: str | None = None, max_instances: int | None = None,
              grammar_timeout: float = DEFAULT_TIMEOUT_S,
              grammar_workers: int = DEFAULT_WORKERS) -> FastAPI:
    """The FastAPI app serving ``runtime`` (already started) under ``served_model_name``
    (default: :func:`default_served_model_name` of the runtime's model, never a cache path).
    ``api_key`` protects every endpoint but ``/health``, ``/ping`` and ``/version``; bodies over
    ``max_request_bytes`` get a 413. With ``pair_log`` every choice that finishes (stop or
    length) is logged as a (prompt, output length) pair, the length predictor's training data
    (TetriInfer §3.3.2). ``/admin`` is served only with ``enable_admin`` or an ``admin_key``
    (which it then requires instead of ``api_key``), and adds instances up to
    ``max_instances`` in all (default: twice the instances running now). Output constraints
    compile in ``grammar_workers`` processes; one that takes over ``grammar_timeout`` seconds
    is a 400."""
    admin = enable_admin or bool(admin_key)
    if max_instances is None:
        max_instances = 2 * max(len(runtime.instance_status()), 1)
    if max_instances < 1:
        raise ValueError(f"max_instances must be >= 1, got {max_instances}")
    if grammar_workers < 1 or not grammar_timeout > 0:
        raise ValueError(f"grammar_workers must be >= 1 and grammar_timeout > 0, got "
                         f"{grammar_workers} and {grammar_timeout}")
    server = OpenAIServer(runtime, served_model_name or default_served_model_name(
        runtime.model_name), pair_log,
        {"workers": grammar_workers, "timeout": grammar_timeout})
    app = FastAPI(title="pdserve", description="OpenAI-compatible LLM serving",
                  version=__version__, default_response_class=LineSafeJSONResponse)
    app.openapi = partial(  # type: ignore[method-assign]
        _openapi, app, getattr(runtime, "vocab_size", None)
        or _tokenizer_vocab_size(runtime.tokenizer), runtime.max_model_len)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        r = APIError(exc.status_code, str(exc.detail)).response()
        r.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return r

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key or admin_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, admin_key=admin_key)

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest),
              responses=_responses(CompletionResponse, GENERATION_ERRORS, stream=True))
    async def completions(raw: Request) -> Response:
        return await server.completions(await server.parse(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest),
              responses=_responses(ChatCompletionResponse, GENERATION_ERRORS, stream=True))
    async def chat_completions(raw: Request) -> Response:
        return await server.chat(await server.parse(raw, ChatCompletionRequest), raw)

    @app.get("/v1/models", responses=_responses(None, (401,)))
    async def models() -> ModelList:
        return server.models()

    @app.post("/tokenize", openapi_extra=_request_body(TokenizeRequest),
              responses=_responses(None, (400, 401, 404, 413)))
    async def tokenize(raw: Request) -> TokenizeResponse:
        return await server.tokenize(await server.parse(raw, TokenizeRequest))

    @app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest),
              responses=_responses(None, (400, 401, 404, 413)))
    async def detokenize(raw: Request) -> DetokenizeResponse:
        return await server.detokenize(await server.parse(raw, DetokenizeRequest))

    @app.get("/health", responses=HEALTH)
    async def health() -> Response:
        return server.health()

    @app.api_route("/ping", methods=["GET", "POST"], responses=HEALTH)
    async def ping() -> Response:  # one route: a 405 lists both methods in Allow
        return server.health()

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=_responses(None, (401,)))
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if not admin:
        @app.api_route("/admin/{rest:path}", methods=["GET", "POST"], include_in_schema=False)
        async def admin_off(rest: str) -> Response:
            raise APIError(404, "the admin API is off; start the server with --enable-admin "
                                "or --admin-key-file")
        return app

    @app.get("/admin/instances", responses=_responses(None, (401,)))
    async def list_instances() -> dict[str, Any]:
        return {"instances": _instances(runtime)}

    @app.post("/admin/instances", openapi_extra=_request_body(AdminInstancesRequest),
              responses=_responses(None, (400, 401, 413, 503)))
    async def scale_instances(raw: Request) -> dict[str, Any]:
        try:
            body = AdminInstancesRequest.model_validate_json(await raw.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await admin_instances(runtime, body, max_instances)

    return app


@contextlib.asynccontextmanager
async def serve_locally(runtime: ServingRuntime, shutdown_runtime: bool = True,
                        **app_kwargs: Any) -> AsyncIterator[str]:
    """Serve ``runtime`` with uvicorn on a free port of 127.0.0.1 in this event loop (tests,
    benchmarks); yields the base URL. On exit the server stops and, with ``shutdown_runtime``,
    the runtime is shut down too."""
    import socket

    import uvicorn

    from pdserve.server.http import timed_h11  # lazy: uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(runtime, **app_kwargs),
                                           log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2, http=timed_h11()))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                raise RuntimeError("uvicorn did not start")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        if shutdown_runtime:
            await runtime.shutdown()
