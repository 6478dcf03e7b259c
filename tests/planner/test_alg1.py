"""Algorithm 1's replication step (DistServe §4.1) and the placements built from phase units,
checked against hand-worked numbers."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import SLO
from pdserve.config import ClusterConfig
from pdserve.planner.placements import alg1_placements, node_layout, replica_placements, replicate
from pdserve.planner.problem import Problem
from pdserve.planner.units import Unit, UnitResult


def test_replication_arithmetic():
    # DistServe §1 / Fig. 1: prefill 5.6 rps per GPU, decode 10 rps; 10 rps needs 2 + 1 GPUs
    assert replicate(10.0, 5.6, 10.0) == (2, 1)
    assert replicate(10.0, 5.0, 10.0) == (2, 1)  # exact multiples need no extra replica
    assert replicate(10.0, 4.99, 10.01) == (3, 1)
    assert replicate(0.1, 3.0, 2.0) == (1, 1)
    assert replicate(17.0, 4.0, 3.0) == (5, 6)
    with pytest.raises(ValueError):
        replicate(1.0, 0.0, 1.0)


def _r(kind: str, tp: int, pp: int, g: float) -> UnitResult:
    u = Unit(kind, tp, pp)
    return UnitResult(u, g, g / u.num_gpus)


def test_alg1_pairs_replicated_to_the_rate():
    p = Problem(rate=10.0, nodes=2, gpus_per_node=4, slo=SLO(0.25, 0.1))
    pre = [_r("prefill", 2, 1, 6.0), _r("prefill", 1, 1, 2.5)]
    dec = [_r("decode", 1, 1, 3.5), _r("decode", 1, 2, 9.0)]
    pls = {pl.name: pl for pl in alg1_placements(p, pre, dec)}
    # prefill TP2 (6 rps): n = 2 (4 GPUs); decode TP1 (3.5 rps): m = 3 (3 GPUs)
    pl = pls["disaggregated 2xP(TP2 PP1) + 3xD(TP1 PP1)"]
    assert (pl.num_gpus, pl.goodput_rps) == (7, pytest.approx(min(12.0, 10.5)))
    assert pl.per_gpu_rps == pytest.approx(10.5 / 7)
    assert pl.fits  # 4 + 3 GPUs on 2 nodes of 4: P P | D D D
    assert pl.layout == ["node 0: prefill-0(TP2xPP1), prefill-1(TP2xPP1)",
                         "node 1: decode-0(TP1xPP1), decode-1(TP1xPP1), decode-2(TP1xPP1)"]
    # prefill TP1 (2.5): n = 4; decode PP2 (9): m = 2 -> 4 + 4 GPUs, capacity min(10, 18)
    pl = pls["disaggregated 4xP(TP1 PP1) + 2xD(TP1 PP2)"]
    assert (pl.num_gpus, pl.goodput_rps, pl.fits) == (8, pytest.approx(10.0), True)
    spec = ClusterConfig.from_dict(pl.deployment)  # the one construction path
    assert [(r.role, r.count, r.tp, r.pp) for r in spec.roles] == [
        ("prefill", 4, 1, 1), ("decode", 2, 1, 2)]
    assert [s.node for s in spec.instance_specs()] == [0, 0, 0, 0, 1, 1]


def test_colocated_replicas_and_cluster_fit():
    p = Problem(rate=5.0, nodes=1, gpus_per_node=4)
    pls = replica_placements(p, [_r("colocated", 1, 1, 2.0), _r("colocated", 2, 1, 3.0)])
    a, b = pls
    assert (a.num_gpus, a.goodput_rps, a.fits) == (3, pytest.approx(6.0), True)
    assert (b.num_gpus, b.goodput_rps, b.fits) == (4, pytest.approx(6.0), True)
    p = Problem(rate=7.0, nodes=1, gpus_per_node=4)
    assert [x.fits for x in replica_placements(p, [_r("colocated", 2, 1, 3.0)])] == [False]


def test_node_layout_matches_instance_specs():
    roles = [("prefill", 3, 2, 1), ("decode", 2, 2, 2)]
    lines, nodes = node_layout(roles, 8)
    spec = ClusterConfig.from_dict({"strategy": "disaggregated", "num_prefill": 3,
                                    "num_decode": 2, "prefill_tp": 2, "decode_tp": 2,
                                    "decode_pp": 2, "gpus_per_node": 8})
    assert nodes == max(s.node for s in spec.instance_specs()) + 1 == 2
    for s in spec.instance_specs():  # each instance on the node the spec puts it on
        assert s.instance_id in lines[s.node]
