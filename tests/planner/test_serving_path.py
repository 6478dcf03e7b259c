"""The serving path in the planner: ``--step-overhead-ms``, ``--seq-overhead-ms`` and
``--request-overhead-ms`` (the flags ``pdserve simulate`` has) price every probe the planner
simulates, are named in its output and written into the plan's ``simulation:`` section, so
``pdserve simulate --config plan.yaml`` prices steps as the planner did. Hand-worked on a
synthetic profile whose steps take constant times (DistServe's JSON format)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pdserve.bench.metrics import SLO
from pdserve.bench.workloads import make_workload
from pdserve.cli import main
from pdserve.planner.cli import compare_whole
from pdserve.planner.problem import Problem
from pdserve.planner.units import (
    Unit,
    _sim,
    decode_feed,
    run_probe,
    unit_deployment,
    unit_model,
    unit_workload,
)
from pdserve.sim.target import SimulationConfig, simulate


def _profile(path: Path, steps_ms: dict[int, tuple[float, float]]) -> str:
    """``steps_ms[tp] = (prefill, decode)``: every prefill batch and every decode step at that
    TP takes this long, whatever its size."""
    entry = lambda pre, dec: {"prefill": [pre, 0.0, 0.0],  # noqa: E731
                              "decoding_smallbs": [dec, 0.0, 0.0],
                              "decoding_largebs": [dec, 0.0, 0.0]}
    path.write_text(json.dumps({"facebook/opt-13b": {
        str(tp): entry(*ms) for tp, ms in steps_ms.items()}}))
    return str(path)


def _one_request(p: Problem, dep: dict, n_out: int = 4) -> tuple[float, float]:
    """TTFT and TPOT of one request of 256 prompt tokens alone on ``dep``, simulated with the
    planner's own simulation settings (what every probe gets)."""
    w = make_workload(f"fixed:input=256,output={n_out}", 1, seed=0, rate=1.0,
                      prompt_mode="ids", vocab_size=50272)
    sim = _sim(p, dep)
    records, _, _ = simulate(sim, w.requests, vocab_size=50272)
    return records[0].ttft, records[0].tpot


def test_every_probe_prices_steps_with_the_serving_path(tmp_path: Path) -> None:
    prof = _profile(tmp_path / "p.json", {1: (60.0, 5.0)})
    kw = dict(model="opt-13b", profile=prof, workload="fixed:input=256,output=4",
              slo=SLO(1.0, 0.1), nodes=1, gpus_per_node=1, num_requests=20)
    bare = Problem(**kw)
    served = Problem(**kw, step_overhead_ms=2.0, seq_overhead_ms=0.5)
    u = Unit("colocated", 1)
    # by hand: a step of one sequence costs its kernel time + 2 ms + 0.5 ms
    assert unit_model(bare, u).latency.decode_time([300]) == pytest.approx(0.005)
    assert unit_model(served, u).latency.decode_time([300]) == pytest.approx(0.0075)
    assert unit_model(served, u).latency.prefill_time([256]) == pytest.approx(0.0625)
    dep = unit_deployment(served, u)
    assert _one_request(bare, dep) == pytest.approx((0.060, 0.005))
    assert _one_request(served, dep) == pytest.approx((0.0625, 0.0075))
    # the capacity bound sees the same steps: 4 tokens per request, 60 + 3 x 5 ms without
    # the serving path, 62.5 + 3 x 7.5 ms with it (one sequence per step at the bound's batch)
    cap = unit_model(bare, u).capacity_rps / unit_model(served, u).capacity_rps
    assert cap > 1.0


