"""Request and response bodies of the OpenAI-compatible API (pydantic 2).

Requests ignore unknown fields (as vLLM does) and check what a type cannot express in validators,
so that a bad value becomes a 400 naming its field. Value ranges of sampling fields are left to
:class:`~pdserve.request.SamplingParams`, whose ``ValueError`` the server turns into a 400 too.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.request import RequestOutput, SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _GenerationRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_timeline: bool = False
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                         "stop_token_ids")
            if getattr(self, name) is not None
        }
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, **kw)


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. ``prompt`` is a string, a list of token ids, or a one-element
    list of either."""

    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and (isinstance(v[0], (str, list))):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            v = v[0]
        if not isinstance(v, str) and not _is_token_list(v):
            raise ValueError("prompt must be a string, a list of token ids, or a one-element "
                             "list of either")
        return v

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ``ValueError`` naming the bad value."""
        return self._sampling_params(max_tokens, self.logprobs)


class ChatMessage(_Request):
    """One chat turn. ``content`` is a string or a list of ``{"type": "text", "text": ...}``
    parts (joined); other fields (``name``, ...) are passed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            parts = []
            for p in v:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError(f"only text content parts are supported, got "
                                     f"{p.get('type')!r}")
                parts.append(p["text"])
            return "".join(parts)
        return v

    def to_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        d.setdefault("content", "")
        return d


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (or the older ``max_tokens``)
    defaults to the rest of the context; ``logprobs`` is a flag and ``top_logprobs`` the number
    of alternatives."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ``ValueError`` naming the bad value."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class TokenizeRequest(_Request):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, and (same shape, as in OpenAI's API) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timeline: dict[str, Any] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    timeline: dict[str, Any] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant", "content": ...} first, then {"content": ...}
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    timeline: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str
    max_model_len: int
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


def dump_json(body: BaseModel, include_usage: bool = True) -> str:
    """Compact JSON of a response body. ``timeline`` appears only when set; ``usage`` (also when
    ``None``) only when ``include_usage``."""
    exclude = set()
    if not include_usage:
        exclude.add("usage")
    if getattr(body, "timeline", None) is None:
        exclude.add("timeline")
    return body.model_dump_json(exclude=exclude or None)


# ---------------------------------------------------------------------------------- shaping
class ResponseFormat:
    """Shapes one request's outputs into an endpoint's response bodies: id, ``created``, model
    name, usage and logprobs. ``top_logprobs`` is the request's ``SamplingParams.logprobs``."""

    prefix = "cmpl"
    prompt_field = "prompt"

    def __init__(self, model: str, tokenizer: Any, num_prompt_tokens: int,
                 top_logprobs: int | None) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.top_logprobs = top_logprobs

    def usage(self, out: RequestOutput) -> Usage:
        n, k = self.num_prompt_tokens, len(out.token_ids)
        return Usage(prompt_tokens=n, completion_tokens=k, total_tokens=n + k,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=out.num_cached_tokens))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def steps(self, out: RequestOutput, delta: bool) -> list[tuple[int, dict[int, float]]] | None:
        """``(token, {token: logprob})`` of the delta's new tokens (or of all tokens), or
        ``None`` when logprobs were not requested."""
        if self.top_logprobs is None or out.logprobs is None:
            return None
        end = len(out.token_ids)
        start = end - len(out.new_token_ids) if delta else 0
        return list(zip(out.token_ids[start:end], out.logprobs[start:end]))

    def top(self, d: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(d.items(), key=lambda kv: -kv[1])[: self.top_logprobs or 0]

    def chunk(self, out: RequestOutput, timeline: dict[str, Any] | None) -> BaseModel:
        """The stream chunk of one delta (``finish_reason`` set on the final one)."""
        raise NotImplementedError

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        """The stream's usage-only chunk (``choices: []``)."""
        raise NotImplementedError

    def response(self, out: RequestOutput, timeline: dict[str, Any] | None) -> BaseModel:
        """The non-streaming response for the final output."""
        raise NotImplementedError


class CompletionFormat(ResponseFormat):

    def _logprobs(self, steps: list[tuple[int, dict[int, float]]] | None,
                  offset: int) -> CompletionLogprobs | None:
        if steps is None:
            return None
        lp = CompletionLogprobs()
        for tok, d in steps:
            text = self.token_text(tok)
            lp.tokens.append(text)
            lp.token_logprobs.append(d.get(tok))
            lp.top_logprobs.append({self.token_text(t): v for t, v in self.top(d)})
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def _body(self, choices: list[CompletionChoice], usage: Usage | None,
              timeline: dict[str, Any] | None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=choices, usage=usage, timeline=timeline)

    def chunk(self, out: RequestOutput, timeline: dict[str, Any] | None) -> BaseModel:
        offset = len(out.text) - len(out.new_text)
        choice = CompletionChoice(text=out.new_text, finish_reason=out.finish_reason,
                                  logprobs=self._logprobs(self.steps(out, True), offset))
        return self._body([choice], None, timeline)

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        return self._body([], self.usage(out), None)

    def response(self, out: RequestOutput, timeline: dict[str, Any] | None) -> BaseModel:
        choice = CompletionChoice(text=out.text, finish_reason=out.finish_reason,
                                  logprobs=self._logprobs(self.steps(out, False), 0))
        return self._body([choice], self.usage(out), timeline)


class ChatFormat(ResponseFormat):
    prefix = "chatcmpl"
    prompt_field = "messages"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.role_sent = False

    def _entry(self, tok: int, lp: float | None) -> TopLogprob:
        text = self.token_text(tok)
        return TopLogprob(token=text, logprob=-9999.0 if lp is None else lp,
                          bytes=list(text.encode("utf-8")))

    def _logprobs(self, steps: list[tuple[int, dict[int, float]]] | None) -> ChatLogprobs | None:
        if steps is None:
            return None
        content = []
        for tok, d in steps:
            e = self._entry(tok, d.get(tok))
            content.append(ChatTokenLogprob(
                token=e.token, logprob=e.logprob, bytes=e.bytes,
                top_logprobs=[self._entry(t, v) for t, v in self.top(d)]))
        return ChatLogprobs(content=content)

    def chunk(self, out: RequestOutput, timeline: dict[str, Any] | None) -> BaseModel:
        delta = {"content": out.new_text}
        if not self.role_sent:  # the first content chunk carries the role; no role-only chunk
            delta = {"role": "assistant", **delta}
            self.role_sent = True
        choice = ChatStreamChoice(delta=delta, finish_reason=out.finish_reason,
                                  logprobs=self._logprobs(self.steps(out, True)))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[choice], timeline=timeline)

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[], usage=self.usage(out))

    def response(self, out: RequestOutput, timeline: dict[str, Any] | None) -> BaseModel:
        choice = ChatChoice(message=ChatResponseMessage(content=out.text),
                            finish_reason=out.finish_reason,
                            logprobs=self._logprobs(self.steps(out, False)))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=[choice], usage=self.usage(out), timeline=timeline)
