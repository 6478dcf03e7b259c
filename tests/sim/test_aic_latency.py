"""The aiconfigurator kernel-database latency source (``--aic-system``): the adapter reproduces
aiconfigurator's own static estimate, the serving-path terms add what they say, and without the
optional package the CLI says how to install it."""

from __future__ import annotations

import importlib.metadata

import pytest

from pdserve.cli import main
from pdserve.config import ClusterConfig
from pdserve.sim.latency import DriverOverhead, PipelineModel
from pdserve.sim.model_catalogue import get_model_config
from pdserve.sim.target import SimulationConfig, step_model

LLAMA = "meta-llama/Meta-Llama-3.1-8B"  # aiconfigurator's bundled config of llama-3.1-8b


def _aic() -> object:
    return pytest.importorskip("aiconfigurator_core", reason="optional package (pdserve[aic])",
                               exc_type=ImportError)


@pytest.fixture(scope="module")
def reference() -> object:
    """aiconfigurator's own engine, compiled here, for its static estimate (``run_static``:
    one batch of ``bs`` prompts of ``isl`` tokens, then ``osl − 1`` decode steps)."""
    _aic()
    from aiconfigurator_core.sdk.engine import EngineHandle

    return {tp: EngineHandle.compile(LLAMA, "h100_sxm", "vllm", tp_size=tp) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
def test_adapter_reproduces_aiconfigurator_static_estimate(reference: dict, tp: int) -> None:
    from pdserve.sim.aic_latency import AicModel

    m = AicModel(get_model_config("llama-3.1-8b"), "h100_sxm", "vllm", tp)
    assert f"h100_sxm/vllm ({LLAMA}, tp={tp})" in m.source
    bs, isl = 4, 2000
    ctx_ms, gen_ms, _ = reference[tp].run_static(batch_size=bs, isl=isl, osl=2)
    prefill = 1000 * m.prefill_time([isl] * bs)
    assert prefill == pytest.approx(ctx_ms, rel=0.10)
    # one decode step of the same batch: each sequence holds its prompt and its first token
    decode = 1000 * m.decode_time([isl + 1] * bs)
    assert decode == pytest.approx(gen_ms, rel=0.10)
    assert m.step_time([], []) == 0.0


def test_tensor_parallelism_reaches_the_database(reference: dict) -> None:
    from pdserve.sim.aic_latency import AicModel

    cfg = get_model_config("llama-3.1-8b")
    t1 = AicModel(cfg, "h100_sxm", "vllm", 1).prefill_time([4000])
    t2 = AicModel(cfg, "h100_sxm", "vllm", 2).prefill_time([4000])
    assert t2 < 0.75 * t1  # half the GEMM work per GPU, plus its all-reduces
    # every simulated run builds its models anew: one compiled engine and one lookup cache
    a, b = AicModel(cfg, "h100_sxm", "vllm", 2), AicModel(cfg, "h100_sxm", "vllm", 2)
    assert a.engine is b.engine and a._cache is b._cache and len(a._cache) > 0



def test_moe_model_above_tp1_prices_its_experts_as_the_role_says() -> None:
    # aiconfigurator requires moe_tp_size x moe_ep_size = tp for a MoE model (it refused TP2
    # when the adapter passed tp alone). The reference is its own engine compiled with the
    # expert split the role asks for: experts 2-way expert parallel, unsharded
    _aic()
    from aiconfigurator_core.sdk.engine import EngineHandle

    qwen = get_model_config("qwen3-30b-a3b")
    sim = SimulationConfig(ClusterConfig(model="qwen3-30b-a3b"), aic_system="h100_sxm")
    tp2 = step_model(sim, qwen, 2, 1, "bfloat16")
    ep2 = step_model(sim, qwen, 2, 1, "bfloat16", ep=2)
    assert "(Qwen/Qwen3-30B-A3B, tp=2)" in tp2.source
    assert "(Qwen/Qwen3-30B-A3B, tp=2, ep=2)" in ep2.source
    ref = EngineHandle.compile("Qwen/Qwen3-30B-A3B", "h100_sxm", "vllm", tp_size=2,
                               moe_tp_size=1, moe_ep_size=2)
    bs, isl = 8, 2048
    ctx_ms, gen_ms, _ = ref.run_static(batch_size=bs, isl=isl, osl=2)
    assert 1000 * ep2.prefill_time([isl] * bs) == pytest.approx(ctx_ms, rel=0.10)
    assert 1000 * ep2.decode_time([isl + 1] * bs) == pytest.approx(gen_ms, rel=0.10)
    assert tp2.decode_time([isl + 1] * bs) > 0 and tp2.engine is not ep2.engine


def test_serving_terms_add_exactly_what_they_say(reference: dict) -> None:
    sim = SimulationConfig(ClusterConfig(model="llama-3.1-8b"), aic_system="h100_sxm",
                           step_overhead_ms=1.5, seq_overhead_ms=0.09)
    cfg = get_model_config("llama-3.1-8b")
    lat = step_model(sim, cfg, 1, 1, "float16")
    assert isinstance(lat, DriverOverhead)
    kernels = lat.base
    prefills, decodes = [(0, 512), (128, 256)], [700, 900, 1100]
    k = kernels.step_time(prefills, decodes)
    assert k > 0
    assert lat.step_time(prefills, decodes) == pytest.approx(k + 1.5e-3 + 5 * 0.09e-3, abs=1e-12)
    assert lat.decode_time([1000] * 8) == pytest.approx(
        kernels.decode_time([1000] * 8) + 1.5e-3 + 8 * 0.09e-3, abs=1e-12)
    # pipeline stages wrap the kernel source as they wrap every other source
    pp = step_model(sim, cfg, 1, 2, "float16")
    assert isinstance(pp, DriverOverhead) and isinstance(pp.base, PipelineModel)
    assert pp.base.base.source == kernels.source


def test_simulate_names_the_kernel_database(capsys: pytest.CaptureFixture[str],
                                            reference: dict) -> None:
    version = importlib.metadata.version("aiconfigurator-core")
    assert main(["simulate", "--model", "llama-3.1-8b", "--aic-system", "h100_sxm",
                 "--num-requests", "8", "--rate", "4", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"latency source: aiconfigurator-core {version} kernel database h100_sxm/vllm" in err


def test_bad_aic_settings_are_one_line_errors(capsys: pytest.CaptureFixture[str],
                                              reference: dict) -> None:
    assert main(["simulate", "--model", "llama-3.1-8b", "--aic-system", "h100_nope",
                 "--num-requests", "4", "--no-progress"]) == 2
    assert "aic system 'h100_nope' is not one of" in capsys.readouterr().err
    assert main(["simulate", "--model", "llama-3.1-8b", "--aic-system", "h100_sxm",
                 "--hardware", "H100", "--num-requests", "4", "--no-progress"]) == 2
    assert "give one latency source" in capsys.readouterr().err


def test_missing_package_is_a_one_line_error(aic_absent: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "llama-3.1-8b", "--aic-system", "h100_sxm",
                 "--num-requests", "4", "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "pip install 'pdserve[aic]'" in lines[0]
