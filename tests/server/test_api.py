"""Endpoints over the fake runtime, in process (httpx ASGI transport)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pdserve.server import build_app
from tests.server.conftest import MODEL
from tests.server.fakes import ALPHABET, FakeRuntime


def frame(obj: Any) -> bytes:
    """One SSE frame as the server must write it: compact JSON, no spaces, blank line after."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def frames(body: bytes) -> list[Any]:
    assert body.endswith(b"\n\n")
    out = []
    for f in body[:-2].split(b"\n\n"):
        assert f.startswith(b"data: "), f
        data = f[len(b"data: "):].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_completion(client: httpx.AsyncClient, runtime: FakeRuntime) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                  "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": "def", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert "timeline" not in body
    assert runtime.finished and not runtime.aborted


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["abc"], [[1, 2, 3]]])
async def test_completion_prompt_forms(client: httpx.AsyncClient, runtime: FakeRuntime,
                                       prompt: Any) -> None:
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "de"
    assert runtime.submitted[-1][1] == [1, 2, 3]


async def test_default_max_tokens_is_16(client: httpx.AsyncClient, runtime: FakeRuntime) -> None:
    r = await client.post("/v1/completions", json={"prompt": "a"})
    assert r.json()["usage"]["completion_tokens"] == 16
    assert runtime.submitted[-1][2].max_tokens == 16


async def test_sampling_fields_are_mapped(client: httpx.AsyncClient,
                                          runtime: FakeRuntime) -> None:
    r = await client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
        "min_p": 0.1, "seed": 42, "stop": "zz", "stop_token_ids": [9], "ignore_eos": True,
        "min_tokens": 2, "logprobs": 1, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "presence_penalty": 0.0, "user": "me",
        "unknown_field": {"ignored": True}})
    assert r.status_code == 200, r.text
    p = runtime.submitted[-1][2]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (5, 0.5, 0.9, 7, 0.1, 42)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens, p.logprobs) == \
        (["zz"], [9], True, 2, 1)
    assert p.skip_special_tokens is False and p.include_stop_str_in_output is True


async def test_stop_and_eos(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "stop": ["f"]})
    assert r.json()["choices"][0] == {
        "index": 0, "text": "de", "logprobs": None, "finish_reason": "stop"}
    last = ALPHABET[-1]  # the next token is EOS
    r = await client.post("/v1/completions", json={"prompt": last})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 1
    r = await client.post("/v1/completions", json={"prompt": last, "ignore_eos": True,
                                                  "max_tokens": 3})
    assert r.json()["choices"][0] == {"index": 0, "text": "ab", "logprobs": None,
                                           "finish_reason": "length"}


async def test_completion_stream_exact_bytes(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    first = frames(r.content)[0]
    head = {"id": first["id"], "object": "text_completion", "created": first["created"],
            "model": MODEL}

    def chunk(text: str, reason: str | None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": reason}], "usage": None}

    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
             "prompt_tokens_details": {"cached_tokens": 0}}
    expected = (frame(chunk("d", None)) + frame(chunk("e", None)) + frame(chunk("f", "length"))
                + frame({**head, "choices": [], "usage": usage}) + frame("[DONE]"))
    assert r.content == expected


async def test_chat_stream_exact_bytes(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
        "stream": True})
    assert r.status_code == 200
    first = frames(r.content)[0]
    assert first["id"].startswith("chatcmpl-")
    head = {"id": first["id"], "object": "chat.completion.chunk", "created": first["created"],
            "model": MODEL}

    def chunk(delta: dict[str, str], reason: str | None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": reason}]}

    # prompt "user: hi\nassistant: " ends in " ", so the fake continues ". , :"
    expected = (frame(chunk({"role": "assistant", "content": "."}, None))
                + frame(chunk({"content": ","}, None)) + frame(chunk({"content": ":"}, "length"))
                + frame("[DONE]"))
    assert r.content == expected


async def test_chat(client: httpx.AsyncClient, runtime: FakeRuntime) -> None:
    runtime.cached_tokens = 4
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text",
                                                                   "text": "hi"}]}],
        "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": ".,"},
                                "logprobs": None, "finish_reason": "length"}]
    prompt = runtime.tokenizer.encode("system: be brief\nuser: hi\nassistant: ")
    assert runtime.submitted[-1][1] == prompt
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 2,
                             "total_tokens": len(prompt) + 2,
                             "prompt_tokens_details": {"cached_tokens": 4}}


