"""Memory pruning, determinism, and one clear message for bad input (exit code 2)."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import SLO
from pdserve.cli import main
from pdserve.config import ClusterConfig, kv_cache_blocks
from pdserve.planner.problem import Problem
from pdserve.planner.search import plan
from pdserve.planner.units import Unit, UnitCache, evaluate_unit
from pdserve.sim.hardware import get_device
from pdserve.sim.model_catalogue import get_model_config

PROFILE = "distserve_profiler-a100-80g.distserve"


def test_units_that_cannot_hold_the_weights_are_pruned_unsimulated():
    # OPT-66B: ~132 GB of fp16 weights; TP2 on 80 GB GPUs leaves ~12 GB of KV, TP1 none at all
    model = get_model_config("opt-66b")
    engine = ClusterConfig.from_dict({"model": "opt-66b", "engine": {"dtype": "float16"}}
                                     ).engine_config(model_max_len=2048)
    with pytest.raises(ValueError):
        kv_cache_blocks(model, engine, device_memory_bytes=get_device("A100-80GB").memory_bytes,
                        num_devices=1)
    p = Problem(model="opt-66b", hardware="A100-80GB", rate=1.0, gpus_per_node=8,
                slo=SLO(2.5, 0.15))
    r = evaluate_unit(p, Unit("colocated", 1))
    assert r.pruned is not None and r.pruned.startswith("does not fit")
    assert r.probes == [] and r.goodput_rps == 0


def test_a_workload_without_decode_work_prunes_decode_units(const_profile):
    """Every output one token (the prefill makes it): a decode unit's TPOT objective holds at
    any rate, so its rate search would grow its probes without bound (two probes of 67k and
    107k requests took 38 s here, and ten would take days). It is pruned with the reason; the
    disaggregated strategy then says it has no decode unit, the others are planned."""
    p = Problem(model="opt-13b", profile=const_profile({1: 100.0}), rate=4.0, nodes=1,
                gpus_per_node=2, workload="fixed:input=512,output=1", slo=SLO(1.0, 10.0),
                num_requests=50, max_probes=4, confirm=0)
    r = evaluate_unit(p, Unit("decode", 1))
    assert r.pruned is not None and r.pruned.startswith("no decode phase") and r.probes == []
    assert evaluate_unit(p, Unit("prefill", 1)).goodput_rps > 0
    res = plan(p, strategies=("colocated", "disaggregated"))
    assert res.best.goodput_rps > 0 and res.best.deployment["strategy"] == "colocated"


def test_a_kv_cache_smaller_than_the_longest_request_is_pruned():
    # 3.5 GiB GPUs: 90 % of it minus OPT-1.3B's 2.63 GB of fp16 weights and the engine's
    # reserve (engine_reserved_bytes: ~486 MiB per GPU at a 2,048-token budget) leaves KV for
    # 1,232 tokens, under one 1,500 + 500-token request at TP1 (TP2: 16,272 tokens, enough).
    # The memory override goes through the one KV formula. (With 3 GiB, as before the reserve
    # was modelled, TP1 no longer holds the weights and the reserve at all.)
    p = Problem(model="opt-1.3b", hardware="A100-80GB", gpu_memory_gib=3.5, rate=1.0,
                gpus_per_node=2, slo=SLO(1.0, 0.1), workload="fixed:input=1500,output=500")
    r = evaluate_unit(p, Unit("colocated", 1))
    assert r.pruned == ("does not fit: colocated TP1 PP1 prefill-first: KV cache holds 1232 "
                        "tokens, fewer than the longest request (2000)")
    from pdserve.planner.units import unit_model

    assert unit_model(p, Unit("colocated", 2)).kv_tokens == 16272  # 1,017 blocks of 16


def test_an_slo_missed_at_zero_load_is_pruned_unsimulated(const_profile):
    prof = const_profile({1: 300.0})  # every prefill takes 0.3 s
    p = Problem(model="opt-13b", profile=prof, slo=SLO(0.25, 0.1), rate=1.0, gpus_per_node=1,
                workload="fixed:input=128,output=8")
    r = evaluate_unit(p, Unit("prefill", 1))
    assert r.pruned is not None and "zero load" in r.pruned and r.probes == []


def test_same_seed_same_plan(const_profile):
    prof = const_profile({1: 60.0, 2: 40.0}, decode_ms=20.0)
    p = Problem(model="opt-13b", profile=prof, slo=SLO(0.5, 0.1), rate=3.0, gpus_per_node=1,
                workload="fixed:input=256,output=4", num_requests=40, max_probes=3,
                horizon=0.1)
    a, b = (plan(p, workers=1, strategies=("colocated",)).to_dict() for _ in range(2))
    for d in (a, b):
        d.pop("wall_s")
        for u in d["units"]:
            u.pop("wall_s")
    assert a == b and a["units"][0]["probes"]
    units = [Unit("colocated", 1), Unit("colocated", 1, chunked=True)]
    with UnitCache(p, workers=2) as cache:  # a process pool gives the same numbers
        pooled = cache.get(units)
    assert [r.goodput_rps for r in pooled] == [u["goodput_rps"] for u in a["units"]]


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--model", "opt-13b", "--profile", "no-such-profile"], "'no-such-profile'"),
    (["plan", "--model", "gpt-nonexistent", "--profile", PROFILE], "'gpt-nonexistent'"),
    (["plan", "--model", "opt-66b", "--profile", PROFILE, "--gpus-per-node", "1"],
     "fits 1 GPUs per node"),
    (["plan", "--model", "opt-13b", "--hardware", "A100-80GB", "--slo-ttft", "0.0001",
      "--slo-tpot", "0.0001", "--gpus-per-node", "1", "--num-requests", "20"],
     "no placement of opt-13b meets TTFT 0.0001 s"),
    (["plan", "--model", "opt-66b", "--hardware", "A100-80GB", "--gpus-per-node", "1",
      "--num-requests", "20"], "does not fit"),
    (["plan", "--model", "opt-13b", "--workload", "nope", "--profile", PROFILE], "'nope'"),
])
def test_bad_input_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve plan: error:") and needle in err[0]


def test_a_pool_gives_the_same_plan_as_one_process(const_profile):
    """Incumbents and dominance come from the units of a kind before it in order, whatever
    finished first on the pool: rankings, alternatives and every unit's result agree."""
    from pdserve.planner.search import plan as plan_

    prof = const_profile({1: 60.0, 2: 40.0}, decode_ms=20.0, decode_per_seq_ms=1.0)
    p = Problem(model="opt-13b", profile=prof, slo=SLO(1.0, 0.2), rate=2.0, nodes=1,
                gpus_per_node=2, workload="fixed:input=256,output=8", num_requests=40,
                max_probes=4)
    one, two = (plan_(p, workers=w).to_dict() for w in (1, 2))
    for d in (one, two):
        d.pop("wall_s")
        for u in d["units"]:
            u.pop("wall_s")
    assert one == two
    assert any(u["stopped"] for u in one["units"])  # incumbents were at work


