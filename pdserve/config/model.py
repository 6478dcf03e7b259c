"""A model's architecture (:class:`ModelConfig`), read from a Hugging Face ``config.json``;
torch-free, so the simulator uses it as the real executor does."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.base import KV_DTYPE_BYTES, _require

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "OPTForCausalLM": "opt",
}



@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, as far as serving needs it.

    ``family`` is one of ``llama`` (Llama 2/3, Mistral, Mixtral), ``qwen2`` (Llama + QKV bias),
    ``qwen3`` (Llama + per-head RMSNorm of Q and K, ``qk_norm``, and an explicit ``head_dim``)
    or ``opt``.

    Mixture of experts (``num_experts`` > 0; Mixtral, Qwen2-MoE, Qwen3-MoE): each of the
    ``num_moe_layers`` sparse layers routes every token to ``num_experts_per_tok`` of
    ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, plus, where the model
    has them, always-on shared experts of total width ``shared_expert_intermediate_size``
    (Qwen2-MoE). The other layers keep a dense MLP of width ``intermediate_size``.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = -1  # -1 = every layer when num_experts > 0
    name: str = ""
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _require(self.family in ("llama", "qwen2", "qwen3", "opt"),
                 f"unsupported model family {self.family!r}")
        if self.num_experts:
            _require(self.family != "opt", "OPT has no mixture-of-experts variant")
            _require(0 < self.num_experts_per_tok <= self.num_experts,
                     f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                     f"1..num_experts={self.num_experts}")
            _require(self.moe_intermediate_size > 0,
                     f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
            if self.num_moe_layers < 0:
                object.__setattr__(self, "num_moe_layers", self.num_layers)
            _require(self.num_moe_layers <= self.num_layers,
                     f"num_moe_layers={self.num_moe_layers} > num_layers={self.num_layers}")
        else:
            _require(self.num_experts_per_tok == 0 and self.shared_expert_intermediate_size == 0,
                     "num_experts_per_tok / shared experts need num_experts > 0")
            object.__setattr__(self, "num_moe_layers", 0)
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "max_position_embeddings"):
            _require(getattr(self, f) > 0, f"{f} must be > 0, got {getattr(self, f)}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads={self.num_heads} is not a multiple of "
                 f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim == 0:
            _require(self.hidden_size % self.num_heads == 0,
                     f"hidden_size={self.hidden_size} not divisible by num_heads={self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    # ---- derived sizes (used by the simulator and the memory planner) ----
    def kv_bytes_per_token(self, dtype: str = "float16") -> int:
        """Bytes of K and V for one token over all layers, cached in ``dtype`` (an engine dtype
        or ``fp8``)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embeddings included); ``active``: only what one token uses (its
        ``num_experts_per_tok`` routed experts, not all of them)."""
        h, i, v, n = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (2 * self.head_dim if self.qk_norm else 0)
        if self.family == "opt":
            mlp = 2 * h * i
            extra = self.max_position_embeddings * h
        else:
            mlp = 3 * h * i
            extra = 0
        moe = 0
        if self.is_moe:
            experts = self.num_experts_per_tok if active else self.num_experts
            moe = (experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
                   + 3 * h * self.shared_expert_intermediate_size
                   + (h if self.shared_expert_intermediate_size else 0))  # shared-expert gate
        dense = n - self.num_moe_layers
        head = 0 if self.tie_word_embeddings else v * h
        return n * attn + dense * mlp + self.num_moe_layers * moe + v * h + head + extra

    # ---- loading ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else ""
        family = SUPPORTED_ARCHITECTURES.get(arch)
        if family is None:
            family = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
                      "qwen2_moe": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3",
                      "opt": "opt"}.get(d.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported architecture {arch or d.get('model_type')!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if family == "opt":
            return cls(
                family="opt",
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["ffn_dim"],
                num_layers=d["num_hidden_layers"],
                num_heads=d["num_attention_heads"],
                num_kv_heads=d["num_attention_heads"],
                max_position_embeddings=d["max_position_embeddings"],
                norm_eps=1e-5,
                tie_word_embeddings=d.get("tie_word_embeddings", True),
                attention_bias=d.get("enable_bias", True),
                eos_token_ids=eos_ids,
                bos_token_id=d.get("bos_token_id"),
                name=name,
                hf_config=d,
            )
        num_experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
        moe: dict[str, Any] = {}
        if num_experts:
            layers = d["num_hidden_layers"]
            step = int(d.get("decoder_sparse_step") or 1)
            dense = set(d.get("mlp_only_layers") or [])
            moe = {
                "num_experts": num_experts,
                "num_experts_per_tok": int(d.get("num_experts_per_tok") or 0),
                "moe_intermediate_size": int(d.get("moe_intermediate_size")
                                             or d["intermediate_size"]),
                "shared_expert_intermediate_size": int(
                    d.get("shared_expert_intermediate_size") or 0),
                "num_moe_layers": sum(1 for i in range(layers)
                                      if i not in dense and (i + 1) % step == 0),
            }
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or moe.get("moe_intermediate_size", 0),
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            head_dim=d.get("head_dim") or 0,
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"),
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            qk_norm=family == "qwen3",
            name=name,
            hf_config=d,
            **moe,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        with open(cfg_path) as f:
            d = json.load(f)
        return cls.from_hf_dict(d, name=os.path.basename(os.path.normpath(path)))
