"""The OpenAI surface on the real stack (a tiny random llama, in-process disaggregated runtime
behind uvicorn): penalties and ``logit_bias`` against transformers' ``generate`` with the same
processors, structured output that must parse, ``n`` samples that reuse the prompt's KV, echo."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import torch

from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.tokenizer import load_tokenizer
from tests.cluster.realstack import assert_pools_clean, engine_config, serving, tiny_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory)


@pytest.fixture(params=["disaggregated", "colocated"])
async def served(request: pytest.FixtureRequest,
                 model_dir: str) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    rt = await build_runtime(ClusterConfig.from_dict({
        "engine": engine_config(model_dir, num_kv_blocks=64), "strategy": request.param,
        "backend": "inproc"}))
    async with serving(rt) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        yield c, rt
        await assert_pools_clean(rt)


_HF: dict[str, Any] = {}


def expected_text(tok: Any, ids: list[int]) -> str:
    """The text the server returns for output ``ids``: special tokens skipped, an incomplete
    UTF-8 sequence at the end held back."""
    return tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def hf_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    return _HF[model_dir]


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, **kw: Any) -> list[int]:
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, num_beams=1,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, **kw)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("kw,hf_kw", [
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"logit_bias": {"300": 8.0, "301": 6.0}}, {"sequence_bias": {(300,): 8.0, (301,): 6.0}}),
], ids=["repetition_penalty", "logit_bias"])
async def test_processing_matches_transformers_generate(
        served: tuple[httpx.AsyncClient, Any], model_dir: str, kw: dict[str, Any],
        hf_kw: dict[str, Any]) -> None:
    c, _ = served
    tok = load_tokenizer(model_dir)
    prompt_ids = tok.encode(PROMPT)
    ref = hf_greedy(model_dir, prompt_ids, 12, **hf_kw)
    plain = hf_greedy(model_dir, prompt_ids, 12)
    assert ref != plain  # the processor changes the output, so the comparison means something
    r = await c.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 12,
                                              "temperature": 0, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text(tok, ref)


def hf_greedy_openai_penalties(model_dir: str, prompt_ids: list[int], steps: int,
                               presence: float, frequency: float) -> list[int]:
    """Greedy decoding with transformers' model and OpenAI's penalty formula written out:
    ``logit[t] -= count(t) * frequency + (count(t) > 0) * presence`` over the output."""
    model = hf_model(model_dir)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].clone()
            for t in set(out):
                logits[t] -= out.count(t) * frequency + presence
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("prompt,presence,frequency", [
    (PROMPT, -2.0, -1.0), ("a a a a a a a a", 2.0, 1.5)], ids=["negative", "positive"])
async def test_presence_and_frequency_penalties_match_the_formula(
        served: tuple[httpx.AsyncClient, Any], model_dir: str, prompt: str, presence: float,
        frequency: float) -> None:
    c, _ = served
    tok = load_tokenizer(model_dir)
    prompt_ids = tok.encode(prompt)
    ref = hf_greedy_openai_penalties(model_dir, prompt_ids, 24, presence, frequency)
    assert ref != hf_greedy(model_dir, prompt_ids, 24)
    r = await c.post("/v1/completions", json={
        "prompt": prompt_ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "presence_penalty": presence, "frequency_penalty": frequency})
    assert r.json()["choices"][0]["text"] == expected_text(tok, ref)


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["cat", "dog", "fish"]}},
          "required": ["name", "ok", "kind"]}


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["Paris", "London", "Rome"]},
     lambda t: t in ("Paris", "London", "Rome")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) is not None),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "pet", "schema": SCHEMA}}},
     lambda t: set(json.loads(t)) == {"name", "ok", "kind"}
     and json.loads(t)["kind"] in ("cat", "dog", "fish") and len(json.loads(t)["name"]) <= 6),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     lambda t: isinstance(json.loads(t), list) and len(json.loads(t)) <= 3),
], ids=["choice", "regex", "json_schema", "guided_json"])
async def test_structured_output_is_valid(served: tuple[httpx.AsyncClient, Any],
                                          extra: dict[str, Any], check: Any) -> None:
    c, _ = served
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "A pet as JSON?"}]})):
        r = await c.post(path, json={**body, "max_tokens": 80, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        text = ch["text"] if "text" in ch else ch["message"]["content"]
        assert ch["finish_reason"] == "stop", text
        assert check(text), text
    # sampled (not greedy) output obeys the constraint too
    r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 80, "n": 3,
                                              "temperature": 1.0, "seed": 3, **extra})
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "stop" and check(ch["text"]), ch["text"]


async def test_json_object(served: tuple[httpx.AsyncClient, Any]) -> None:
    c, _ = served
    r = await c.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_object"}})
    ch = r.json()["choices"][0]
    if ch["finish_reason"] == "stop":
        assert isinstance(json.loads(ch["text"]), dict)
    else:  # out of tokens inside an (unbounded) string: still the start of an object
        assert ch["text"].startswith("{")


async def test_n_samples_reuse_the_prompt_kv(served: tuple[httpx.AsyncClient, Any],
                                             model_dir: str) -> None:
    c, rt = served
    prompt = list(range(10, 58))  # 48 tokens: three full 16-token blocks

    def hits() -> int:
        return sum(s.stats.prefix_hits for s in rt.instance_status() if s.stats)

    before = hits()
    body = {"prompt": prompt, "max_tokens": 6, "n": 3, "temperature": 20.0, "seed": 11,
            "ignore_eos": True}
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    texts = [ch["text"] for ch in r.json()["choices"]]
    assert len(texts) == 3 and len(set(texts)) > 1  # different samples
    assert hits() > before  # samples 1 and 2 found sample 0's prompt blocks cached
    r = await c.post("/v1/completions", json=body)
    assert [ch["text"] for ch in r.json()["choices"]] == texts  # seeded: reproducible


async def test_echo_and_prompt_list(served: tuple[httpx.AsyncClient, Any]) -> None:
    c, _ = served
    r = await c.post("/v1/completions", json={"prompt": [PROMPT, "Hello"], "max_tokens": 4,
                                              "temperature": 0, "echo": True})
    assert r.status_code == 200, r.text
    texts = [ch["text"] for ch in r.json()["choices"]]
    assert texts[0].startswith(PROMPT) and texts[1].startswith("Hello")
    r0 = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                               "temperature": 0})
    assert texts[0] == PROMPT + r0.json()["choices"][0]["text"]
