"""The streaming client against a fake OpenAI-compatible server with known token delays."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdserve.bench.client import ClientConfig, reconcile_token_times, run_requests
from pdserve.bench.metrics import latency_breakdown
from pdserve.bench.targets import HttpTarget
from pdserve.bench.workloads import WorkloadRequest
from tests.bench.fakes import MAX_MODEL_LEN, TPOT_DELAY, TTFT_DELAY, FakeServer


def req(i: int, out: int = 10, at: float = 0.0, text: str | None = None) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", at, 4, out, [5, 6, 7, 8] if text is None else None, text)


def run(server: FakeServer, reqs: list[WorkloadRequest], **kw) -> list:
    cfg = ClientConfig(server.url, progress=False, **kw)
    return asyncio.run(run_requests(reqs, cfg))


def test_records_ttft_tpot_and_sends_forced_lengths(fake_server: FakeServer) -> None:
    n0 = len(fake_server.bodies)
    recs = run(fake_server, [req(0, 10), req(1, 1, at=0.05)])
    a, b = recs
    assert a.ok and b.ok, (a.error, b.error)
    assert a.output_len == 10 and b.output_len == 1 and a.note is None
    # times are the chunks' receive times: no upper bound (a busy machine delays them), but
    # the server's sleeps are lower bounds and TTFT/TPOT follow from the ten token times
    times = a.timeline.token_times
    assert len(times) == 10 and times == sorted(times)
    assert a.ttft == pytest.approx(times[0] - a.timeline.arrival)
    assert a.ttft >= TTFT_DELAY
    assert a.tpot == pytest.approx((times[-1] - times[0]) / 9)
    # the last token left the server after its 9 sleeps between tokens
    assert times[-1] - a.timeline.arrival >= TTFT_DELAY + 9 * TPOT_DELAY
    assert b.tpot is None and b.timeline.arrival == 0.05
    assert b.sent_time >= 0.05  # open loop: sent at its arrival time
    body = fake_server.bodies[n0]
    assert body["model"] == "fake" and body["prompt"] == [5, 6, 7, 8]
    assert body["max_tokens"] == 10 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["return_timeline"] is True and "min_tokens" not in body


def test_http_400_becomes_failed_record(fake_server: FakeServer) -> None:
    (r,) = run(fake_server, [req(0, 5, text="BAD prompt")])
    assert not r.ok and r.error == "HTTP 400: prompt is not allowed"
    assert r.output_len == 0


def test_dropped_connection_becomes_failed_record(fake_server: FakeServer) -> None:
    (r,) = run(fake_server, [req(0, 10, text="DROP")])
    assert not r.ok
    assert r.error.startswith("connection dropped") or "closed" in r.error
    assert r.output_len == 2  # the tokens before the drop are kept


def test_error_chunk_becomes_failed_record(fake_server: FakeServer) -> None:
    (r,) = run(fake_server, [req(0, 10, text="STREAMERR")])
    assert not r.ok and r.error == "error in stream: engine died"


def test_read_timeout_does_not_hang(fake_server: FakeServer) -> None:
    (r,) = run(fake_server, [req(0, 3, text="SLOW")], timeout=0.5)
    assert not r.ok and "timed out" in r.error
    (r,) = run(fake_server, [req(0, 3, text="SLOW")], total_timeout=0.3)
    assert not r.ok and "timed out after 0.3 s" in r.error


def test_coalesced_chunks_are_spread_by_usage(fake_server: FakeServer) -> None:
    (r,) = run(fake_server, [req(0, 9, text="COALESCE")])
    assert r.ok and r.output_len == 9
    assert "5 chunks for 9 tokens" in r.note
    times = r.timeline.token_times  # spread evenly between the first and the last chunk
    assert len(times) == 9 and times[-1] - r.timeline.arrival >= TTFT_DELAY + 8 * TPOT_DELAY
    assert np.allclose(np.diff(times), r.tpot)


def test_line_separators_inside_json_are_not_line_ends(fake_server: FakeServer) -> None:
    """SSE lines end only at CR, LF or CRLF: U+2028, U+0085 and U+2029 written raw inside a
    chunk's JSON (JSON allows them) belong to the token text."""
    (r,) = run(fake_server, [req(0, 7, text="SEPS")])
    assert r.ok and r.error is None, r.error
    assert r.output_len == 7 and r.note is None


def test_sse_decoder_follows_the_spec() -> None:
    from pdserve.bench.client import SSEDecoder

    stream = ("\ufeffdata: a\u2028b\r\n\r\n: comment\rdata:c\rdata:  d\revent: x\r\r"
              "id: 1\n\ndata: é\n\ndata: cut off").encode()
    for size in (1, 2, 3, len(stream)):  # every split point, across CRLF and UTF-8 bytes
        dec = SSEDecoder()
        events = [e for i in range(0, len(stream), size) for e in dec.feed(stream[i:i + size])]
        assert events == ["a\u2028b", "c\n d", "é"]


