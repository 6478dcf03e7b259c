"""What ``pdserve plan`` tells its user: the defaults it applies, a rate no placement can serve
said before any simulation, the placement a GPU count names."""

from __future__ import annotations

import re

import pytest

import pdserve.planner.units as unit_mod
from pdserve.bench.metrics import SLO
from pdserve.cli import main
from pdserve.planner.problem import ENGINE_DEFAULTS, Problem
from pdserve.planner.search import CEILING_SLACK, plan, rate_ceiling
from pdserve.planner.units import candidate_units, unit_model


def test_help_shows_the_engine_defaults_the_planner_applies(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    settings = Problem().engine_settings()
    for name in ENGINE_DEFAULTS:
        flag = "--" + name.replace("_", "-")
        shown = re.search(re.escape(flag) + r"[^(]*\(default: (\w+)\)", text)
        assert shown is not None and shown.group(1) == str(settings[name]), name



@pytest.mark.parametrize(("model", "dtype"), [("llama-3.1-8b", "bfloat16"),
                                              ("opt-13b", "float16")])
def test_the_planner_plans_the_checkpoints_dtype(capsys, model, dtype):
    # the checkpoints' own torch_dtype (Llama 3.1 ships bfloat16, OPT float16), as simulate
    # serves them; plan --help says so, and a given dtype wins
    p = Problem(model=model, hardware="A100-80GB")
    assert p.engine_settings()["dtype"] == dtype
    dep = unit_mod.unit_deployment(p, unit_mod.Unit("colocated", 1))
    assert dep["engine"]["dtype"] == dtype
    assert Problem(model=model, engine={"dtype": "float32"}).engine_settings()["dtype"] == \
        "float32"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dtype {float32,bfloat16,float16} weight and KV dtype (default: auto: the " \
           "checkpoint's" in text


def test_a_rate_beyond_the_capacity_bounds_fails_before_any_simulation(const_profile,
                                                                      monkeypatch):
    p = Problem(model="opt-13b", profile=const_profile({1: 100.0}, decode_ms=20.0,
                                                       decode_per_seq_ms=1.0),
                workload="fixed:input=512,output=8", slo=SLO(5.0, 1.0), nodes=1,
                gpus_per_node=2, lm=512, rate=1000.0)
    units = candidate_units(p)
    ceiling, how = rate_ceiling(p, units)
    # the bound by hand: the best of each unit kind replicated (colocated, partial) or split
    colo = max(2 // u.num_gpus * unit_model(p, u).capacity_rps for u in units
               if u.kind in ("colocated", "partial"))
    assert ceiling >= colo and 0 < ceiling < p.rate / CEILING_SLACK

    def never(*a, **k):
        raise AssertionError("simulated")

    monkeypatch.setattr(unit_mod, "evaluate_unit", never)
    with pytest.raises(ValueError, match=r"1000 req/s is beyond .* nothing was simulated"):
        plan(p, 1)


def test_a_strategy_without_a_fitting_placement_says_why(const_profile, capsys):
    prof = const_profile({1: 60.0}, decode_ms=20.0)
    assert main(["plan", "--profile", prof, "--model", "opt-13b", "--gpus-per-node", "1",
                 "--workload", "fixed:input=256,output=4", "--slo-ttft", "1", "--slo-tpot",
                 "0.2", "--num-requests", "30", "--max-probes", "3", "--strategies",
                 "colocated,disaggregated", "--no-progress"]) == 0
    out = capsys.readouterr().out
    # one GPU holds no prefill instance beside a decode one
    assert re.search(r"^\| disaggregated \| none: every unit pruned \(no room beside the "
                     r"smallest (decode|prefill) unit", out, re.M)
    assert "| partial |" not in out  # not searched, not listed
