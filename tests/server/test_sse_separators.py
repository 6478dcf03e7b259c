"""Tokens that decode to U+2028, U+0085 or U+2029 (line ends to Python's ``str.splitlines`` and
to old JavaScript, not to SSE or JSON) over real HTTP: the server writes them as ``\\u`` escapes
in its JSON and ``pdserve bench``'s client reads every token of such a stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx

from pdserve.bench.client import ClientConfig, run_requests
from pdserve.bench.workloads import WorkloadRequest
from tests.server.fakes import ALPHABET, CharTokenizer, FakeRuntime

SEPARATORS = {"x": "\u2028", "y": "\u0085", "z": "\u2029"}
RAW = [s.encode() for s in SEPARATORS.values()]  # their UTF-8 bytes


class SeparatorTokenizer(CharTokenizer):
    """The character tokenizer with ``x``, ``y`` and ``z`` decoding to the three separators."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **kw: Any) -> str:
        text = super().decode(ids, skip_special_tokens, **kw)
        return "".join(SEPARATORS.get(c, c) for c in text)


def separator_runtime() -> FakeRuntime:
    rt = FakeRuntime(max_model_len=256)
    rt.tokenizer = SeparatorTokenizer()
    return rt


# the fake generates (last + 1) % vocab: after "w" come x, y, z, then 0, 1, ...
PROMPT = [ALPHABET.index("w") + 1]


async def _raw_stream(url: str) -> bytes:
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{url}/v1/completions", json={
            "model": "fake-model", "prompt": PROMPT, "max_tokens": 6, "stream": True})
        assert r.status_code == 200, r.text
        return r.content


def test_server_escapes_line_separators(live_server: Callable[..., str]) -> None:
    url = live_server(separator_runtime())
    raw = asyncio.run(_raw_stream(url))
    assert not any(sep in raw for sep in RAW), raw
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events if e != b"[DONE]"
                   if json.loads(e)["choices"])
    assert text == "\u2028\u0085\u2029012"
    with httpx.Client() as c:  # non-streaming bodies too
        r = c.post(f"{url}/v1/completions", json={"model": "fake-model", "prompt": PROMPT,
                                                 "max_tokens": 3})
    assert not any(sep in r.content for sep in RAW)
    assert r.json()["choices"][0]["text"] == "\u2028\u0085\u2029"
    with httpx.Client() as c:  # and every other JSON body (here /detokenize's)
        r = c.post(f"{url}/detokenize", json={"model": "fake-model", "tokens": [24, 25, 26]})
    assert r.status_code == 200 and not any(sep in r.content for sep in RAW), r.content
    assert r.json()["prompt"] == "\u2028\u0085\u2029"


def test_bench_client_reads_every_token(live_server: Callable[..., str]) -> None:
    url = live_server(separator_runtime())
    reqs = [WorkloadRequest(f"r{i}", 0.01 * i, 1, 6, PROMPT, None) for i in range(4)]
    recs = asyncio.run(run_requests(reqs, ClientConfig(url, progress=False)))
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert [r.output_len for r in recs] == [6] * 4