def test_the_front_ends_cost_is_on_every_ttft_the_planner_judges(tmp_path: Path) -> None:
    """A prefill takes 100 ms and the TTFT objective is 250 ms: 100 ms of front end leave
    the SLO met (200 ms), 200 ms miss it (300 ms) for every request, even alone."""
    prof = _profile(tmp_path / "p.json", {1: (100.0, 5.0)})
    kw = dict(model="opt-13b", profile=prof, workload="fixed:input=256,output=4",
              slo=SLO(0.25, 0.1), nodes=1, gpus_per_node=1, num_requests=20, horizon=0.5)
    u = Unit("colocated", 1)
    ok, late = Problem(**kw, request_overhead_ms=100.0), Problem(**kw, request_overhead_ms=200.0)
    assert unit_model(ok, u).zero_load_attainment == 1.0
    assert unit_model(late, u).zero_load_attainment == 0.0
    rate = 0.05  # one request at a time, nothing queues
    for p, passed in ((ok, True), (late, False)):
        dep = unit_deployment(p, u, *decode_feed(p, rate))
        reqs = unit_workload(p, u, rate).retimed(rate).requests
        for early in (True, False):  # the early watch and the full run see the same TTFTs
            r = run_probe(p, dep, reqs, rate, u.kind, early)
            assert r.passed is passed, (p.request_overhead_ms, early, r)
        full = run_probe(p, dep, reqs, rate, u.kind, False)
        assert full.attainment == (1.0 if passed else 0.0)


PLAN = ["plan", "--model", "opt-13b", "--gpus-per-node", "2", "--max-pp", "1",
        "--strategies", "colocated", "--workload", "fixed:input=256,output=8",
        "--slo-ttft", "1", "--slo-tpot", "0.2", "--rate", "1", "--num-requests", "20",
        "--max-probes", "3", "--workers", "1", "--no-progress"]


