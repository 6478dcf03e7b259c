"""Request and response bodies of the OpenAI-compatible API (pydantic 2).

Requests ignore unknown fields (as vLLM does) and check what a type cannot express in validators,
so that a bad value becomes a 400 naming its field. Value ranges of sampling fields are left to
:class:`~pdserve.request.SamplingParams`, whose ``ValueError`` the server turns into a 400 too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from pdserve.request import SamplingParams

MAX_CHOICES = 128  # n × prompts per request
# Admission bounds (a 400 naming the limit; docs/api.md). OpenAI caps ``stop`` at 4 strings;
# pdserve allows 16 (vLLM has no cap) of at most 1,024 characters: every new token is checked
# against each of them, so a request with 700,000 slowed every other on its instance 20x.
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096  # chat turns per request (checked before the template runs)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap for /v1/completions ``logprobs``
MAX_TOP_LOGPROBS = 20  # OpenAI's cap for chat ``top_logprobs``
CHAT_ROLES = ("system", "developer", "user", "assistant")


# The JSON schema each field states (OpenAPI, fuzzers): the rules the validators below and
# SamplingParams enforce, whose messages name the field; the schema only says them.
# a token id: the app's OpenAPI schema bounds it by the model's vocabulary
TOKEN_ID = {"type": "integer", "minimum": 0, "x-token-id": True}
# a prompt's token ids / a completion's token budget: bounded by max_model_len (the same way)
PROMPT_IDS = {"type": "array", "minItems": 1, "items": TOKEN_ID, "x-prompt": True}


def _or_null(**kw: Any) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [kw, {"type": "null"}]})


def _num(**kw: Any) -> WithJsonSchema:
    return _or_null(type="number", **kw)


def _int(**kw: Any) -> WithJsonSchema:
    return _or_null(type="integer", **kw)


def find_lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) in a JSON value that is not valid Unicode (a lone
    surrogate such as ``"\\ud800"``), or ``None``. Iterative: any nesting depth."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if find_lone_surrogate(data) is not None:
            raise ValueError("the request contains a string that is not valid Unicode (a lone "
                             "UTF-16 surrogate); send UTF-8 text")
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class _GenerationRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM's extras).

    What pdserve does not implement is refused with a 400 rather than ignored: ``best_of > 1``,
    tools and function calling, ``guided_grammar``."""

    model: str | None = None
    temperature: Annotated[float | None, _num(minimum=0, maximum=1e6)] = None
    top_p: Annotated[float | None, _num(exclusiveMinimum=0, maximum=1)] = None
    top_k: Annotated[int | None, _int(minimum=-1)] = None
    min_p: Annotated[float | None, _num(minimum=0, maximum=1)] = None
    seed: int | None = None
    stop: (Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
           | Annotated[list[Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]],
                       Field(max_length=MAX_STOP)]
           | None) = None
    stop_token_ids: Annotated[list[int] | None, _or_null(
        type="array", maxItems=MAX_STOP_TOKEN_IDS, items={"type": "integer", "minimum": 0})] \
        = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0})] = 0
    n: Annotated[int, WithJsonSchema({"type": "integer", "minimum": 1,
                                      "maximum": MAX_CHOICES})] = 1
    best_of: Annotated[int | None, WithJsonSchema({"anyOf": [{"const": 1},
                                                             {"type": "null"}]})] = None
    presence_penalty: Annotated[float | None, _num(minimum=-2, maximum=2)] = None
    frequency_penalty: Annotated[float | None, _num(minimum=-2, maximum=2)] = None
    repetition_penalty: Annotated[float | None, _num(exclusiveMinimum=0, maximum=100)] = None
    logit_bias: Annotated[dict[str, float] | None, _or_null(
        type="object", maxProperties=300, propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100})] = None
    response_format: Annotated[dict[str, Any] | None, _or_null(
        type="object", required=["type"], properties={
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["schema"],
                            "properties": {"name": {"type": "string"},
                                           "schema": {"type": "object"}}}})] = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: Annotated[str | None, _or_null(type="string", minLength=1)] = None
    guided_choice: Annotated[list[str] | None, _or_null(
        type="array", minItems=1, items={"type": "string", "minLength": 1})] = None
    guided_grammar: Annotated[str | None, WithJsonSchema({"type": "null"})] = None
    tools: Annotated[list[Any] | None, _or_null(type="array", maxItems=0)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(
        {"anyOf": [{"const": "none"}, {"type": "null"}]})] = None
    functions: Annotated[list[Any] | None, _or_null(type="array", maxItems=0)] = None
    function_call: Annotated[str | dict[str, Any] | None, WithJsonSchema(
        {"anyOf": [{"const": "none"}, {"type": "null"}]})] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_timeline: bool = False
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {v}")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"best_of > 1 is not supported (got {v}); use n to get several "
                             "samples")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tools and function calling are not supported by this server")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v is not None and v != "none":
            raise ValueError(f"tool_choice {v!r} is not supported (only 'none'); this server "
                             "has no tool calling")
        return v

    @field_validator("guided_grammar")
    @classmethod
    def _no_grammar(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("guided_grammar is not supported; use guided_json, guided_regex, "
                             "guided_choice or response_format")
        return v

    @field_validator("guided_choice")
    @classmethod
    def _choices_given(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or any(not c for c in v)):
            raise ValueError("guided_choice must be a non-empty list of non-empty strings")
        return v

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kind = v.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type must be 'text', 'json_object' or "
                             f"'json_schema', got {kind!r}")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs {'json_schema': {'name': "
                                 "..., 'schema': {...}}}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def output_constraint(self) -> tuple[str, Any] | None:
        """``(kind, spec)`` of the structured-output request: ``('json', schema dict or text)``,
        ``('json_object', None)``, ``('regex', text)`` or ``('choice', list)``; ``None`` for
        free text. Raises ``ValueError`` when more than one is given."""
        found: list[tuple[str, Any]] = []
        rf = self.response_format
        if rf is not None and rf.get("type") == "json_object":
            found.append(("json_object", None))
        elif rf is not None and rf.get("type") == "json_schema":
            found.append(("json", rf["json_schema"]["schema"]))
        if self.guided_json is not None:
            found.append(("json", self.guided_json))
        if self.guided_regex is not None:
            found.append(("regex", self.guided_regex))
        if self.guided_choice is not None:
            found.append(("choice", self.guided_choice))
        if len(found) > 1:
            raise ValueError("give at most one of response_format (json), guided_json, "
                             "guided_regex and guided_choice")
        return found[0] if found else None

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         guided_regex: str | None) -> SamplingParams:
        kw: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                         "stop_token_ids", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "logit_bias")
            if getattr(self, name) is not None
        }
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            guided_regex=guided_regex, **kw)


