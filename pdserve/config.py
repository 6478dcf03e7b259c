"""Frozen configuration dataclasses, validated in ``__post_init__``.

One dataclass per layer: :class:`ModelConfig` (architecture facts read from a Hugging Face
``config.json``; torch-free so the simulator can use it), :class:`CacheConfig` (KV block pool),
:class:`SchedulerConfig` (iteration scheduler of one instance), :class:`EngineConfig` (one
model instance = the three above plus device/dtype/seed) and :class:`ClusterConfig`, **the one
deployment spec**: roles (count, parallelism, per-role engine settings), routers, KV links and
node layout. The live runtime and the simulator both build their instances from
:meth:`ClusterConfig.instance_specs`, and size KV pools with :func:`kv_cache_blocks`.

Every field that is a command-line flag carries its help text in ``metadata["help"]``;
:mod:`pdserve.flags` generates the flags from these fields.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

Role = Literal["colocated", "prefill", "decode", "temporal"]
ROLES: tuple[str, ...] = ("colocated", "prefill", "decode", "temporal")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Names of the registered policies that the configs validate against. They live here, below the
# packages that register the classes (pdserve.engine, pdserve.predict, pdserve.cluster.flip),
# so that a config imports nothing above it; each registry refuses a class whose name is not
# in its table (pdserve.registry.Registry ``names``).
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "preble", "sjf", "ljf")
ADMISSION_POLICIES: tuple[str, ...] = ("greedy", "reserve-static", "reserve-dynamic")
LENGTH_PREDICTORS: tuple[str, ...] = ("none", "oracle", "majority", "prompt-length",
                                      "classifier")
FLIP_POLICIES: tuple[str, ...] = ("none", "idle", "load")

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


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def _help(text: str, **kw: Any) -> Any:
    """A dataclass field whose ``metadata["help"]`` becomes its flag's help text."""
    return field(metadata={"help": text}, **kw)


GiB = 1 << 30


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """A file's text; ``ValueError`` naming ``what`` and the file when it cannot be read."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ValueError(f"{what} {p!r} does not exist")
    try:
        with open(p) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {p!r}: {e.strerror}") from None


def load_data_file(path: str | os.PathLike[str], what: str) -> Any:
    """A JSON (``.json``) or YAML (any other name) file's content — deployment specs, hardware
    specs, target lists; ``ValueError`` naming ``what`` and the file on any problem."""
    p = os.fspath(path)
    text = read_text(p, what)
    kind = "JSON" if p.endswith(".json") else "YAML"
    try:
        if kind == "JSON":
            return json.loads(text)
        import yaml

        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError
        raise ValueError(f"{what} {p!r} is not valid {kind}: {e}") from None


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

    ``num_kv_blocks=None`` sizes the pool from memory (:func:`kv_cache_blocks`): on a GPU a share
    ``gpu_memory_utilization`` of the devices' memory minus the weights, on CPU ``cpu_kv_gib``.
    """

    block_size: int = _help("tokens per KV cache block", default=16)
    num_kv_blocks: int | None = _help(
        "KV cache blocks per instance (default: sized from memory)", default=None)
    enable_prefix_caching: bool = _help("reuse the KV of shared prompt prefixes", default=True)
    gpu_memory_utilization: float = _help(
        "share of each GPU's memory for weights + KV cache", default=0.9)
    cpu_kv_gib: float = _help("KV cache size of a CPU instance, in GiB", default=1.0)

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                 f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.cpu_kv_gib > 0, f"cpu_kv_gib must be > 0, got {self.cpu_kv_gib}")


