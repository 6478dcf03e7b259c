"""Structured output keeps its promise on the real stack (a tiny random llama, colocated and
disaggregated, in-process runtime behind uvicorn): every answer to a ``json_schema`` request,
greedy or sampled, parses and validates under its schema (jsonschema) and ends with ``stop``;
an unenforceable keyword is a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import jsonschema
import pytest

from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from tests.cluster.realstack import assert_pools_clean, engine_config, serving, tiny_model

SCHEMAS = {
    # the case: an integer field (no bound) ran on as 1111... until max_tokens
    "integer": {"type": "object", "properties": {"population_millions": {"type": "integer"}},
                "required": ["population_millions"]},
    "bounds": {"type": "object",
               "properties": {"pct": {"type": "integer", "minimum": 0, "maximum": 100},
                              "x": {"type": "number", "exclusiveMinimum": -1, "maximum": 1}},
               "required": ["pct", "x"], "additionalProperties": False},
    "lengths": {"type": "object",
                "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 5},
                               "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": {"enum": ["a", "b", 7]}},
                               "note": {"type": ["string", "null"], "maxLength": 4}},
                "required": ["name", "tags"]},
    "nested": {"$defs": {"pt": {"type": "object", "required": ["x", "y"],
                                "properties": {"x": {"type": "integer", "maximum": -3},
                                               "y": {"type": "boolean"}}}},
               "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory)


@pytest.fixture(params=["colocated", "disaggregated"])
async def served(request: pytest.FixtureRequest,
                 model_dir: str) -> AsyncIterator[httpx.AsyncClient]:
    rt = await build_runtime(ClusterConfig.from_dict({
        "engine": engine_config(model_dir, num_kv_blocks=64), "strategy": request.param,
        "backend": "inproc"}))
    async with serving(rt) as url, httpx.AsyncClient(base_url=url, timeout=120) as c:
        yield c
        await assert_pools_clean(rt)


async def test_every_answer_validates(served: httpx.AsyncClient) -> None:
    c = served
    for name, schema in SCHEMAS.items():
        validator = jsonschema.Draft202012Validator(schema)
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        answers = []
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 200,
            "temperature": 0, "response_format": rf})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop", ch
        answers.append(ch["message"]["content"])
        for seed in (1, 2):
            r = await c.post("/v1/completions", json={
                "prompt": "JSON:", "max_tokens": 200, "temperature": 1.0, "n": 3, "seed": seed,
                "guided_json": schema})
            assert r.status_code == 200, r.text
            chs = r.json()["choices"]
            assert [ch["finish_reason"] for ch in chs] == ["stop"] * 3, chs
            answers += [ch["text"] for ch in chs]
        for text in answers:
            value = json.loads(text)
            errors = [e.message for e in validator.iter_errors(value)]
            assert not errors, (name, text, errors)


async def test_unenforceable_keyword_is_a_400_naming_it(served: httpx.AsyncClient) -> None:
    r = await served.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 5,
        "guided_json": {"type": "integer", "multipleOf": 5}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "multipleOf" in err["message"] and err["param"] == "guided_json"
