"""The serving path around the engine steps, from records with the server's timeline: the
front end's cost per request and the KV hand-off (``pdserve.sim.measurements``), and what
``pdserve calibrate --timelines`` says of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.request import Timeline
from pdserve.sim.serving_path import handoff_link, request_overhead, serving_path


def test_request_overhead_is_the_client_wait_beyond_queue_to_first_token() -> None:
    """Hand-worked: the client's TTFT minus the server's queued → first-token time, median over
    the requests; failed requests and ones without a server timeline are left out."""
    def rec(ttft: float, queued: float, first: float, ok: bool = True,
            server: bool = True) -> RequestRecord:
        st = Timeline(arrival=50.0, prefill_queued=queued, prefill_end=first,
                      token_times=[first]) if server else None
        return RequestRecord("r", 8, 1, Timeline(arrival=0.0, token_times=[ttft]), ok,
                             server_timeline=st)

    got = request_overhead([
        rec(0.030, 50.002, 50.022),  # 30 ms seen, 20 ms at the server: 10 ms
        rec(0.050, 50.003, 50.041),  # a queue wait the simulator models: 12 ms left
        rec(0.019, 50.001, 50.010),  # 10 ms
        rec(0.900, 50.0, 50.01, ok=False),
        rec(0.900, 0, 0, server=False),
    ])
    assert got["requests"] == 3
    assert got["median_ms"] == pytest.approx(10.0)
    assert got["p90_ms"] == pytest.approx(11.6)
    with pytest.raises(ValueError, match="server timeline"):
        request_overhead([rec(0.9, 0, 0, server=False)])


def test_handoff_link_fits_the_copy_and_adds_the_waits() -> None:
    """Hand-worked: copies of 1 ms + bytes at 2 GB/s, 3 ms from the prefill's end to the
    copy's start and 0.5 ms from its end to the decode's admission → a link of 4.5 ms latency
    at 2 GB/s. Colocated requests (no transfer) and failed ones are left out."""
    per_token = 1000  # KV bytes per prompt token

    def rec(prompt: int, ok: bool = True, transfer: bool = True) -> RequestRecord:
        end = 10.0
        start = end + 0.003
        done = start + 0.001 + prompt * per_token / 2e9
        st = Timeline(arrival=9.0, prefill_end=end, transfer_start=start if transfer else None,
                      transfer_end=done if transfer else None, decode_admitted=done + 0.0005,
                      token_times=[end])
        return RequestRecord("r", prompt, 1, Timeline(arrival=0.0, token_times=[1.0]), ok,
                             server_timeline=st)

    got = handoff_link([rec(100), rec(4000), rec(20000), rec(9000, ok=False),
                        rec(50, transfer=False)], per_token)
    assert got["requests"] == 3
    assert got["bandwidth_gb_per_s"] == pytest.approx(2.0, rel=1e-6)
    assert got["latency_s"] == pytest.approx(0.0045, rel=1e-6)
    assert handoff_link([rec(50, transfer=False)], per_token) is None


def _served(arrival: float, prompt: int, front_ms: float, n: int = 3) -> dict:
    """A bench record of a colocated pdserve server: queued ``front_ms / 2`` after the client
    sent it, first token 20 ms later, the client sees it ``front_ms / 2`` after that."""
    half = front_ms / 2000
    q, first = arrival + half, arrival + half + 0.020
    server = [first + 0.01 * k for k in range(n)]
    return {"request_id": f"r{arrival}", "prompt_len": prompt, "output_len": n, "ok": True,
            "timeline": {"arrival": arrival, "token_times": [t + half for t in server]},
            "server_timeline": {"arrival": q - 0.001, "prefill_queued": q, "prefill_start": q,
                                "prefill_end": first, "token_times": server}}


def test_serving_path_prefers_lone_requests_and_calibrate_prints_it(tmp_path: Path,
                                                                    capsys) -> None:
    """Three lone requests cost 6 ms in the front end; two that overlap cost 30 ms (queued
    behind each other's tokens): the lone ones decide. ``pdserve calibrate --timelines`` prints
    the flag to simulate with and reports it; a colocated run has no hand-off."""
    from pdserve.cli import main

    recs = [_served(0.0, 64, 6), _served(1.0, 64, 6), _served(2.0, 64, 6),
            _served(3.0, 64, 30), _served(3.01, 64, 30)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"records": recs}))
    sp = serving_path(path, "llama-3-8b")
    assert sp["kv_link"] is None
    assert sp["request_overhead"]["alone"] is True and sp["request_overhead"]["requests"] == 3
    assert sp["request_overhead"]["median_ms"] == pytest.approx(6.0)
    report = tmp_path / "r.json"
    assert main(["calibrate", "--hardware", "A100", "--timelines", str(path), "--model",
                 "llama-3-8b", "--report-json", str(report)]) == 0
    assert "--request-overhead-ms 6.00" in capsys.readouterr().out
    got = json.loads(report.read_text())["serving_path"][str(path)]
    assert got["request_overhead"]["median_ms"] == pytest.approx(6.0)
    # a server that sends no timelines (vLLM): nothing to tell
    for r in recs:
        del r["server_timeline"]
    path.write_text(json.dumps({"records": recs}))
    assert serving_path(path, "llama-3-8b") == {"request_overhead": None, "kv_link": None}


def test_calibrate_step_log_prints_the_serving_overhead(tmp_path: Path, capsys) -> None:
    """``pdserve calibrate --step-log`` also prints the per-step and per-sequence costs that
    the gaps between logged steps show (the synthetic log was made with 0.6 ms + 0.15 ms)."""
    from pdserve.cli import main
    from tests.bench.test_fidelity_overhead import synthetic_log

    log = tmp_path / "steps.jsonl"
    synthetic_log(log, a=0.0006, b=0.00015)
    assert main(["calibrate", "--hardware", "cpu", "--step-log", str(log), "--model",
                 "llama-3-8b", "--fit", "step_overhead_s"]) == 0
    out = capsys.readouterr().out
    step = re.search(r"--step-overhead-ms ([0-9.]+) --seq-overhead-ms ([0-9.]+)", out)
    assert step, out
    assert float(step[1]) == pytest.approx(0.6, rel=0.02)
    assert float(step[2]) == pytest.approx(0.15, rel=0.02)


def test_with_a_step_log_the_timelines_are_not_fitted(tmp_path: Path, capsys) -> None:
    """Given a step log and timelines of the same server, the steps are fitted on the log
    alone (800 steps), and the timelines still give the front end's cost."""
    from pdserve.cli import main
    from tests.bench.test_fidelity_overhead import synthetic_log

    log, recs = tmp_path / "steps.jsonl", tmp_path / "bench.json"
    synthetic_log(log, a=0.0006, b=0.00015)
    recs.write_text(json.dumps({"records": [_served(0.0, 64, 6), _served(1.0, 64, 6)]}))
    assert main(["calibrate", "--hardware", "cpu", "--step-log", str(log), "--timelines",
                 str(recs), "--model", "llama-3-8b", "--fit", "step_overhead_s"]) == 0
    out = capsys.readouterr().out
    assert "calibrated cpu on 800 measurements" in out
    assert "--request-overhead-ms 6.00" in out