def _few_messages(v: Any) -> Any:
    """Refuse too many chat turns by count, before any of them is validated."""
    if isinstance(v, list) and len(v) > MAX_MESSAGES:
        raise ValueError(f"messages has {len(v)} turns, more than the {MAX_MESSAGES} a request "
                         "may have")
    return v


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _at_most_one_constraint() -> list[dict[str, Any]]:
    """JSON schema: at most one of the structured-output fields is set (``anyOf`` of "all
    but this one are null or absent")."""
    names = ["guided_json", "guided_regex", "guided_choice"]

    def unset(name: str) -> dict[str, Any]:
        return {"anyOf": [{"not": {"required": [name]}},
                          {"properties": {name: {"type": "null"}}}]}

    rf_free = {"anyOf": [{"not": {"required": ["response_format"]}},
                         {"properties": {"response_format": {"anyOf": [
                             {"type": "null"},
                             {"properties": {"type": {"const": "text"}}}]}}}]}
    cases = [{"allOf": [rf_free, *(unset(m) for m in names if m != n)]} for n in names]
    cases.append({"allOf": [unset(m) for m in names]})
    return cases


def _needs(field: str, flag: str, value: Any) -> dict[str, Any]:
    """JSON schema: ``field`` (when set) needs ``flag`` to be ``value``."""
    return {"anyOf": [{"not": {"required": [field]}},
                      {"properties": {field: {"type": "null"}}},
                      {"required": [flag], "properties": {flag: {"const": value}}}]}


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. ``prompt`` is a string, a list of token ids, or a list of
    either (one choice per prompt and sample: choice ``i * n + j`` is sample ``j`` of prompt
    ``i``). ``echo`` prepends the prompt to the text; ``suffix`` is refused."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"anyOf": _at_most_one_constraint()},
        {"anyOf": [{"not": {"required": ["echo"]}}, {"properties": {"echo": {"const": False}}},
                   {"not": {"required": ["logprobs"]}},
                   {"properties": {"logprobs": {"type": "null"}}}]}]})

    prompt: Annotated[str | list[int] | list[str | list[int]], WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        PROMPT_IDS,
        {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"anyOf": [
            {"type": "string", "minLength": 1},
            PROMPT_IDS]}}]})]
    max_tokens: Annotated[int | None, _int(minimum=1, **{"x-budget": True})] = 16
    logprobs: Annotated[int | None, _int(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)] = None
    echo: bool = False
    suffix: Annotated[str | None, _or_null(type="string", maxLength=0)] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if not all(isinstance(p, str) or _is_token_list(p) for p in v):
                raise ValueError("prompt must be a string, a list of token ids, or a list of "
                                 "either")
            return v
        if not isinstance(v, str) and not _is_token_list(v):
            raise ValueError("prompt must be a string, a list of token ids, or a list of "
                             "either")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported by this server")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_cap(cls, v: int | None) -> int | None:
        if v is not None and v > MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"logprobs must be <= {MAX_COMPLETION_LOGPROBS}, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("logprobs cannot be combined with echo (prompt logprobs are not "
                             "computed); drop one of them")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"prompt count × n must be <= {MAX_CHOICES}, got "
                             f"{len(self.prompts)} × {self.n}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or _is_token_list(p):
            return [p]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, max_tokens: int, guided_regex: str | None = None
                           ) -> SamplingParams:
        """Raises ``ValueError`` naming the bad value."""
        return self._sampling_params(max_tokens, self.logprobs, guided_regex)


