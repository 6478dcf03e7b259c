"""The official ``openai`` client and bad inputs against the real stack: a tiny model on an
in-process disaggregated runtime (1 prefill + 1 decode) behind uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from pdserve.tokenizer import apply_chat_template, load_tokenizer
from tests.cluster.realstack import MAX_LEN, assert_pools_clean, engine_config, serving, tiny_model

PROMPT = "The capital of France is"
MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many legs does a spider have?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> dict[str, tuple[str, int]]:
    """Offline greedy (text, tokens) for the completion prompt and the chat prompt."""
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=MAX_LEN)
    chat_ids = apply_chat_template(load_tokenizer(model_dir), MSGS)
    outs = llm.generate([PROMPT, chat_ids], SamplingParams(max_tokens=10, temperature=0))
    return {"completion": (outs[0].text, len(outs[0].token_ids)),
            "chat": (outs[1].text, len(outs[1].token_ids))}


@pytest.fixture
async def served(model_dir: str) -> AsyncIterator[tuple[str, object]]:
    rt = await build_runtime(ClusterConfig.from_dict({
        "engine": engine_config(model_dir, num_kv_blocks=64), "strategy": "disaggregated",
        "backend": "inproc"}))
    async with serving(rt) as url:
        yield url, rt
        await assert_pools_clean(rt)


async def test_openai_client_completions_and_chat(served: tuple[str, object],
                                                  reference: dict[str, tuple[str, int]]) -> None:
    url, _ = served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    text, n = reference["completion"]

    c = await client.completions.create(model=model, prompt=PROMPT, max_tokens=10,
                                        temperature=0)
    assert c.choices[0].text == text and c.usage.completion_tokens == n
    chunks = [ch async for ch in await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")

    text, n = reference["chat"]
    r = await client.chat.completions.create(model=model, messages=MSGS, max_tokens=10,
                                             temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.usage.completion_tokens == n
    chunks = [ch async for ch in await client.chat.completions.create(
        model=model, messages=MSGS, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens > 0
    await client.close()


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": [5, 600, 7]}, 400, "prompt"),  # token id outside the 512-token vocabulary
    ({"prompt": [5] * 300}, 400, "prompt"),  # longer than max_model_len (256)
    ({"prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens"),  # prompt + output too long
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
], ids=["vocab", "too-long", "too-long-with-output", "temperature", "model", "missing"])
async def test_bad_input_gets_4xx(served: tuple[str, object], body: dict, status: int,
                                  param: str) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/completions", json={"max_tokens": 2, **body})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == status and err["param"] == param and err["message"]
        # the same through a streaming request, and the server still serves
        r = await c.post("/v1/completions", json={"max_tokens": 2, "stream": True, **body})
        assert r.status_code == status
        r = await c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_prompt_ids_are_checked_against_the_models_vocabulary(tmp_path) -> None:
    """A model whose vocabulary is larger than its tokenizer's (common: padded embeddings)
    takes every id below the model's vocab_size, which /v1/models reports and benchmark clients
    draw from; ids at or past it are a 400."""
    from pdserve.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "wide", vocab_size=1024, num_layers=1)
    assert len(load_tokenizer(model)) < 1000
    rt = await build_runtime(ClusterConfig.from_dict({
        "engine": engine_config(model, num_kv_blocks=16), "backend": "inproc"}))
    async with serving(rt) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["vocab_size"] == 1024
        r = await c.post("/v1/completions", json={"prompt": [5, 1000, 1023], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        r = await c.post("/v1/completions", json={"prompt": [5, 1024], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        await assert_pools_clean(rt)