def _slow_first(p, u, incumbent=0.0):
    """Stand-in unit search: TP1 takes a while and reaches 1.0 req/s per GPU, TP2 0.8; a unit
    below its incumbent stops."""
    import time

    from pdserve.planner.units import UnitResult

    g = {1: 1.0, 2: 1.6}[u.tp]
    if u.tp == 1:
        time.sleep(0.5)
    if incumbent > 0 and g / u.num_gpus < incumbent:
        return UnitResult(u, bound_rps=incumbent * u.num_gpus, stopped="cannot beat")
    return UnitResult(u, goodput_rps=g, per_gpu_rps=g / u.num_gpus)


def test_a_later_unit_of_a_kind_waits_for_the_earlier_ones_on_a_pool(monkeypatch):
    """TP2 comes after TP1 in its queue: on a pool it starts only once TP1 finished, so it is
    stopped against TP1 as in one process, although a worker was free earlier."""
    from types import SimpleNamespace

    import pdserve.planner.units as unit_mod

    monkeypatch.setattr(unit_mod, "evaluate_unit", _slow_first)
    monkeypatch.setattr(unit_mod, "unit_model",
                        lambda p, u: SimpleNamespace(capacity_rps=10.0 * u.num_gpus))
    p = Problem(model="opt-13b", hardware="A100-80GB", gpus_per_node=2)
    units = [Unit("colocated", 1), Unit("colocated", 2)]
    got = []
    for workers in (1, 2):
        with UnitCache(p, workers=workers) as cache:
            got.append([(r.goodput_rps, r.stopped) for r in cache.get_bounded(units)])
    assert got[0] == got[1] == [(1.0, None), (0.0, "cannot beat")]
