"""Step times from aiconfigurator's measured per-kernel databases (torch-free; optional).

:class:`AicModel` is a :class:`~pdserve.sim.latency.LatencyModel` that prices an engine step
with NVIDIA aiconfigurator-core's compiled engine (``pip install 'pdserve[aic]'``): the sum of
the GPU kernels of one forward pass, looked up in the package's databases measured per system
(``h100_sxm``, ``h200_sxm``, ``b200_sxm``, ``a100_sxm``, ``l40s``, ``rtx_pro_6000_server``, ...)
and backend (``vllm``, ``sglang``, ``trtllm``) at the instance's tensor parallelism, its
all-reduces included. A sum of kernels is not a serving step: the host-side work around it is
added by the same :class:`~pdserve.sim.latency.DriverOverhead` wrapper as for every source
(``step_overhead_ms`` / ``seq_overhead_ms``), and pipeline stages by
:class:`~pdserve.sim.latency.PipelineModel`.

How a step maps onto aiconfigurator's calls (its ``AicEngine`` surface):

* prefill only — ``predict_prefill_latency(bs, isl, prefix)`` with ``bs`` the number of
  chunks, ``isl`` their mean ``start + new`` and ``prefix`` their mean ``start`` (exact for a
  batch of equal chunks, which is what aiconfigurator's own static estimate prices);
* decode only — ``decode_step_latency(bs, isl, osl=2)``: one decode step of ``bs`` sequences
  at the mean context length;
* mixed — ``mixed_step_latency(ctx_tokens, gen_tokens, isl, osl=2, prefix)`` with the chunks'
  tokens and means as above (aiconfigurator prices the decode part's attention at the
  prefill's ``isl``, an approximation of its own that this adapter keeps).

Lengths are bucketed (about 1/32 relative) and results cached: a decode lookup costs ~2 ms.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from pdserve.config import KV_CACHE_DTYPES, QUANTIZATIONS, ModelConfig
from pdserve.sim.latency import Chunks, LatencyModel

PACKAGE = "aiconfigurator-core"
INSTALL_HINT = "pip install 'pdserve[aic]'"
BACKENDS = ("vllm", "sglang", "trtllm")
DTYPES = ("float16", "bfloat16")  # the databases' default (fp16/bf16) GEMM and KV modes


def fp8_label(quantization: str | None, kv_cache_dtype: str) -> str:
    """What a source's name adds for its fp8 modes: ``", fp8 weights"``, ``", fp8 KV"``, both or
    nothing."""
    return (f"{', fp8 weights' if quantization == 'fp8' else ''}"
            f"{', fp8 KV' if kv_cache_dtype == 'fp8' else ''}")


class AicUnavailable(ValueError):
    """aiconfigurator-core is not installed."""


def aic_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise AicUnavailable(f"--aic-system needs the optional package {PACKAGE}: "
                             f"{INSTALL_HINT}") from None


def _package_dir() -> str:
    import aiconfigurator_core

    return os.path.dirname(aiconfigurator_core.__file__)


def systems() -> list[str]:
    """The systems whose kernel databases the installed package carries (0.12.0 also has
    empty directories, e.g. ``h100_pcie``: those are left out)."""
    aic_version()
    data = os.path.join(_package_dir(), "systems", "data")
    return sorted(d for d in os.listdir(data) if os.path.isdir(os.path.join(data, d))
                  and any(os.path.isdir(os.path.join(data, d, k))
                          for k in os.listdir(os.path.join(data, d))))


def database_version(system: str, backend: str) -> str:
    """The backend version whose kernel data the package serves for ``system`` (its
    ``current`` slot, e.g. ``0.24.0`` for vllm on h100_sxm)."""
    from aiconfigurator_core.sdk import perf_database

    return str(perf_database.resolve_query_version(system, backend, "current"))


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else -1 for x in v.replace("rc", ".").split("."))


def allreduce_table(system: str, backend: str = "vllm") -> dict[str, Any]:
    """The database's measured all-reduces on ``system``: the backend's own collective (vllm:
    its custom all-reduce under CUDA graphs) and NCCL's, as ``{"source": ..., "rows": [(kind,
    gpus, bytes, seconds), ...]}``; ``kind`` is ``backend`` or ``nccl``. Message sizes in the
    tables are bf16/half elements (2 bytes each); latencies in ms. Each table is the newest
    version not newer than the one the engine serves (backend) or the system's NCCL."""
    import pandas as pd
    import yaml

    aic_version()
    root = os.path.join(_package_dir(), "systems")
    comm = os.path.join(root, "data", system, "comm")
    with open(os.path.join(root, f"{system}.yaml")) as f:
        nccl_want = str((yaml.safe_load(f).get("misc") or {}).get("nccl_version", ""))
    rows: list[tuple[str, int, int, float]] = []
    used = []
    for kind, sub, want, fname in (
            ("backend", backend, database_version(system, backend),
             "custom_allreduce_perf.parquet"),
            ("nccl", "nccl", nccl_want, "nccl_perf.parquet")):
        d = os.path.join(comm, sub)
        have = sorted((v for v in (os.listdir(d) if os.path.isdir(d) else [])
                       if os.path.isfile(os.path.join(d, v, fname))), key=_version_key)
        if not have:
            continue
        older = [v for v in have if _version_key(v) <= _version_key(want)] if want else []
        ver = older[-1] if older else have[-1]
        t = pd.read_parquet(os.path.join(d, ver, fname))
        if kind == "backend":
            graph = t[t["backend"].astype(str).str.endswith("graph")] if "backend" in t else t
            t = graph if len(graph) else t
        else:
            t = t[(t["op_name"] == "all_reduce") & (t["nccl_dtype"] == "half")]
        rows += [(kind, int(g), 2 * int(n), float(ms) / 1000.0)
                 for g, n, ms in zip(t["num_gpus"], t["message_size"], t["latency"])]
        used.append(f"comm/{sub}/{ver}/{fname}")
    return {"source": f"{PACKAGE} {aic_version()} {system}: {', '.join(used)}", "rows": rows}


