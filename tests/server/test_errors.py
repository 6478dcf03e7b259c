"""Every bad input gets the right status and an OpenAI error object."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pdserve.server import build_app
from tests.server.fakes import FakeRuntime

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, type_: str, param: str | None,
                 contains: str = "") -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (type_, param, status), err
    assert contains in err["message"], err["message"]


@pytest.mark.parametrize(("path", "body", "param", "contains"), [
    (COMPL, {"prompt": ""}, "prompt", "prompt is empty"),
    (COMPL, {"prompt": []}, "prompt", "prompt is empty"),
    (COMPL, {"prompt": "abc", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    (COMPL, {"prompt": "abc", "temperature": -1}, "temperature", "temperature must be >= 0"),
    (COMPL, {"prompt": "abc", "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    (COMPL, {"prompt": "abc", "top_k": -2}, "top_k", "top_k"),
    (COMPL, {"prompt": "abc", "min_p": 2}, "min_p", "min_p"),
    (COMPL, {"prompt": "abc", "logprobs": -1}, "logprobs", "logprobs"),
    (COMPL, {"prompt": "abc", "min_tokens": 20}, "min_tokens", "must be <= max_tokens"),
    (COMPL, {"prompt": "abc", "stop": [""]}, "stop", "non-empty"),
    (COMPL, {"prompt": "abc", "stop": 5}, "stop", "stop"),
    (COMPL, {"prompt": "abc", "n": 0}, "n", "n must be in [1, 128]"),
    (COMPL, {"prompt": ["abc"] * 3, "n": 50}, "prompt", "prompt count × n must be <= 128"),
    (COMPL, {"prompt": "abc", "best_of": 2}, "best_of", "best_of > 1 is not supported"),
    (COMPL, {"prompt": "abc", "suffix": "x"}, "suffix", "suffix"),
    (COMPL, {"prompt": "abc", "logprobs": 6}, "logprobs", "logprobs must be <= 5"),
    (COMPL, {"prompt": "abc", "echo": True, "logprobs": 1}, "logprobs",
     "cannot be combined with echo"),
    (COMPL, {"prompt": "abc", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    (COMPL, {"prompt": "abc", "frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    (COMPL, {"prompt": "abc", "repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    (COMPL, {"prompt": "abc", "logit_bias": {"3": 200}}, "logit_bias", "[-100, 100]"),
    (COMPL, {"prompt": "abc", "logit_bias": {"tok": 2}}, "logit_bias", "token ids"),
    (COMPL, {"prompt": "abc", "logit_bias": {"9999": 2}}, "logit_bias", "outside the vocab"),
    (COMPL, {"prompt": "abc", "guided_grammar": "root ::= x"}, "guided_grammar",
     "not supported"),
    (COMPL, {"prompt": "abc", "guided_regex": "a(", "max_tokens": 2}, "guided_regex",
     "cannot compile"),
    (COMPL, {"prompt": "abc", "guided_regex": "a", "guided_choice": ["b"]}, "response_format",
     "at most one"),
    (COMPL, {"prompt": "abc", "guided_choice": []}, "guided_choice", "non-empty"),
    (COMPL, {"prompt": "abc", "guided_regex": "x{5000}"}, "guided_regex", "at most 2000"),
    (COMPL, {"prompt": "abc", "guided_json": {"type": "string", "maxLength": 100000}},
     "guided_json", "at most 2000"),
    (COMPL, {"prompt": "abc", "guided_json": {"type": "nonsense"}}, "guided_json",
     "unsupported JSON schema"),
    (COMPL, {"prompt": "abc", "response_format": {"type": "xml"}}, "response_format",
     "response_format type"),
    (COMPL, {"prompt": "abc", "response_format": {"type": "json_schema"}}, "response_format",
     "json_schema"),
    (COMPL, {"prompt": "a\ud800b"}, None, "not valid Unicode"),
    (COMPL, {"prompt": "abc", "max_tokens": "many"}, "max_tokens", "integer"),
    (COMPL, {"prompt": "a" * 64}, "prompt", "maximum context length is 64"),
    (COMPL, {"prompt": "a" * 60, "max_tokens": 10}, "max_tokens",
     "you requested 70 tokens (60 in the prompt, 10 for the completion)"),
    (COMPL, {"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
    (COMPL, {"prompt": ["a", ""]}, "prompt", "prompt is empty"),
    (COMPL, {"prompt": ["a", 3]}, "prompt", "prompt must be a string"),
    (COMPL, {"prompt": "x" * 5000}, "prompt", "more than that many tokens can hold"),
    (COMPL, {"prompt": 3}, "prompt", "prompt must be a string"),
    (COMPL, {"max_tokens": 3}, "prompt", "'prompt' is required"),
    (CHAT, {"messages": []}, "messages", "messages"),
    (CHAT, {}, "messages", "'messages' is required"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages", "'messages[0].role' is required"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "only text content"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_tokens must be"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    (CHAT, {"messages": MSGS, "n": 129}, "n", "n must be in [1, 128]"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be in [0, 20]"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, "tools", "not supported"),
    (CHAT, {"messages": MSGS, "tool_choice": "auto"}, "tool_choice", "not supported"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages",
     "role must be one of"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages", "role must be one of"),
    (CHAT, {"messages": [{"role": "user", "content": "\udfff"}]}, None, "not valid Unicode"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 70}]}, "messages",
     "maximum context length"),
    (CHAT, {"messages": MSGS, "max_tokens": 60}, "max_tokens", "maximum context length"),
])
async def test_bad_values_are_400(client: httpx.AsyncClient, runtime: FakeRuntime, path: str,
                                  body: dict[str, Any], param: str, contains: str) -> None:
    # json.dumps escapes lone surrogates (httpx's json= cannot encode them)
    r = await client.post(path, content=json.dumps(body),
                          headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_request_error", param, contains)
    assert r.json()["error"]["code"] == 400
    assert not runtime.active


@pytest.mark.parametrize("path", [COMPL, CHAT])
@pytest.mark.parametrize("content", [b'{"prompt": "abc",', b"not json", b"", b"[1, 2]",
                                     b'"abc"'])
async def test_malformed_bodies_are_400(client: httpx.AsyncClient, path: str,
                                        content: bytes) -> None:
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_request_error", None)


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    r = await client.post(COMPL, json={"model": "gpt-4", "prompt": "abc"})
    assert_error(r, 404, "not_found_error", "model", "`gpt-4` does not exist")
    r = await client.post(CHAT, json={"model": "gpt-4", "messages": MSGS, "stream": True})
    assert_error(r, 404, "not_found_error", "model")


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404, "not_found_error", None)
    assert_error(await client.get(COMPL), 405, "invalid_request_error", None)


@pytest.mark.parametrize("stream", [False, True])
async def test_queue_full_is_429(stream: bool) -> None:
    runtime = FakeRuntime(token_delay=0.01, max_waiting=1)
    app = build_app(runtime)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        first = asyncio.create_task(c.post(COMPL, json={"prompt": "abc", "max_tokens": 20}))
        while not runtime.active:
            await asyncio.sleep(0.001)
        r = await c.post(COMPL, json={"prompt": "abc", "stream": stream})
        assert_error(r, 429, "rate_limit_error", None, "retry later")
        assert (await first).status_code == 200
        assert (await c.post(COMPL, json={"prompt": "abc"})).status_code == 200


async def test_api_key() -> None:
    app = build_app(FakeRuntime(), "m", api_key="sekrit")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        body = {"prompt": "abc", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sekrit"}):
            assert_error(await c.post(COMPL, json=body, headers=headers), 401,
                         "authentication_error", None, "API key")
        assert_error(await c.get("/v1/models"), 401, "authentication_error", None)
        # a bad body without a key is still a 401, not a 400
        r = await c.post(COMPL, content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 401
        ok = {"Authorization": "Bearer sekrit"}
        assert (await c.post(COMPL, json=body, headers=ok)).status_code == 200
        assert (await c.get("/v1/models", headers=ok)).status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics", headers=ok)).status_code == 200


def test_error_body_is_compact_json() -> None:
    from pdserve.server.app import APIError

    body = json.loads(APIError(429, "busy").body())
    assert body == {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                              "code": 429}}


async def test_chat_without_template_is_400(client: httpx.AsyncClient,
                                            runtime: FakeRuntime) -> None:
    runtime.tokenizer.chat_template = None
    r = await client.post(CHAT, json={"messages": MSGS})
    assert_error(r, 400, "invalid_request_error", "messages", "no chat template")


async def test_runtime_validating_lazily(client: httpx.AsyncClient,
                                         runtime: FakeRuntime) -> None:
    """A runtime that raises at the first iteration: 400/429 when not streaming, an error chunk
    with the same code when streaming (the 200 headers are gone by then)."""
    runtime.lazy = True
    assert_error(await client.post(COMPL, json={"prompt": ""}), 400, "invalid_request_error",
                 "prompt", "prompt is empty")
    runtime.max_waiting = 0
    assert_error(await client.post(CHAT, json={"messages": MSGS}), 429, "rate_limit_error",
                 None)
    r = await client.post(CHAT, json={"messages": MSGS, "stream": True})
    assert r.status_code == 200
    assert r.content.split(b"\n\n")[1:] == [b"data: [DONE]", b""]
    assert json.loads(r.content.split(b"\n\n")[0][6:])["error"]["code"] == 429
    runtime.max_waiting = None
    assert (await client.post(COMPL, json={"prompt": "abc"})).status_code == 200


@pytest.mark.parametrize("path", [COMPL, CHAT])
async def test_a_client_gone_before_its_body_is_answered_not_a_crash(path: str) -> None:
    """A client that disconnects before its body arrives (a soak's cancelled requests do) is
    answered like any bad input; the ASGI application does not raise (uvicorn logged each one
    as 'Exception in ASGI application' with a traceback)."""
    app = build_app(FakeRuntime(), "m")
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "server": ("test", 80),
             "client": ("127.0.0.1", 1), "headers": [(b"content-type", b"application/json"),
                                                     (b"content-length", b"100")]}
    await app(scope, receive, send)  # raised ClientDisconnect before the fix
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert "closed the connection" in body["error"]["message"]
