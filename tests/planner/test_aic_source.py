"""``pdserve plan --aic-system``: the planner prices its units with aiconfigurator-core's kernel
database (the same :class:`~pdserve.sim.aic_latency.AicModel` as ``simulate``), says so in its
output, and without the optional package says how to install it."""

from __future__ import annotations

import importlib.metadata

import pytest

from pdserve.bench.metrics import SLO
from pdserve.cli import main
from pdserve.planner.problem import Problem
from pdserve.planner.units import Unit, unit_model

LLAMA = "meta-llama/Meta-Llama-3.1-8B"  # aiconfigurator's bundled config of llama-3.1-8b
PLAN = ["plan", "--model", "llama-3.1-8b", "--aic-system", "h100_sxm", "--nodes", "1",
        "--gpus-per-node", "2", "--max-tp", "1", "--max-pp", "1", "--strategies", "colocated",
        "--workload", "fixed:input=512,output=16", "--slo-ttft", "1", "--slo-tpot", "0.05",
        "--num-requests", "20", "--rate", "2", "--max-probes", "3", "--no-progress"]


def _aic() -> None:
    pytest.importorskip("aiconfigurator_core", reason="optional package (pdserve[aic])",
                        exc_type=ImportError)


def test_plan_runs_on_the_kernel_database_and_names_it(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    _aic()
    version = importlib.metadata.version("aiconfigurator-core")
    assert main([*PLAN, "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"latency source aiconfigurator-core {version} kernel database h100_sxm/vllm"
            in out)
    assert "**Chosen:** colocated" in out
    # advise shares the problem flags and names the source too
    assert main(["advise", *PLAN[1:], "--slo-scales", "1", "--output-scales", "1",
                 "--workers", "1"]) == 0
    assert f"latency source aiconfigurator-core {version}" in capsys.readouterr().out


def test_the_planners_step_times_are_aiconfigurators() -> None:
    _aic()
    from aiconfigurator_core.sdk.engine import EngineHandle

    from pdserve.sim.aic_latency import AicModel
    from pdserve.sim.model_catalogue import get_model_config

    p = Problem(model="llama-3.1-8b", aic_system="h100_sxm", aic_backend="vllm",
                workload="fixed:input=512,output=16", slo=SLO(1.0, 0.05), nodes=1,
                gpus_per_node=2, num_requests=20)
    for tp in (1, 2):
        lat = unit_model(p, Unit("colocated", tp)).latency
        assert isinstance(lat, AicModel) and lat.tp == tp and lat.backend == "vllm"
        mine = AicModel(get_model_config("llama-3.1-8b"), "h100_sxm", "vllm", tp)
        # aiconfigurator's own engine, compiled here: lengths on bucket bounds, so no rounding
        ref = EngineHandle.compile(LLAMA, "h100_sxm", "vllm", tp_size=tp)
        decode, prefill = [1024] * 8, [512] * 4
        assert lat.decode_time(decode) == mine.decode_time(decode)
        assert lat.decode_time(decode) == pytest.approx(
            ref.decode_step_latency(8, 1024, 2) / 1000, rel=1e-9)
        assert lat.prefill_time(prefill) == mine.prefill_time(prefill)
        assert lat.prefill_time(prefill) == pytest.approx(
            ref.predict_prefill_latency(4, 512, 0) / 1000, rel=1e-9)


def test_plan_aic_errors_are_one_line(aic_absent: None,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN[:3], "--aic-backend", "sglang", *PLAN[5:]]) == 2
    assert "--aic-backend sglang: give --aic-system too" in capsys.readouterr().err
    assert main(PLAN) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "pip install 'pdserve[aic]'" in lines[0]
