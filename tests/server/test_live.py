"""Against a real uvicorn server: the official ``openai`` client, and client disconnects."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.fakes import FakeRuntime


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def oai(live_server: Callable[..., str]) -> tuple[openai.OpenAI, FakeRuntime]:
    runtime = FakeRuntime(cached_tokens=1)
    url = live_server(runtime)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), runtime


def test_openai_completions(oai: tuple[openai.OpenAI, FakeRuntime]) -> None:
    client, _ = oai
    c = client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
    assert c.choices[0].text == "def" and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 3 and c.usage.completion_tokens == 3
    assert c.usage.prompt_tokens_details.cached_tokens == 1
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=3,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    assert [ch.choices[0].text for ch in chunks[:3]] == ["d", "e", "f"]
    assert [ch.choices[0].finish_reason for ch in chunks[:3]] == [None, None, "length"]
    assert all(ch.usage is None for ch in chunks[:3])
    assert chunks[3].choices == [] and chunks[3].usage.total_tokens == 6
    assert len(chunks) == 4
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2,
                                            stream=True))
    assert [ch.choices[0].text for ch in chunks] == ["d", "e"]


def test_openai_chat(oai: tuple[openai.OpenAI, FakeRuntime]) -> None:
    client, runtime = oai
    msgs = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3,
                                       seed=1, temperature=0)
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == ".,:"
    assert runtime.submitted[-1][2].temperature == 0 and runtime.submitted[-1][2].seed == 1
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=1))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:3])
    assert "".join(ch.choices[0].delta.content for ch in chunks[:3]) == ".,:"
    assert chunks[0].choices[0].logprobs.content[0].token == "."
    assert chunks[2].choices[0].finish_reason == "length"
    assert chunks[3].usage.completion_tokens == 3 and len(chunks) == 4
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_openai_errors(live_server: Callable[..., str]) -> None:
    runtime = FakeRuntime()
    url = live_server(runtime, api_key="k")
    bad_key = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="abc", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="abc")
    runtime.max_waiting = 0
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="abc")
    runtime.max_waiting = None
    runtime.fail_after = 1
    with pytest.raises(openai.APIError, match="instance lost"):
        list(client.completions.create(model=MODEL, prompt="abc", stream=True))


def test_disconnect_mid_stream_aborts(live_server: Callable[..., str]) -> None:
    runtime = FakeRuntime(token_delay=0.05)
    url = live_server(runtime)
    body = {"prompt": "abc", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: len(runtime.submitted) == 1)
    # the connection is closed here, after one or two tokens of fifty
    wait_for(lambda: runtime.aborted == [runtime.submitted[0][0]], timeout=1.5)
    assert not runtime.active and not runtime.finished
    metrics = httpx.get(f"{url}/metrics").text
    assert 'finished_reason="abort"' in metrics


def test_disconnect_while_waiting_aborts(live_server: Callable[..., str]) -> None:
    runtime = FakeRuntime(token_delay=0.05)
    url = live_server(runtime)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", timeout=0.3,
                   json={"prompt": "abc", "max_tokens": 50, "ignore_eos": True})
    wait_for(lambda: len(runtime.aborted) == 1, timeout=1.5)
    assert not runtime.active and not runtime.finished
    # the server is still healthy and serves the next request
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "de"
