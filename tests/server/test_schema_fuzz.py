"""The OpenAPI schema is deep enough to fuzz: schemathesis generates bodies from it for every
operation, and the server answers each with a declared status, a declared content type and a
body (or SSE events) matching the declared schema — no 5xx, no 422, no undeclared status.
Bounded (``MAX_EXAMPLES`` per operation, derandomized); the share of generated generation
bodies that reach the engine is checked at the end.

Not asked for: ``negative_data_rejection`` (the models coerce as vLLM's do: ``"1"`` for 1) and
``positive_data_acceptance`` (a schema cannot state the runtime's context-length rule: prompt
plus ``max_tokens`` within ``max_model_len``, counted in tokens)."""

from __future__ import annotations

import collections

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    negative_data_rejection,
    positive_data_acceptance,
)

from pdserve.server import build_app  # noqa: E402
from tests.server.fakes import FakeRuntime  # noqa: E402

MAX_EXAMPLES = 40
GENERATION = ("/v1/completions", "/v1/chat/completions")
RUNTIME = FakeRuntime(max_model_len=256)
APP = build_app(RUNTIME, "m")
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
SENT: collections.Counter[str] = collections.Counter()


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_declared(case: object) -> None:
    before = len(RUNTIME.submitted)
    case.call_and_validate(  # type: ignore[attr-defined]
        excluded_checks=[negative_data_rejection, positive_data_acceptance])
    meta = getattr(case, "_meta", None)
    positive = meta is not None and meta.generation.mode == GenerationMode.POSITIVE
    if case.path in GENERATION and positive:  # type: ignore[attr-defined]
        SENT["positive"] += 1
        SENT["reached"] += len(RUNTIME.submitted) > before


@pytest.mark.slow
def test_a_meaningful_share_reaches_the_engine() -> None:
    if not SENT["positive"]:
        pytest.skip("run with the schemathesis cases above")
    share = SENT["reached"] / SENT["positive"]
    print(f"{share:.0%} of {SENT['positive']} schema-valid generation bodies reached the engine")
    assert share >= 0.3, share
