"""The search's bounds (early stop against the incumbent, exhaustive search as the reference)
and EcoServe's PaDG as the planner's third strategy (EcoServe §4.2.1, issue 13 item 6)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from pdserve.bench.metrics import SLO
from pdserve.cli import main
from pdserve.config import ClusterConfig
from pdserve.planner.placements import replica_placements
from pdserve.planner.problem import Problem
from pdserve.planner.search import plan
from pdserve.planner.units import Unit, UnitResult, candidate_units, evaluate_unit, unpaired_units

from .test_mdl_optimum import closed_form_goodput

D = 0.1  # TP1 prefill time (s), constant: an M/D/1 server (test_mdl_optimum)


def _mdl_problem(prof: str, n: int = 800) -> Problem:
    return Problem(model="opt-13b", profile=prof, workload="fixed:input=512,output=2",
                   num_requests=n, slo=SLO(0.3, 10.0), rate=1.0, nodes=1, gpus_per_node=2,
                   lm=512, precision=0.05, max_probes=8, engine=(("max_num_seqs", 8),))


def test_a_unit_that_cannot_beat_the_incumbent_stops_after_one_probe(const_profile):
    p = _mdl_problem(const_profile({1: D * 1000}))
    g = closed_form_goodput(0.3, D, D)  # the unit's true goodput (M/D/1, Erlang)
    r = evaluate_unit(p, Unit("prefill", 1), incumbent=1.4 * g)
    assert r.stopped is not None and len(r.probes) == 1
    assert r.probes[0]["rate"] == pytest.approx(1.4 * g) and not r.probes[0]["passed"]
    assert (r.goodput_rps, r.bound_rps) == (0.0, pytest.approx(1.4 * g))


def test_a_unit_that_beats_the_incumbent_is_searched_as_without_one(const_profile):
    p = _mdl_problem(const_profile({1: D * 1000}))
    g = closed_form_goodput(0.3, D, D)
    plain = evaluate_unit(p, Unit("prefill", 1))
    r = evaluate_unit(p, Unit("prefill", 1), incumbent=0.6 * g)
    assert r.stopped is None and r.probes[0]["phase"] == "incumbent" and r.probes[0]["passed"]
    assert r.goodput_rps == plain.goodput_rps  # the same search after the tie probe
    assert [q["rate"] for q in r.probes[1:]] == [q["rate"] for q in plain.probes]
    assert plain.goodput_rps == pytest.approx(g, rel=0.1)


def test_bounded_search_finds_the_exhaustive_optimum(const_profile):
    """Branch and bound (dominance + early stop) against brute force: every unit searched to
    convergence. The best placement and each strategy's best must be the same."""
    prof = const_profile({1: 60.0, 2: 40.0}, decode_ms=20.0)
    p = Problem(model="opt-13b", profile=prof, slo=SLO(0.5, 0.1), rate=3.0, gpus_per_node=2,
                workload="fixed:input=256,output=8", num_requests=60, max_probes=6,
                horizon=1.0, max_pp=1, engine=(("max_num_seqs", 4),))
    fast = plan(p, workers=1, strategies=("colocated", "disaggregated"))
    full = plan(p, workers=1, strategies=("colocated", "disaggregated"), prune=False)
    assert fast.best.name == full.best.name
    assert fast.best.goodput_rps == full.best.goodput_rps
    for s in ("colocated", "disaggregated"):
        assert fast.best_of(s).name == full.best_of(s).name, s
        assert fast.best_of(s).per_gpu_rps == full.best_of(s).per_gpu_rps, s
    # the bounds did work: fewer probes, and every stopped unit's bound is below the best
    probes = lambda res: sum(len(u.probes) for u in res.units)  # noqa: E731
    assert probes(fast) < probes(full)
    best = {u.unit.kind: max(x.per_gpu_rps for x in full.units if x.unit.kind == u.unit.kind)
            for u in full.units}
    for u in fast.units:
        if u.stopped:
            assert u.bound_rps / u.unit.num_gpus <= best[u.unit.kind] + 1e-12


def test_padg_candidates_fit_the_cluster(const_profile):
    # profile at TP 1, 2, 4; OPT-13B has 40 layers (PP 1, 2, 4 within a node of 4)
    prof = const_profile({1: 60.0, 2: 40.0, 4: 30.0})
    p = Problem(model="opt-13b", profile=prof, nodes=1, gpus_per_node=4, macro_size=2)
    got = [(u.tp, u.pp, u.size, u.num_gpus) for u in candidate_units(p, ("partial",))]
    # a macro instance of two TP x PP instances must fit 4 GPUs: TP1 PP1, TP1 PP2, TP2 PP1
    assert got == [(1, 1, 2, 2), (1, 2, 2, 4), (2, 1, 2, 4)]
    two = Problem(model="opt-13b", profile=prof, nodes=2, gpus_per_node=4, macro_size=2)
    got = {(u.tp, u.pp) for u in candidate_units(two, ("partial",))}
    assert got == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}  # up to 8 GPUs, any nodes
    assert {u.kind for u in candidate_units(p)} == {"colocated", "prefill", "decode",
                                                      "partial"}
    with pytest.raises(ValueError, match="'padg'"):
        candidate_units(p, ("padg",))


