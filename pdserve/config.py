"""Frozen configuration dataclasses, validated in ``__post_init__``.

One dataclass per layer: :class:`ModelConfig` (architecture facts read from a Hugging Face
``config.json``; torch-free so the simulator can use it), :class:`CacheConfig` (KV block pool),
:class:`SchedulerConfig` (iteration scheduler of one instance) and :class:`EngineConfig` (one
model instance = the three above plus device/dtype/seed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

Role = Literal["colocated", "prefill", "decode"]
ROLES: tuple[str, ...] = ("colocated", "prefill", "decode")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


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
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_kv_blocks`` blocks of ``block_size`` tokens.

    ``num_kv_blocks=None`` sizes the pool from available memory: on CUDA a share
    ``memory_utilization`` of the free device memory after the weights, on CPU ``cpu_kv_gib``.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    memory_utilization: float = 0.9
    cpu_kv_gib: float = 1.0

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                 f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _require(0.0 < self.memory_utilization <= 1.0,
                 f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        _require(self.cpu_kv_gib > 0, f"cpu_kv_gib must be > 0, got {self.cpu_kv_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduler of one instance.

    ``role``: ``colocated`` runs both phases; ``prefill`` stops each request after its first token
    and holds its KV for a decode instance to pull; ``decode`` admits only requests whose KV was
    imported. ``prefill_token_target`` is DistServe's L_m (section 4.3): a prefill instance batches
    whole prompts up to this many tokens, a longer prompt runs alone. ``None`` = the token budget.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    role: Role = "colocated"
    prefill_token_target: int | None = None
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        _require(self.prefill_token_target is None or self.prefill_token_target >= 1,
                 f"prefill_token_target must be >= 1, got {self.prefill_token_target}")
        if not self.enable_chunked_prefill and self.role != "prefill":
            _require(self.max_num_batched_tokens >= self.max_model_len,
                     "without chunked prefill max_num_batched_tokens "
                     f"({self.max_num_batched_tokens}) must be >= max_model_len "
                     f"({self.max_model_len}) so that every prompt fits one step")


@dataclass(frozen=True)
class EngineConfig:
    """One model instance: model directory, device, dtype, cache and scheduler."""

    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.device == "cpu" or self.device.startswith("cuda"),
                 f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    # Keyword arguments accepted by ``LLM(model, **kwargs)`` and the CLI engine flags.
    KWARGS = (
        "device", "dtype", "seed", "block_size", "num_kv_blocks", "enable_prefix_caching",
        "memory_utilization", "cpu_kv_gib", "max_num_batched_tokens", "max_num_seqs",
        "max_model_len", "enable_chunked_prefill", "role", "prefill_token_target", "policy",
    )

    @classmethod
    def from_kwargs(cls, model: str, model_max_len: int | None = None, **kw: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM`` / CLI). Unknown names raise ``TypeError``.

        ``max_model_len=None`` takes the model's ``max_position_embeddings`` (``model_max_len``);
        ``max_num_batched_tokens=None`` picks vLLM's defaults (2048 with chunked prefill,
        ``max_model_len`` without).
        """
        unknown = set(kw) - set(cls.KWARGS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        kw = {k: v for k, v in kw.items() if v is not None or k == "num_kv_blocks"}
        cache_names = {f.name for f in fields(CacheConfig)}
        sched_names = {f.name for f in fields(SchedulerConfig)}
        cache = CacheConfig(**{k: v for k, v in kw.items() if k in cache_names})
        sk = {k: v for k, v in kw.items() if k in sched_names}
        max_len = sk.get("max_model_len") or model_max_len or SchedulerConfig.max_model_len
        if model_max_len is not None and max_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings "
                f"({model_max_len})"
            )
        sk["max_model_len"] = max_len
        chunked = sk.get("enable_chunked_prefill", SchedulerConfig.enable_chunked_prefill)
        if "max_num_batched_tokens" not in sk:
            sk["max_num_batched_tokens"] = 2048 if chunked else max(2048, max_len)
        sched = SchedulerConfig(**sk)
        top = {k: v for k, v in kw.items() if k in ("device", "dtype", "seed")}
        return cls(model=model, cache=cache, scheduler=sched, **top)

    def with_role(self, role: Role) -> EngineConfig:
        return replace(self, scheduler=replace(self.scheduler, role=role))


STRATEGIES: tuple[str, ...] = ("colocated", "disaggregated")
BACKENDS: tuple[str, ...] = ("inproc", "ray")


@dataclass(frozen=True)
class ClusterConfig:
    """A deployment: strategy, instance counts, routers, KV links and where instances run.

    ``colocated``: ``num_instances`` instances run both phases (vLLM-style). ``disaggregated``
    (DistServe): ``num_prefill`` prefill instances batch whole prompts up to
    ``prefill_token_target`` tokens (L_m, §4.3) and hold the KV until one of ``num_decode`` decode
    instances pulls it. ``link_bandwidth_gbps``/``link_latency_ms`` emulate the KV link (a transfer
    takes at least bytes / bandwidth + latency, as TetriInfer's evaluation did); ``None`` = as fast
    as the transport goes. ``max_waiting_requests`` bounds requests accepted but not yet started.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    strategy: str = "colocated"
    num_instances: int = 1
    num_prefill: int = 1
    num_decode: int = 1
    prefill_router: str = "shortest_queue"
    decode_router: str = "least_load"
    prefill_token_target: int | None = None
    backend: str = "inproc"
    ray_address: str | None = None
    link_bandwidth_gbps: float | None = None
    link_latency_ms: float = 0.0
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        _require(self.strategy in STRATEGIES,
                 f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        _require(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got "
                 f"{self.backend!r}")
        for name in ("num_instances", "num_prefill", "num_decode", "max_waiting_requests"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(self.link_bandwidth_gbps is None or self.link_bandwidth_gbps > 0,
                 f"link_bandwidth_gbps must be > 0, got {self.link_bandwidth_gbps}")
        _require(self.link_latency_ms >= 0,
                 f"link_latency_ms must be >= 0, got {self.link_latency_ms}")
        _require(self.prefill_token_target is None or self.prefill_token_target >= 1,
                 f"prefill_token_target must be >= 1, got {self.prefill_token_target}")

    def instance_configs(self) -> list[tuple[str, EngineConfig]]:
        """``(instance_id, engine config)`` for every instance, roles applied."""
        if self.strategy == "colocated":
            return [(f"colocated-{i}", self.engine) for i in range(self.num_instances)]
        sched = self.engine.scheduler
        pre = replace(self.engine, scheduler=replace(
            sched, role="prefill", enable_chunked_prefill=False,
            prefill_token_target=self.prefill_token_target or sched.prefill_token_target))
        dec = self.engine.with_role("decode")
        return ([(f"prefill-{i}", pre) for i in range(self.num_prefill)]
                + [(f"decode-{i}", dec) for i in range(self.num_decode)])

    @property
    def num_gpus(self) -> int:
        if self.strategy == "colocated":
            return self.num_instances
        return self.num_prefill + self.num_decode
