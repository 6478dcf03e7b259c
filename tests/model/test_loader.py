"""Loader: HF checkpoints written by transformers itself, sharded files, clear errors."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model.layers import rope_inv_freq
from pdserve.model.loader import load_model
from tests.model.helpers import (
    HandDriver,
    hf_reference,
    make_executor,
    make_prompts,
    read_json,
    rel_err,
    write_json,
)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * 2.0 / p.shape[-1] ** 0.5 if "embed" not in name else noise * 0.5)


def _hf_variant(kind: str, path: str) -> torch.nn.Module:
    import transformers as tf

    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    if kind == "llama3":  # GQA 4:1, head_dim override, biases, tied head, llama3 rope scaling
        cfg = tf.LlamaConfig(**common, intermediate_size=96, num_key_value_heads=1, head_dim=32,
                             attention_bias=True, tie_word_embeddings=True, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mistral":  # a window shorter than the prompts
        cfg = tf.MistralConfig(**common, intermediate_size=96, num_key_value_heads=2,
                               sliding_window=24, tie_word_embeddings=False)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, intermediate_size=96, num_key_value_heads=2,
                             tie_word_embeddings=False, use_sliding_window=False)
        model = tf.Qwen2ForCausalLM(cfg)
    else:  # opt-350m layout: post-LN, project_in/out
        cfg = tf.OPTConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, ffn_dim=96,
                           num_attention_heads=4, max_position_embeddings=512,
                           word_embed_proj_dim=32, do_layer_norm_before=False, bos_token_id=1,
                           eos_token_id=2, pad_token_id=0)
        model = tf.OPTForCausalLM(cfg)
    _randomise(model, 7)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2", "opt350m"])
def test_checkpoints_saved_by_transformers(kind, tmp_path):
    path = str(tmp_path / kind)
    hf = _hf_variant(kind, path)
    prompts = make_prompts((5, 90, 200), vocab=320, seed=1)
    refs = hf_reference(hf, prompts, new_tokens=4)
    drv = HandDriver(make_executor(path))
    reqs = [drv.add(p) for p in prompts]
    drv.step([(reqs[0], None), (reqs[1], 40), (reqs[2], None)])  # prompts: 5, 90, 200 tokens
    drv.step([(reqs[0], 1), (reqs[1], None), (reqs[2], 1)])
    drv.decode_all(reqs, 4)
    for req, ref in zip(reqs, refs):
        assert drv.tokens[req.request_id] == ref.tokens
        for got, want in zip(drv.logits[req.request_id], ref.logits):
            assert rel_err(got, want) <= 1e-4


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      rope_scaling=scaling, max_position_embeddings=131072)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        rope_inv_freq(128, 1e4, {"rope_type": "dynamic", "factor": 2.0})


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_sharded_safetensors_load_identically(arch, tiny_dirs, tmp_path):
    src = tiny_dirs[arch]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    os.remove(dst / "model.safetensors")
    weights = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    with open(dst / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    a, cfg_a = load_model(src)
    b, cfg_b = load_model(str(dst))
    assert replace(cfg_a, name="") == replace(cfg_b, name="")
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _rewrite(tiny_dir: str, tmp_path, edit) -> str:
    dst = tmp_path / "edited"
    shutil.copytree(tiny_dir, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_tensor_is_named(tiny_dirs, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _rewrite(tiny_dirs["llama"], tmp_path, lambda w: w.pop(name))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*k_proj"):
        load_model(path)


def test_unexpected_and_misshapen_tensors(tiny_dirs, tmp_path):
    path = _rewrite(tiny_dirs["qwen2"], tmp_path,
                    lambda w: w.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected .*mystery"):
        load_model(path)
    shutil.rmtree(path)
    name = "model.layers.0.mlp.up_proj.weight"
    path = _rewrite(tiny_dirs["qwen2"], tmp_path,
                    lambda w: w.update({name: w[name][:, :10].contiguous()}))
    with pytest.raises(ValueError, match="up_proj"):
        load_model(path)


def test_tied_head_duplicate_and_inv_freq_are_ignored(tiny_dirs, tmp_path):
    def edit(w):
        w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
        w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    model, cfg = load_model(_rewrite(tiny_dirs["qwen2"], tmp_path, edit))
    assert cfg.tie_word_embeddings and model.lm_head is None


def test_bad_directories(tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path / "empty"))
    shutil.copy(os.path.join(tiny_dirs["llama"], "config.json"), tmp_path / "empty")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(tmp_path / "empty"))
    cfg = read_json(tmp_path / "empty" / "config.json")
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    write_json(tmp_path / "empty" / "config.json", cfg)
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_dirs["llama"], dtype="int8")


def test_bfloat16_on_cpu(tiny_dirs, hf_models):
    """bf16 weights and KV: teacher-forced on the float32 reference, the argmax agrees at most
    positions and the logits stay close."""
    prompts = make_prompts((12, 60, 140))
    refs = hf_reference(hf_models("llama"), prompts)
    ex = make_executor(tiny_dirs["llama"], dtype="bfloat16")
    assert ex.kv_cache.dtype == torch.bfloat16
    drv = HandDriver(ex, force={f"r{i}": r.tokens for i, r in enumerate(refs)})
    reqs = [drv.add(p) for p in prompts]
    drv.step([(r, None) for r in reqs])
    drv.decode_all(reqs, len(refs[0].tokens))
    agree = total = 0
    for req, ref in zip(reqs, refs):
        for got, want in zip(drv.logits[req.request_id], ref.logits):
            agree += int(got.argmax() == want.argmax())
            total += 1
            assert rel_err(got, want) < 0.1
    assert agree >= 0.8 * total


def test_engine_rejects_mixture_of_experts():
    from pdserve.config import ModelConfig
    from pdserve.model.loader import build_model
    from pdserve.sim.model_catalogue import CATALOGUE

    cfg = ModelConfig.from_hf_dict(dict(CATALOGUE["mixtral-8x7b"], num_hidden_layers=1,
                                        hidden_size=64, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=4,
                                        vocab_size=300), name="mixtral-tiny")
    with pytest.raises(ValueError, match="'mixtral-tiny' is a mixture of experts"):
        build_model(cfg)
