"""Steady-state rule 7 (pdserve.bench.steady): the goodput a plan bets on is confirmed over a
long probe.

The server: a prefill instance with a constant 100 ms step and one 512-token prompt per batch,
whose requests end at their first token, is an M/D/1 queue of capacity 10 req/s (DistServe
§3.1, tests/planner/test_steady_probe.py). With a 5 s TTFT SLO and a 90 % target its goodput is
9.96 req/s in closed form (Erlang's waiting time, test_mdl_optimum.closed_form_goodput). A probe
of 12 lifetimes cannot reject a rate up to ~9 % over capacity (steady.py, "Why this length"), so
the rate search lands past capacity; five probe lengths reject anything ~2 % over it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest

import pdserve.planner.search as search
from pdserve.bench.goodput import AttainmentResult
from pdserve.bench.metrics import SLO
from pdserve.bench.steady import SteadyState, until_confident
from pdserve.config import ClusterConfig
from pdserve.planner.placements import confirm_goodput, simulate_goodput
from pdserve.planner.problem import Problem
from pdserve.planner.replan import WindowStats, deployed_planner
from pdserve.planner.search import plan
from pdserve.planner.units import (
    Unit,
    confirm,
    decode_feed,
    evaluate_unit,
    unit_deployment,
    unit_probe,
)
from tests.planner.conftest import stand_in_units
from tests.planner.test_mdl_optimum import closed_form_goodput, mdl_wait_cdf

D, SLO_TTFT = 0.1, 5.0


@pytest.fixture
def mdl(const_profile):
    p = Problem(model="opt-13b", profile=const_profile({1: D * 1000}),
                workload="fixed:input=512,output=1", slo=SLO(SLO_TTFT, 10.0), nodes=1,
                gpus_per_node=1, lm=512, engine=(("max_num_seqs", 8),))
    return p, unit_deployment(p, Unit("prefill", 1), *decode_feed(p, 10.0))


def test_the_confirmation_rule_is_five_probe_lengths_without_extensions():
    rule = SteadyState().confirming(5)
    assert (rule.horizon, rule.min_judged, rule.extensions) == (60.0, 1500, 0)
    assert rule.num_requests(10.0, 5.0) == 1500 + 1500  # 10/s x 30 lifetimes x 5 s, as many
    with pytest.raises(ValueError, match="probe lengths"):
        SteadyState().confirming(0)
    calls = []

    def uncertain(r: SteadyState) -> AttainmentResult:  # a pass no longer probe can firm up
        calls.append(r.horizon)
        return AttainmentResult(1.0, 0.92, True, {"confidence": 0.6})

    out = until_confident(rule, uncertain)
    assert calls == [60.0] and not out.passed and out.details["uncertain"]


def test_a_goodput_past_capacity_is_lowered_to_one_that_holds(mdl):
    p, dep = mdl
    closed = closed_form_goodput(SLO_TTFT, D, D)
    assert 9.9 < closed < 10.0
    searched, _ = simulate_goodput(p, dep, 9.0)  # 12-lifetime probes
    assert searched > 1 / D  # past capacity: its queue grows without bound
    g, info = confirm_goodput(p, dep, searched)
    assert not info["held"] and info["rate"] == searched
    assert info["judged"] >= 5 * p.num_requests
    assert info["probes"][0][:3:2] == (searched, False)
    assert g <= 1 / D  # at or under capacity now
    assert g >= closed - p.precision * searched  # within the search's bracket of the truth
    assert all(ok == (r <= g) for r, _, ok in info["probes"])  # every higher rate failed


def test_a_goodput_under_capacity_holds_with_one_probe(mdl):
    p, dep = mdl
    assert mdl_wait_cdf(SLO_TTFT - D, 9.0, D) > 0.999
    g, info = confirm_goodput(p, dep, 9.0)
    assert g == 9.0 and info["held"] and len(info["probes"]) == 1
    assert info["attainment"] == 1.0 and info["confidence"] > 0.99


# ------------------------------------------------------------- the plan: stand-ins, by hand
# Rate 4 on one node of 8 GPUs, top 2 per strategy, colocated and PaDG. Units: colocated TP1
# chunked 1.0 req/s alone (4 replicas), prefill-first 0.95 (5 replicas); a PaDG macro
# instance of 2 x TP1 2.2 (2 of them). Whole: 4.8 (1.2 per GPU), 5.5 (1.1), 3.6 (0.9). The
# long probe: the chunked replicas hold only 4.0 (1.0 per GPU), the others hold.
UNITS = {Unit("colocated", 1, 1, True): 1.0, Unit("colocated", 1, 1, False): 0.95,
         Unit("partial", 1, 1, size=2): 2.2}
WHOLE = {"colocated 4x(TP1 PP1 chunked)": 4.8, "colocated 5x(TP1 PP1)": 5.5,
         "partial 2x[2x temporal (TP1 PP1)]": 3.6}
HOLDS = {"colocated 4x(TP1 PP1 chunked)": 4.0}


@pytest.fixture
def stand_ins(monkeypatch):
    stand_in_units(monkeypatch, UNITS, lambda u: 10.0 * u.num_gpus)
    confirmed: list[str] = []

    def confirm_eval(args):
        _, pl = args
        confirmed.append(pl.name)
        g, held = HOLDS.get(pl.name, pl.goodput_rps), pl.name not in HOLDS
        probes = [(pl.goodput_rps, 0.95 if held else 0.7, held)]
        if not held:  # the search downwards: its lowest probe passed, or none did
            probes.append((g or pl.goodput_rps / 2, 0.95 if g else 0.8, g > 0))
        return pl.name, g, {"factor": 5, "rate": pl.goodput_rps, "held": held,
                            "attainment": probes[0][1], "judged": 3000, "confidence": 0.99,
                            "probes": probes}

    monkeypatch.setattr(search, "pair_eval", lambda args: (args[1].name, WHOLE[args[1].name]))
    monkeypatch.setattr(search, "confirm_eval", confirm_eval)
    return confirmed


def _problem(**kw) -> Problem:
    return Problem(model="opt-13b", hardware="L20", workload="chatbot", slo=SLO(5.0, 0.1),
                   rate=4.0, nodes=1, gpus_per_node=8, max_pp=1, top_k=2, **kw)


def test_a_leader_that_fails_its_long_probe_yields_to_the_next(stand_ins):
    """Round 1 confirms each strategy's leader side by side: the chunked replicas (1.2 per
    GPU whole) hold only 1.0, so the prefill-first ones (1.1) lead and round 2 confirms them;
    they hold and are chosen. Every placement ranked is confirmed first. Each step is said
    (progress)."""
    lines: list[str] = []
    r = plan(_problem(), 1, strategies=["colocated", "partial"], on_stage=lines.append)
    assert lines == [
        "simulating whole: colocated 4x(TP1 PP1 chunked), colocated 5x(TP1 PP1), "
        "partial 2x[2x temporal (TP1 PP1)]",
        "confirming over 5 x the probe length: colocated 4x(TP1 PP1 chunked) at 4.800 req/s, "
        "partial 2x[2x temporal (TP1 PP1)] at 3.600 req/s",
        *lines[2:4],
        "confirming over 5 x the probe length: colocated 5x(TP1 PP1) at 5.500 req/s",
        lines[5]]
    assert lines[2].startswith("colocated 4x(TP1 PP1 chunked): failed over 5 x the probe length")
    assert lines[5].startswith("colocated 5x(TP1 PP1): holds over 5 x the probe length")
    assert stand_ins == ["colocated 4x(TP1 PP1 chunked)", "partial 2x[2x temporal (TP1 PP1)]",
                         "colocated 5x(TP1 PP1)"]
    assert r.best.name == "colocated 5x(TP1 PP1)"
    assert r.best.per_gpu_rps == pytest.approx(1.1) and r.best.confirmed["held"]
    names = [x.name for x in [r.best, *r.alternatives]]
    assert names == ["colocated 5x(TP1 PP1)", "colocated 4x(TP1 PP1 chunked)",
                     "partial 2x[2x temporal (TP1 PP1)]"]
    lowered = r.alternatives[0]
    assert lowered.goodput_rps == 4.0 and not lowered.confirmed["held"]
    assert "confirmed at 4.000 req/s" in lowered.note
    assert any(n.startswith("colocated 4x(TP1 PP1 chunked): failed over 5 x") for n in r.notes)
    assert r.best_partial.confirmed["held"] and r.best_partial.per_gpu_rps == pytest.approx(0.9)


def test_a_leader_that_holds_ends_the_confirmation(stand_ins):
    HOLDS.clear()
    try:
        r = plan(_problem(), 1, strategies=["colocated", "partial"])
    finally:
        HOLDS["colocated 4x(TP1 PP1 chunked)"] = 4.0
    assert stand_ins == ["colocated 4x(TP1 PP1 chunked)", "partial 2x[2x temporal (TP1 PP1)]"]
    assert r.best.name == "colocated 4x(TP1 PP1 chunked)"
    assert r.best.per_gpu_rps == pytest.approx(1.2)
    assert r.alternatives[0].confirmed is not None  # the partial leader, confirmed too
    assert r.alternatives[1].confirmed is None  # the prefill-first replicas: whole only


def test_a_placement_no_rate_of_which_holds_is_dropped(stand_ins):
    HOLDS["partial 2x[2x temporal (TP1 PP1)]"] = 0.0
    try:
        r = plan(_problem(), 1, strategies=["colocated", "partial"])
    finally:
        del HOLDS["partial 2x[2x temporal (TP1 PP1)]"]
    assert r.best_partial is None
    assert all(not x.name.startswith("partial") for x in r.alternatives)
    assert any(n.startswith("partial 2x[2x temporal (TP1 PP1)]: failed over 5 x")
               and n.endswith("no rate held down to 1.800 req/s: dropped") for n in r.notes)


def test_confirm_zero_turns_the_rule_off(stand_ins):
    r = plan(_problem(confirm=0), 1, strategies=["colocated", "partial"])
    assert stand_ins == []
    assert r.best.name == "colocated 4x(TP1 PP1 chunked)" and r.best.confirmed is None


def test_confirmations_per_strategy_are_capped(stand_ins, monkeypatch):
    """One round per strategy: the chunked replicas fall behind the prefill-first ones,
    which are not confirmed then; the choice is the confirmed placement, and an unconfirmed
    one ranks after it whatever its goodput."""
    monkeypatch.setattr(search, "CONFIRM_ROUNDS", 1)
    r = plan(_problem(), 1, strategies=["colocated"])
    assert stand_ins == ["colocated 4x(TP1 PP1 chunked)"]
    assert r.best.name == "colocated 4x(TP1 PP1 chunked)" and r.best.confirmed is not None
    assert r.alternatives[0].confirmed is None


def test_the_problem_refuses_a_bad_length():
    with pytest.raises(ValueError, match="confirm must be an integer >= 0"):
        replace(_problem(), confirm=-1)


# --------------------------------------------------------------------- the live replanner
def test_the_live_replanner_counts_instances_by_confirmed_goodputs(mdl):
    """``deployed_planner`` (``serve --replan``) replicates each role by its unit's goodput
    confirmed as a plan's is. The colocated TP1 unit of this server (it batches prompts, so it
    is no M/D/1 queue) searches to a goodput that five probe lengths lower; ⌈R / g⌉ on the
    searched one would plan too few instances for 130 req/s. (Probes of 6 lifetimes: rule 7
    does not depend on the length, the test's time does.)"""
    p = replace(mdl[0], horizon=6.0)
    cfg = ClusterConfig.from_dict({"model": "opt-13b", "strategy": "colocated",
                                   "num_instances": 1})
    window = WindowStats(rate=130.0, mean_prompt=512.0, mean_output=1.0, num_requests=600)
    q, u = replace(p, rate=130.0), Unit("colocated", 1)
    searched = evaluate_unit(q, u).goodput_rps
    confirmed, info = confirm(q, partial(unit_probe, q, u), searched, 1)
    assert confirmed < searched and not info["held"] and info["factor"] == 5
    assert math.ceil(130 / confirmed) > math.ceil(130 / searched)
    assert deployed_planner(p, cfg)(window) == {"colocated": math.ceil(130 / confirmed)}
    assert deployed_planner(replace(p, confirm=0), cfg)(window) == \
        {"colocated": math.ceil(130 / searched)}
