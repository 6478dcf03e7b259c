"""``--rate`` optional (issue 28): without a rate every placement is sized to the cluster and the
most goodput per GPU wins (aiconfigurator's default mode); ``--min-gpus`` (with ``--rate``)
chooses the fewest GPUs that serve the rate. One code path: only the replica counts and the
ranking key depend on the mode. Hand-worked on synthetic unit goodputs."""

from __future__ import annotations

import re

import pytest

from pdserve.bench.metrics import SLO
from pdserve.cli import main
from pdserve.planner.placements import (
    Placement,
    alg1_placements,
    pair_instances,
    replica_placements,
)
from pdserve.planner.problem import Problem
from pdserve.planner.search import _rank
from pdserve.planner.units import Unit, UnitResult

PROFILE = "distserve_profiler-a100-80g.distserve"


def _p(**kw) -> Problem:
    base = dict(model="opt-13b", profile=PROFILE, slo=SLO(1.0, 0.1), nodes=1, gpus_per_node=8)
    base.update(kw)
    return Problem(**base)


def test_without_a_rate_a_unit_fills_the_cluster() -> None:
    p = _p(rate=None, nodes=2, gpus_per_node=4)
    rs = [UnitResult(Unit("colocated", 1), 0.9), UnitResult(Unit("colocated", 2), 1.0),
          UnitResult(Unit("partial", 2, size=2), 3.0)]
    got = {pl.name: (pl.num_gpus, pl.goodput_rps, pl.fits) for pl in replica_placements(p, rs)}
    # 8 TP1 instances, 4 TP2 ones, 2 macro instances of 2 x TP2: every GPU of the 2 x 4
    assert got == {"colocated 8x(TP1 PP1)": (8, pytest.approx(7.2), True),
                   "colocated 4x(TP2 PP1)": (8, pytest.approx(4.0), True),
                   "partial 2x[2x temporal (TP2 PP1)]": (8, pytest.approx(6.0), True)}
    # with a rate, n = ceil(R / g) as before
    with_rate = replica_placements(_p(rate=2.0, nodes=2, gpus_per_node=4), rs[:1])
    assert [(pl.name, pl.num_gpus) for pl in with_rate] == [("colocated 3x(TP1 PP1)", 3)]


@pytest.mark.parametrize(("gpus", "expect"), [
    (8, (2, 6)),  # 1:3 twice: 6 req/s on 8 GPUs (0.75 per GPU), the most goodput at that
    (6, (1, 3)),  # 1:3 on 4 of the 6 GPUs (0.75) beats 2:4 (4 / 6) and 1:5 (3 / 6)
    (2, (1, 1)),  # the only split: 1 req/s on 2 GPUs
])
def test_without_a_rate_a_pair_takes_the_counts_with_most_goodput_per_gpu(gpus, expect) -> None:
    p = _p(rate=None, gpus_per_node=gpus)
    pu, du = Unit("prefill", 1), Unit("decode", 1)
    assert pair_instances(p, pu, du, 3.0, 1.0) == expect
    (pl,) = alg1_placements(p, [UnitResult(pu, 3.0)], [UnitResult(du, 1.0)])
    n, m = expect
    assert (pl.num_gpus, pl.goodput_rps) == (n + m, pytest.approx(min(3.0 * n, m)))
    assert pl.name == f"disaggregated {n}xP(TP1 PP1) + {m}xD(TP1 PP1)"


def test_without_a_rate_a_pair_fits_the_nodes() -> None:
    """Two nodes of 4: a TP4 prefill and a TP4 decode use one node each; a second pair would
    not fit, whatever the goodputs."""
    p = _p(rate=None, nodes=2, gpus_per_node=4)
    assert pair_instances(p, Unit("prefill", 4), Unit("decode", 4, link="inter"), 5.0,
                          5.0) == (1, 1)
    assert pair_instances(p, Unit("prefill", 4), Unit("decode", 2, link="inter"), 2.0,
                          1.0) == (1, 2)


def _pl(name: str, goodput: float, gpus: int) -> Placement:
    return Placement(name, "colocated", "colocated", {}, goodput, gpus, [])


def test_min_gpus_ranks_the_fewest_gpus_serving_the_rate_first() -> None:
    """At 1 req/s: one TP4 instance of 4 req/s (1.0 per GPU, 4 GPUs) against two TP1 ones of
    0.55 each (1.1 req/s, 0.55 per GPU, 2 GPUs) and one TP1 of 0.9 (1 GPU, short of the rate:
    it does not serve it)."""
    wide, narrow, short = _pl("tp4", 4.0, 4), _pl("2 x tp1", 1.1, 2), _pl("tp1", 0.9, 1)
    # the most per GPU among those serving the rate; the short one (0.9 per GPU) last
    assert [x.name for x in _rank(_p(rate=1.0), [narrow, short, wide])] == [
        "tp4", "2 x tp1", "tp1"]
    # the fewest GPUs among those serving the rate, then those that do not serve it
    assert [x.name for x in _rank(_p(rate=1.0, min_gpus=True), [wide, short, narrow])] == [
        "2 x tp1", "tp4", "tp1"]


