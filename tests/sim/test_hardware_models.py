"""Hardware registry and model catalogue: lookups, aliases, error messages, spec numbers."""

import json

import pytest

from pdserve.sim.hardware import (
    DeviceSpec,
    LinkSpec,
    get_device,
    get_link,
    list_devices,
    list_links,
)
from pdserve.sim.model_catalogue import canonical_model_name, get_model_config, list_models


def test_device_lookup_case_insensitive_and_aliases():
    a100 = get_device("a100-80gb")
    assert a100 is get_device("A100-80GB") is get_device("a100") is get_device("A100_80GB")
    assert (a100.peak_tflops, a100.memory_gib, a100.memory_bw_gbs) == (312.0, 80.0, 2039.0)
    assert a100.ridge_point == pytest.approx(153, abs=1)  # DistServe App. A.2 says ~156
    assert get_device("h100").memory_bw_gbs == 3350.0
    assert get_device("H200").memory_gib == 141.0
    assert get_device("l20").intra_node_link == "pcie4"
    assert get_device(a100) is a100
    assert {"A100-80GB", "A100-40GB", "A800-80GB", "H100", "H200", "L20", "cpu"} <= \
        set(list_devices())


def test_unknown_device_lists_choices():
    with pytest.raises(ValueError, match=r"unknown device 'v100'; choices: .*A100-80GB.*H200"):
        get_device("v100")


def test_links():
    assert get_link("ETH-25G").bandwidth_gb_per_s == 25 / 8  # DistServe §6.1 testbed
    assert get_link("ethernet") is get_link("eth-25g")
    assert get_link("eth-100g").bandwidth_gb_per_s == 12.5
    assert get_link("ib-hdr").bandwidth_gb_per_s == 25.0
    assert get_link("ndr").bandwidth_gb_per_s == 50.0
    # per-direction halves of the spec sheets' bidirectional NVLink numbers
    assert get_link(get_device("a100").intra_node_link).bandwidth_gb_per_s == 300.0
    # 400 GB/s bidirectional
    assert get_link(get_device("a800").intra_node_link).bandwidth_gb_per_s == 200.0
    assert get_link(get_device("h100").intra_node_link).bandwidth_gb_per_s == 450.0
    assert get_link("pcie5").bandwidth_gb_per_s == 2 * get_link("pcie4").bandwidth_gb_per_s
    assert get_link("eth-25g").min_time(3.125e9) == pytest.approx(1.0 + 50e-6)
    assert {"nvlink3", "nvlink4", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "eth-25g"} <= \
        set(list_links())
    with pytest.raises(ValueError, match="unknown link 'tcp'; choices: .*nvlink3"):
        get_link("tcp")


def test_spec_validation():
    with pytest.raises(ValueError, match="bandwidth_gb_per_s"):
        LinkSpec(0.0, name="x")
    with pytest.raises(ValueError, match="peak_tflops"):
        DeviceSpec("x", 0.0, 1.0, 1.0, "pcie4")


def test_catalogue_architectures():
    m = get_model_config("facebook/opt-13b")
    assert m == get_model_config("OPT-13B") and m.name == "opt-13b"
    assert (m.family, m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size) == \
        ("opt", 5120, 40, 40, 20480)
    assert m.num_params() == pytest.approx(12.85e9, rel=0.01)
    assert get_model_config("opt-66b").num_params() == pytest.approx(65.7e9, rel=0.01)
    assert get_model_config("opt-175b").num_params() == pytest.approx(174.6e9, rel=0.01)
    l70 = get_model_config("meta-llama/Llama-2-70b-hf")
    assert (l70.num_kv_heads, l70.num_params()) == (8, pytest.approx(69.0e9, rel=0.01))
    assert get_model_config("llama-2-7b").num_params() == pytest.approx(6.74e9, rel=0.01)
    assert get_model_config("meta-llama/Meta-Llama-3-8B").num_params() == \
        pytest.approx(8.03e9, rel=0.01)
    assert get_model_config("llama-3.1-8b").rope_scaling["rope_type"] == "llama3"
    assert get_model_config("mistral-7b").num_params() == pytest.approx(7.24e9, rel=0.01)
    q = get_model_config("Qwen/Qwen2-7B")
    assert (q.family, q.num_kv_heads, q.attention_bias) == ("qwen2", 4, True)
    assert q.num_params() == pytest.approx(7.62e9, rel=0.01)
    for name in list_models():
        assert get_model_config(name).name == name


def test_model_from_directory_and_errors(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model_config(tmp_path)
    assert (m.hidden_size, m.num_kv_heads) == (64, 2)
    assert canonical_model_name("nobody/opt-13b") == "opt-13b"
    assert canonical_model_name("gpt-2") is None
    with pytest.raises(ValueError, match="unknown model 'gpt-2'.*opt-13b"):
        get_model_config("gpt-2")


def test_qwen3_and_moe_catalogue_configs():
    """Parameter counts against the model cards (total / activated)."""
    q = get_model_config("Qwen/Qwen3-8B")
    assert (q.family, q.qk_norm, q.head_dim, q.num_kv_heads, q.attention_bias) == \
        ("qwen3", True, 128, 8, False)
    assert q.num_params() == pytest.approx(8.2e9, rel=0.01)
    small = get_model_config("qwen3-0.6b")
    assert small.head_dim * small.num_heads != small.hidden_size  # explicit head_dim: 128·16
    assert small.num_params() == pytest.approx(0.6e9, rel=0.01)
    a3b = get_model_config("Qwen/Qwen3-30B-A3B")
    assert (a3b.num_experts, a3b.num_experts_per_tok, a3b.moe_intermediate_size,
            a3b.num_moe_layers) == (128, 8, 768, 48)
    assert a3b.num_params() == pytest.approx(30.5e9, rel=0.01)
    assert a3b.num_params(active=True) == pytest.approx(3.3e9, rel=0.02)
    big = get_model_config("qwen3-235b-a22b")
    assert big.num_params() == pytest.approx(235e9, rel=0.01)
    assert big.num_params(active=True) == pytest.approx(22e9, rel=0.02)
    mix = get_model_config("mistralai/Mixtral-8x7B-v0.1")
    assert (mix.family, mix.num_experts, mix.num_experts_per_tok) == ("llama", 8, 2)
    assert mix.num_params() == pytest.approx(46.7e9, rel=0.01)
    assert mix.num_params(active=True) == pytest.approx(12.9e9, rel=0.01)
    assert get_model_config("mixtral-8x22b").num_params() == pytest.approx(141e9, rel=0.01)


def test_moe_config_fields_from_hf(tmp_path):
    """Qwen2-MoE style: shared expert, every second layer sparse, layer 0 dense."""
    from pdserve.config import ModelConfig

    d = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
         "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128,
         "decoder_sparse_step": 2, "mlp_only_layers": [1]}
    m = ModelConfig.from_hf_dict(d)
    assert (m.family, m.num_moe_layers, m.shared_expert_intermediate_size) == ("qwen2", 1, 128)
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64
    moe = 4 * 3 * 64 * 32 + 64 * 4 + 3 * 64 * 128 + 64
    assert m.num_params() == 4 * attn + 3 * 3 * 64 * 256 + moe + 2 * 1000 * 64
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be in 1..num_experts=4"):
        ModelConfig.from_hf_dict({**d, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_hf_dict({**d, "architectures": ["GPT2LMHeadModel"],
                                  "model_type": "gpt2"})
