"""``/metrics``: Prometheus text that parses, per-request histograms, per-instance gauges."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.server import build_app
from tests.server.fakes import FakeRuntime


async def scrape(c: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of every sample."""
    r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_and_histograms_move() -> None:
    runtime = FakeRuntime()
    app = build_app(runtime, "m")
    m = {"model_name": "m", "instance": "colocated-0"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        before = await scrape(c)
        assert value(before, "pdserve:prompt_tokens_total", **m) == 0
        r = await c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 5})
        assert r.status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3,
                                                  "stream": True})
        assert r.status_code == 200
        after = await scrape(c)
    assert value(after, "pdserve:prompt_tokens_total", **m) == 7
    assert value(after, "pdserve:generation_tokens_total", **m) == 8
    assert value(after, "pdserve:request_success_total", finished_reason="length", **m) == 2
    assert value(after, "pdserve:time_to_first_token_seconds_count", **m) == 2
    assert value(after, "pdserve:inter_token_latency_seconds_count", **m) == 4 + 2
    for h in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
              "request_decode_time"):
        assert value(after, f"pdserve:{h}_seconds_count", **m) == 2, h
    assert value(after, "pdserve:request_kv_transfer_time_seconds_count", **m) == 0
    assert value(after, "pdserve:time_to_first_token_seconds_bucket", le="+Inf", **m) == 2
    inst = {**m, "role": "colocated"}
    assert value(after, "pdserve:instance_alive", **inst) == 1
    assert value(after, "pdserve:num_requests_waiting", **inst) == 1
    assert value(after, "pdserve:kv_cache_usage_perc", **inst) == 0.25
    assert value(after, "pdserve:prefix_cache_queries_total", **inst) == 40
    assert value(after, "pdserve:prefix_cache_hits_total", **inst) == 10
    assert value(after, "pdserve:num_preemptions_total", **inst) == 2
    assert ("pdserve:num_requests_running", tuple(sorted(inst.items()))) in after
    assert ("pdserve:num_requests_held", tuple(sorted(inst.items()))) in after


async def test_disaggregated_labels() -> None:
    runtime = FakeRuntime(disaggregated=True)
    app = build_app(runtime, "m")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        assert r.status_code == 200
        runtime.alive = False
        s = await scrape(c)
    pre = {"model_name": "m", "instance": "prefill-0"}
    dec = {"model_name": "m", "instance": "decode-0"}
    assert value(s, "pdserve:prompt_tokens_total", **pre) == 3
    assert value(s, "pdserve:generation_tokens_total", **pre) == 1
    assert value(s, "pdserve:generation_tokens_total", **dec) == 3
    for h in ("time_to_first_token", "request_queue_time", "request_prefill_time"):
        assert value(s, f"pdserve:{h}_seconds_count", **pre) == 1, h
        assert value(s, f"pdserve:{h}_seconds_count", **dec) == 0, h
    for h in ("e2e_request_latency", "request_kv_transfer_time", "request_decode_time",
              "request_decode_queue_time"):
        assert value(s, f"pdserve:{h}_seconds_count", **dec) == 1, h
    assert value(s, "pdserve:inter_token_latency_seconds_count", **dec) == 3
    assert value(s, "pdserve:request_success_total", finished_reason="length", **dec) == 1
    assert value(s, "pdserve:instance_alive", role="decode", **dec) == 0
    assert value(s, "pdserve:instance_alive", role="prefill", **pre) == 1
    assert ("pdserve:kv_cache_usage_perc", tuple(sorted({**dec, "role": "decode"}.items()))) \
        not in s


async def test_each_app_has_its_own_registry() -> None:
    a, b = build_app(FakeRuntime(), "a"), build_app(FakeRuntime(), "b")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(a), base_url="http://t") as c:
        await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(b), base_url="http://t") as c:
        s = await scrape(c)
    assert not any(labels and dict(labels).get("model_name") == "a" for _, labels in s)
    assert value(s, "pdserve:prompt_tokens_total", model_name="b", instance="colocated-0") == 0


async def test_errors_are_counted() -> None:
    runtime = FakeRuntime()
    runtime.fail_after = 1
    app = build_app(runtime, "m")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert (await c.post("/v1/completions", json={"prompt": "abc"})).status_code == 503
        s = await scrape(c)
    m = {"model_name": "m", "instance": "colocated-0"}
    assert value(s, "pdserve:request_success_total", finished_reason="error", **m) == 1
    assert value(s, "pdserve:e2e_request_latency_seconds_count", **m) == 0


async def test_a_request_no_instance_answered_is_counted_under_none() -> None:
    """A request that ends before any instance produced output for it (here: the runtime
    fails it at once) is counted, under ``instance="none"`` (not an "unknown" instance)."""
    runtime = FakeRuntime()
    runtime.fail_after, runtime.fail_mode = 0, "raise"
    app = build_app(runtime, "m")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 5,
                                                  "stream": True})
        assert r.status_code == 200 and "error" in r.text
        after = await scrape(c)
    ended = {labels: v for (name, labels), v in after.items()
             if name == "pdserve:request_success_total"}
    assert ended and all(dict(labels)["instance"] == "none" for labels in ended), ended
    assert sum(ended.values()) == 1