class ChatMessage(_Request):
    """One chat turn. ``content`` is a string or a list of ``{"type": "text", "text": ...}``
    parts (joined); other fields (``name``, ...) are passed to the chat template. Roles:
    ``system``, ``developer``, ``user``, ``assistant`` (no tool messages: no tool calling)."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[str, WithJsonSchema({"enum": list(CHAT_ROLES)})]
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"},
                                                   "text": {"type": "string"}}}},
        {"type": "null"}]})] = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {v!r}")
        return v

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
    of alternatives (at most 20)."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"anyOf": _at_most_one_constraint()}, _needs("top_logprobs", "logprobs", True)]})

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Annotated[int | None, _int(minimum=1, **{"x-budget": True})] = None
    max_completion_tokens: Annotated[int | None, _int(minimum=1, **{"x-budget": True})] \
        = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, _int(minimum=0, maximum=MAX_TOP_LOGPROBS)] = None

    _messages_count = field_validator("messages", mode="before")(_few_messages)

    @field_validator("top_logprobs")
    @classmethod
    def _top_cap(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
        return v

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

    def to_sampling_params(self, max_tokens: int, guided_regex: str | None = None
                           ) -> SamplingParams:
        """Raises ``ValueError`` naming the bad value."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, guided_regex)


class TokenizeRequest(_Request):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None \
        = None
    add_special_tokens: bool = True

    _messages_count = field_validator("messages", mode="before")(_few_messages)

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Annotated[list[int], WithJsonSchema(
        {"type": "array", "items": TOKEN_ID})]


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
    vocab_size: int | None = None  # pdserve's addition: benchmark clients draw token ids below it
    num_gpus: int | None = None  # pdserve's addition: the deployment's devices (per-GPU numbers)
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


# Characters that JSON allows raw inside strings but that some line readers take for line ends
# (Python's str.splitlines, JavaScript before ES2019): written as \u escapes, as most servers do.
_LINE_SEPARATORS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028",
                                  "\u2029": "\\u2029"})


def escape_line_separators(json_text: str) -> str:
    """``json_text`` with U+0085, U+2028 and U+2029 written as ``\\uXXXX`` escapes (they can
    occur only inside JSON strings, where the escape means the same character)."""
    return json_text.translate(_LINE_SEPARATORS)


def dump_json(body: BaseModel, include_usage: bool = True) -> str:
    """Compact JSON of a response body (line separators escaped:
    :func:`escape_line_separators`). ``timeline`` appears only when set; ``usage`` (also when
    ``None``) only when ``include_usage``."""
    exclude = set()
    if not include_usage:
        exclude.add("usage")
    if getattr(body, "timeline", None) is None:
        exclude.add("timeline")
    return escape_line_separators(body.model_dump_json(exclude=exclude or None))
