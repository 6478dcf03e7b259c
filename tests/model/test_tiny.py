"""Tiny random models: Hugging Face layout, tokenizer round trip, chat template, determinism."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pdserve.model.tiny import EOS_ID, default_model_dir, make_tiny_model
from tests.model.conftest import ARCHS
from tests.model.helpers import read_json

TEXTS = [
    "Hello, world! The quick brown fox.",
    "def f(x):\n    return x ** 2  # trailing  spaces  \n\n\ttab",
    "Ünïcödé — 你好, мир 🚀 ∑ x²",
    " leading space and <s> literal-looking text </s>",
    "",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers(arch, tiny_dirs, hf_models):
    from transformers import AutoTokenizer

    d = tiny_dirs[arch]
    cfg = read_json(os.path.join(d, "config.json"))
    assert cfg["torch_dtype"] == "float32" and cfg["eos_token_id"] == EOS_ID
    model = hf_models(arch)
    assert type(model).__name__ == cfg["architectures"][0]
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) <= cfg["vocab_size"]
    assert tok.eos_token == "</s>" and tok.eos_token_id == EOS_ID
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text
    assert len(tok.encode("the model", add_special_tokens=False)) < len("the model")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    no_prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("<|assistant|>\n")


def test_architecture_details(tiny_dirs):
    cfgs = {a: read_json(os.path.join(tiny_dirs[a], "config.json")) for a in ARCHS}
    assert cfgs["llama"]["num_key_value_heads"] < cfgs["llama"]["num_attention_heads"]
    assert cfgs["opt"]["do_layer_norm_before"] is True
    assert cfgs["opt"]["word_embed_proj_dim"] == cfgs["opt"]["hidden_size"]
    w = load_file(os.path.join(tiny_dirs["qwen2"], "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in w and "lm_head.weight" not in w
    w = load_file(os.path.join(tiny_dirs["opt"], "model.safetensors"))
    assert w["model.decoder.embed_positions.weight"].shape[0] == 1024 + 2


def test_same_seed_same_bytes(tmp_path):
    a = make_tiny_model(tmp_path / "a", "llama", seed=3)
    b = make_tiny_model(tmp_path / "b", "llama", seed=3)
    c = make_tiny_model(tmp_path / "c", "llama", seed=4)
    for name in sorted(os.listdir(a)):
        assert Path(a, name).read_bytes() == Path(b, name).read_bytes()
    assert Path(a, "model.safetensors").read_bytes() != Path(c, "model.safetensors").read_bytes()


def test_custom_sizes_and_bad_arguments(tmp_path):
    d = make_tiny_model(tmp_path / "m", "qwen2", vocab_size=600, hidden_size=96, num_heads=6,
                        num_kv_heads=3, num_layers=1, intermediate_size=80,
                        max_position_embeddings=128, tie_word_embeddings=False)
    cfg = read_json(os.path.join(d, "config.json"))
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (600, 96, 3)
    assert "lm_head.weight" in load_file(os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        make_tiny_model(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(tmp_path / "x", "opt", num_kv_heads=1)
    with pytest.raises(ValueError, match="divisible"):
        make_tiny_model(tmp_path / "x", "llama", hidden_size=66)
    for size in ("hidden_size", "num_layers", "num_heads", "head_dim"):  # not the default
        with pytest.raises(ValueError, match=f"{size} must be an integer >= 1, got 0"):
            make_tiny_model(tmp_path / "x", "qwen3", **{size: 0})


def test_default_model_dir_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    d = default_model_dir()
    assert d == os.path.join(str(tmp_path), "tiny-llama")
    mtime = os.path.getmtime(os.path.join(d, "model.safetensors"))
    assert default_model_dir() == d
    assert os.path.getmtime(os.path.join(d, "model.safetensors")) == mtime
    assert read_json(os.path.join(d, "config.json"))["architectures"] == ["LlamaForCausalLM"]
