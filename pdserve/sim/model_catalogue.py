"""Architectures of public models, for simulating without a checkpoint (torch-free).

Each entry is the relevant subset of the model's Hugging Face ``config.json`` and goes through
:meth:`ModelConfig.from_hf_dict`, the same path a real checkpoint directory takes. Numbers are
from the published configs: OPT (Zhang et al. 2022, ``facebook/opt-*``), Llama 2 (Touvron et al.
2023, ``meta-llama/Llama-2-*-hf``), Llama 3 / 3.1 (``meta-llama/Meta-Llama-3-*``,
``meta-llama/Llama-3.1-*``), Mistral 7B v0.1 (``mistralai/Mistral-7B-v0.1``), Qwen2 7B
(``Qwen/Qwen2-7B``), Qwen3 (``Qwen/Qwen3-*``: q/k norms, explicit ``head_dim``; the MoE ones
``Qwen/Qwen3-30B-A3B`` and ``Qwen/Qwen3-235B-A22B``: 128 experts, 8 active, no shared expert)
and Mixtral (``mistralai/Mixtral-8x7B-v0.1``, ``mistralai/Mixtral-8x22B-v0.1``: 8 experts,
2 active).
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.config import ModelConfig


def _opt(hf_id: str, hidden: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "_name_or_path": hf_id, "architectures": ["OPTForCausalLM"], "model_type": "opt",
        "vocab_size": 50272, "hidden_size": hidden, "ffn_dim": 4 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "max_position_embeddings": 2048, "enable_bias": True, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16",
    }


def _llama(hf_id: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           vocab: int, max_pos: int, rope_theta: float, bos: int, eos: int,
           arch: str = "LlamaForCausalLM", model_type: str = "llama", eps: float = 1e-5,
           **extra: Any) -> dict[str, Any]:
    d = {
        "_name_or_path": hf_id, "architectures": [arch], "model_type": model_type,
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": max_pos,
        "rope_theta": rope_theta, "rms_norm_eps": eps, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16",
    }
    d.update(extra)
    return d


def _qwen3(hf_id: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           tie: bool, max_pos: int = 40960, **moe: Any) -> dict[str, Any]:
    arch, mt = ("Qwen3MoeForCausalLM", "qwen3_moe") if moe else ("Qwen3ForCausalLM", "qwen3")
    return _llama(hf_id, hidden, inter, layers, heads, kv_heads, 151936, max_pos, 1000000.0,
                  151643, 151645, arch=arch, model_type=mt, eps=1e-6, head_dim=128,
                  attention_bias=False, tie_word_embeddings=tie, **moe)


def _qwen3_moe(hf_id: str, hidden: int, layers: int, heads: int, kv_heads: int,
               moe_inter: int) -> dict[str, Any]:
    return _qwen3(hf_id, hidden, 6144 if hidden == 2048 else 12288, layers, heads, kv_heads,
                  False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=moe_inter,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


def _mixtral(hf_id: str, hidden: int, inter: int, layers: int, heads: int, vocab: int,
             max_pos: int, theta: float) -> dict[str, Any]:
    return _llama(hf_id, hidden, inter, layers, heads, 8, vocab, max_pos, theta, 1, 2,
                  arch="MixtralForCausalLM", model_type="mixtral", num_local_experts=8,
                  num_experts_per_tok=2)


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

CATALOGUE: dict[str, dict[str, Any]] = {
    "opt-1.3b": _opt("facebook/opt-1.3b", 2048, 24, 32),
    "opt-6.7b": _opt("facebook/opt-6.7b", 4096, 32, 32),
    "opt-13b": _opt("facebook/opt-13b", 5120, 40, 40),
    "opt-30b": _opt("facebook/opt-30b", 7168, 48, 56),
    "opt-66b": _opt("facebook/opt-66b", 9216, 64, 72),
    "opt-175b": _opt("facebook/opt-175b", 12288, 96, 96),
    "llama-2-7b": _llama("meta-llama/Llama-2-7b-hf", 4096, 11008, 32, 32, 32, 32000, 4096,
                         10000.0, 1, 2),
    "llama-2-13b": _llama("meta-llama/Llama-2-13b-hf", 5120, 13824, 40, 40, 40, 32000, 4096,
                          10000.0, 1, 2),
    "llama-2-70b": _llama("meta-llama/Llama-2-70b-hf", 8192, 28672, 80, 64, 8, 32000, 4096,
                          10000.0, 1, 2),
    "llama-3-8b": _llama("meta-llama/Meta-Llama-3-8B", 4096, 14336, 32, 32, 8, 128256, 8192,
                         500000.0, 128000, 128001),
    "llama-3-70b": _llama("meta-llama/Meta-Llama-3-70B", 8192, 28672, 80, 64, 8, 128256, 8192,
                          500000.0, 128000, 128001),
    "llama-3.1-8b": _llama("meta-llama/Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, 131072,
                           500000.0, 128000, 128001, rope_scaling=_LLAMA31_ROPE),
    "llama-3.1-70b": _llama("meta-llama/Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128256,
                            131072, 500000.0, 128000, 128001, rope_scaling=_LLAMA31_ROPE),
    "mistral-7b": _llama("mistralai/Mistral-7B-v0.1", 4096, 14336, 32, 32, 8, 32000, 32768,
                         10000.0, 1, 2, arch="MistralForCausalLM", model_type="mistral",
                         sliding_window=4096),
    "qwen2-7b": _llama("Qwen/Qwen2-7B", 3584, 18944, 28, 28, 4, 152064, 131072, 1000000.0,
                       151643, 151643, arch="Qwen2ForCausalLM", model_type="qwen2", eps=1e-6),
    "qwen3-0.6b": _qwen3("Qwen/Qwen3-0.6B", 1024, 3072, 28, 16, 8, True),
    "qwen3-8b": _qwen3("Qwen/Qwen3-8B", 4096, 12288, 36, 32, 8, False),
    "qwen3-32b": _qwen3("Qwen/Qwen3-32B", 5120, 25600, 64, 64, 8, False),
    "qwen3-30b-a3b": _qwen3_moe("Qwen/Qwen3-30B-A3B", 2048, 48, 32, 4, 768),
    "qwen3-235b-a22b": _qwen3_moe("Qwen/Qwen3-235B-A22B", 4096, 94, 64, 4, 1536),
    "mixtral-8x7b": _mixtral("mistralai/Mixtral-8x7B-v0.1", 4096, 14336, 32, 32, 32000, 32768,
                             1000000.0),
    "mixtral-8x22b": _mixtral("mistralai/Mixtral-8x22B-v0.1", 6144, 16384, 56, 48, 32768,
                              65536, 1000000.0),
}

# Alternative spellings → catalogue name (after lower-casing and dropping an ``org/`` prefix).
_ALIASES = {
    "llama-2-7b-hf": "llama-2-7b", "llama-2-13b-hf": "llama-2-13b",
    "llama-2-70b-hf": "llama-2-70b", "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama-3.1-70b": "llama-3.1-70b", "mistral-7b-v0.1": "mistral-7b",
    "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b", "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral-8x22b-v0.1": "mixtral-8x22b",
}


def canonical_model_name(name: str) -> str | None:
    """Catalogue name for ``name`` (``facebook/OPT-13B`` → ``opt-13b``), or ``None``."""
    key = name.strip().lower().rstrip("/").rsplit("/", 1)[-1].replace("_", "-")
    key = _ALIASES.get(key, key)
    return key if key in CATALOGUE else None


def list_models() -> list[str]:
    return list(CATALOGUE)


def get_model_config(name_or_dir: str | os.PathLike[str]) -> ModelConfig:
    """A catalogue model (``opt-13b``, ``facebook/opt-13b``, ``meta-llama/Llama-2-7b-hf``) or a
    local directory holding a ``config.json``. The catalogue entry's ``name`` is its canonical
    catalogue name; its HF id is in ``hf_config["_name_or_path"]``."""
    path = os.fspath(name_or_dir)
    if os.path.isdir(path):
        return ModelConfig.from_dir(path)
    canon = canonical_model_name(path)
    if canon is None:
        raise ValueError(f"unknown model {path!r}: not a directory with config.json and not in "
                         f"the catalogue ({', '.join(CATALOGUE)})")
    return ModelConfig.from_hf_dict(dict(CATALOGUE[canon]), name=canon)