def _norm(name: str) -> str:
    name = name.split("/")[-1].split("--")[-1].lower()
    return name[len("meta-"):] if name.startswith("meta-") else name


def aic_model_id(model: ModelConfig) -> str:
    """aiconfigurator's id (``org/name`` of a bundled config) of a catalogue model."""
    d = os.path.join(_package_dir(), "model_configs")
    ids = {}
    for f in os.listdir(d):
        if f.endswith("_config.json") and not f.endswith("_hf_quant_config.json"):
            hf = f[: -len("_config.json")].replace("--", "/", 1)
            ids[_norm(hf)] = hf
    key = _norm(model.name)
    if key not in ids:
        raise ValueError(f"model {model.name!r} has no aiconfigurator config (bundled: "
                         f"{', '.join(sorted(ids))})")
    return ids[key]


def _bucket(x: float) -> int:
    """``x`` rounded to about 1/32 of its size (16 tokens at least)."""
    x = max(int(round(x)), 1)
    step = max(16, 1 << max(int(math.log2(x)) - 5, 0))
    return max(step, int(round(x / step)) * step) if x >= 16 else x


@dataclass(frozen=True, eq=False)
class AicModel(LatencyModel):
    """Kernel-database step times for ``model`` on ``system`` / ``backend`` at ``tp``
    (module docstring). A MoE model's experts run ``tp // ep``-way tensor parallel on each of
    ``ep`` expert-parallel groups (aiconfigurator's ``moe_tp_size`` × ``moe_ep_size`` = ``tp``).
    ``quantization`` ``fp8``: the database's fp8 GEMM tables (``gemm_quant_mode``; dense
    models only); ``kv_cache_dtype`` ``fp8``: its fp8-KV attention
    tables (``kvcache_quant_mode``); attention itself computes in 16 bits, as in vLLM.
    ``source`` names the database: package, version, system, backend, and the fp8 modes."""

    model: ModelConfig
    system: str
    backend: str = "vllm"
    tp: int = 1
    dtype: str = "float16"
    ep: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    engine: Any = field(default=None, repr=False)
    version: str = field(default="", init=False)
    _cache: dict[tuple[Any, ...], float] = field(default_factory=dict, init=False, repr=False)
    """Lookups by bucketed shape, shared by every model on the same engine (each simulated
    run builds its models anew; a goodput search runs many)."""

    def __post_init__(self) -> None:
        version = aic_version()
        if self.backend not in BACKENDS:
            raise ValueError(f"aic backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: the aic source prices "
                             f"{' or '.join(DTYPES)} weights and KV")
        known = systems()
        if self.system not in known:
            raise ValueError(f"aic system {self.system!r} is not one of {', '.join(known)}")
        if self.ep < 1 or self.tp % self.ep:
            raise ValueError(f"ep={self.ep} must be >= 1 and divide tp={self.tp}")
        if self.ep > 1 and (not self.model.is_moe or self.model.num_experts % self.ep):
            raise ValueError(f"ep={self.ep} needs a mixture-of-experts model whose num_experts "
                             f"({self.model.num_experts}) it divides")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r}: the aic source prices fp8 "
                             f"or the engine's dtype")
        if self.quantization == "fp8" and self.model.is_moe:
            # aiconfigurator-core 0.12.0, h100_sxm/vllm, Qwen3-30B-A3B TP1: per-tensor fp8
            # experts price a 2000-token prefill at 94 ms against 45 ms in bf16, block fp8 at
            # 38 ms, the bundled FP8 checkpoint at 43 ms: no one answer to stand behind
            raise ValueError(f"quantization fp8 of a mixture-of-experts model "
                             f"({self.model.name}): the kernel database's fp8 expert tables "
                             f"disagree by 2x; fp8 is priced for dense models only "
                             f"(--kv-cache-dtype fp8 works for both)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: the aic source prices "
                             f"auto or fp8")
        if self.engine is None:  # compiled once per process, its lookups shared
            moe = (self.tp // self.ep, self.ep) if self.model.is_moe else None
            object.__setattr__(self, "engine", _compile(
                aic_model_id(self.model), self.system, self.backend, self.tp, moe,
                self.quantization == "fp8", self.kv_cache_dtype == "fp8"))
            object.__setattr__(self, "_cache", _CACHES.setdefault(id(self.engine), {}))
        object.__setattr__(self, "version", version)

    @property
    def source(self) -> str:
        return (f"{PACKAGE} {self.version} kernel database {self.system}/{self.backend} "
                f"({aic_model_id(self.model)}, tp={self.tp}"
                f"{f', ep={self.ep}' if self.ep > 1 else ''}"
                f"{fp8_label(self.quantization, self.kv_cache_dtype)})")

    def kernel_ms(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        """aiconfigurator's kernel sum for one step, ms (no serving terms)."""
        n, b = len(prefill_chunks), len(decode_context_lens)
        if n:
            tokens = sum(c for _, c in prefill_chunks)
            isl = _bucket(sum(s + c for s, c in prefill_chunks) / n)
            prefix = _bucket(sum(s for s, _ in prefill_chunks) / n) if any(
                s for s, _ in prefill_chunks) else 0
            prefix = min(prefix, isl - 1)
            if b:
                key: tuple[Any, ...] = ("m", _bucket(tokens), b, isl, prefix)
            else:
                key = ("p", n, isl, prefix)
        elif b:
            key = ("d", b, _bucket(sum(decode_context_lens) / b))
        else:
            return 0.0
        ms = self._cache.get(key)
        if ms is None:
            e = self.engine
            if key[0] == "p":
                ms = e.predict_prefill_latency(key[1], key[2], key[3])
            elif key[0] == "d":
                ms = e.decode_step_latency(key[1], key[2], 2)
            else:
                ms = e.mixed_step_latency(key[1], key[2], key[3], 2, key[4])
            self._cache[key] = ms
        return float(ms)

    def step_time(self, prefill_chunks: Chunks, decode_context_lens: Sequence[int]) -> float:
        return self.kernel_ms(prefill_chunks, decode_context_lens) / 1000.0


# lookups by the id of an engine _compile keeps alive (so an id is never reused)
_CACHES: dict[int, dict[tuple[Any, ...], float]] = {}


@cache
def _compile(model_id: str, system: str, backend: str, tp: int,
             moe: tuple[int, int] | None = None, fp8_weights: bool = False,
             fp8_kv: bool = False) -> Any:
    """aiconfigurator's engine for ``model_id`` at ``tp``; ``moe``: a MoE model's
    ``(moe_tp_size, moe_ep_size)``, whose product is ``tp``; ``fp8_weights`` / ``fp8_kv``: its
    fp8 GEMM and KV-cache quant modes (else the checkpoint's own)."""
    import logging

    from aiconfigurator_core.sdk.engine import EngineHandle

    # the package logs every fallback table it loads; keep the simulator's output readable
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    kw: dict[str, Any] = {} if moe is None else {"moe_tp_size": moe[0], "moe_ep_size": moe[1]}
    if fp8_weights:  # (dense models only: AicModel)
        kw["gemm_quant_mode"] = "fp8"
    if fp8_kv:
        kw["kvcache_quant_mode"] = "fp8"
    try:
        e = EngineHandle.compile(model_id, system, backend, tp_size=tp, **kw)
        if fp8_weights or fp8_kv:  # missing fp8 tables show on the first lookup: fail here,
            e.predict_prefill_latency(1, 128, 0)  # not in the middle of a simulation
            e.decode_step_latency(1, 128, 2)
        return e
    except Exception as e:  # e.g. PerfDataNotAvailableError: no fp8 tables for this system
        if not (fp8_weights or fp8_kv):
            raise
        raise ValueError(f"{PACKAGE} has no fp8 kernel data for {model_id} on {system}/"
                         f"{backend} at tp={tp}: {str(e).splitlines()[0][:160]}") from None
