"""``pdserve profile --pp 2`` times a live pipeline (two gloo ranks, one stage each): every shape
as one micro-batch's pass through both stages and as the stage time of a full pipeline, each
fitted to DistServe's forms. ``pdserve simulate`` prices pp=2 instances with both — a lone
request's TTFT is the measured pass, back-to-back batches leave one stage time apart (worked by
hand below) — and refuses the profile, in one line, for a pipeline of another depth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.config import ModelConfig
from pdserve.sim import profiler
from pdserve.sim.latency import FittedProfile, PipelineModel, pipeline_send
from pdserve.sim.simulator import PipelineStages

from .test_profile_tp import TINY_GRID, quick_profile


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdserve.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def pp2_profile(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "pp2.json"
    assert not quick_profile(model_dir, out, "--pp", "2")  # the other stage's rank stopped
    return out


def test_profile_pp2_fits_the_pass_and_the_stage_time(pp2_profile: Path) -> None:
    data = json.loads(pp2_profile.read_text())
    assert data["tp"] == 1 and data["pp"] == 2 and "--pp 2" in data["source"]
    assert {k: e["n"] for k, e in data["stage"]["fit_error"].items()} == {
        "prefill": 3, "decode": 3, "mixed": 1}
    prof = FittedProfile.load(pp2_profile, tp=1, pp=2)
    assert prof.pp == 2 and prof.stage is not None
    assert FittedProfile.from_dict(prof.to_dict()) == prof
    for chunks, ctx in (([(0, 64)], []), ([], [32, 32, 32, 32])):
        assert prof.stage.step_time(chunks, ctx) > 0


def test_simulate_prices_a_lone_request_at_the_measured_pass(model_dir: str, pp2_profile: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(pp2_profile), "--model", model_dir, "--pp", "2",
                 "--workload", "fixed:input=64,output=2", "--num-requests", "1",
                 "--rate", "1", "--no-progress", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    role = data["deployment"]["roles"]["colocated"]
    assert role["pp"] == 2 and role["latency_model"].endswith("tp=1 pp=2")
    prof = FittedProfile.load(pp2_profile, tp=1, pp=2)
    assert prof.stage is not None  # a pass takes at least one stage time (the fits are apart)
    shape = ([(0, 64)], [])
    expect = max(prof.step_time(*shape), prof.stage.step_time(*shape))
    assert data["summary"]["ttft"]["mean"] == pytest.approx(expect)


def test_simulate_refuses_the_pipeline_profile_at_another_depth(
        model_dir: str, pp2_profile: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["simulate", "--profile", str(pp2_profile), "--model", model_dir,
               "--workload", "fixed:input=32,output=2", "--num-requests", "1", "--rate", "1",
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == (f"pdserve simulate: error: profile {str(pp2_profile)!r} was measured on "
                       "a pipeline of pp=2, not pp=1; measure both with `pdserve profile "
                       "--tp 1 --pp 1,2` (one file)")


def test_one_file_keys_each_layout(model_dir: str, pp2_profile: Path, tmp_path: Path) -> None:
    """``--tp 1 --pp 1,2`` writes ``"1"`` and ``"1x2"``; a pipeline depth the file lacks falls
    back to the unpipelined entry (priced as ``step / pp``, as before)."""
    tp1 = profiler.profile_instance(model_dir, grid=TINY_GRID, progress=False)
    pp2 = FittedProfile.load(pp2_profile)
    both = tmp_path / "both.json"
    profiler.save_profiles(str(both), [tp1, profiler.MeasuredProfile(pp2, {})])
    assert sorted(json.loads(both.read_text())["by_tp"]) == ["1", "1x2"]
    assert FittedProfile.load(both, tp=1, pp=2) == pp2
    assert FittedProfile.load(both, tp=1) == tp1.profile
    assert FittedProfile.load(both, tp=1, pp=4) == tp1.profile


def constant(seconds: float, **kw) -> FittedProfile:
    return FittedProfile((seconds, 0.0, 0.0), (seconds, 0.0, 0.0), (seconds, 0.0, 0.0), **kw)


def stream(pipe: PipelineModel, n: int) -> list[float]:
    """Exit times of ``n`` equal prefill steps entering the simulator's stages at time 0."""
    stages = PipelineStages(pipe.pp)
    return [stages.enter(0.0, *pipe.split([(0, 8)], [])) for _ in range(n)]


def test_measured_pass_and_stage_drive_the_stages_by_hand() -> None:
    """Pass 10 ms, stage 4 ms, pp=2: each stage computes 4 ms and hands on in 2 ms
    (2·4 + 2 = 10). Batches 1-3 leave at 10, 14, 18 ms: hand-worked from ``f[i][s] =
    max(f[i−1][s], f[i][s−1] + send) + 4``. Pass 5 ms with the same stage: the hand-off is
    −3 ms (the driver's stage is the slow one), and batches leave at 5, 9, 13 ms."""
    model = ModelConfig(name="m", family="llama", vocab_size=100, hidden_size=64,
                        intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                        max_position_embeddings=128)
    pipe = PipelineModel(constant(0.010, pp=2, stage=constant(0.004)), 2, model)
    assert pipe.measured is not None
    assert pipe.split([(0, 8)], []) == pytest.approx((0.004, 0.002))
    assert pipe.step_time([(0, 8)], []) == pytest.approx(0.010)
    assert stream(pipe, 3) == pytest.approx([0.010, 0.014, 0.018])
    fast = PipelineModel(constant(0.005, pp=2, stage=constant(0.004)), 2, model)
    assert fast.split([(0, 8)], [])[1] == pytest.approx(-0.003)
    assert stream(fast, 3) == pytest.approx([0.005, 0.009, 0.013])
    assert pipeline_send(0.001, 0.004, 2) == -0.004  # a pass takes at least one stage time
    # an unpipelined profile keeps DistServe's split: step / pp on each stage, no link
    plain = PipelineModel(constant(0.010), 2, model)
    assert plain.measured is None and plain.split([(0, 8)], []) == pytest.approx((0.005, 0.0))
    with pytest.raises(ValueError, match="needs its stage fit"):
        constant(0.010, pp=2)
