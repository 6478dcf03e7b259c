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
from pdserve.sim.models import canonical_model_name, get_model_config, list_models


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
    assert get_link("ETH-25G").bandwidth_gbs == 25 / 8  # DistServe §6.1 testbed
    assert get_link("ethernet") is get_link("eth-25g")
    assert get_link("eth-100g").bandwidth_gbs == 12.5
    assert get_link("ib-hdr").bandwidth_gbs == 25.0 and get_link("ndr").bandwidth_gbs == 50.0
    # per-direction halves of the spec sheets' bidirectional NVLink numbers
    assert get_link(get_device("a100").intra_node_link).bandwidth_gbs == 300.0
    assert get_link(get_device("a800").intra_node_link).bandwidth_gbs == 200.0  # 400 GB/s bidir
    assert get_link(get_device("h100").intra_node_link).bandwidth_gbs == 450.0
    assert get_link("pcie5").bandwidth_gbs == 2 * get_link("pcie4").bandwidth_gbs
    assert get_link("eth-25g").min_time(3.125e9) == pytest.approx(1.0 + 50e-6)
    assert {"nvlink3", "nvlink4", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "eth-25g"} <= \
        set(list_links())
    with pytest.raises(ValueError, match="unknown link 'tcp'; choices: .*nvlink3"):
        get_link("tcp")


def test_spec_validation():
    with pytest.raises(ValueError, match="bandwidth_gbs"):
        LinkSpec("x", 0.0)
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