def test_finish_only_chunk_is_not_a_token(fake_server: FakeServer) -> None:
    (r,) = run(fake_server, [req(0, 4, text="FINISHCHUNK")])
    assert r.ok and r.output_len == 4 and r.note is None


def test_server_timeline_gives_breakdown(fake_server: FakeServer) -> None:
    (r,) = run(fake_server, [req(0, 5)])
    assert r.server_timeline is not None and r.server_timeline.prefill_start is not None
    b = latency_breakdown([r])
    assert b is not None and b["mean_s"]["prefill_queue"] == pytest.approx(0.01, abs=1e-6)
    (r,) = run(fake_server, [req(0, 5)], request_timeline=False)
    assert r.server_timeline is None


def test_concurrency_cap_is_a_safety_limit(fake_server: FakeServer) -> None:
    recs = run(fake_server, [req(i, 3) for i in range(4)], max_concurrency=1)
    assert all(r.ok for r in recs)
    sent = sorted(r.sent_time for r in recs)
    assert sent[-1] >= 3 * TTFT_DELAY  # each waited for the previous one
    assert max(r.ttft for r in recs) >= 3 * TTFT_DELAY  # and the wait counts in TTFT


def test_unreachable_server() -> None:
    cfg = ClientConfig("http://127.0.0.1:9", progress=False, timeout=2.0)
    with pytest.raises(ConnectionError, match="cannot reach"):
        asyncio.run(run_requests([req(0)], cfg))
    (r,) = asyncio.run(run_requests([req(0)], ClientConfig("http://127.0.0.1:9", model="m",
                                                           progress=False, timeout=2.0)))
    assert not r.ok and r.error.startswith("cannot connect")


def test_http_target_prepare_and_run(fake_server: FakeServer) -> None:
    t = HttpTarget(fake_server.url + "/v1/", num_gpus=2, progress=False)
    asyncio.run(t.prepare())
    assert t.config.model == "fake" and t.max_model_len == MAX_MODEL_LEN and t.num_gpus == 2
    recs = asyncio.run(t.run([req(0, 3), req(1, 2, text="hello")]))
    assert [r.request_id for r in recs] == ["r0", "r1"] and all(r.ok for r in recs)
    assert fake_server.bodies[-1]["prompt"] in ("hello", [5, 6, 7, 8])


def test_reconcile_token_times() -> None:
    assert reconcile_token_times([1.0, 2.0], ["a", "b"], True, 2) == ([1.0, 2.0], None)
    assert reconcile_token_times([1.0, 2.0, 2.1], ["a", "b", ""], True, 2) == ([1.0, 2.0], None)
    times, note = reconcile_token_times([1.0, 3.0], ["ab", "cd"], True, 5)
    assert times == [1.0, 1.5, 2.0, 2.5, 3.0] and "2 chunks for 5 tokens" in note
    assert reconcile_token_times([1.0, 2.0, 2.1], ["a", "b", ""], True, None)[0] == [1.0, 2.0]
    assert reconcile_token_times([], [], False, None) == ([], None)


def test_scrapes_metrics_during_the_run(fake_server: FakeServer, tmp_path) -> None:
    """``--scrape-metrics``: /metrics before, during and after the run, as JSON lines that
    ``from_metrics_log`` parses; the last scrape sees every request."""
    import json

    from pdserve.sim.measurements import _scrape_values

    log = tmp_path / "scrapes.jsonl"
    n0 = len(fake_server.bodies)
    target = HttpTarget(fake_server.url, progress=False, scrape_metrics=str(log),
                        scrape_interval=0.05)
    recs = asyncio.run(target.run([req(0, 10), req(1, 10, at=0.1)]))
    assert all(r.ok for r in recs)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) >= 4  # before, at least two during (~0.3 s of streaming), after
    times = [x["time"] for x in lines]
    assert times == sorted(times)
    seen = [_scrape_values(x["metrics"])["finished"] for x in lines]
    assert seen[0] == n0 and seen[-1] == n0 + 2 and seen == sorted(seen)


def test_scraping_a_server_without_metrics_fails_clearly(fake_server: FakeServer,
                                                         tmp_path) -> None:
    target = HttpTarget(fake_server.url + "/nowhere", progress=False,
                        scrape_metrics=str(tmp_path / "s.jsonl"))
    with pytest.raises(RuntimeError, match=r"scraping .*/nowhere/metrics failed: HTTP 404"):
        asyncio.run(target.run([req(0, 2)]))
    with pytest.raises(ValueError, match="scrape_interval must be > 0"):
        HttpTarget(fake_server.url, scrape_metrics="x", scrape_interval=0)
