"""The replanning monitor (DistServe §4.3 "Replanning") on synthetic traces with a known shift."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.metrics import SLO, RequestRecord
from pdserve.bench.workloads import WorkloadRequest
from pdserve.planner.replan import (
    ShiftDetector,
    WindowStats,
    attainment_over_time,
    detect,
    simulate_replanning,
)
from pdserve.request import Timeline


def _trace(segments: list[tuple[float, float, int, int]], seed: int = 0) -> list[WorkloadRequest]:
    """Poisson arrivals: ``(duration_s, rate, prompt_len, output_len)`` one after another."""
    rng = np.random.default_rng(seed)
    out, t0 = [], 0.0
    for dur, rate, p, o in segments:
        t = t0
        while True:
            t += rng.exponential(1 / rate)
            if t >= t0 + dur:
                break
            out.append(WorkloadRequest(f"r{len(out)}", t, p, o))
        t0 += dur
    return out


def test_steady_trace_raises_no_shift():
    reqs = _trace([(600, 4.0, 1000, 200)])
    assert detect(reqs, ShiftDetector(60.0)) == []


def test_length_shift_detected_within_two_windows():
    # code-like (long prompt, short output) then conversation-like (shorter prompt, long output)
    reqs = _trace([(300, 4.0, 2000, 20), (300, 4.0, 1000, 250)])
    shifts = detect(reqs, ShiftDetector(60.0))
    assert len(shifts) == 1
    s = shifts[0]
    assert 300 < s.time <= 300 + 2 * 60 + 1e-9  # two windows after the change at most
    assert "output length 20.0 -> 250.0" in s.reasons and "prompt length 2000.0 -> 1000.0" in \
        s.reasons
    assert s.after.mean_output == 250 and s.after.mean_prompt == 1000  # the new pattern alone
    assert s.before.rate == pytest.approx(4.0, rel=0.3)


def test_rate_shift_against_the_planned_reference():
    ref = WindowStats(rate=2.0, mean_prompt=500, mean_output=100, num_requests=120)
    reqs = _trace([(120, 2.0, 500, 100), (200, 5.0, 500, 100)])
    shifts = detect(reqs, ShiftDetector(60.0, reference=ref, rate_threshold=0.5))
    assert len(shifts) == 1 and shifts[0].reasons[0].startswith("rate 2.0 -> ")
    assert 120 < shifts[0].time <= 120 + 2 * 60 + 1e-9
    assert shifts[0].after.rate == pytest.approx(5.0, rel=0.2)
    # a rise within the threshold is no shift
    assert detect(_trace([(300, 2.4, 500, 100)]), ShiftDetector(60.0, reference=ref,
                                                                 rate_threshold=0.5)) == []


def test_blue_green_switch_routes_by_arrival_and_keeps_every_request():
    reqs = _trace([(100, 1.0, 100, 10)])
    seen: dict[str, list[str]] = {"old": [], "new": []}

    def fake_sim(cfg: str, rs, progress, vocab):
        seen[cfg] += [r.request_id for r in rs]
        good = cfg == "new"
        recs = [RequestRecord(r.request_id, r.prompt_len, r.output_len,
                              Timeline(arrival=r.arrival_time,
                                       token_times=[r.arrival_time + (0.1 if good else 9.0)]),
                              True) for r in rs]
        return recs, None, None

    recs = simulate_replanning(reqs, "old", "new", 50.0, 100, fake_sim)
    assert [r.request_id for r in recs] == [r.request_id for r in reqs]
    assert all(r.arrival_time < 50 for r in reqs if r.request_id in seen["old"])
    assert len(seen["old"]) + len(seen["new"]) == len(reqs)
    bins = attainment_over_time(reqs, recs, SLO(1.0, 1.0), 50.0)
    assert [(b[0], b[1]) for b in bins] == [(0.0, 0.0), (50.0, 1.0)]
