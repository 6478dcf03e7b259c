"""``/metrics``: the per-instance routing effect (issue 27) — prefix-cache hit rate, prompt
tokens computed, busy seconds — from the instance's engine stats."""

from __future__ import annotations

import dataclasses

import httpx

from pdserve.cluster.serving_api import InstanceStatus
from pdserve.server import build_app
from tests.server.fakes import FakeRuntime
from tests.server.test_metrics import scrape, value


class StatsRuntime(FakeRuntime):
    """Two instances: one with 40 prompt tokens queried and 10 found (25 %), busy 3.5 s; one
    that has seen no query yet."""

    def instance_status(self) -> list[InstanceStatus]:
        (st,) = super().instance_status()
        assert st.stats is not None
        busy = dataclasses.replace(st.stats, busy_time=3.5)
        idle = dataclasses.replace(st.stats, prefix_queries=0, prefix_hits=0)
        return [dataclasses.replace(st, stats=busy),
                InstanceStatus("colocated-1", "colocated", True, idle)]


async def test_per_instance_hit_rate_computed_tokens_and_busy_seconds() -> None:
    app = build_app(StatsRuntime(), "m")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        s = await scrape(c)
    a = {"model_name": "m", "instance": "colocated-0", "role": "colocated"}
    b = {**a, "instance": "colocated-1"}
    assert value(s, "pdserve:prefix_cache_hit_rate", **a) == 0.25
    assert value(s, "pdserve:prompt_tokens_computed_total", **a) == 30
    assert value(s, "pdserve:busy_seconds_total", **a) == 3.5
    assert ("pdserve:prefix_cache_hit_rate", tuple(sorted(b.items()))) in s
    assert value(s, "pdserve:prefix_cache_hit_rate", **b) == 0.0
    assert value(s, "pdserve:prompt_tokens_computed_total", **b) == 0
