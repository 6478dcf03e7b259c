"""No single request can block the event loop or slow everyone: admission-time bounds (stop
strings, chat turns and characters, logprob entries, choices against the queue bound), large
bodies parsed and large responses built off the loop. Count- and event-based: no wall clock."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest

import pdserve.server.app as app_module
from pdserve.server import build_app
from pdserve.server.formats import ChatFormat
from pdserve.server.openai_types import MAX_MESSAGES, MAX_STOP
from tests.server.fakes import FakeRuntime

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def _client(runtime: FakeRuntime, **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(build_app(runtime, "m", **kw)),
                             base_url="http://t")


def _error(r: httpx.Response, status: int, param: str | None, contains: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and contains in err["message"], err


async def test_700k_stop_strings_are_refused() -> None:
    runtime = FakeRuntime()
    async with _client(runtime) as c:
        r = await c.post(COMPL, content=json.dumps({"prompt": "abc", "stop": ["x"] * 700_000}),
                         headers={"content-type": "application/json"})
        _error(r, 400, "stop", f"at most {MAX_STOP} items")
        r = await c.post(COMPL, json={"prompt": "abc", "stop": ["x" * 5000]})
        _error(r, 400, "stop", "1024 characters")
        ok = await c.post(COMPL, json={"prompt": "abc", "stop": ["q"] * MAX_STOP})
        assert ok.status_code == 200, ok.text
    assert len(runtime.submitted) == 1


class CountingTokenizer:
    """Counts chat-template calls of the fake's tokenizer."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.calls = 0
        real = runtime.tokenizer.apply_chat_template

        def counted(*a: Any, **kw: Any) -> Any:
            self.calls += 1
            return real(*a, **kw)

        runtime.tokenizer.apply_chat_template = counted  # type: ignore[method-assign]


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
async def test_200k_one_character_messages_are_refused_before_the_template(path: str) -> None:
    runtime = FakeRuntime()
    tok = CountingTokenizer(runtime)
    many = [{"role": "user", "content": "a"}] * 200_000
    async with _client(runtime) as c:
        r = await c.post(path, content=json.dumps({"messages": many}),
                         headers={"content-type": "application/json"})
        _error(r, 400, "messages", f"more than the {MAX_MESSAGES}")
        # under the count, over the characters max_model_len tokens can hold (64 x 4)
        r = await c.post(path, json={"messages": [{"role": "user", "content": "b" * 100}] * 3})
        _error(r, 400, "messages", "300 characters together")
        assert tok.calls == 0
        r = await c.post(path, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and tok.calls == 1, r.text


async def test_n_times_max_tokens_times_logprobs_is_bounded() -> None:
    runtime = FakeRuntime(max_model_len=4096)
    async with _client(runtime) as c:
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 128,
                                     "logprobs": True, "top_logprobs": 20, "max_tokens": 1000})
        _error(r, 400, "top_logprobs", "128 × 1000 × 21 = 2688000")
        r = await c.post(COMPL, json={"prompt": ["ab", "cd"], "n": 64, "logprobs": 5,
                                      "max_tokens": 1000})
        _error(r, 400, "logprobs", "128 × 1000 × 6")
        assert runtime.submitted == []
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                     "logprobs": True, "top_logprobs": 2, "max_tokens": 3})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
async def test_n_beyond_the_queue_bound_is_a_400_at_once(stream: bool) -> None:
    runtime = FakeRuntime(max_waiting=4)
    async with _client(runtime) as c:
        r = await c.post(COMPL, json={"prompt": "abc", "n": 5, "stream": stream})
        _error(r, 400, "n", "more than the 4 requests the server queues")
        r = await c.post(COMPL, json={"prompt": ["ab", "cd", "ef"], "n": 2, "stream": stream})
        _error(r, 400, "n", "6 choices")
    assert runtime.submitted == []  # refused before any sample ran


async def test_a_429_is_decided_before_any_sample_runs() -> None:
    runtime = FakeRuntime(max_waiting=4, token_delay=0.01)
    async with _client(runtime) as c:
        busy = [asyncio.create_task(c.post(COMPL, json={"prompt": "abc", "max_tokens": 40}))
                for _ in range(2)]
        while len(runtime.active) < 2:
            await asyncio.sleep(0.001)
        r = await c.post(COMPL, json={"prompt": "abc", "n": 3, "max_tokens": 2})
        _error(r, 429, None, "retry later")
        assert r.headers["retry-after"] == "1"
        assert len(runtime.submitted) == 2  # none of the refused request's samples ran
        for t in busy:
            assert (await t).status_code == 200
        r = await c.post(COMPL, json={"prompt": "abc", "n": 4, "max_tokens": 2})  # all fit
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


async def test_health_is_answered_while_a_large_response_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The response body is built off the loop: with its building held, ``/health`` is
    answered, which releases it."""
    building, release, released = threading.Event(), threading.Event(), []
    real = ChatFormat.response

    def held(self: ChatFormat, *a: Any) -> Any:
        building.set()
        released.append(release.wait(30))  # on the loop, this would stall /health
        return real(self, *a)

    monkeypatch.setattr(ChatFormat, "response", held)
    async with _client(FakeRuntime()) as c:
        task = asyncio.create_task(c.post(CHAT, json={
            "messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 4,
            "logprobs": True, "top_logprobs": 5}))
        while not building.is_set():
            await asyncio.sleep(0.001)
        assert (await c.get("/health")).status_code == 200
        release.set()
        r = await task
    assert r.status_code == 200 and released == [True]
    assert len(r.json()["choices"]) == 8


async def test_health_is_answered_while_a_large_body_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A body over ``INLINE_BODY`` bytes (a long token-id prompt) is parsed and validated off
    the loop."""
    parsing, release, released = threading.Event(), threading.Event(), []
    real = app_module._validate

    def held(model: Any, data: bytes) -> Any:
        if len(data) > app_module.INLINE_BODY:
            parsing.set()
            released.append(release.wait(30))
        return real(model, data)

    monkeypatch.setattr(app_module, "_validate", held)
    runtime = FakeRuntime(max_model_len=1 << 16)
    async with _client(runtime) as c:
        task = asyncio.create_task(c.post(COMPL, json={"prompt": [5] * 40_000,
                                                       "max_tokens": 1}))
        while not parsing.is_set():
            await asyncio.sleep(0.001)
        assert (await c.get("/health")).status_code == 200
        release.set()
        r = await task
    assert r.status_code == 200 and released == [True], r.text
