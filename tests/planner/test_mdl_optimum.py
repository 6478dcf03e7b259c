"""The phase search against DistServe's M/D/1 analysis (§3.1), whose optimum is known in closed
form.

A prefill instance serving fixed-length prompts one at a time (L_m = the prompt length) with a
constant step time is an M/D/1 queue: TTFT = W + D, with W the M/D/1 waiting time. Intra-op
parallelism (TP2, speed-up K) is M/D/1 with service D/K on 2 GPUs; inter-op (PP2, equal stages)
queues at the first stage with service D/2 and then takes a full pass D (Eq. 2). Erlang's
waiting-time distribution gives each unit's goodput — the highest Poisson rate with
P(TTFT <= SLO) >= 90 % — exactly; the simulated search must land on it and rank the units as
the closed form does: TP wins under a tight TTFT SLO, PP under a loose one (Fig. 4).
"""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import SLO
from pdserve.planner.problem import Problem
from pdserve.planner.units import Unit, UnitCache

D, K = 0.1, 1.6  # TP1 prefill time (s); TP2 speed-up


def mdl_wait_cdf(t: float, lam: float, d: float) -> float:
    """P(W <= t) of an M/D/1 queue (Erlang): (1-ρ) Σ_{k<=t/d} [λ(kd-t)]^k / k! e^{-λ(kd-t)}."""
    if t < 0:
        return 0.0
    total = 0.0
    for k in range(int(math.floor(t / d)) + 1):
        x = lam * (k * d - t)
        total += x ** k / math.factorial(k) * math.exp(-x)
    return (1 - lam * d) * total


def closed_form_goodput(slo: float, exec_s: float, service_s: float, target: float = 0.9
                        ) -> float:
    lo, hi = 0.0, (1 - 1e-9) / service_s
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mdl_wait_cdf(slo - exec_s, mid, service_s) >= target else (lo, mid)
    return lo


def test_erlang_formula_against_known_values():
    # P(W = 0) = 1 - ρ, and for t < d only the k = 0 term: (1 - ρ) e^{λt}
    assert mdl_wait_cdf(0.0, 5.0, 0.1) == pytest.approx(0.5)
    assert mdl_wait_cdf(0.05, 5.0, 0.1) == pytest.approx(0.5 * math.exp(0.25))
    # mean of W from the CDF equals Pollaczek-Khinchine: ρd / (2(1-ρ))
    lam, d, dt = 6.0, 0.1, 1e-3
    mean = sum((1 - mdl_wait_cdf(i * dt, lam, d)) * dt for i in range(1500))
    assert mean == pytest.approx(lam * d * d / (2 * (1 - lam * d)), rel=0.01)


@pytest.mark.parametrize("slo_ttft,winner", [(0.12, Unit("prefill", 2)),
                                              (0.3, Unit("prefill", 1, 2))])
def test_phase_search_finds_the_closed_form_optimum(const_profile, slo_ttft, winner):
    prof = const_profile({1: D * 1000, 2: D / K * 1000})
    p = Problem(model="opt-13b", profile=prof, workload="fixed:input=512,output=2",
                num_requests=3000, slo=SLO(slo_ttft, 10.0), rate=1.0, nodes=1,
                gpus_per_node=2, lm=512, precision=0.01, max_probes=14,
                engine=(("max_num_seqs", 8),))
    units = [Unit("prefill", 1), Unit("prefill", 2), Unit("prefill", 1, 2)]
    expect = {Unit("prefill", 1): closed_form_goodput(slo_ttft, D, D),
              Unit("prefill", 2): closed_form_goodput(slo_ttft, D / K, D / K),
              Unit("prefill", 1, 2): closed_form_goodput(slo_ttft, D, D / 2)}
    with UnitCache(p) as cache:
        results = cache.get(units)
    got = {r.unit: r.goodput_rps for r in results}
    for u in units:
        assert got[u] == pytest.approx(expect[u], rel=0.08), u.label
    best = max(results, key=lambda r: r.per_gpu_rps)
    assert best.unit == winner
    assert max(expect, key=lambda u: expect[u] / u.num_gpus) == winner
