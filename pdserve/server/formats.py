"""Shaping one request's outputs into an endpoint's response bodies (completions and chat,
whole or as stream chunks): ids, usage, logprobs, echo, one choice per prompt and sample."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel

from pdserve.request import RequestOutput
from pdserve.server.openai_types import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)


class ResponseFormat:
    """Shapes one request's outputs into an endpoint's response bodies: id, ``created``, model
    name, usage and logprobs. A request has one choice per prompt and sample; choice ``index``
    is sample ``index % n`` of prompt ``index // n``. ``top_logprobs`` is the request's
    ``SamplingParams.logprobs``; ``echo`` (completions) holds each prompt's text to prepend."""

    prefix = "cmpl"
    prompt_field = "prompt"

    def __init__(self, model: str, tokenizer: Any, prompt_lens: list[int], n: int,
                 top_logprobs: int | None, echo: list[str] | None = None) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_lens = prompt_lens
        self.n = n
        self.top_logprobs = top_logprobs
        self.echo = echo
        self.started: set[int] = set()

    @property
    def num_choices(self) -> int:
        return len(self.prompt_lens) * self.n

    def usage(self, finals: list[RequestOutput]) -> Usage:
        """Prompt tokens count once per prompt (its samples share them); cached tokens are
        those of each prompt's first sample."""
        n = sum(self.prompt_lens)
        k = sum(len(out.token_ids) for out in finals)
        cached = sum(out.num_cached_tokens for i, out in enumerate(finals) if i % self.n == 0)
        return Usage(prompt_tokens=n, completion_tokens=k, total_tokens=n + k,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

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

    def first_delta(self, index: int) -> bool:
        """True the first time it is asked for ``index``."""
        if index in self.started:
            return False
        self.started.add(index)
        return True

    def chunk(self, index: int, out: RequestOutput, timeline: dict[str, Any] | None
              ) -> BaseModel:
        """The stream chunk of one delta of choice ``index`` (``finish_reason`` set on its
        final one)."""
        raise NotImplementedError

    def usage_chunk(self, finals: list[RequestOutput]) -> BaseModel:
        """The stream's usage-only chunk (``choices: []``)."""
        raise NotImplementedError

    def response(self, finals: list[RequestOutput], timeline: dict[str, Any] | None
                 ) -> BaseModel:
        """The non-streaming response for the final outputs, in choice order."""
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

    def chunk(self, index: int, out: RequestOutput, timeline: dict[str, Any] | None
              ) -> BaseModel:
        offset = len(out.text) - len(out.new_text)
        text = out.new_text
        if self.echo is not None and self.first_delta(index):
            text = self.echo[index // self.n] + text
        choice = CompletionChoice(index=index, text=text, finish_reason=out.finish_reason,
                                  logprobs=self._logprobs(self.steps(out, True), offset))
        return self._body([choice], None, timeline)

    def usage_chunk(self, finals: list[RequestOutput]) -> BaseModel:
        return self._body([], self.usage(finals), None)

    def response(self, finals: list[RequestOutput], timeline: dict[str, Any] | None
                 ) -> BaseModel:
        choices = []
        for i, out in enumerate(finals):
            text = out.text if self.echo is None else self.echo[i // self.n] + out.text
            choices.append(CompletionChoice(
                index=i, text=text, finish_reason=out.finish_reason,
                logprobs=self._logprobs(self.steps(out, False), 0)))
        return self._body(choices, self.usage(finals), timeline)


class ChatFormat(ResponseFormat):
    prefix = "chatcmpl"
    prompt_field = "messages"

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

    def chunk(self, index: int, out: RequestOutput, timeline: dict[str, Any] | None
              ) -> BaseModel:
        delta = {"content": out.new_text}
        if self.first_delta(index):  # a choice's first chunk carries the role
            delta = {"role": "assistant", **delta}
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=out.finish_reason,
                                  logprobs=self._logprobs(self.steps(out, True)))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[choice], timeline=timeline)

    def usage_chunk(self, finals: list[RequestOutput]) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[], usage=self.usage(finals))

    def response(self, finals: list[RequestOutput], timeline: dict[str, Any] | None
                 ) -> BaseModel:
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=out.text),
                              finish_reason=out.finish_reason,
                              logprobs=self._logprobs(self.steps(out, False)))
                   for i, out in enumerate(finals)]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=choices, usage=self.usage(finals),
                                      timeline=timeline)