def test_min_gpus_needs_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="min_gpus"):
        Problem(rate=None, min_gpus=True)
    assert main(["plan", "--min-gpus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--min-gpus: give --rate" in err[0], err


PLAN = ["plan", "--profile", PROFILE, "--model", "opt-13b", "--gpus-per-node", "2",
        "--max-pp", "1", "--strategies", "colocated", "--workload",
        "fixed:input=256,output=8", "--slo-ttft", "1", "--slo-tpot", "0.2", "--num-requests",
        "20", "--max-probes", "3", "--workers", "1", "--no-progress", "--no-joint"]


def test_plan_without_a_rate_sizes_every_placement_to_the_cluster(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "· no rate ·" in out
    assert "Objective: the most goodput per GPU on the cluster (no rate given)." in out
    units = {m[1]: float(m[2]) for m in re.finditer(
        r"^\| colocated (TP\d PP1 (?:prefill-first|chunked)) \| ([\d.]+) \|", out, re.M)}
    rows = re.findall(r"^\| \d+ \| colocated (\d)x\((TP\d PP1(?: chunked)?)\) \| colocated \| "
                      r"(\d) \| ([\d.]+) \|", out, re.M)
    assert rows
    for n, unit, gpus, goodput in rows:  # every GPU used: 2 x TP1 or 1 x TP2
        assert int(gpus) == 2 and int(n) * int(unit[2]) == 2
        label = unit if "chunked" in unit else f"{unit} prefill-first"
        assert float(goodput) == pytest.approx(int(n) * units[label], abs=2e-3)


def test_min_gpus_chooses_one_narrow_instance_where_goodput_per_gpu_chooses_a_wide_one(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Constant steps: TP1 prefills in 60 ms, TP4 in 5 ms (decode 5 and 1 ms). At 20 req/s
    one TP4 instance has the most goodput per GPU (hundreds of req/s on 4 GPUs), while one
    TP1 instance (a 256-token prompt per 60 ms batch of two, some 20-30 req/s) already serves
    the rate on one GPU. Per-GPU pruning would stop the TP1 units against the TP4 one, so
    ``--min-gpus`` searches every unit in full. (Probes of a few requests, for speed, and no
    long confirmation of them: ``tests/planner/test_confirm.py``.)"""
    import json

    step = lambda pre, dec: {"prefill": [pre, 0, 0], "decoding_smallbs": [dec, 0, 0],  # noqa: E731
                             "decoding_largebs": [dec, 0, 0]}
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"facebook/opt-13b": {"1": step(60.0, 5.0),
                                                     "4": step(5.0, 1.0)}}))
    argv = ["plan", "--profile", str(prof), "--model", "opt-13b", "--gpus-per-node", "4",
            "--max-pp", "1", "--strategies", "colocated", "--workload",
            "fixed:input=256,output=8", "--slo-ttft", "0.3", "--slo-tpot", "0.05",
            "--horizon", "0.5", "--num-requests", "20", "--max-probes", "3", "--workers", "1",
            "--no-progress", "--rate", "20", "--confirm", "0"]
    assert main(argv) == 0
    assert re.search(r"\*\*Chosen:\*\* colocated 1x\(TP4 PP1", capsys.readouterr().out)
    assert main([*argv, "--min-gpus"]) == 0
    out = capsys.readouterr().out
    assert "Objective: the fewest GPUs serving 20 req/s." in out
    best = re.search(r"^\| 1 \| (colocated 1x\(TP1 PP1[^)]*\)) \| colocated \| 1 \| ([\d.]+) \|",
                     out, re.M)
    assert best is not None and float(best.group(2)) >= 20, out
    assert f"**Chosen:** {best.group(1)}" in out
    assert "--min-gpus: every unit searched in full" in out


def test_cluster_rate_fills_every_gpu_with_the_best_units() -> None:
    """What a cluster too small for ``--rate`` does serve (the error names it), hand-worked on
    2 x 4 GPUs: 8 colocated TP1 units of 0.9 req/s serve 7.2; the best prefill/decode split,
    3 x P (3 req/s each) + 5 x D (2 each), serves min(9, 10) = 9; a unit that did not hold
    (0 req/s) counts for nothing."""
    from pdserve.planner.search import cluster_rate

    p = _p(rate=50.0, nodes=2, gpus_per_node=4)
    rates = {Unit("colocated", 1): 0.9, Unit("colocated", 2): 1.0,
             Unit("partial", 2, size=2): 3.0, Unit("prefill", 1): 3.0, Unit("decode", 1): 2.0,
             Unit("colocated", 4): 0.0}
    assert cluster_rate(p, rates) == (pytest.approx(9.0),
                                      "3 x prefill TP1 PP1 + 5 x decode TP1 PP1")
    del rates[Unit("decode", 1)]
    assert cluster_rate(p, rates) == (pytest.approx(7.2), "8 x colocated TP1 PP1 prefill-first")
    assert cluster_rate(p, {Unit("colocated", 4): 0.0}) == (0.0, "no unit fits")
