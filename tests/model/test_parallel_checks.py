"""A parallel layout the live engine cannot run is one clear error naming the value (never a
silent unsharded instance); the simulator keeps modelling it."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.config import ModelConfig
from pdserve.model.parallel import TPLayout, check_live_layout, check_tp


def model(heads: int = 8, kv: int = 4, layers: int = 2, inter: int = 64) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=100, hidden_size=heads * 8,
                       intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, max_position_embeddings=128, name="m")


@pytest.mark.parametrize(("kw", "message"), [
    ({"ep": 2}, "ep=2"),
    ({"pp": 3}, "pp=3 exceeds the 2 layers"),
    ({"tp": 3}, "tp=3 does not divide the 8 attention heads"),
    ({"tp": 0}, "tp must be an integer >= 1, got 0"),
    ({"tp": 2, "device": "cuda", "ranks_available": 1}, "needs 2 ranks, more than the 1 GPUs"),
    ({"tp": 4, "ranks_available": 2}, "needs 4 ranks, more than the 2 CPUs"),
])
def test_live_layout_errors_name_the_value(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_live_layout(model(), **kw)


def test_tp_must_divide_heads_or_kv_heads() -> None:
    check_tp(model(8, 4), 8)  # tp > KV heads: KV heads replicated
    with pytest.raises(ValueError, match="tp=6 neither divides the 4 KV heads"):
        check_tp(model(12, 4, inter=60), 6)
    with pytest.raises(ValueError, match="MLP width 63"):
        check_tp(model(8, 4, inter=63), 2)


def test_layout_ranges() -> None:
    m = model(8, 2)
    lay = [TPLayout(m, 4, r) for r in range(4)]
    assert [x.head_range() for x in lay] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads over 4 ranks: each replicated on two neighbouring ranks
    assert [x.kv_head_range() for x in lay] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [lay[0].kv_owner(h) for h in range(2)] == [0, 2]
    assert [x.vocab_range() for x in lay] == [(0, 25), (25, 50), (50, 75), (75, 100)]
    local = lay[1].local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.head_dim) == \
        (2, 1, 16, 8)


def test_generate_refuses_more_stages_than_layers(tiny_dirs, capsys) -> None:
    assert cli.main(["generate", "--model", tiny_dirs["llama"], "--prompt", "hi",
                     "--pp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pp=3 exceeds the 2 layers" in err and len(err.splitlines()) == 1, err


def test_generate_with_pp2_prints_what_pp1_prints(tiny_dirs, capsys) -> None:
    argv = ["generate", "--model", tiny_dirs["opt"], "--prompt", "The quick brown fox",
            "--max-tokens", "12", "--num-kv-blocks", "32", "--max-model-len", "256"]
    assert cli.main([*argv, "--pp", "1"]) == 0
    one = capsys.readouterr().out
    assert cli.main([*argv, "--pp", "2"]) == 0
    assert capsys.readouterr().out == one and "12 tokens" in one


def test_llm_refuses_bad_layouts(tiny_dirs) -> None:
    from pdserve.llm import LLM

    with pytest.raises(ValueError, match="pp=3 exceeds"):
        LLM(tiny_dirs["llama"], pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        LLM(tiny_dirs["llama"], tensor_parallel_size=3)


def test_serve_refuses_a_deployment_it_cannot_run(tiny_dirs, tmp_path, capsys) -> None:
    spec = tmp_path / "d.yaml"
    spec.write_text(f"model: {tiny_dirs['llama']}\nbackend: inproc\n"
                    "roles: [{role: prefill, pp: 3}, {role: decode}]\n")
    assert cli.main(["serve", "--config", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "prefill instances: pp=3 exceeds the 2 layers" in err, err


def test_simulate_still_models_tp_and_pp(tiny_dirs) -> None:
    from pdserve.config import ClusterConfig

    cfg = ClusterConfig.from_dict({"model": tiny_dirs["llama"], "tp": 2, "pp": 2,
                                   "backend": "inproc"})
    assert cfg.num_gpus == 4  # the spec itself stays valid: only the live paths refuse it
