"""``pdserve plan --against``: hand-picked deployments are measured only on the plan's own
latency source, and each is simulated whole by the same rate search as the chosen placement."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from pdserve.bench.metrics import SLO
from pdserve.planner.cli import against_markdown, compare_whole
from pdserve.planner.problem import Problem


def _result(p: Problem) -> SimpleNamespace:
    best = SimpleNamespace(name="colocated 1x(TP1 PP1)", per_gpu_rps=1.0,
                           deployment={"model": p.model, "strategy": "colocated",
                                       "num_instances": 1})
    return SimpleNamespace(problem=p, best=best)


def test_a_deployment_on_another_latency_source_is_refused(tmp_path):
    p = Problem(model="opt-13b", hardware="L20", slo=SLO(5.0, 0.1))
    f = tmp_path / "a100.yaml"
    f.write_text(yaml.safe_dump({"model": "opt-13b", "strategy": "colocated",
                                 "num_instances": 2, "simulation": {"hardware": "A100-80GB"}}))
    with pytest.raises(ValueError, match="latency source"):
        compare_whole(_result(p), [str(f)], 1)


def test_the_chosen_placement_and_a_file_get_the_same_probes(tmp_path, monkeypatch):
    """The rate search sees each deployment with a first bracket of (chosen per GPU) x (its
    GPUs): 1.0 x 1 for the chosen single instance, 1.0 x 2 for the two-instance file; then
    each goodput is confirmed over 5 probe lengths, as a plan's leaders are (rule 7; here the
    long probe holds 90 % of it)."""
    import pdserve.planner.placements as placements

    p = Problem(model="opt-13b", hardware="L20", slo=SLO(5.0, 0.1))
    f = tmp_path / "two.yaml"
    f.write_text(yaml.safe_dump({"model": "opt-13b", "strategy": "colocated",
                                 "num_instances": 2, "simulation": {"hardware": "L20"}}))
    seen = []

    def fake(prob, dep, hi):
        seen.append((prob, dep.get("num_instances") or dep["roles"][0]["count"], hi))
        return 0.5 * hi, []

    def long(prob, dep, goodput):
        seen.append(("confirm", prob.confirm, goodput))
        return 0.9 * goodput, {"factor": prob.confirm, "held": False}

    monkeypatch.setattr(placements, "simulate_goodput", fake)
    monkeypatch.setattr(placements, "confirm_goodput", long)
    rows = compare_whole(_result(p), [str(f)], 1)
    assert [(x[0] is p, *x[1:]) if isinstance(x[0], Problem) else x for x in seen] == [
        (True, 1, 1.0), ("confirm", 5, 0.5), (True, 2, 2.0), ("confirm", 5, 1.0)]
    assert [(r["name"], r["num_gpus"], r["per_gpu_rps"]) for r in rows] == [
        ("chosen: colocated 1x(TP1 PP1)", 1, pytest.approx(0.45)),
        ("two", 2, pytest.approx(0.45))]
    assert all(r["confirmed"] == {"factor": 5, "held": False} for r in rows)
    assert against_markdown(rows).count("| lowered to hold over 5 x the probe length |") == 2
