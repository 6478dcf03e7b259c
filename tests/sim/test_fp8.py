"""fp8 weights and KV (``--quantization fp8``, ``--kv-cache-dtype fp8``): the KV pool is sized by
hand as an fp8 checkpoint leaves it, only the kernel database prices fp8 (every other source and
the live server refuse it), and the database's fp8 tables are the ones it prices with."""

from __future__ import annotations

import pytest
import yaml

from pdserve import cli
from pdserve.config import ClusterConfig, EngineConfig, GiB, ModelConfig, simulated_kv_blocks
from pdserve.config.engine import engine_reserved_bytes
from pdserve.planner.problem import Problem
from pdserve.sim.model_catalogue import get_model_config
from pdserve.sim.target import SimulationConfig

TINY = ModelConfig(family="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=4096,
                   head_dim=16)
LLAMA = "meta-llama/Meta-Llama-3.1-8B"


def test_fp8_pool_by_hand() -> None:
    e = EngineConfig.from_kwargs("x", dtype="bfloat16", max_num_seqs=10_000,
                                 max_num_batched_tokens=1024, gpu_memory_utilization=0.5)
    mem = 2 * GiB
    reserved = engine_reserved_bytes(TINY, e, device_memory_bytes=mem)
    params = TINY.num_params()
    embed = 2 * 1000 * 64  # untied: embeddings and LM head, kept at bf16
    budget16 = 0.5 * mem - 2 * params - reserved
    budget8 = 0.5 * mem - (params - embed + 2 * embed) - reserved
    block16 = 16 * 2 * 2 * 2 * 16 * 2  # block x (K, V) x layers x kv heads x head_dim x bytes
    blocks = {(q, k): simulated_kv_blocks(TINY, e, device_memory_bytes=mem, quantization=q,
                                          kv_cache_dtype=k)
              for q in (None, "fp8") for k in ("auto", "fp8")}
    assert blocks[None, "auto"] == int(budget16 // block16)
    assert blocks["fp8", "auto"] == int(budget8 // block16)
    assert blocks[None, "fp8"] == int(budget16 // (block16 // 2))
    assert blocks["fp8", "fp8"] == int(budget8 // (block16 // 2))


@pytest.mark.parametrize("kw", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}])
@pytest.mark.parametrize("source", [{"hardware": "H100"},
                                    {"profile": "distserve_profiler-a100-80g.distserve"}])
def test_only_the_kernel_database_prices_fp8(kw: dict, source: dict) -> None:
    with pytest.raises(ValueError, match="only the kernel database prices fp8"):
        SimulationConfig(ClusterConfig(model="opt-13b"), **source, **kw)
    with pytest.raises(ValueError, match="only the kernel database prices fp8"):
        Problem(model="opt-13b", **source, **kw)


def test_unknown_values_are_refused() -> None:
    with pytest.raises(ValueError, match="quantization 'int4' is not one of fp8"):
        SimulationConfig(ClusterConfig(model="opt-13b"), quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp16' is not one of auto, fp8"):
        SimulationConfig(ClusterConfig(model="opt-13b"), kv_cache_dtype="fp16")


def test_simulate_flag_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--model", "opt-13b", "--kv-cache-dtype", "fp8",
                     "--num-requests", "4", "--rate", "1", "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "kv_cache_dtype fp8: only the kernel database" in lines[0]


def test_serve_refuses_a_spec_priced_in_fp8(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "plan.yaml"
    spec.write_text(yaml.safe_dump({"model": "opt-125m", "simulation": {
        "aic_system": "h100_sxm", "quantization": "fp8"}}))
    assert cli.main(["serve", "--config", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "prices quantization: fp8, which the live engine does not serve" in err, err


# ----------------------------------------------------------- with aiconfigurator-core (optional)
@pytest.fixture(scope="module")
def handle() -> object:
    pytest.importorskip("aiconfigurator_core", reason="optional package (pdserve[aic])",
                        exc_type=ImportError)
    from aiconfigurator_core.sdk.engine import EngineHandle

    return EngineHandle.compile


@pytest.mark.parametrize("kw,modes", [
    ({"quantization": "fp8"}, {"gemm_quant_mode": "fp8"}),
    ({"kv_cache_dtype": "fp8"}, {"kvcache_quant_mode": "fp8"}),
    ({"quantization": "fp8", "kv_cache_dtype": "fp8"},
     {"gemm_quant_mode": "fp8", "kvcache_quant_mode": "fp8"})])
def test_fp8_reaches_the_database(handle, kw: dict, modes: dict) -> None:
    from pdserve.sim.aic_latency import AicModel

    cfg = get_model_config("llama-3.1-8b")
    m = AicModel(cfg, "h100_sxm", "vllm", 1, **kw)
    ref = handle(LLAMA, "h100_sxm", "vllm", tp_size=1, **modes)
    bs, isl = 16, 2000
    ctx_ms, gen_ms, _ = ref.run_static(batch_size=bs, isl=isl, osl=2)
    assert 1000 * m.prefill_time([isl] * bs) == pytest.approx(ctx_ms, rel=0.10)
    assert 1000 * m.decode_time([isl + 1] * bs) == pytest.approx(gen_ms, rel=0.10)
    bf16 = AicModel(cfg, "h100_sxm", "vllm", 1)
    assert m.decode_time([isl + 1] * 64) < 0.9 * bf16.decode_time([isl + 1] * 64)
    assert ("fp8 weights" in m.source) == ("quantization" in kw)
    assert ("fp8 KV" in m.source) == ("kv_cache_dtype" in kw)


def test_missing_fp8_data_fails_before_the_simulation(handle) -> None:
    from pdserve.sim.aic_latency import AicModel

    cfg = get_model_config("llama-3.1-8b")
    with pytest.raises(ValueError, match="has no fp8 kernel data for .* on a100_sxm/vllm"):
        AicModel(cfg, "a100_sxm", "vllm", 1, quantization="fp8")  # Ampere: no fp8 cores
    with pytest.raises(ValueError, match="fp8 is priced for dense models only"):
        AicModel(get_model_config("qwen3-30b-a3b"), "h100_sxm", "vllm", 1, quantization="fp8")


def test_plan_writes_fp8_into_its_simulation_section(handle) -> None:
    p = Problem(model="llama-3.1-8b", aic_system="h100_sxm", quantization="fp8",
                kv_cache_dtype="fp8")
    assert p.simulation() == {"aic_system": "h100_sxm", "aic_backend": "vllm",
                              "quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert "fp8 weights, fp8 KV" in p.latency_source()
    sim = SimulationConfig(ClusterConfig(model="llama-3.1-8b"), **p.sim_settings())
    assert (sim.quantization, sim.kv_cache_dtype) == ("fp8", "fp8")
