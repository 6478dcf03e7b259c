"""OPT decoder: learned absolute positions (offset 2), LayerNorm, ReLU MLP, biases everywhere.

Supports pre-LN (``do_layer_norm_before=True``, most sizes) and post-LN (opt-350m) layers, and a
``word_embed_proj_dim`` different from ``hidden_size`` (``project_in``/``project_out``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.layers import (
    AttentionMetadata,
    Embedding,
    LayerNorm,
    Linear,
    linear,
    paged_attention,
)

WeightSpec = dict[str, tuple[str, int]]

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.qkv_proj = Linear(h, 3 * cfg.num_heads * cfg.head_dim, bias=bias)
        self.out_proj = Linear(cfg.num_heads * cfg.head_dim, h, bias=bias)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(paged_attention(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        h, bias = cfg.hidden_size, cfg.attention_bias
        affine = bool(hf.get("layer_norm_elementwise_affine", True))
        self.pre_norm = bool(hf.get("do_layer_norm_before", True))
        self.act = _ACTIVATIONS[hf.get("activation_function", "relu")]
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = LayerNorm(h, eps=cfg.norm_eps, elementwise_affine=affine)
        self.fc1 = Linear(h, cfg.intermediate_size, bias=bias)
        self.fc2 = Linear(cfg.intermediate_size, h, bias=bias)
        self.final_layer_norm = LayerNorm(h, eps=cfg.norm_eps, elementwise_affine=affine)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), kv_cache, meta)
            return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, kv_cache, meta))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class OPTForCausalLM(nn.Module):
    """Paged-attention OPT; same interface as :class:`pdserve.model.llama.LlamaForCausalLM`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        h = cfg.hidden_size
        wdim = int(hf.get("word_embed_proj_dim") or h)
        self.embed_tokens = Embedding(cfg.vocab_size, wdim)
        self.embed_positions = Embedding(cfg.max_position_embeddings + POSITION_OFFSET, h)
        self.project_in = Linear(wdim, h, bias=False) if wdim != h else None
        self.project_out = Linear(h, wdim, bias=False) if wdim != h else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_layers))
        affine = bool(hf.get("layer_norm_elementwise_affine", True))
        keep_final = hf.get("do_layer_norm_before", True) and not hf.get(
            "_remove_final_layer_norm", False)
        self.final_layer_norm = (LayerNorm(h, eps=cfg.norm_eps, elementwise_affine=affine)
                                 if keep_final else None)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(wdim, cfg.vocab_size, bias=False))
        self.packed_head: torch.Tensor | None = None  # tied head for CPU (prepack_linears)
        self.last_stage = True  # False: a pipeline stage before the last (pdserve.model.tp)

    def forward(self, meta: AttentionMetadata, kv_cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``kv_cache``: ``[layers, 2, heads, blocks, block_size, head_dim]``; ``hidden``: as
        :meth:`pdserve.model.llama.LlamaForCausalLM.forward`."""
        if hidden is None:
            x = self.embed_tokens(meta.input_ids)
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(meta.positions + POSITION_OFFSET)
        else:
            x = hidden
        for i, layer in enumerate(self.layers):
            x = layer(x, kv_cache[i], meta)
        if not self.last_stage:
            return x
        x = x.index_select(0, meta.sample_indices)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return linear(hidden, self.embed_tokens.weight, None, self.packed_head)
        return self.lm_head(hidden)

    def hf_weight_spec(self) -> WeightSpec:
        """Hugging Face tensor name -> (our parameter name, first row inside it)."""
        p = "model.decoder."
        spec: WeightSpec = {p + "embed_tokens.weight": ("embed_tokens.weight", 0),
                            p + "embed_positions.weight": ("embed_positions.weight", 0)}
        for proj in ("project_in", "project_out"):
            if getattr(self, proj) is not None:
                spec[f"{p}{proj}.weight"] = (f"{proj}.weight", 0)
        if self.lm_head is not None:
            spec["lm_head.weight"] = ("lm_head.weight", 0)
        qkv = self.config.num_heads * self.config.head_dim
        for i, layer in enumerate(self.layers):
            hf, me = f"{p}layers.{i}.", f"layers.{i}."
            attn = layer.self_attn
            kinds = ["weight"] + (["bias"] if attn.qkv_proj.bias is not None else [])
            for kind in kinds:
                for name, row in (("q_proj", 0), ("k_proj", qkv), ("v_proj", 2 * qkv)):
                    spec[f"{hf}self_attn.{name}.{kind}"] = (f"{me}self_attn.qkv_proj.{kind}", row)
                for name in ("self_attn.out_proj", "fc1", "fc2"):
                    spec[f"{hf}{name}.{kind}"] = (f"{me}{name}.{kind}", 0)
            if layer.final_layer_norm.weight is not None:
                for name in ("self_attn_layer_norm", "final_layer_norm"):
                    for kind in ("weight", "bias"):
                        spec[f"{hf}{name}.{kind}"] = (f"{me}{name}.{kind}", 0)
        final = self.final_layer_norm
        if final is not None and final.weight is not None:
            for kind in ("weight", "bias"):
                spec[f"{p}final_layer_norm.{kind}"] = (f"final_layer_norm.{kind}", 0)
        return spec

    @staticmethod
    def ignored_hf_weight(name: str) -> bool:
        """A tied ``lm_head.weight`` duplicated in the checkpoint is ignored."""
        return name == "lm_head.weight"
