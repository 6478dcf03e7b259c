"""Property: no body, however malformed, gets a 5xx; every error is an OpenAI error object;
and the server is healthy (no request left running) afterwards.

Bodies are random JSON (unicode with lone surrogates, huge and non-finite numbers, nested junk)
either as a whole or as the values of the endpoints' real field names, plus raw bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from pdserve.server import build_app
from pdserve.server.openai_types import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from tests.server.fakes import FakeRuntime

POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
GETS = ["/health", "/ping", "/version", "/v1/models", "/metrics"]
FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
                | set(TokenizeRequest.model_fields) | {"tokens", "json_schema", "schema"})

HOT = ["model", "prompt", "messages", "stop", "max_tokens", "n", "logit_bias", "stream",
       "response_format", "guided_json", "guided_regex", "guided_choice", "echo", "seed",
       "temperature", "tokens", "logprobs", "top_logprobs", "user"]
fields = st.one_of(st.sampled_from(HOT), st.sampled_from(FIELDS))
# any code point, and often a lone surrogate
text = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=12),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=3),
              st.sampled_from(["\ud800", "\udfff", "\udc80"]), st.text(max_size=3)),
)
numbers = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64 + 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(text, fields), inner, max_size=4)),
    max_leaves=12,
)
plausible = st.one_of(
    text,
    st.sampled_from(["abc", "", "a\ud800b", [1, 2, 3], [], [[1, 2], "x"], ["a", 3], 0.5, 2, -1,
                     True, {"type": "json_object"}, {"type": "json_schema"},
                     {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}},
                     [{"role": "user", "content": "hi"}], [{"role": "tool"}],
                     [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
                     {"include_usage": True}, {"3": 5}, {"x": 1}, "[a-z]+", "(", ["yes"]]),
    json_values,
)
bodies = st.one_of(
    json_values,
    st.dictionaries(fields, plausible, max_size=8),
    st.fixed_dictionaries({"prompt": plausible}, optional={
        k: plausible for k in ("model", "max_tokens", "n", "stream", "logprobs", "echo",
                               "guided_regex", "response_format", "logit_bias", "seed",
                               "temperature", "stop")}),
    st.fixed_dictionaries({"messages": plausible}, optional={
        k: plausible for k in ("model", "max_tokens", "n", "stream", "top_logprobs",
                               "logprobs", "tools", "guided_choice", "guided_json", "stop")}),
)

VALID = [
    ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["ab", [1, 2]], "max_tokens": 2, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2, "stream": True, "logprobs": True}),
    ("/tokenize", {"prompt": "abc"}),
    ("/detokenize", {"tokens": [1, 2]}),
]
# a valid request with one to three fields replaced: reaches the code behind validation
mutated = st.tuples(st.sampled_from(VALID),
                    st.dictionaries(fields, plausible, min_size=1, max_size=3))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, FakeRuntime]]:
    runtime = FakeRuntime()
    with TestClient(build_app(runtime, "m", max_request_bytes=64 << 10),
                    raise_server_exceptions=False) as c:
        yield c, runtime
    assert c.get("/health").status_code == 200


def check(r: Any) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == r.status_code


def _healthy(runtime: FakeRuntime, c: TestClient) -> None:
    assert not runtime.active
    assert c.get("/health").status_code == 200


SETTINGS = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(path=st.sampled_from(POSTS), body=bodies)
def test_json_bodies_never_5xx(served: tuple[TestClient, FakeRuntime], path: str,
                               body: Any) -> None:
    c, runtime = served
    data = json.dumps(body, allow_nan=True)  # escapes lone surrogates as \udXXX
    check(c.post(path, content=data, headers={"content-type": "application/json"}))
    _healthy(runtime, c)


@SETTINGS
@given(case=mutated)
def test_mutated_valid_bodies_never_5xx(served: tuple[TestClient, FakeRuntime],
                                        case: tuple[tuple[str, dict[str, Any]], dict[str, Any]]
                                        ) -> None:
    c, runtime = served
    (path, body), changes = case
    data = json.dumps({**body, **changes}, allow_nan=True)
    check(c.post(path, content=data, headers={"content-type": "application/json"}))
    _healthy(runtime, c)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(POSTS + GETS), raw=st.binary(max_size=64),
       ctype=st.sampled_from(["application/json", "text/plain", ""]))
def test_raw_bytes_never_5xx(served: tuple[TestClient, FakeRuntime], path: str, raw: bytes,
                             ctype: str) -> None:
    c, runtime = served
    headers = {"content-type": ctype} if ctype else {}
    method = "GET" if path in GETS else "POST"
    check(c.request(method, path, content=raw, headers=headers))
    _healthy(runtime, c)


@pytest.mark.parametrize("raw", [
    b'{"prompt": "a\\ud800b"}', b'{"prompt": "\\udfff", "stream": true}',
    b'{"prompt": "' + b"\xff\xfe" + b'"}',  # not UTF-8
    b"[" * 5000 + b"]" * 5000,  # deeper than the JSON parser's recursion limit
    b'{"prompt": "abc", "max_tokens": 1e400}', b'{"prompt": "abc", "temperature": NaN}',
    b'{"prompt": "abc", "seed": 1' + b"0" * 400 + b"}",
    b'{"prompt": "abc", "top_k": 1' + b"0" * 30 + b', "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}',
], ids=lambda raw: str(len(raw)))
def test_known_nasty_bodies(served: tuple[TestClient, FakeRuntime], raw: bytes) -> None:
    c, runtime = served
    for path in POSTS:
        check(c.post(path, content=raw, headers={"content-type": "application/json"}))
    _healthy(runtime, c)