def test_phase_units_without_room_for_the_other_phase_are_not_searched(const_profile):
    """Hand-worked: on 1 x 4 GPUs a disaggregated placement holds at least one instance of
    each phase, so a prefill or decode unit of 4 GPUs (TP4, TP2 PP2, TP1 PP4) has no room
    beside the other phase's smallest (TP1, 1 GPU); the 2-GPU units keep theirs. With low
    affinity on 2 x 4 GPUs a stage's two segments share a node: TP4 leaves no GPU of the
    node for the other phase, whatever its PP."""
    prof = const_profile({1: 60.0, 2: 40.0, 4: 30.0})
    p = Problem(model="opt-13b", profile=prof, nodes=1, gpus_per_node=4)
    units = candidate_units(p, ("disaggregated",))
    cut = {(r.unit.kind, r.unit.tp, r.unit.pp) for r in unpaired_units(p, units)}
    assert cut == {(k, tp, pp) for k in ("prefill", "decode")
                   for tp, pp in ((4, 1), (2, 2), (1, 4))}
    assert all("no room beside the smallest" in r.pruned for r in unpaired_units(p, units))
    low = Problem(model="opt-13b", profile=prof, nodes=2, gpus_per_node=4, affinity="low")
    units = candidate_units(low, ("disaggregated",))
    cut = {(r.unit.kind, r.unit.tp) for r in unpaired_units(low, units)}
    assert cut == {("prefill", 4), ("decode", 4)}
    assert len(unpaired_units(low, units)) == 2 * len({u.pp for u in units})
    # one phase alone (no pair to make): nothing to cut
    assert unpaired_units(p, [u for u in units if u.kind == "prefill"]) == []


def test_padg_placement_replicates_macro_instances():
    p = Problem(rate=5.0, nodes=2, gpus_per_node=4, slo=SLO(1.0, 0.1), macro_size=2)
    u = Unit("partial", 1, 1, size=2)
    (pl,) = replica_placements(p, [UnitResult(u, 2.0, 1.0)])
    # ceil(5 / 2) = 3 macro instances of 2 TP1 instances: 6 GPUs, capacity 6 req/s
    assert (pl.strategy, pl.num_gpus, pl.goodput_rps, pl.fits) == ("partial", 6, 6.0, True)
    spec = ClusterConfig.from_dict(pl.deployment)
    assert spec.strategy == "partial" and spec.macro.size == 2
    assert [(r.role, r.count, r.tp) for r in spec.roles] == [("temporal", 6, 1)]
    assert (spec.macro.slo_ttft, spec.macro.slo_tpot, spec.prefill_router) == \
        (1.0, 0.1, "macro_rolling")
    assert [s.node for s in spec.instance_specs()] == [0, 0, 0, 0, 1, 1]


def test_a_padg_plan_file_runs_with_simulate_config(const_profile, tmp_path: Path, capsys):
    prof = const_profile({1: 60.0}, decode_ms=20.0)
    out = tmp_path / "plan.yaml"
    rc = main(["plan", "--profile", prof, "--model", "opt-13b", "--gpus-per-node", "2",
               "--workload", "fixed:input=256,output=4", "--slo-ttft", "1", "--slo-tpot",
               "0.2", "--rate", "2", "--num-requests", "30", "--max-probes", "3",
               "--strategies", "partial", "--out", str(out), "--no-progress"])
    assert rc == 0
    spec = yaml.safe_load(out.read_text())
    assert [r["role"] for r in spec["roles"]] == ["temporal"]
    assert spec["prefill_router"] == "macro_rolling" and spec["simulation"]["profile"] == prof
    assert "partial" in capsys.readouterr().out
    rc = main(["simulate", "--config", str(out), "--workload", "fixed:input=256,output=4",
               "--num-requests", "20", "--rate", "2", "--no-progress"])
    assert rc == 0
    out_text = capsys.readouterr().out
    assert "sim:partial" in out_text and "20 requests" in out_text
    # the file names the command that replays what was planned: workload, rate, SLO
    (line,) = [x for x in out.read_text().splitlines() if x.startswith("# simulate")]
    argv = shlex.split(line.split(": ", 1)[1])
    assert argv[:4] == ["pdserve", "simulate", "--config", str(out)]
    for flag, value in (("--workload", "fixed:input=256,output=4"), ("--rate", "2"),
                        ("--num-requests", "30"), ("--slo-ttft", "1"), ("--slo-tpot", "0.2")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert main(argv[1:] + ["--no-progress"]) == 0
    assert "30 requests" in capsys.readouterr().out


def test_advice_point_names_the_winner_of_three():
    from pdserve.planner.advise import AdvicePoint

    pt = lambda c, d, q: AdvicePoint(1.0, 1.0, c, d, "c", "d", q, "q")  # noqa: E731
    assert pt(1.0, 1.2, 1.1).winner == "disaggregated"
    assert pt(1.0, 0.9, 1.1).winner == "partial"
    assert pt(1.0, 1.0, 1.0).winner == "colocated"  # a tie goes to the simpler strategy
    assert pt(0.0, 0.0, 0.0).winner == "neither"
    assert pt(2.0, 3.0, 0.0).ratio == pytest.approx(1.5)