def default_token_budget(enable_chunked_prefill: bool, max_model_len: int) -> int:
    """vLLM's default ``max_num_batched_tokens``: 2048 with chunked prefill, else enough for the
    longest prompt in one step."""
    return 2048 if enable_chunked_prefill else max(2048, max_model_len)


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduler of one instance.

    ``role``: ``colocated`` runs both phases; ``prefill`` stops each request after its first token
    and holds its KV for a decode instance to pull; ``decode`` admits only requests whose KV was
    imported; ``temporal`` (EcoServe §4.2.1) runs both phases but never in one batch: a
    prefill-only phase whenever prompts wait, decode-only otherwise (no chunked prefill).
    ``prefill_token_target`` is DistServe's L_m (section 4.3): a prefill instance batches whole
    prompts up to this many tokens, a longer prompt runs alone. ``None`` = the token budget.
    ``max_num_batched_tokens=None`` = :func:`default_token_budget`.
    """

    max_num_batched_tokens: int | None = _help(
        "token budget of one step (default: 2048 with chunked prefill, else "
        "max(2048, max_model_len))", default=None)
    max_num_seqs: int = _help("most requests in one step", default=256)
    max_model_len: int = _help(
        "longest prompt + output (default: the model's max_position_embeddings)", default=2048)
    enable_chunked_prefill: bool = _help(
        "split long prompts over several steps (colocated and decode instances; prefill "
        "instances batch whole prompts)", default=True)
    role: Role = "colocated"
    prefill_token_target: int | None = _help(
        "DistServe's L_m: a prefill instance batches whole prompts up to this many tokens "
        "(default: the token budget)", default=None)
    policy: str = _help("local waiting-queue policy: fcfs, preble, or TetriInfer's prefill "
                        "orders sjf / ljf by prompt length (section 3.3.1)", default="fcfs")
    prefill_sched_batch: int = _help(
        "TetriInfer's PrefillSchedBatch: sjf/ljf sort the waiting requests in consecutive "
        "groups of this many, groups in arrival order, so that nothing starves", default=16)
    prefill_chunk_size: int | None = _help(
        "TetriInfer's ChunkSize (section 3.3.3): a prefill instance runs prefill-only steps of "
        "exactly this many tokens, slicing and merging prompts and padding the last chunk "
        "(`pdserve profile` reports the saturation point; default: off)", default=None)
    admission: str = _help(
        "decode admission (TetriInfer section 3.4): greedy, reserve-static or reserve-dynamic",
        default="greedy")

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        _require(self.prefill_token_target is None or self.prefill_token_target >= 1,
                 f"prefill_token_target must be >= 1, got {self.prefill_token_target}")
        _require(self.prefill_sched_batch >= 1,
                 f"prefill_sched_batch must be >= 1, got {self.prefill_sched_batch}")
        _require(self.prefill_chunk_size is None or self.prefill_chunk_size >= 1,
                 f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
        _require(self.policy in SCHEDULING_POLICIES,
                 f"unknown scheduling policy {self.policy!r}; available: "
                 f"{sorted(SCHEDULING_POLICIES)}")
        _require(self.admission in ADMISSION_POLICIES,
                 f"unknown admission policy {self.admission!r}; available: "
                 f"{sorted(ADMISSION_POLICIES)}")
        _require(not (self.role == "temporal" and self.enable_chunked_prefill),
                 "a temporal instance runs prefill-only and decode-only phases (EcoServe "
                 "§4.2.1): enable_chunked_prefill must be false")
        if not self.enable_chunked_prefill and self.role != "prefill":
            _require(self.token_budget >= self.max_model_len,
                     "without chunked prefill max_num_batched_tokens "
                     f"({self.token_budget}) must be >= max_model_len "
                     f"({self.max_model_len}) so that every prompt fits one step")

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return default_token_budget(self.enable_chunked_prefill, self.max_model_len)


@dataclass(frozen=True)
class EngineConfig:
    """One model instance: model directory, device, dtype, cache and scheduler."""

    model: str = ""
    device: str = _help("'cpu' or 'cuda[:N]'", default="cpu")
    dtype: str = _help("weight and KV dtype", default="float32")
    seed: int = _help("random seed of the model's sampler", default=0)
    step_log: str | None = _help(
        "append one JSON line per engine step (instance, elapsed seconds, batch shape) to this "
        "file; `pdserve calibrate --step-log FILE` fits a latency model to it (default: no log)",
        default=None)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.device == "cpu" or self.device.startswith("cuda"),
                 f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    # Keyword arguments accepted by ``LLM(model, **kwargs)``, the deployment spec's ``engine``
    # section and the engine flags (vLLM's names).
    KWARGS = (
        "device", "dtype", "seed", "block_size", "num_kv_blocks", "enable_prefix_caching",
        "gpu_memory_utilization", "cpu_kv_gib", "max_num_batched_tokens", "max_num_seqs",
        "max_model_len", "enable_chunked_prefill", "role", "prefill_token_target", "policy",
        "prefill_sched_batch", "prefill_chunk_size", "admission", "step_log",
    )

    @classmethod
    def from_kwargs(cls, model: str, model_max_len: int | None = None, **kw: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM`` / CLI / deployment files). Unknown names
        raise ``TypeError``; ``None`` values mean "the default".

        ``max_model_len=None`` takes the model's ``max_position_embeddings`` (``model_max_len``).
        """
        unknown = set(kw) - set(cls.KWARGS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        kw = {k: v for k, v in kw.items() if v is not None}
        for k, v in kw.items():  # files and programs can pass anything: name a wrong type
            want = _KWARG_TYPES[k]
            ok = isinstance(v, want) and not (want is not bool and isinstance(v, bool))
            if not ok:
                raise ValueError(f"{k} must be {_TYPE_WORDS.get(want, 'a number')}, got {v!r}")
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
        sched = SchedulerConfig(**sk)
        top = {k: v for k, v in kw.items() if k in ("device", "dtype", "seed", "step_log")}
        if "step_log" in top:  # Ray actors may run elsewhere in the file system: pin it
            top["step_log"] = os.path.abspath(top["step_log"])
        return cls(model=model, cache=cache, scheduler=sched, **top)

    def with_role(self, role: Role) -> EngineConfig:
        return replace(self, scheduler=replace(self.scheduler, role=role))

    def to_kwargs(self) -> dict[str, Any]:
        """The :attr:`KWARGS` values (``role`` excluded) that rebuild this config."""
        parts = (self, self.cache, self.scheduler)
        return {k: getattr(next(p for p in parts if hasattr(p, k)), k)
                for k in self.KWARGS if k != "role"}


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _kwarg_types() -> dict[str, type | tuple[type, ...]]:
    import typing

    out: dict[str, Any] = {}
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in EngineConfig.KWARGS:
                args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
                t = args[0] if args and typing.get_origin(hints[f.name]) is not Literal \
                    else hints[f.name]
                out[f.name] = str if typing.get_origin(t) is Literal else t
    out["gpu_memory_utilization"] = out["cpu_kv_gib"] = (int, float)
    return out


def kv_cache_blocks(model: ModelConfig, engine: EngineConfig, *,
                    device_memory_bytes: float | None, num_devices: int = 1,
                    weight_bytes: float | None = None, reserved_bytes: float = 0.0) -> int:
    """KV blocks of one instance — the one formula, for the real executor and the simulator.

    ``cache.num_kv_blocks`` if set. Otherwise, on ``num_devices`` GPUs (TP × PP) of
    ``device_memory_bytes`` each: ``num_devices × memory × gpu_memory_utilization − weights −
    reserved`` (activations) over the bytes of one block; ``weight_bytes`` defaults to the
    parameter count at the engine's dtype. On CPU (``device_memory_bytes=None``): ``cpu_kv_gib``.
    Capped at what ``max_num_seqs`` requests of ``max_model_len`` tokens can use.
    """
    cache, sched = engine.cache, engine.scheduler
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    block_bytes = cache.block_size * model.kv_bytes_per_token(engine.dtype)
    useful = cdiv(sched.max_model_len, cache.block_size) * sched.max_num_seqs + 1
    if device_memory_bytes is None:
        budget = cache.cpu_kv_gib * GiB
        where = "CPU"
    else:
        weights = (model.num_params() * DTYPE_BYTES[engine.dtype] if weight_bytes is None
                   else weight_bytes)
        budget = (num_devices * device_memory_bytes * cache.gpu_memory_utilization - weights
                  - reserved_bytes)
        where = f"{num_devices} device(s) of {device_memory_bytes / GiB:.1f} GiB"
    blocks = min(int(budget // block_bytes), useful)
    if blocks < 1:
        raise ValueError(f"{model.name or 'the model'} leaves no memory for the KV cache on "
                         f"{where} (budget {budget / 2**20:.1f} MiB, one block is "
                         f"{block_bytes} bytes)")
    return blocks


# ------------------------------------------------------------------------ the deployment spec
STRATEGIES: tuple[str, ...] = ("colocated", "disaggregated", "partial")
_STRATEGY_ROLES = {"colocated": ["colocated"], "disaggregated": ["prefill", "decode"],
                   "partial": ["temporal"]}
BACKENDS: tuple[str, ...] = ("inproc", "ray")


@dataclass(frozen=True)
class Link:
    """An interconnect — the one link type of the deployment spec, the hardware catalogue
    (``pdserve/data/hardware/links.yaml``: NVLink, PCIe, Ethernet, ...) and both drivers:
    ``bandwidth_gb_per_s`` in GB/s per direction (``None`` = unlimited) and ``latency_s`` per
    transfer; a transfer of ``n`` bytes takes at least ``n / bandwidth + latency``
    (TetriInfer's emulated network, DistServe §4.2's links). ``name``/``description`` label a
    catalogue entry."""

    bandwidth_gb_per_s: float | None = None
    latency_s: float = 0.0
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        what = f"link {self.name!r}" if self.name else "link"
        _require(self.bandwidth_gb_per_s is None or self.bandwidth_gb_per_s > 0,
                 f"{what}: bandwidth_gb_per_s must be > 0, got {self.bandwidth_gb_per_s}")
        _require(self.latency_s >= 0, f"{what}: latency_s must be >= 0, got {self.latency_s}")

    @property
    def bytes_per_s(self) -> float:
        if self.bandwidth_gb_per_s is None:
            return float("inf")
        return self.bandwidth_gb_per_s * 1e9

    def min_time(self, nbytes: float) -> float:
        t = self.latency_s
        if self.bandwidth_gb_per_s is not None:
            t += nbytes / (self.bandwidth_gb_per_s * 1e9)
        return t

    @property
    def emulated(self) -> bool:
        return self.bandwidth_gb_per_s is not None or self.latency_s > 0


LINKS_FILE = Path(__file__).resolve().parent / "data" / "hardware" / "links.yaml"


@cache
def link_catalogue() -> tuple[dict[str, Link], dict[str, str]]:
    """The shipped link catalogue (``data/hardware/links.yaml``): links by lower-case name, and
    aliases (lower case) -> names."""
    d = load_data_file(LINKS_FILE, "hardware file")
    where = str(LINKS_FILE)
    if not isinstance(d, dict):
        raise ValueError(f"hardware file {where!r}: expected a mapping at the top level")
    links: dict[str, Link] = {}
    for i, lk in enumerate(d.get("links") or []):
        if not isinstance(lk, dict) or lk.get("name") is None or \
                lk.get("bandwidth_gb_per_s") is None:
            raise ValueError(f"{where}: links[{i}] needs a name and a bandwidth_gb_per_s")
        try:
            spec = Link(**lk)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: links[{i}]: {e}") from None
        links[spec.name.lower()] = spec
    aliases = {str(k).lower(): str(v).lower() for k, v in (d.get("aliases") or {}).items()}
    return links, aliases


def get_link(name: str | Link) -> Link:
    """Link by case-insensitive name or alias (``nvlink`` = NVLink 3, ``ethernet`` = 25 Gb/s)."""
    if isinstance(name, Link):
        return name
    links, aliases = link_catalogue()
    key = name.strip().lower().replace("_", "-")
    key = aliases.get(key, key)
    if key in links:
        return links[key]
    raise ValueError(f"unknown link {name!r}; choices: "
                     f"{', '.join(sorted(lk.name for lk in links.values()))} "
                     f"(aliases: {', '.join(sorted(aliases))})")


def check_granularity(granularity: Any) -> int:
    """A length predictor's bucket size (TetriInfer §3.3.2), checked."""
    if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"predictor granularity must be an integer >= 1 token, got "
                         f"{granularity!r}")
    return granularity


def flip_settings(spec: str) -> tuple[str, tuple[float, ...]]:
    """TetriInfer §3.5's flip policy as a deployment names it — ``none`` | ``idle[:SECONDS]`` |
    ``load[:SHARE[:SECONDS]]`` — as ``(name, values)``, checked (clear errors);
    :func:`pdserve.cluster.flip.parse_flip` builds the policy from them."""
    name, *args = str(spec).split(":")
    if name not in FLIP_POLICIES:
        raise ValueError(f"unknown flip policy {spec!r}; use none, idle[:SECONDS] or "
                         f"load[:SHARE[:SECONDS]]")
    try:
        values = tuple(float(a) for a in args)
    except ValueError as e:
        raise ValueError(f"bad flip policy {spec!r}: {e}") from None
    most = {"none": 0, "idle": 1, "load": 2}[name]
    if len(values) > most:
        raise ValueError(f"bad flip policy {spec!r}: {name} takes at most {most} value(s)")
    if name == "idle" and values and not values[0] > 0:
        raise ValueError(f"flip idle time must be > 0 s, got {values[0]}")
    if name == "load" and values and not 0 < values[0] <= 1:
        raise ValueError(f"flip load threshold must be in (0, 1], got {values[0]}")
    if name == "load" and len(values) > 1 and not values[1] > 0:
        raise ValueError(f"flip window must be > 0 s, got {values[1]}")
    return name, values


@dataclass(frozen=True)
class RoleSpec:
    """The instances of one role: how many, their parallelism (TP × PP GPUs each; ``ep``: the
    expert-parallel degree of a mixture-of-experts model, dividing ``tp`` — experts sit whole on
    ``ep`` of the TP GPUs instead of being sharded, simulated by the analytic model) and the
    engine settings they change from the deployment's (``engine``: :attr:`EngineConfig.KWARGS`
    names)."""

    role: Role
    count: int = 1
    tp: int = 1
    pp: int = 1
    engine: Mapping[str, Any] = field(default_factory=dict)
    ep: int = 1

    def __post_init__(self) -> None:
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("count", "tp", "pp", "ep"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1, f"{self.role} {name} must be an integer "
                                                    f">= 1, got {v!r}")
        _require(self.tp % self.ep == 0,
                 f"{self.role} ep={self.ep} must divide tp={self.tp} (experts are spread over "
                 f"ep of the instance's TP GPUs)")
        bad = set(self.engine) - set(EngineConfig.KWARGS) | ({"role"} & set(self.engine))
        _require(not bad, f"{self.role} engine: unknown setting(s) {sorted(bad)}; known: "
                          f"{', '.join(k for k in EngineConfig.KWARGS if k != 'role')}")
        object.__setattr__(self, "engine", dict(self.engine))


@dataclass(frozen=True)
class InstanceSpec:
    """One instance of a deployment, as both drivers build it."""

    instance_id: str
    role: Role
    engine: EngineConfig
    tp: int = 1
    pp: int = 1
    node: int = 0
    ep: int = 1

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


# A prefill instance batches whole prompts (DistServe §4.3): it never chunks; a temporal
# instance never mixes phases (EcoServe §4.2.1), so it does not chunk either.
_ROLE_DEFAULTS: dict[str, dict[str, Any]] = {"prefill": {"enable_chunked_prefill": False},
                                             "temporal": {"enable_chunked_prefill": False}}


@dataclass(frozen=True)
class PredictorConfig:
    """TetriInfer's length predictor (§3.3.2; :mod:`pdserve.predict`): ``name`` (``none``,
    ``oracle``, ...), the bucket ``granularity`` in tokens, the oracle's ``accuracy`` and the
    ``data`` it is fitted on (a trained classifier, logged pairs or a trace name)."""

    name: str = "none"
    granularity: int = 200
    accuracy: float = 1.0
    data: str | None = None

    def __post_init__(self) -> None:
        _require(self.name in LENGTH_PREDICTORS,
                 f"unknown length predictor {self.name!r}; available: "
                 f"{list(LENGTH_PREDICTORS)}")
        check_granularity(self.granularity)
        _require(isinstance(self.accuracy, (int, float)) and 0.0 <= self.accuracy <= 1.0,
                 f"predictor_accuracy must be in [0, 1], got {self.accuracy}")


@dataclass(frozen=True)
class MacroConfig:
    """EcoServe's macro instances (strategy ``partial``): ``size`` temporal instances each, routed
    by ``macro_rolling`` against ``slo_ttft``/``slo_tpot`` (Alg. 2); ``mitosis`` scales them
    between ``mitosis_lower`` (N_l) and ``mitosis_upper`` (N_u) instances each (§4.2.4)."""

    slo_ttft: float = _help("TTFT objective the macro_rolling router admits against, s "
                            "(EcoServe Alg. 2)", default=5.0)
    slo_tpot: float = _help("TPOT objective the macro_rolling router admits against, s "
                            "(EcoServe Alg. 2)", default=0.1)
    size: int = _help("temporal instances per macro instance (EcoServe §4.2.1)", default=4)
    mitosis: bool = _help("scale macro instances with mitosis (EcoServe §4.2.4): start with "
                          "mitosis_initial instances, park the rest", default=False)
    mitosis_lower: int = _help("N_l: fewest instances of a macro instance", default=2)
    mitosis_upper: int = _help("N_u: most instances of a macro instance", default=4)
    mitosis_initial: int | None = _help(
        "instances serving at the start with mitosis (default: mitosis_lower)", default=None)
    mitosis_interval: float = _help("seconds between mitosis scaling decisions", default=10.0)

    def __post_init__(self) -> None:
        flat = {name: key for key, (_, name) in FLAT_KEYS.items()}  # messages say the flags
        for name in ("slo_ttft", "slo_tpot", "mitosis_interval"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and v > 0,
                     f"{flat[name]} must be > 0, got {v!r}")
        for name in ("size", "mitosis_lower", "mitosis_upper"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1,
                     f"{flat[name]} must be an integer >= 1, got {v!r}")
        _require(self.mitosis_lower <= self.mitosis_upper,
                 f"mitosis_lower (N_l={self.mitosis_lower}) must be <= mitosis_upper "
                 f"(N_u={self.mitosis_upper})")
        _require(self.mitosis_upper >= 2 * self.mitosis_lower - 1,
                 f"mitosis_upper (N_u={self.mitosis_upper}) must be >= 2*N_l - 1 = "
                 f"{2 * self.mitosis_lower - 1}: a split past N_u leaves two macro instances "
                 f"of at least N_l")
        _require(self.mitosis_initial is None or self.mitosis_initial >= 1,
                 f"mitosis_initial must be >= 1, got {self.mitosis_initial}")


# The flat deployment keys of the nested settings -> (ClusterConfig field, nested field): the
# command line's flags (``--predictor-granularity``, ``--mitosis-lower``, ...) and deployment
# files written before the nesting use them; :meth:`ClusterConfig.from_dict` accepts both forms.
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "length_predictor": ("predictor", "name"),
    "predictor_granularity": ("predictor", "granularity"),
    "predictor_accuracy": ("predictor", "accuracy"),
    "predictor_data": ("predictor", "data"),
    "slo_ttft": ("macro", "slo_ttft"),
    "slo_tpot": ("macro", "slo_tpot"),
    "macro_instance_size": ("macro", "size"),
    "mitosis": ("macro", "mitosis"),
    "mitosis_lower": ("macro", "mitosis_lower"),
    "mitosis_upper": ("macro", "mitosis_upper"),
    "mitosis_initial": ("macro", "mitosis_initial"),
    "mitosis_interval": ("macro", "mitosis_interval"),
}
_NESTED: dict[str, type[PredictorConfig] | type[MacroConfig]] = {
    "predictor": PredictorConfig, "macro": MacroConfig}


@dataclass(frozen=True)
class ClusterConfig:
    """A deployment: the one spec from which the live runtime and the simulator build instances.

    ``engine`` holds the engine settings every role shares (``EngineConfig.KWARGS`` names, vLLM's);
    ``roles`` the instances — colocated (vLLM-style) or prefill + decode (DistServe), each role
    with its count, TP/PP and engine overrides. ``kv_link`` joins instances on one node (live: an
    emulated link, ``None`` = as fast as the transport goes; simulated: ``None`` = the device's
    intra-node link), ``inter_node_link`` instances on different nodes; instances fill nodes of
    ``gpus_per_node`` GPUs in order (``None``: one node). ``max_waiting_requests`` bounds
    requests accepted but not yet started. Build it with :meth:`from_dict` (files, flags).

    ``predictor`` (:class:`PredictorConfig`) and ``flip`` are TetriInfer's length predictor and
    instance flip; ``macro`` (:class:`MacroConfig`) holds partial disaggregation's settings
    (EcoServe, strategy ``partial``: ``temporal`` instances in macro instances, mitosis).
    """

    model: str = ""
    engine: Mapping[str, Any] = field(default_factory=dict)
    roles: tuple[RoleSpec, ...] = (RoleSpec("colocated"),)
    prefill_router: str = "shortest_queue"
    decode_router: str = "least_load"
    kv_link: Link | None = None
    inter_node_link: Link | None = None
    gpus_per_node: int | None = None
    backend: str = "ray"
    ray_address: str | None = None
    max_waiting_requests: int = 1024
    # TetriInfer (§3.3.2 length predictor, §3.5 instance flip; pdserve/predict, cluster/flip.py)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    flip: str = "none"
    # EcoServe (strategy partial: macro instances, rolling activation, mitosis)
    macro: MacroConfig = field(default_factory=MacroConfig)

    def __post_init__(self) -> None:
        _require(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got "
                 f"{self.backend!r}")
        _require(self.max_waiting_requests >= 1,
                 f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        _require(self.gpus_per_node is None or self.gpus_per_node >= 1,
                 f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        object.__setattr__(self, "roles", tuple(self.roles))
        names = [r.role for r in self.roles]
        _require(len(set(names)) == len(names), f"each role may appear once, got {names}")
        _require(sorted(names) in (["colocated"], ["decode", "prefill"], ["temporal"]),
                 f"roles must be [colocated], [prefill, decode] or [temporal], got {names}")
        object.__setattr__(self, "engine", dict(self.engine))
        self.engine_config()  # validates the shared engine settings now
        _require(isinstance(self.predictor, PredictorConfig),
                 f"predictor must be a PredictorConfig, got {self.predictor!r}")
        _require(isinstance(self.macro, MacroConfig),
                 f"macro must be a MacroConfig, got {self.macro!r}")
        flip_settings(self.flip)
        if self.gpus_per_node is not None:
            for r in self.roles:
                _require(r.tp * r.pp <= self.gpus_per_node,
                         f"a {r.role} instance needs tp*pp={r.tp * r.pp} GPUs, more than "
                         f"gpus_per_node={self.gpus_per_node}")

    @property
    def strategy(self) -> str:
        return _strategy_of(self.roles)

    def router_options(self) -> dict[str, Any]:
        """Settings a router may take as constructor keywords (``make_routers`` passes each to
        the routers whose constructor names it): EcoServe's SLOs, macro size and mitosis."""
        return {key: getattr(self.macro, name) for key, (group, name) in FLAT_KEYS.items()
                if group == "macro"}

    def role(self, name: str) -> RoleSpec | None:
        return next((r for r in self.roles if r.role == name), None)

    def engine_config(self, role: RoleSpec | None = None,
                      model_max_len: int | None = None) -> EngineConfig:
        """The engine of ``role``'s instances (``None``: the shared settings, colocated)."""
        kw = dict(self.engine)
        if role is not None:
            kw.update(_ROLE_DEFAULTS.get(role.role, {}))
            kw.update(role.engine)
            kw["role"] = role.role
        return EngineConfig.from_kwargs(self.model, model_max_len=model_max_len, **kw)

    def instance_specs(self, model_max_len: int | None = None) -> list[InstanceSpec]:
        """Every instance, roles applied, placed on nodes in order."""
        out: list[InstanceSpec] = []
        gpus = 0
        for r in self.roles:
            engine = self.engine_config(r, model_max_len)
            for i in range(r.count):
                need = r.tp * r.pp
                if self.gpus_per_node is not None and gpus % self.gpus_per_node + need > \
                        self.gpus_per_node:
                    gpus += self.gpus_per_node - gpus % self.gpus_per_node  # next node
                node = gpus // self.gpus_per_node if self.gpus_per_node else 0
                out.append(InstanceSpec(f"{r.role}-{i}", r.role, engine, r.tp, r.pp, node, r.ep))
                gpus += need
        return out

    @property
    def num_gpus(self) -> int:
        return sum(r.count * r.tp * r.pp for r in self.roles)

    # ---- files and flags ----
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterConfig:
        """From a deployment file's mapping or the flags' values (``None`` = not given).

        Besides the fields, the shorthand of the command line is accepted: ``strategy``,
        ``num_instances`` (colocated or temporal), ``num_prefill``/``num_decode``,
        ``tp``/``pp``/``ep`` (every role), ``prefill_tp``/``prefill_pp``/``prefill_ep`` and the
        same for ``decode``,
        ``prefill_token_target`` (L_m of prefill instances), engine settings at the top level,
        links as ``{bandwidth_gb_per_s, latency_s}`` mappings, and the nested settings as
        mappings (``predictor: {name: oracle}``) or by their flat keys (:data:`FLAT_KEYS`:
        ``length_predictor: oracle``, the flags' names); a flat key overrides the same setting
        given nested (a flag over a file). Shorthand overrides ``roles``.
        """
        d = {k.replace("-", "_"): v for k, v in d.items() if v is not None}
        known = {f.name for f in fields(cls)}
        short = {k: d.pop(k) for k in _SHORTHAND if k in d}
        for group, sub in _NESTED.items():
            given = d.get(group, {})
            if isinstance(given, sub):
                given = {f.name: getattr(given, f.name) for f in fields(sub)}
            _require(isinstance(given, Mapping),
                     f"{group} must be a mapping of {', '.join(f.name for f in fields(sub))}, "
                     f"got {given!r}")
            nested = {k.replace("-", "_"): v for k, v in given.items() if v is not None}
            bad = set(nested) - {f.name for f in fields(sub)}
            _require(not bad, f"{group}: unknown setting(s) {sorted(bad)}; known: "
                              f"{', '.join(f.name for f in fields(sub))}")
            nested.update({name: d.pop(key) for key, (g, name) in FLAT_KEYS.items()
                           if g == group and key in d})
            d[group] = sub(**nested)
        engine = d.pop("engine", None) or {}
        if isinstance(engine, EngineConfig):
            d.setdefault("model", engine.model)
            engine = engine.to_kwargs()
        engine = dict(engine)
        for k in list(d):
            if k in EngineConfig.KWARGS:
                engine[k] = d.pop(k)
        roles = [r if isinstance(r, RoleSpec) else _role_from_dict(r)
                 for r in d.pop("roles", None) or []]
        roles = _apply_shorthand(roles, short)
        if roles and _strategy_of(roles) == "partial":
            d.setdefault("prefill_router", "macro_rolling")  # EcoServe's router by default
        unknown = set(d) - known
        _require(not unknown, f"unknown deployment setting(s) {sorted(unknown)}; known: "
                              f"{', '.join(sorted(known | set(_SHORTHAND) | set(FLAT_KEYS)))}")
        for name in ("kv_link", "inter_node_link"):
            if isinstance(d.get(name), Mapping):
                d[name] = Link(**d[name])
            elif isinstance(d.get(name), str):  # a catalogue link (nvlink3, eth-25g, ...)
                d[name] = get_link(d[name])
        return cls(engine=engine, roles=tuple(roles), **d)

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads back (a deployment file's content)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "roles":
                v = [{"role": r.role, "count": r.count, "tp": r.tp, "pp": r.pp,
                      **({"ep": r.ep} if r.ep != 1 else {}),
                      **({"engine": dict(r.engine)} if r.engine else {})} for r in v]
            elif isinstance(v, Link):
                v = {"bandwidth_gb_per_s": v.bandwidth_gb_per_s, "latency_s": v.latency_s}
            elif isinstance(v, (PredictorConfig, MacroConfig)):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        return out


_SHORTHAND = ("strategy", "num_instances", "num_prefill", "num_decode", "tp", "pp", "ep",
              "prefill_tp", "prefill_pp", "prefill_ep", "decode_tp", "decode_pp", "decode_ep",
              "prefill_token_target")


def _strategy_of(roles: Any) -> str:
    return {"colocated": "colocated", "temporal": "partial"}.get(roles[0].role, "disaggregated")


def _role_from_dict(d: Any) -> RoleSpec:
    _require(isinstance(d, Mapping) and "role" in d,
             f"each entry of roles must be a mapping with a 'role', got {d!r}")
    unknown = set(d) - {f.name for f in fields(RoleSpec)}
    _require(not unknown, f"role {d['role']!r}: unknown key(s) {sorted(unknown)}")
    return RoleSpec(**d)


def _apply_shorthand(roles: list[RoleSpec], short: dict[str, Any]) -> list[RoleSpec]:
    strategy = short.get("strategy")
    _require(strategy is None or strategy in STRATEGIES,
             f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    current = _strategy_of(roles) if roles else "colocated"
    if strategy is not None and strategy != current or not roles:
        strategy = strategy or "colocated"
        roles = [RoleSpec(n) for n in _STRATEGY_ROLES[strategy]]
    out = []
    for r in roles:
        kw: dict[str, Any] = {}
        count = short.get({"colocated": "num_instances", "prefill": "num_prefill",
                           "decode": "num_decode", "temporal": "num_instances"}[r.role])
        if count is not None:
            kw["count"] = count
        for dim in ("tp", "pp", "ep"):
            v = short.get(f"{r.role}_{dim}", short.get(dim))
            if v is not None:
                kw[dim] = v
        engine = dict(r.engine)
        if r.role == "prefill" and short.get("prefill_token_target") is not None:
            engine["prefill_token_target"] = short["prefill_token_target"]
        out.append(replace(r, engine=engine, **kw))
    return out


_KWARG_TYPES = _kwarg_types()
