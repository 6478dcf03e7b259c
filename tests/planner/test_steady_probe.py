"""The planner's probes follow the steady-state rule (pdserve.bench.steady): a prefill unit
with a constant 100 ms step and one 512-token prompt per batch (L_m = 512) is an M/D/1 server
of capacity 10 req/s (DistServe §3.1)."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import SLO
from pdserve.planner.problem import Problem
from pdserve.planner.units import (
    Unit,
    decode_feed,
    probe_requests,
    probe_warmup,
    run_probe,
    unit_deployment,
    unit_workload,
)
from tests.planner.test_mdl_optimum import mdl_wait_cdf

D = 0.1


@pytest.fixture
def problem(const_profile) -> Problem:
    return Problem(model="opt-13b", profile=const_profile({1: D * 1000}),
                   workload="fixed:input=512,output=2", slo=SLO(5.0, 10.0), nodes=1,
                   gpus_per_node=1, lm=512, engine=(("max_num_seqs", 8),))


def _probe(p: Problem, rate: float, n: int | None = None, early: bool = True):
    u = Unit("prefill", 1)
    reqs = unit_workload(p, u, rate).retimed(rate).requests[:n]
    return run_probe(p, unit_deployment(p, u, *decode_feed(p, rate)), reqs, rate, u.kind, early)


@pytest.mark.parametrize("early", [True, False])
def test_an_overloaded_rate_is_rejected_and_an_underloaded_one_accepted(problem, early):
    over, under = 11.0, 8.0
    assert over * D > 1 and under * D < 1  # closed form: 10 req/s is the capacity
    assert probe_warmup(problem, over, "prefill") == 330  # 11/s x 6 lifetimes x 5 s
    assert probe_requests(problem, over, "prefill") == 660
    r = _probe(problem, over, early=early)
    assert not r.passed and r.details["judged"] == 330
    assert r.details["confidence"] > 0.99
    assert mdl_wait_cdf(5.0 - D, under, D) > 0.999
    r = _probe(problem, under, early=early)
    assert r.passed and r.details["confidence"] > 0.99


def test_the_300_request_probe_passed_the_overloaded_rate(problem):
    """Before the rule a prefill probe was 300 requests, all judged: the 11 req/s backlog has
    not passed the 5 s SLO when they end."""
    old = Problem(**{**problem.__dict__, "num_requests": 300, "horizon": 1e-9})
    assert probe_requests(old, 11.0, "prefill") == 301  # one warm-up request, 300 judged
    assert _probe(old, 11.0, early=False).passed


def test_the_distserve_criterion_checks_the_two_percentiles_separately(const_profile):
    """``criterion="distserve"``: a probe's attainment is min(share meeting TTFT, share
    meeting TPOT) of its judged requests (pdserve.bench.metrics.attainment), here against a
    hand count over the same simulation's records."""
    from pdserve.bench.metrics import meets
    from pdserve.planner.units import _sim
    from pdserve.sim.target import build_simulator, to_records, to_sim_requests

    prof = const_profile({1: 60.0}, decode_ms=30.0, decode_per_seq_ms=2.0)
    p = Problem(model="opt-13b", profile=prof, workload="fixed:input=256,output=16",
                slo=SLO(0.1, 0.06), nodes=1, gpus_per_node=1, num_requests=100,
                criterion="distserve")
    u = Unit("colocated", 1)
    rate = 4.0
    reqs = unit_workload(p, u, rate).retimed(rate).requests
    dep = unit_deployment(p, u)
    r = run_probe(p, dep, reqs, rate, u.kind)
    res = build_simulator(_sim(p, dep)).simulator.run(to_sim_requests(reqs, 50272))
    recs = sorted(to_records(reqs, res), key=lambda x: x.timeline.arrival)
    judged = recs[probe_warmup(p, rate, u.kind):]
    flags = [meets(x, p.slo) for x in judged]
    ttft, tpot = sum(a for a, _ in flags), sum(b for _, b in flags)
    assert ttft != tpot  # the two criteria differ on this probe
    assert r.details["criterion"] == "distserve" and r.details["judged"] == len(judged)
    assert r.attainment == pytest.approx(min(ttft, tpot) / len(judged))
    both = run_probe(Problem(**{**p.__dict__, "criterion": "both"}), dep, reqs, rate, u.kind,
                     early=False)
    assert both.attainment == pytest.approx(sum(a and b for a, b in flags) / len(judged))
    assert both.attainment < r.attainment
