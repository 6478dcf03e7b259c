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
* a fixed **per-step overhead** (scheduler, Python, kernel launches; DistServe's ``C_3``).

The defaults of :class:`Efficiency` were chosen once, on OPT-13B / TP 1 / A100-80GB against
DistServe's measured profile (``docs/fidelity.md``), and are not tuned per shape or per TP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from pdserve.config import DTYPE_BYTES, ModelConfig
from pdserve.sim.hardware import DeviceSpec, LinkSpec, get_device, get_link
from pdserve.sim.latency import (
    DISTSERVE_DECODE_THRESHOLD,
    Chunks,
    FittedProfile,
    LatencyModel,
    ProfileSample,
    profile_model,
)


@dataclass(frozen=True)
class Efficiency:
    """Named efficiency factors of the roofline (fractions of peak) and fixed costs.

    * ``mfu_gemm`` — achieved share of peak tensor FLOP/s in the linear layers (large GEMMs on
      A100 reach 70–80 %);
    * ``mfu_attention`` — the same for prefill attention (FlashAttention-2 forward on A100 reaches
      50–70 % in its paper; DistServe's own kernel is slower);
    * ``mbu_weights`` — achieved share of memory bandwidth when streaming weights/activations;
    * ``mbu_kv`` — the same for paged KV reads in decode attention (scattered blocks: lower);
    * ``comm`` — achieved share of the link bandwidth in an all-reduce (NCCL bus bandwidth);
    * ``step_overhead_s`` — fixed seconds per iteration (DistServe App. A's ``C_3``);
    * ``attn_q_tile`` — query rows per attention tile (K/V re-read per tile).
    """

    mfu_gemm: float = 0.70
    mfu_attention: float = 0.35
    mbu_weights: float = 0.80
    mbu_kv: float = 0.65
    comm: float = 0.60
    step_overhead_s: float = 4e-3
    attn_q_tile: int = 128

    def __post_init__(self) -> None:
        for f in ("mfu_gemm", "mfu_attention", "mbu_weights", "mbu_kv", "comm"):
            v = getattr(self, f)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{f} must be in (0, 1], got {v}")
        if self.step_overhead_s < 0 or self.attn_q_tile < 1:
            raise ValueError("step_overhead_s must be >= 0 and attn_q_tile >= 1")


class AnalyticModel(LatencyModel):
    """Roofline step time of ``model`` on ``tp`` GPUs of type ``device``.

    ``link`` joins the TP group (default: the device's intra-node link, e.g. NVLink 3 on A100);
    ``efficiency`` (or keyword overrides of its fields) sets the factors.
    """

    def __init__(self, model: ModelConfig, device: DeviceSpec | str, tp: int = 1,
                 link: LinkSpec | str | None = None, dtype: str = "float16",
                 efficiency: Efficiency | None = None, **factors: Any) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
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
        self.link = get_link(link if link is not None else self.device.intra_node_link)
        self.dtype = dtype
        self.eff = replace(efficiency or Efficiency(), **factors)
        self._precompute()

    def _precompute(self) -> None:
        m, tp, nb = self.model, self.tp, DTYPE_BYTES[self.dtype]
        h, hd, inter = m.hidden_size, m.head_dim, m.intermediate_size
        self.q_dim = m.num_heads * hd // tp
        self.kv_dim = math.ceil(m.num_kv_heads / tp) * hd  # KV heads replicate when kv < tp
        gated = m.family != "opt"
        mlp_in = (2 if gated else 1) * inter // tp
        # Per layer per GPU: weight elements, and activation elements in + out per token.
        self.layer_params = (h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
                             + h * mlp_in + (inter // tp) * h)
        self.layer_act = ((h + self.q_dim + 2 * self.kv_dim) + (self.q_dim + h)
                          + (h + mlp_in) + (inter // tp + h))
        self.head_params = m.vocab_size * h // tp
        self.bytes_el = nb
        self.flops = self.device.flops_per_s(self.dtype)
        self.bw = self.device.memory_bw_gbs * 1e9

    def _roof(self, flops: float, nbytes: float, mfu: float, mbu: float) -> float:
        return max(flops / (self.flops * mfu), nbytes / (self.bw * mbu))

    def breakdown(self, prefill_chunks: Chunks,
                  decode_context_lens: Sequence[int]) -> dict[str, float]:
        """Seconds per component: ``linear``, ``attn_prefill``, ``attn_decode``, ``allreduce``,
        ``overhead``. Their sum is :meth:`step_time`."""
        if not prefill_chunks and not decode_context_lens:
            return {}
        m, e, nb, L = self.model, self.eff, self.bytes_el, self.model.num_layers
        tokens = sum(n for _, n in prefill_chunks) + len(decode_context_lens)
        sampled = len(prefill_chunks) + len(decode_context_lens)
        lin_flops = 2.0 * (tokens * self.layer_params * L + sampled * self.head_params)
        lin_bytes = nb * ((self.layer_params + tokens * self.layer_act) * L
                          + self.head_params + sampled * m.hidden_size)
        out = {"linear": self._roof(lin_flops, lin_bytes, e.mfu_gemm, e.mbu_weights)}

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
            nbytes = tokens * m.hidden_size * nb
            ring = 2 * (self.tp - 1)
            one = ring / self.tp * nbytes / (self.link.bytes_per_s * e.comm) \
                + ring * self.link.latency_s
            out["allreduce"] = 2 * L * one
        out["overhead"] = e.step_overhead_s
        return out

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
        return (f"AnalyticModel({self.model.name or self.model.family}, {self.device.name}, "
                f"tp={self.tp}, link={self.link.name}, {self.eff})")
