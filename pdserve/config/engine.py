"""One model instance's settings: :class:`CacheConfig` (KV block pool), :class:`SchedulerConfig`
(iteration scheduler), :class:`EngineConfig` (the two plus device, dtype and seed) and
:func:`kv_cache_blocks`, the one KV pool formula of the real executor and the simulator (which
reserves :func:`engine_reserved_bytes` where the executor measures)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from pdserve.config.base import (
    ADMISSION_POLICIES,
    DTYPE_BYTES,
    DTYPES,
    ROLES,
    SCHEDULING_POLICIES,
    GiB,
    Role,
    _help,
    _require,
    cdiv,
)
from pdserve.config.model import ModelConfig


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
        max_len = sk.get("max_model_len")  # (0 is refused below, not taken for the default)
        if max_len is None:
            max_len = model_max_len or SchedulerConfig.max_model_len
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


_TYPE_WORDS: dict[Any, str] = {int: "an integer", float: "a number", bool: "true or false",
                               str: "a string"}


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
                    weight_bytes: float | None = None, reserved_bytes: float = 0.0,
                    kv_cache_dtype: str = "auto") -> int:
    """KV blocks of one instance — the one formula, for the real executor and the simulator.

    ``cache.num_kv_blocks`` if set. Otherwise, on ``num_devices`` GPUs (TP × PP) of
    ``device_memory_bytes`` each: ``num_devices × memory × gpu_memory_utilization − weights −
    reserved`` (activations) over the bytes of one block; ``weight_bytes`` defaults to the
    parameter count at the engine's dtype. On CPU (``device_memory_bytes=None``): ``cpu_kv_gib``.
    ``kv_cache_dtype``: ``auto`` (the engine's dtype) or ``fp8`` (one byte per element).
    Capped at what ``max_num_seqs`` requests of ``max_model_len`` tokens can use.
    """
    cache, sched = engine.cache, engine.scheduler
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    block_bytes = cache.block_size * model.kv_bytes_per_token(
        engine.dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
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


def check_pool_holds_a_request(num_blocks: int, block_size: int, max_model_len: int,
                               what: str = "the KV pool") -> None:
    """``ValueError`` unless ``num_blocks`` blocks hold one request of ``max_model_len``
    tokens, as vLLM refuses to start (a live instance would refuse every long request)."""
    need = cdiv(max_model_len, block_size)
    if num_blocks < need:
        raise ValueError(
            f"{what} holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} "
            f"tokens), fewer than one request of max_model_len={max_model_len} needs ({need} "
            f"blocks): raise num_kv_blocks (or gpu_memory_utilization, cpu_kv_gib), or set "
            f"max_model_len <= {num_blocks * block_size}")



# What a GPU engine keeps out of its KV pool besides the weights, per GPU (vLLM's V1
# ``Worker.determine_available_memory``: ``total × gpu_memory_utilization`` minus the weights, the
# torch peak of a profile run, the non-torch memory and the CUDA-graph estimate). Constants:
CUDA_HIDDEN_GIB = (0.27, 0.0064)  # nominal − CUDA's total = a + b × nominal (GiB): vLLM logs
#   total_gpu_memory 23.58 GiB on a 24 GiB RTX 3090 and 79.22 GiB on an 80 GiB H100
NON_TORCH_GIB = 0.25  # cuBLAS/NCCL workspaces: vLLM logs non_torch_memory 0.20-0.35 GiB
CUDA_GRAPH_MAX_TOKENS = 512  # vLLM's largest captured batch: min(2 × max_num_seqs, 512)


def _activation_bytes(model: ModelConfig, tokens: int, nbytes: int, tp: int, ep: int) -> int:
    """Peak intermediates of ``tokens`` tokens through one layer on one of ``tp`` GPUs: the hidden
    states and residual (full width on every rank) plus the larger of the attention block's
    (q, k, v and the attention output) and the MLP's (gate/up and the activation's output; a MoE
    layer's ``num_experts_per_tok`` rows per token, experts split over ``tp // ep``, plus their
    outputs before the weighted sum)."""
    m, hd = model, model.head_dim
    q, kv = m.num_heads * hd // tp, -(-m.num_kv_heads // tp) * hd
    attn = 2 * q + 2 * kv
    mlp = (3 if m.family != "opt" else 2) * m.intermediate_size // tp
    if m.is_moe:
        routed = m.num_experts_per_tok * (3 * m.moe_intermediate_size // max(1, tp // ep)
                                          + m.hidden_size)  # + each expert's output rows
        mlp = max(mlp if m.num_moe_layers < m.num_layers else 0,
                  routed + 3 * m.shared_expert_intermediate_size // tp)
    return tokens * nbytes * (2 * m.hidden_size + max(attn, mlp))


def engine_reserved_bytes(model: ModelConfig, engine: EngineConfig, *, device_memory_bytes: float,
                          tp: int = 1, pp: int = 1, ep: int = 1) -> float:
    """Closed-form estimate of the memory a vLLM-like engine on ``tp × pp`` GPUs of
    ``device_memory_bytes`` each keeps out of its KV pool beyond the weights — the
    ``reserved_bytes`` of :func:`kv_cache_blocks` for a simulated instance (the real executor
    measures its own). Per GPU, on the last pipeline stage (the one that binds: vLLM gives every
    stage the fewest blocks any stage can hold):

    * ``gpu_memory_utilization`` × the memory CUDA does not expose (:data:`CUDA_HIDDEN_GIB`);
    * the profile run: :func:`_activation_bytes` of the full token budget, plus the float32 logits
      of its ``min(max_num_seqs, budget)`` sampled rows and one sampler buffer of that shape;
    * CUDA graphs: the activations of the largest captured batch (:data:`CUDA_GRAPH_MAX_TOKENS`);
    * non-torch memory (:data:`NON_TORCH_GIB`).

    Checked against vLLM 0.19's pool for Llama-3.1-8B on an RTX 4090 (tests/sim/test_kv_reserve.py).
    """
    sched, nbytes = engine.scheduler, DTYPE_BYTES[engine.dtype]
    budget = sched.token_budget
    rows = min(sched.max_num_seqs, budget)
    graph_tokens = min(CUDA_GRAPH_MAX_TOKENS, 2 * sched.max_num_seqs)
    a, b = CUDA_HIDDEN_GIB
    hidden = engine.cache.gpu_memory_utilization * (a * GiB + b * device_memory_bytes)
    per_gpu = (hidden + _activation_bytes(model, budget, nbytes, tp, ep)
               + 2 * rows * model.vocab_size * 4
               + _activation_bytes(model, graph_tokens, nbytes, tp, ep)
               + NON_TORCH_GIB * GiB)
    return tp * pp * per_gpu


def simulated_kv_blocks(model: ModelConfig, engine: EngineConfig, *,
                        device_memory_bytes: float | None, tp: int = 1, pp: int = 1,
                        ep: int = 1, quantization: str | None = None,
                        kv_cache_dtype: str = "auto") -> int:
    """KV blocks of a simulated (or planned) instance: :func:`kv_cache_blocks` with
    :func:`engine_reserved_bytes` reserved on a GPU, ``cpu_kv_gib`` on CPU. ``quantization``
    ``fp8``: the weights take :func:`fp8_weight_bytes` (activations stay at the engine's dtype);
    ``kv_cache_dtype`` ``fp8``: one byte per cached element."""
    reserved = 0.0 if device_memory_bytes is None else engine_reserved_bytes(
        model, engine, device_memory_bytes=device_memory_bytes, tp=tp, pp=pp, ep=ep)
    weights = fp8_weight_bytes(model, engine.dtype) if quantization == "fp8" else None
    return kv_cache_blocks(model, engine, device_memory_bytes=device_memory_bytes,
                           num_devices=tp * pp, reserved_bytes=reserved, weight_bytes=weights,
                           kv_cache_dtype=kv_cache_dtype)


def fp8_weight_bytes(model: ModelConfig, dtype: str) -> int:
    """Weights of an fp8-quantized checkpoint as vLLM's ``--quantization fp8`` loads them: one
    byte per parameter of the linear layers, the embeddings (and an untied LM head) kept at
    ``dtype``."""
    embed = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    return model.num_params() - embed + embed * DTYPE_BYTES[dtype]


_KWARG_TYPES = _kwarg_types()
