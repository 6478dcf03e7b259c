"""The Pareto points of a plan (pdserve/planner/pareto.py): tokens/s/GPU against tokens/s/user of
each placement simulated whole, at its goodput, as aiconfigurator draws them; in ``--plot`` and
``--output-json``. Hand-worked on a constant-step profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.metrics import SLO
from pdserve.cli import main
from pdserve.planner.pareto import measure_point, on_front
from pdserve.planner.problem import Problem
from pdserve.planner.units import Unit, unit_deployment


def _pt(user: float | None, gpu: float) -> dict:
    return {"tok_s_user": user, "tok_s_gpu": gpu}


def test_the_front_keeps_the_points_nothing_beats_on_both_axes() -> None:
    pts = [_pt(10, 100), _pt(20, 50), _pt(15, 40), _pt(10, 100), _pt(5, 90), _pt(None, 500),
           _pt(30, 10)]
    # (15, 40) is beaten by (20, 50) and (5, 90) by (10, 100); equal points do not beat each
    # other; a point without a TPOT is not drawn
    assert on_front(pts) == [True, True, False, True, False, False, True]


def _profile(path: Path) -> str:
    entry = {"prefill": [60.0, 0.0, 0.0], "decoding_smallbs": [5.0, 0.0, 0.0],
             "decoding_largebs": [5.0, 0.0, 0.0]}
    path.write_text(json.dumps({"facebook/opt-13b": {"1": entry}}))
    return str(path)


@pytest.mark.parametrize(("step_ms", "tpot_ms"), [(0.0, 5.0), (2.0, 7.0)])
def test_a_point_by_hand(tmp_path: Path, step_ms: float, tpot_ms: float) -> None:
    """At 0.05 req/s no two requests of 60 + 3 x 5 ms overlap: every TPOT is one decode step
    (5 ms, + 2 ms of serving path), 200 tokens/s/user (~143); 4 output tokens per request at
    0.05 req/s on one GPU are 0.2 tokens/s/GPU."""
    p = Problem(model="opt-13b", profile=_profile(tmp_path / "p.json"),
                workload="fixed:input=256,output=4", slo=SLO(1.0, 0.1), nodes=1,
                gpus_per_node=1, num_requests=20, horizon=0.5, step_overhead_ms=step_ms)
    dep = unit_deployment(p, Unit("colocated", 1))
    pt = measure_point((p, "one", "colocated", dep, 0.05, 1))
    assert pt["mean_tpot_s"] == pytest.approx(tpot_ms / 1000)
    assert pt["tok_s_user"] == pytest.approx(1000 / tpot_ms)
    assert pt["tok_s_gpu"] == pytest.approx(0.2)
    assert pt["judged"] >= 20


def test_plot_and_json_carry_the_points(tmp_path: Path) -> None:
    prof = _profile(tmp_path / "p.json")
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", prof, "--model", "opt-13b", "--gpus-per-node", "2",
                 "--max-pp", "1", "--strategies", "colocated,partial", "--workload",
                 "fixed:input=256,output=4", "--slo-ttft", "1", "--slo-tpot", "0.1",
                 "--horizon", "0.5", "--num-requests", "20", "--max-probes", "3",
                 "--workers", "1", "--no-progress", "--plot", str(tmp_path / "plots"),
                 "--output-json", str(out)]) == 0
    assert (tmp_path / "plots" / "pareto.png").stat().st_size > 0
    d = json.loads(out.read_text())
    points = {pt["name"]: pt for pt in d["pareto"]}
    simulated = [pl for pl in [d["best"], *d["alternatives"]] if pl["simulated"]]
    assert sorted(points) == sorted(pl["name"] for pl in simulated)
    for pl in simulated:
        pt = points[pl["name"]]
        assert pt["rate_rps"] == pl["goodput_rps"] and pt["num_gpus"] == pl["num_gpus"]
        assert pt["tok_s_gpu"] == pytest.approx(pl["per_gpu_rps"] * 4)  # 4 output tokens
        assert pt["mean_tpot_s"] >= 0.005 and pt["tok_s_user"] == pytest.approx(
            1 / pt["mean_tpot_s"])
    assert any(pt["on_front"] for pt in points.values())
