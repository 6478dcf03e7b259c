"""The OpenAI/vLLM surface beyond one prompt and one sample: ``n``, prompt lists, ``echo``,
penalties, structured output, ``/ping``, ``/version``, ``Retry-After``, body limits, and the
event loop staying free while a tokenizer works."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from pdserve import __version__
from pdserve.grammar import json_object_regex, regex_for_choice, regex_for_schema
from pdserve.request import derive_seed
from pdserve.server import build_app
from tests.server.fakes import FakeRuntime
from tests.server.test_api import frames

COMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


class RecordingRuntime(FakeRuntime):
    """Records when each request was submitted (``time.time()``, the fake's clock)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.submit_times: dict[str, float] = {}

    def generate(self, request_id, prompt_token_ids, params, **kw):  # type: ignore[override]
        self.submit_times[request_id] = time.time()
        return super().generate(request_id, prompt_token_ids, params, **kw)


async def _client(runtime: FakeRuntime, **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(build_app(runtime, "m", **kw)),
                             base_url="http://t")


async def test_n_samples_share_the_prompt_and_derive_seeds() -> None:
    runtime = RecordingRuntime(token_delay=0.01)
    async with await _client(runtime) as c:
        r = await c.post(COMPL, json={"prompt": "abc", "max_tokens": 3, "n": 3, "seed": 7,
                                      "return_timeline": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert [ch["text"] for ch in body["choices"]] == ["def"] * 3
    # prompt tokens count once; completion tokens of every sample
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 9
    ids = [rid for rid, _, _ in runtime.submitted]
    assert ids == [f"{body['id']}-{i}" for i in range(3)]
    assert [p.seed for _, _, p in runtime.submitted] == [7, derive_seed(7, 1), derive_seed(7, 2)]
    assert len({p.seed for _, _, p in runtime.submitted}) == 3
    assert all(prompt == [1, 2, 3] for _, prompt, _ in runtime.submitted)
    # samples 1.. are submitted once sample 0 has its first token (its prompt KV is cached)
    first_token = body["timeline"]["choices"][0]["token_times"][0]
    assert all(runtime.submit_times[rid] >= first_token for rid in ids[1:])


async def test_n_without_seed_leaves_seeds_unset(client: httpx.AsyncClient,
                                                 runtime: FakeRuntime) -> None:
    r = await client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "n": 2})
    assert [ch["index"] for ch in r.json()["choices"]] == [0, 1]
    assert [p.seed for _, _, p in runtime.submitted] == [None, None]


async def test_prompt_list_with_n(client: httpx.AsyncClient, runtime: FakeRuntime) -> None:
    r = await client.post(COMPL, json={"prompt": ["abc", [5, 6]], "max_tokens": 2, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    # choice i * n + j is sample j of prompt i
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [
        (0, "de"), (1, "de"), (2, "gh"), (3, "gh")]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 8
    assert sorted(tuple(p) for _, p, _ in runtime.submitted) == [(1, 2, 3)] * 2 + [(5, 6)] * 2


async def test_streamed_choices(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "n": 2,
                                      "stream": True,
                                      "stream_options": {"include_usage": True}})
    fs = frames(r.content)
    assert fs[-1] == "[DONE]"
    assert fs[-2]["choices"] == [] and fs[-2]["usage"]["completion_tokens"] == 4
    by_index: dict[int, list[dict[str, Any]]] = {}
    for f in fs[:-2]:
        (ch,) = f["choices"]
        by_index.setdefault(ch["index"], []).append(ch)
    assert sorted(by_index) == [0, 1]
    for chunks in by_index.values():
        assert chunks[0]["delta"]["role"] == "assistant"
        assert all("role" not in ch["delta"] for ch in chunks[1:])
        assert [ch["finish_reason"] for ch in chunks] == [None, "length"]


async def test_client_gone_aborts_every_sample() -> None:
    runtime = FakeRuntime(token_delay=0.02)
    async with await _client(runtime) as c:
        task = asyncio.create_task(c.post(COMPL, json={"prompt": "abc", "max_tokens": 40,
                                                       "n": 3, "ignore_eos": True}))
        while len(runtime.submitted) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for _ in range(100):
        if not runtime.active:
            break
        await asyncio.sleep(0.01)
    assert not runtime.active and sorted(runtime.aborted) == sorted(
        rid for rid, _, _ in runtime.submitted)


async def test_echo(client: httpx.AsyncClient) -> None:
    r = await client.post(COMPL, json={"prompt": "abc", "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"] == "abcde"
    r = await client.post(COMPL, json={"prompt": [1, 2], "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"] == "abcd"
    r = await client.post(COMPL, json={"prompt": "abc", "max_tokens": 2, "echo": True,
                                       "stream": True})
    assert [f["choices"][0]["text"] for f in frames(r.content)[:-1]] == ["abcd", "e"]


async def test_penalties_and_bias_are_mapped(client: httpx.AsyncClient,
                                             runtime: FakeRuntime) -> None:
    r = await client.post(CHAT, json={
        "messages": MSGS, "max_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -1,
        "repetition_penalty": 1.2, "logit_bias": {"3": -100, "7": 2.5}, "best_of": 1,
        "tool_choice": "none", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    p = runtime.submitted[-1][2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1, 1.2)
    assert p.logit_bias == {3: -100.0, 7: 2.5} and p.guided_regex is None


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("extra", "regex"), [
    ({"guided_choice": ["yes", "no"]}, regex_for_choice(["yes", "no"])),
    ({"guided_regex": "[a-c]+"}, "[a-c]+"),
    ({"guided_json": SCHEMA}, regex_for_schema(SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, regex_for_schema(SCHEMA)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA}}},
     regex_for_schema(SCHEMA)),
    ({"response_format": {"type": "json_object"}}, json_object_regex()),
])
async def test_structured_output_is_passed_as_a_regex(client: httpx.AsyncClient,
                                                      runtime: FakeRuntime,
                                                      extra: dict[str, Any], regex: str) -> None:
    r = await client.post(COMPL, json={"prompt": "abc", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    assert runtime.submitted[-1][2].guided_regex == regex


async def test_ping_version_retry_after() -> None:
    runtime = FakeRuntime(token_delay=0.01, max_waiting=0)
    async with await _client(runtime) as c:
        assert (await c.get("/version")).json() == {"version": __version__}
        for method in ("GET", "POST"):
            r = await c.request(method, "/ping")
            assert r.status_code == 200 and r.json() == {}
        r = await c.post(COMPL, json={"prompt": "abc"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        runtime.alive = False
        assert (await c.get("/ping")).status_code == 503


async def test_body_limit_is_413() -> None:
    async with await _client(FakeRuntime(), max_request_bytes=1000) as c:
        r = await c.post(COMPL, json={"prompt": "a" * 2000})
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "larger than 1000 bytes" in r.json()["error"]["message"]

        async def chunked():  # no Content-Length: counted while it arrives
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"a" * 100
            yield b'"}'

        r = await c.post(COMPL, content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        r = await c.post(COMPL, json={"prompt": "abc", "max_tokens": 1})
        assert r.status_code == 200


class BlockingTokenizerRuntime(FakeRuntime):
    """A tokenizer whose every call blocks until :attr:`release` is set (like a long prompt);
    :attr:`calls` counts the calls."""

    def __init__(self) -> None:
        super().__init__(max_model_len=1024)
        self.release = threading.Event()
        self.calls = 0
        tok = self.tokenizer
        encode = tok.encode

        def blocking(text: str, add_special_tokens: bool = True) -> list[int]:
            self.calls += 1
            assert self.release.wait(30), "the test never released the tokenizer"
            return encode(text, add_special_tokens)

        tok.encode = blocking  # type: ignore[method-assign]


async def test_tokenization_does_not_block_the_loop() -> None:
    runtime = BlockingTokenizerRuntime()
    try:
        async with await _client(runtime) as c:
            long = "abc " * 100  # over INLINE_TEXT: tokenized on the worker thread
            slow = asyncio.create_task(c.post(COMPL, json={"prompt": long, "max_tokens": 1}))
            tok = asyncio.create_task(c.post("/tokenize", json={"prompt": long}))
            while runtime.calls < 1:  # an encode is under way (and blocked) off the loop
                await asyncio.sleep(0.01)
            # the loop answers while the encode blocks (the other waits its turn)
            assert (await c.get("/health")).status_code == 200
            assert not slow.done() and not tok.done()
            runtime.release.set()
            assert (await slow).status_code == 200 and (await tok).json()["count"] == 400
    finally:
        runtime.release.set()


async def test_too_many_characters_are_refused_without_tokenizing() -> None:
    runtime = BlockingTokenizerRuntime()
    try:
        async with await _client(runtime) as c:
            r = await c.post(COMPL, json={"prompt": "a" * 100_000})
            assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
            r = await c.post("/tokenize", json={"prompt": "a" * 100_000})
            assert r.status_code == 400
        assert runtime.calls == 0
    finally:
        runtime.release.set()