async def test_chat_max_tokens_default_and_precedence(client: httpx.AsyncClient,
                                                      runtime: FakeRuntime) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    await client.post("/v1/chat/completions", json={"messages": msgs, "ignore_eos": True})
    n = len(runtime.submitted[-1][1])
    assert runtime.submitted[-1][2].max_tokens == runtime.max_model_len - n
    await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 9,
                                                    "max_completion_tokens": 4})
    assert runtime.submitted[-1][2].max_tokens == 4


async def test_logprobs(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2,
                                                  "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["d", "e"], "token_logprobs": [-0.5, -0.5],
                  "top_logprobs": [{"d": -0.5}, {"e": -0.5}], "text_offset": [0, 1]}
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True,
        "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content == [{"token": ".", "logprob": -0.5, "bytes": [46], "top_logprobs": [
        {"token": ".", "logprob": -0.5, "bytes": [46]},
        {"token": ",", "logprob": -1.0, "bytes": [44]}]}]
    assert r.json()["choices"][0]["message"]["content"] == "."


async def test_timeline(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2,
                                                  "return_timeline": True})
    tl = r.json()["timeline"]
    assert len(tl["token_times"]) == 2 and tl["arrival"] <= tl["token_times"][0] <= tl["finish"]
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
        "return_timeline": True})
    chunks = frames(r.content)
    assert "timeline" not in chunks[0]
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks[1]["timeline"]["token_times"]) == 2
    assert chunks[2] == "[DONE]"


async def test_failure_mid_stream(client: httpx.AsyncClient, runtime: FakeRuntime) -> None:
    runtime.fail_after = 2
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5,
                                                  "stream": True})
    chunks = frames(r.content)
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["d", "e"]
    # a request caught by a failure: the same explicit 503 whichever way the runtime says it
    assert chunks[2] == {"error": {"message": "instance lost",
                                   "type": "service_unavailable_error", "param": None,
                                   "code": 503}}
    assert chunks[3] == "[DONE]" and len(chunks) == 4
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
    assert r.status_code == 503 and r.json()["error"]["message"] == "instance lost"
    runtime.fail_mode = "raise"
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
    assert r.status_code == 503 and "decode instance died" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True})
    chunks = frames(r.content)
    assert chunks[2]["error"]["code"] == 503 and chunks[3] == "[DONE]"


async def test_models(client: httpx.AsyncClient, runtime: FakeRuntime) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    card = body["data"][0]
    assert body["object"] == "list" and len(body["data"]) == 1
    assert card == {"id": MODEL, "object": "model", "created": card["created"],
                    "owned_by": "pdserve", "root": runtime.model_name,
                    "max_model_len": runtime.max_model_len,
                    "vocab_size": None,  # the fake runtime has no vocab_size
                    "num_gpus": runtime.num_gpus, "parent": None}


@pytest.mark.parametrize(("path", "name"), [
    ("/models/fake", "fake"),
    ("/models/fake/", "fake"),
    ("/root/.cache/huggingface/hub/models--Qwen--Qwen2-0.5B/snapshots/abc123", "Qwen/Qwen2-0.5B"),
    ("tiny", "tiny"),
])
async def test_served_name_defaults_to_directory_name(path: str, name: str) -> None:
    runtime = FakeRuntime(model_name=path)
    app = build_app(runtime)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == name
        for model in (name, path):  # the path the server was started with is accepted too
            r = await c.post("/v1/completions", json={"model": model, "prompt": "a"})
            assert r.status_code == 200
            assert r.json()["model"] == name


async def test_tokenize_detokenize(client: httpx.AsyncClient, runtime: FakeRuntime) -> None:
    r = await client.post("/tokenize", json={"prompt": "abc"})
    assert r.json() == {"tokens": [1, 2, 3], "count": 3, "max_model_len": 64}
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})
    assert r.json()["tokens"] == runtime.tokenizer.encode("user: a\nassistant: ")
    r = await client.post("/detokenize", json={"tokens": [1, 2, 3]})
    assert r.json() == {"prompt": "abc"}
    for bad in ([runtime.tokenizer.vocab_size], [-1]):
        r = await client.post("/detokenize", json={"tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = await client.post("/tokenize", json={})
    assert r.status_code == 400


async def test_health() -> None:
    runtime = FakeRuntime(disaggregated=True)
    app = build_app(runtime)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.get("/health")
        assert r.status_code == 200 and r.json() == {}
        runtime.alive = False  # the only decode instance died
        r = await c.get("/health")
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