def test_a_step_overhead_moves_the_choice_and_travels_in_the_plan_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Decode steps take 120 ms at TP1 and 5 ms at TP2 (prefill 60 ms both), TPOT SLO 200 ms.
    Without a serving path TP1 serves the rate on half the GPUs; 90 ms per step put a lone
    TP1 request's TPOT at 210 ms (pruned at zero load) and TP2's at 95 ms, so TP2 is chosen,
    and the written plan, simulated, gives TTFT 60 + 90 ms and TPOT 5 + 90 ms again."""
    prof = _profile(tmp_path / "p.json", {1: (60.0, 120.0), 2: (60.0, 5.0)})
    assert main([*PLAN, "--profile", prof]) == 0
    bare = capsys.readouterr().out
    assert "**Chosen:** colocated 1x(TP1 PP1" in bare
    assert "no serving-path terms" in bare
    out = tmp_path / "plan.yaml"
    assert main([*PLAN, "--profile", prof, "--step-overhead-ms", "90", "--out",
                 str(out)]) == 0
    served = capsys.readouterr().out
    assert "**Chosen:** colocated 1x(TP2 PP1" in served
    assert f"latency source {prof} + serving path 90 ms per step;" in served
    assert "misses the SLO even at zero load" in served  # the TP1 units
    spec = yaml.safe_load(out.read_text())
    assert spec["simulation"] == {"profile": prof, "step_overhead_ms": 90.0}
    sim = SimulationConfig.from_dict(spec)
    assert sim.step_overhead_ms == 90.0 and sim.seq_overhead_ms == 0.0
    w = make_workload("fixed:input=256,output=8", 1, seed=0, rate=1.0, prompt_mode="ids",
                      vocab_size=50272)
    rec = simulate(sim, w.requests, vocab_size=50272)[0][0]
    assert (rec.ttft, rec.tpot) == pytest.approx((0.150, 0.095))
    # and `pdserve simulate --config plan.yaml` on its own command line
    js = tmp_path / "sim.json"
    assert main(["simulate", "--config", str(out), "--workload", "fixed:input=256,output=8",
                 "--num-requests", "1", "--rate", "0.1", "--no-progress", "--output-json",
                 str(js)]) == 0
    summary = json.loads(js.read_text())["summary"]
    assert (summary["ttft"]["mean"], summary["tpot"]["mean"]) == pytest.approx((0.150, 0.095))


def test_against_a_file_with_other_serving_path_terms_is_refused(tmp_path: Path) -> None:
    from types import SimpleNamespace

    p = Problem(model="opt-13b", hardware="L20", slo=SLO(5.0, 0.1), step_overhead_ms=1.5)
    best = SimpleNamespace(name="colocated 1x(TP1 PP1)", per_gpu_rps=1.0,
                           deployment={"model": "opt-13b", "strategy": "colocated",
                                       "num_instances": 1})
    f = tmp_path / "other.yaml"
    f.write_text(yaml.safe_dump({"model": "opt-13b", "strategy": "colocated",
                                 "num_instances": 2,
                                 "simulation": {"hardware": "L20", "step_overhead_ms": 0.5}}))
    with pytest.raises(ValueError, match=r"step_overhead_ms 0.5 is not the plan's 1.5"):
        compare_whole(SimpleNamespace(problem=p, best=best), [str(f)], 1)


@pytest.mark.parametrize("cmd", ["plan", "advise"])
@pytest.mark.parametrize("flag", ["--step-overhead-ms", "--seq-overhead-ms",
                                  "--request-overhead-ms"])
def test_a_negative_overhead_is_one_line_and_exit_2(cmd: str, flag: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([cmd, flag, "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "'-1'" in err[0], err


def test_a_problem_refuses_a_negative_overhead() -> None:
    with pytest.raises(ValueError, match="seq_overhead_ms must be a number >= 0"):
        Problem(seq_overhead_ms=-0.1)


def test_the_kernel_sums_get_the_serving_path_too() -> None:
    """``--aic-system``: a decode step of 8 sequences is aiconfigurator's kernel sum + 1.5 ms
    + 8 x 0.09 ms, and the output says both."""
    pytest.importorskip("aiconfigurator_core", reason="optional package (pdserve[aic])",
                        exc_type=ImportError)
    from pdserve.sim.aic_latency import AicModel
    from pdserve.sim.model_catalogue import get_model_config

    p = Problem(model="llama-3.1-8b", aic_system="h100_sxm", workload="fixed:input=512,output=16",
                slo=SLO(1.0, 0.05), nodes=1, gpus_per_node=1, num_requests=20,
                step_overhead_ms=1.5, seq_overhead_ms=0.09)
    kernels = AicModel(get_model_config("llama-3.1-8b"), "h100_sxm", "vllm", 1)
    lat = unit_model(p, Unit("colocated", 1)).latency
    ctx = [1024] * 8
    assert lat.decode_time(ctx) == pytest.approx(kernels.decode_time(ctx) + 0.0015 + 8 * 0.00009)
    assert p.latency_source().endswith("h100_sxm/vllm (kernel sums) + serving path 1.5 ms per "
                                       "step + 0.09 ms per sequence in a step")
    assert p.simulation() == {"aic_system": "h100_sxm", "aic_backend": "vllm",
                              "step_overhead_ms": 1.5, "seq_overhead_ms": 0.09}


def test_a_plan_without_a_rate_replays_at_its_goodput(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The written plan's simulate command, without a planned rate, replays the chosen
    placement's goodput (with the serving path from the file)."""
    prof = _profile(tmp_path / "p.json", {1: (60.0, 5.0)})
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", prof, "--model", "opt-13b", "--gpus-per-node", "1",
                 "--strategies", "colocated", "--workload", "fixed:input=256,output=4",
                 "--slo-ttft", "1", "--slo-tpot", "0.1", "--num-requests", "20",
                 "--max-probes", "3", "--workers", "1", "--no-progress",
                 "--seq-overhead-ms", "1", "--out", str(out)]) == 0
    text = out.read_text()
    goodput = re.search(r"^# predicted goodput ([\d.]+) req/s", text, re.M)
    replay = re.search(r"^# simulate what was planned: .* --rate ([\d.]+) ", text, re.M)
    assert goodput and replay and float(replay.group(1)) == pytest.approx(
        float(goodput.group(1)), rel=1e-3)
    assert yaml.safe_load(text)["simulation"]["seq_overhead_ms"] == 1.0
    capsys.readouterr()
