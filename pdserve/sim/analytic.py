"""Analytic roofline step-time model from FLOPs and bytes (DistServe Appendix A; torch-free).

Per iteration on one GPU of a ``tp``-way tensor-parallel instance, each operator group costs
``max(FLOPs / (peak · mfu), bytes / (bandwidth · mbu))`` (a roofline; DistServe App. A.2/A.3
argues which side binds) and the groups add up:

* **linear layers** (QKV, attention output, MLP; App. A.2 table): ``2 · tokens · params / tp``
  FLOPs; the weights are read once per step however many tokens there are, plus the
  activations in and out. The LM head runs only for the sequences that sample a token.
* **prefill attention** (FlashAttention-style, causal): a chunk of ``n`` new tokens after
  ``start`` cached ones has ``n·start + n(n+1)/2`` query-key pairs, ``4·head_dim`` FLOPs each
  per head; K/V are re-read once per query tile of ``attn_q_tile`` rows (App. A.2's ``l/b``).
* **decode attention** (App. A.3): each sequence reads its whole KV cache — memory-bound.
* **tensor parallelism**: two all-reduces per layer (after attention and after the MLP,
  Megatron-style) of ``tokens × hidden`` activations, ring algorithm:
  ``2·(tp−1)/tp · bytes / (link bandwidth · comm) + 2·(tp−1) · link latency``.
* **mixture of experts** (Mixtral, Qwen3-MoE): a sparse layer's router sends each token to
  ``k`` of ``E`` experts; FLOPs are ``2·tokens·k·expert_params``, and the weights read are the
  experts actually touched — ``E·(1 − (1 − k/E)^tokens)`` of them under uniform routing (one
  decoded token reads ``k`` experts, a long prefill reads all ``E``). Shared experts are dense.
  **Expert parallelism** (``ep`` > 1, ``ep`` dividing ``tp`` and ``E``): experts sit whole on
  ``ep`` GPUs instead of being sharded ``tp`` ways; attention stays tensor-parallel and the
  post-MoE all-reduce combines the experts' outputs, so the traffic is unchanged, but the step
  waits for the busiest GPU: ``m + σ·√(2 ln ep)`` token-expert pairs for a binomial mean ``m``.
* a fixed **per-step overhead** (scheduler, Python, kernel launches; DistServe's ``C_3``) and a
  **per-sequence overhead** (sampling, metadata).

The factors (:class:`~pdserve.sim.hardware.Efficiency`) come with the device
(``DeviceSpec.efficiency``): A100-80GB's were chosen once on OPT-13B / TP 1 against DistServe's
measured profile (``docs/fidelity.md``); ``pdserve calibrate`` fits them for any device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from pdserve.config import DTYPE_BYTES, ModelConfig
from pdserve.sim.hardware import DeviceSpec, Efficiency, LinkSpec, get_device, get_link
from pdserve.sim.latency import (
    DISTSERVE_DECODE_THRESHOLD,
    Chunks,
    FittedProfile,
    LatencyModel,
    ProfileSample,
    profile_model,
)


class AnalyticModel(LatencyModel):
    """Roofline step time of ``model`` on ``tp`` GPUs of type ``device`` (a catalogue name, a
    hardware file or a :class:`DeviceSpec`).

    ``link`` joins the TP group (default: the device's intra-node link, e.g. NVLink 3 on A100);
    ``efficiency`` (default: the device's own) or keyword overrides of its fields set the
    factors; ``ep``: expert-parallel degree of a mixture-of-experts model (1 = experts
    sharded ``tp`` ways).
    """

    def __init__(self, model: ModelConfig, device: DeviceSpec | str, tp: int = 1,
                 link: LinkSpec | str | None = None, dtype: str = "float16",
                 efficiency: Efficiency | None = None, ep: int = 1, **factors: Any) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if ep < 1 or tp % ep:
            raise ValueError(f"ep={ep} must be >= 1 and divide tp={tp}")
        if ep > 1 and (not model.is_moe or model.num_experts % ep):
            raise ValueError(f"ep={ep} needs a mixture-of-experts model whose num_experts "
                             f"({model.num_experts}) it divides")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        if model.num_heads % tp:
            raise ValueError(f"num_heads={model.num_heads} is not divisible by tp={tp}")
        unknown = set(factors) - {f.name for f in fields(Efficiency)}
        if unknown:
            raise TypeError(f"unknown efficiency factor(s): {sorted(unknown)}")
        self.model = model
        self.device = get_device(device)
        self.tp = tp
        self.ep = ep
        self.link = get_link(link) if link is not None else self.device.intra_link
        self.dtype = dtype
        self.eff = replace(efficiency or self.device.efficiency, **factors)
        self._precompute()

    def _precompute(self) -> None:
        m, tp, nb = self.model, self.tp, DTYPE_BYTES[self.dtype]
        h, hd, inter = m.hidden_size, m.head_dim, m.intermediate_size
        self.q_dim = m.num_heads * hd // tp
        self.kv_dim = math.ceil(m.num_kv_heads / tp) * hd  # KV heads replicate when kv < tp
        gated = m.family != "opt"
        mlp_in = (2 if gated else 1) * inter // tp
        attn_params = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        attn_act = (h + self.q_dim + 2 * self.kv_dim) + (self.q_dim + h)
        # Per GPU, summed over layers: weight elements, activation elements in + out per token.
        dense = m.num_layers - m.num_moe_layers
        self.linear_params = m.num_layers * attn_params + dense * (h * mlp_in + inter // tp * h)
        self.linear_act = m.num_layers * attn_act + dense * ((h + mlp_in) + (inter // tp + h))
        if m.is_moe:  # router (replicated) and shared experts (dense, TP-sharded)
            shared = m.shared_expert_intermediate_size // tp
            self.linear_params += m.num_moe_layers * (h * m.num_experts + 3 * h * shared)
            self.linear_act += m.num_moe_layers * (h + m.num_experts
                                                   + (2 * h + 3 * shared if shared else 0))
            # one routed expert, per GPU that holds (a shard of) it
            self.expert_params = 3 * h * m.moe_intermediate_size // (tp // self.ep)
            self.expert_act = 2 * h + 3 * m.moe_intermediate_size // (tp // self.ep)
        self.head_params = m.vocab_size * h // tp
        self.bytes_el = nb
        self.flops = self.device.flops_per_s(self.dtype)
        self.bw = self.device.memory_bw_gbs * 1e9

    def _roof(self, flops: float, nbytes: float, mfu: float, mbu: float) -> float:
        c, m = flops / (self.flops * mfu), nbytes / (self.bw * mbu)
        return max(c, m) + (1.0 - self.eff.overlap) * min(c, m)

    def _experts(self, tokens: int) -> tuple[float, float]:
        """``(token-expert pairs, experts touched)`` on the busiest GPU of one sparse layer."""
        m, ep = self.model, self.ep
        k, n_exp = m.num_experts_per_tok, m.num_experts
        pairs = tokens * k / ep
        if ep > 1:  # binomial load of one GPU's expert group; expected max over ep GPUs
            pairs += math.sqrt(pairs * (1 - 1 / ep) * 2 * math.log(ep))
        touched = n_exp / ep * -math.expm1(tokens * math.log1p(-k / n_exp)) \
            if k < n_exp else n_exp / ep
        return min(pairs, tokens * k), touched

    def breakdown(self, prefill_chunks: Chunks,
                  decode_context_lens: Sequence[int]) -> dict[str, float]:
        """Seconds per component: ``linear``, ``moe`` (routed experts), ``attn_prefill``,
        ``attn_decode``, ``allreduce``, ``launch`` (per-layer fixed cost), ``overhead``. Their
        sum is :meth:`step_time`."""
        if not prefill_chunks and not decode_context_lens:
            return {}
        m, e, nb, L = self.model, self.eff, self.bytes_el, self.model.num_layers
        tokens = sum(n for _, n in prefill_chunks) + len(decode_context_lens)
        sampled = len(prefill_chunks) + len(decode_context_lens)
        lin_flops = 2.0 * (tokens * self.linear_params + sampled * self.head_params)
        lin_bytes = nb * (self.linear_params + tokens * self.linear_act
                          + self.head_params + sampled * m.hidden_size)
        out = {"linear": self._roof(lin_flops, lin_bytes, e.mfu_gemm, e.mbu_weights)}
        if m.is_moe:
            pairs, touched = self._experts(tokens)
            f = 2.0 * pairs * self.expert_params * m.num_moe_layers
            b = nb * m.num_moe_layers * (touched * self.expert_params + pairs * self.expert_act)
            out["moe"] = self._roof(f, b, e.mfu_gemm, e.mbu_weights)

        pairs = kv_read = qo = 0.0
        for start, n in prefill_chunks:
            pairs += n * start + n * (n + 1) / 2
            tiles = math.ceil(n / e.attn_q_tile)
            # tile j attends start + min((j+1)·tile, n) keys; summed over tiles:
            kv_read += tiles * start + e.attn_q_tile * tiles * (tiles - 1) / 2 + n
            qo += 2 * n
        if prefill_chunks:
            f = 4.0 * pairs * self.q_dim * L
            b = nb * L * (qo * self.q_dim + (2 * kv_read + 2 * tokens) * self.kv_dim)
            out["attn_prefill"] = self._roof(f, b, e.mfu_attention, e.mbu_weights)
        if decode_context_lens:
            ctx = float(sum(decode_context_lens))
            f = 4.0 * ctx * self.q_dim * L
            b = nb * L * 2 * ctx * self.kv_dim
            out["attn_decode"] = self._roof(f, b, e.mfu_attention, e.mbu_kv)
        if self.tp > 1:
            out["allreduce"] = 2 * L * self.allreduce_time(tokens * m.hidden_size * nb)
        if e.layer_overhead_s:
            out["launch"] = e.layer_overhead_s * L
        out["overhead"] = e.step_overhead_s + e.seq_overhead_s * sampled
        return out

    def allreduce_time(self, nbytes: float) -> float:
        """One ring all-reduce of ``nbytes`` over the TP group:
        ``2(tp−1)/tp · bytes / (bandwidth · comm)`` plus ``comm_latency_s`` (default: one link
        latency per ring hop, ``2(tp−1)``)."""
        if self.tp == 1:
            return 0.0
        e, ring = self.eff, 2 * (self.tp - 1)
        lat = ring * self.link.latency_s if e.comm_latency_s is None else e.comm_latency_s
        return ring / self.tp * nbytes / (self.link.bytes_per_s * e.comm) + lat

    def step_time(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        return sum(self.breakdown(prefill_chunks, decode_context_lens).values())

    def to_fitted_profile(self, grid: Sequence[ProfileSample] | None = None,
                          decode_threshold: int = DISTSERVE_DECODE_THRESHOLD) -> FittedProfile:
        """DistServe-form profile fitted (relative LSQ) to this model's predictions on ``grid``
        (default :func:`~pdserve.sim.latency.profile_grid`); ``fit_error`` says how well the
        three-coefficient forms capture the roofline."""
        name = str(self.model.hf_config.get("_name_or_path") or self.model.name)
        return profile_model(self, grid, decode_threshold, model=name,
                             hardware=self.device.name, tp=self.tp, dtype=self.dtype,
                             source=f"analytic:{self.eff}")

    def __repr__(self) -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return (f"AnalyticModel({self.model.name or self.model.family}, {self.device.name}, "
                f"tp={self.tp}{ep}, link={self.link.name}, {self.eff})")
