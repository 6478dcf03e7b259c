"""The steady-state rule (:mod:`pdserve.bench.steady`) against closed-form queueing.

``QueueTarget(10)`` is one FIFO server with a deterministic 0.1 s service per request, so under
Poisson arrivals it is an M/D/1 queue of capacity 10 req/s: any rate above 10 req/s is
overloaded (λ·D > 1, its backlog grows without bound and the steady-state attainment is 0), and
below it the waiting time follows Erlang's M/D/1 distribution.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.bench.goodput import search_goodput
from pdserve.bench.metrics import SLO, meets
from pdserve.bench.runner import Settings, _prober, build_workload, find_goodput
from pdserve.bench.steady import SteadyState, confidence
from tests.bench.fakes import QueueTarget
from tests.planner.test_mdl_optimum import closed_form_goodput, mdl_wait_cdf

D = 0.1  # service time of QueueTarget(10)
SLO_LOOSE = SLO(5.0, 0.02)  # TPOT is always 0.01 s: only the TTFT (queueing) matters
WORKLOAD = "fixed:input=8,output=5"


def _old_probe(rate: float, n: int = 300) -> float:
    """The probe the rule replaces: ``n`` requests, every one judged."""
    t = QueueTarget(1 / D)
    s = Settings(workload=WORKLOAD, num_requests=n, slo=SLO_LOOSE)
    w = build_workload(t, s, rate).retimed(rate)
    recs = asyncio.run(t.run(list(w.requests)))
    return sum(all(meets(r, SLO_LOOSE)) for r in recs) / len(recs)


def _new_probe(rate: float):
    t = QueueTarget(1 / D)
    s = Settings(workload=WORKLOAD, num_requests=300, slo=SLO_LOOSE)
    runs: list = []
    return _prober(t, build_workload(t, s, rate), s, runs)(rate), runs


def test_an_overloaded_rate_that_300_requests_pass_is_rejected():
    rate = 11.0
    assert rate * D > 1  # 10 % above capacity: the backlog grows by 0.1 s of work per second
    assert _old_probe(rate) >= 0.9  # 300 requests end (27 s) before the backlog passes 4.9 s
    res, runs = _new_probe(rate)
    life = SLO_LOOSE.ttft + 4 * SLO_LOOSE.tpot
    warm = math.ceil(rate * 6 * life)  # half the horizon of 12 lifetimes
    assert len(runs[0].records) == warm + max(300, warm)
    assert res.details["judged"] == max(300, warm)
    assert not res.passed and res.attainment < 0.7
    assert res.details["confidence"] > 0.99


def test_an_underloaded_rate_is_accepted():
    rate = 8.0
    assert mdl_wait_cdf(SLO_LOOSE.ttft - D, rate, D) > 0.999  # closed form: all but ~0 attain
    res, _ = _new_probe(rate)
    assert res.passed and res.attainment == 1.0 and res.details["confidence"] > 0.99


def test_the_goodput_search_lands_within_the_stated_overload_bound():
    """With the rule the search reports no rate more than 1 / (0.95 × horizon) above capacity
    (10 req/s; module docstring of pdserve.bench.steady); the 300-request probe goes past it."""
    t = QueueTarget(1 / D)
    s = Settings(workload=WORKLOAD, num_requests=300, slo=SLO_LOOSE)
    new = search_goodput(_prober(t, build_workload(t, s, 8.0), s, []), hi=8.0, precision=0.2)
    bound = (1 / D) * (1 + 1 / (0.95 * 12))
    assert 8.0 <= new.goodput_rps <= bound
    old = search_goodput(lambda r: _as_result(r, _old_probe(r)), hi=8.0, precision=0.2)
    assert old.goodput_rps > bound


def test_rule_7_lowers_the_goodput_search_past_capacity_to_a_rate_that_holds():
    """``pdserve goodput``'s confirmation (``find_goodput(confirm=5)``): the search's answer
    lies past capacity; five probe lengths reject it and the search continues downwards to a
    rate under capacity, near the closed-form goodput (9.96 req/s: Erlang's M/D/1 waiting time
    for a 4.9 s queueing budget at 90 %). The reported run is the confirmation's."""
    t = QueueTarget(1 / D)
    s = Settings(workload=WORKLOAD, num_requests=300, slo=SLO_LOOSE)
    plain = find_goodput(t, s, hi=8.0, precision=0.2, confirm=0)
    assert plain.confirmed is None and plain.result.goodput_rps > 1 / D
    sr = find_goodput(QueueTarget(1 / D), s, hi=8.0, precision=0.2, confirm=5)
    c = sr.confirmed
    assert c["factor"] == 5 and c["rate"] == plain.result.goodput_rps and not c["held"]
    assert c["judged"] >= 5 * 300 and c["probes"][0][::2] == (plain.result.goodput_rps, False)
    g = sr.result.goodput_rps
    closed = closed_form_goodput(SLO_LOOSE.ttft, D, D)
    assert 9.9 < closed < 1 / D
    assert closed - 0.3 <= g <= 1 / D  # under capacity; within 3 % of the truth
    assert sr.result.per_gpu_goodput_rps == g / t.num_gpus
    assert all(ok == (r <= g) for r, _, ok in c["probes"])  # every higher rate failed
    assert sr.result.lo == g and sr.result.hi == min(r for r, _, ok in c["probes"] if not ok)
    assert sr.best is not None and sr.best.rate == g and sr.best.judged >= 5 * 300


