"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3): GQA, RoPE, RMSNorm, SwiGLU.

Q/K/V and gate/up projections are fused into one matrix each; :meth:`hf_weight_spec` tells the
loader where each Hugging Face tensor goes. Qwen2 adds a bias to Q/K/V; Qwen3 normalises each
head of Q and K with its own RMSNorm (``q_norm``/``k_norm``, weights of ``head_dim``) before
RoPE, and may set ``head_dim`` apart from ``hidden_size / heads``; Llama's
``attention_bias`` adds one to all four attention projections and ``mlp_bias`` to the MLP.
Mistral's sliding window is applied through the attention metadata (see
:func:`pdserve.engine.model_executor.sliding_window`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.layers import (
    AttentionMetadata,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    linear,
    paged_attention,
)

WeightSpec = dict[str, tuple[str, int]]


def rope_params(cfg: ModelConfig) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` from the config, also reading transformers 5's ``rope_parameters``."""
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    rp = cfg.hf_config.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" not in cfg.hf_config and "rope_theta" in rp:
            theta = float(rp["rope_theta"])
        if scaling is None and rp.get("rope_type", "default") != "default":
            scaling = rp
    return theta, scaling


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qk_size = q + kv
        qkv_bias = cfg.attention_bias
        o_bias = cfg.family in ("llama", "qwen3") and cfg.attention_bias
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=qkv_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, h, hd = x.shape[0], self.num_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([self.qk_size, self.qk_size - h * hd], dim=-1)
        qk = qk.view(t, -1, hd)
        if self.q_norm is not None:
            q, k = qk.split([h, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = apply_rope(qk, cos, sin).split([h, self.num_kv_heads], dim=1)
        o = paged_attention(q, k, v.view(t, self.num_kv_heads, hd), kv_cache, meta)
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = bool(cfg.hf_config.get("mlp_bias", False))
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Paged-attention Llama/Mistral/Qwen2/Qwen3 for serving (dense models only).

    ``forward(meta, kv_cache)`` runs the flattened tokens of a whole mixed batch and returns the
    final hidden states of the rows in ``meta.sample_indices`` only; :meth:`compute_logits`
    turns them into logits.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.is_moe:
            raise ValueError(f"model {cfg.name or cfg.family!r} is a mixture of experts "
                             f"({cfg.num_experts} experts): the engine runs dense models only; "
                             "simulate it instead (pdserve simulate)")
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        theta, scaling = rope_params(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.packed_head: torch.Tensor | None = None  # tied head for CPU (prepack_linears)
        self.last_stage = True  # False: a pipeline stage before the last (pdserve.model.tp)

    def forward(self, meta: AttentionMetadata, kv_cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``kv_cache``: ``[layers, 2, kv_heads, blocks, block_size, head_dim]``. ``hidden``:
        the previous pipeline stage's hidden states (instead of embedding the tokens); a stage
        before the last returns every token's hidden states."""
        x = self.embed_tokens(meta.input_ids) if hidden is None else hidden
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], meta)
        if not self.last_stage:
            return x
        return self.norm(x.index_select(0, meta.sample_indices))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return linear(hidden, self.embed_tokens.weight, None, self.packed_head)
        return self.lm_head(hidden)

    def hf_weight_spec(self) -> WeightSpec:
        """Hugging Face tensor name -> (our parameter name, first row inside it)."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        spec: WeightSpec = {"model.embed_tokens.weight": ("embed_tokens.weight", 0),
                            "model.norm.weight": ("norm.weight", 0)}
        if self.lm_head is not None:
            spec["lm_head.weight"] = ("lm_head.weight", 0)
        for i, layer in enumerate(self.layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            kinds = ["weight"] + (["bias"] if layer.self_attn.qkv_proj.bias is not None else [])
            for kind in kinds:
                for name, row in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
                    spec[f"{hf}self_attn.{name}.{kind}"] = (f"{me}self_attn.qkv_proj.{kind}", row)
            kinds = ["weight"] + (["bias"] if layer.self_attn.o_proj.bias is not None else [])
            for kind in kinds:
                spec[f"{hf}self_attn.o_proj.{kind}"] = (f"{me}self_attn.o_proj.{kind}", 0)
            kinds = ["weight"] + (["bias"] if layer.mlp.down_proj.bias is not None else [])
            for kind in kinds:
                spec[f"{hf}mlp.gate_proj.{kind}"] = (f"{me}mlp.gate_up_proj.{kind}", 0)
                spec[f"{hf}mlp.up_proj.{kind}"] = (f"{me}mlp.gate_up_proj.{kind}",
                                                   cfg.intermediate_size)
                spec[f"{hf}mlp.down_proj.{kind}"] = (f"{me}mlp.down_proj.{kind}", 0)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                spec[f"{hf}{norm}.weight"] = (f"{me}{norm}.weight", 0)
            if cfg.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    spec[f"{hf}self_attn.{norm}.weight"] = (f"{me}self_attn.{norm}.weight", 0)
        return spec

    @staticmethod
    def ignored_hf_weight(name: str) -> bool:
        """Checkpoint tensors that carry nothing we need (recomputed buffers, a tied head)."""
        return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"