def _as_result(rate: float, a: float):
    from pdserve.bench.goodput import AttainmentResult

    return AttainmentResult(rate, a, a >= 0.9)


def test_rule_arithmetic():
    rule = SteadyState(horizon=12, min_judged=300)
    assert rule.lifetime(SLO(1.0, 0.02), 500) == pytest.approx(1.0 + 499 * 0.02)
    assert rule.warmup(13.24, 10.98) == math.ceil(13.24 * 6 * 10.98)  # 873
    assert rule.num_requests(13.24, 10.98) == 2 * 873
    assert rule.num_requests(1.0, 1.0) == 6 + 300
    assert SteadyState.first_judged(306, 6) == 6
    assert SteadyState.first_judged(100, 80) == 50  # at least half is judged
    v = rule.verdict([True] * 95 + [False] * 5, 0.9)
    assert (v.attainment, v.passed, v.judged) == (0.95, True, 100)
    # all misses in the last batch: batch means spread more than the binomial error
    assert v.confidence < confidence(0.95, 0.9, 100)
    assert confidence(0.9, 0.9, 100) == pytest.approx(0.5)
    assert confidence(0.5, 0.9, 1000) > 0.999
    # rule 4: a whole run under the target fails, whatever its judged part says
    v = rule.verdict([True] * 100, 0.9, whole=0.85)
    assert (v.attainment, v.passed) == (0.85, False)
    with pytest.raises(ValueError, match="horizon"):
        SteadyState(horizon=0)


def _stand_in(confidences: dict[float, float], passed: bool = True):
    """A probe whose verdict at horizon ``h`` has confidence ``confidences[h]``; records the
    rules it was called with."""
    from pdserve.bench.goodput import AttainmentResult

    calls: list[SteadyState] = []

    def probe(rule: SteadyState) -> AttainmentResult:
        calls.append(rule)
        return AttainmentResult(1.0, 0.91, passed, {"confidence": confidences[rule.horizon]})

    return probe, calls


def test_an_uncertain_pass_is_extended_until_confident_by_hand():
    """Rule 6: a pass at confidence 0.6 is run again at twice the horizon and judged minimum;
    its confident pass there is the verdict."""
    from pdserve.bench.steady import until_confident

    probe, calls = _stand_in({12.0: 0.6, 24.0: 0.95})
    res = until_confident(SteadyState(), probe)
    assert [(c.horizon, c.min_judged) for c in calls] == [(12.0, 300), (24.0, 600)]
    assert res.passed and res.details["extensions"] == 1 and "uncertain" not in res.details


def test_a_pass_uncertain_at_the_longest_probe_fails():
    from pdserve.bench.steady import until_confident

    probe, calls = _stand_in({12.0: 0.6, 24.0: 0.7, 48.0: 0.89})
    res = until_confident(SteadyState(), probe)
    assert [c.horizon for c in calls] == [12.0, 24.0, 48.0]  # extensions=2: 4 x the length
    assert not res.passed and res.details["uncertain"] and res.details["extensions"] == 2


def test_fails_and_confident_passes_are_not_extended():
    from pdserve.bench.steady import until_confident

    for passed, conf in ((False, 0.5), (True, 0.9)):
        probe, calls = _stand_in({12.0: conf}, passed)
        res = until_confident(SteadyState(), probe)
        assert len(calls) == 1 and res.passed is passed and res.details["extensions"] == 0
    probe, calls = _stand_in({12.0: 0.5})  # min_confidence 0: every pass taken (the old rule)
    assert until_confident(SteadyState(min_confidence=0.0), probe).passed and len(calls) == 1


def test_episodes_longer_than_the_probe_make_its_pass_uncertain():
    """The long-context plan's case (module docstring, rule 6): judged requests that meet the
    SLO in calm stretches and miss in bursts attain above the target on average, but their
    batch means spread so far that the pass is not confident, while the same attainment spread
    evenly is."""
    rule = SteadyState()
    calm, burst = [True] * 50, [True] * 27 + [False] * 23  # 100 % and 54 % batches
    episodes = (calm * 4 + burst) * 2   # 10 batches of 50: 90.8 %
    even = ([True] * 45 + [False] * 4 + [True]) * 10  # 10 batches of 50: 92 % each
    a, b = rule.verdict(episodes, 0.9), rule.verdict(even, 0.9)
    # by hand: batch means 1 (x 8) and 0.54 (x 2), standard error sqrt(0.33856 / 9 / 10) =
    # 0.0613, z = 0.008 / 0.0613 = 0.13: confidence 0.552 (the binomial se would give 0.73)
    assert a.passed and a.attainment == pytest.approx(0.908)
    assert a.confidence == pytest.approx(0.552, abs=2e-3)
    assert a.confidence < rule.min_confidence
    # the binomial se sqrt(0.92 x 0.08 / 500) = 0.0121, z = 1.649: 0.950, taken
    assert b.passed and b.confidence == pytest.approx(0.950, abs=2e-3)
    assert b.confidence >= rule.min_confidence
