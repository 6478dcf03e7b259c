"""What the planner is asked (DistServe §4): the :class:`Problem` (model, latency source,
workload, SLOs, attainment target, traffic rate, cluster) and what follows from it alone — the
TP and PP degrees a latency source can price and the problem's workload."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from pdserve.bench.metrics import CRITERIA, SLO
from pdserve.bench.steady import CONFIRM, SteadyState
from pdserve.bench.steady import DEFAULT as DEFAULT_STEADY
from pdserve.bench.workloads import Workload, make_workload
from pdserve.config import ClusterConfig, Link, ModelConfig
from pdserve.sim.aic_latency import BACKENDS, PACKAGE, aic_version, fp8_label
from pdserve.sim.hardware import get_link
from pdserve.sim.latency import match_model_key
from pdserve.sim.model_catalogue import get_model_config
from pdserve.sim.target import (
    SimulationConfig,
    auto_dtype,
    base_model,
    check_fp8,
    device_of,
    fp8_settings,
    resolve_profile,
    step_model,
)

KINDS = ("colocated", "prefill", "decode", "partial")
STRATEGIES = ("colocated", "disaggregated", "partial")
AFFINITIES = ("high", "low")
# engine settings every planned instance gets unless the problem says otherwise (prefix reuse
# depends on a workload's shared prefixes, which plans ignore); the dtype defaults to the
# checkpoint's, as simulate's does (Problem.engine_settings, sim.target.auto_dtype)
ENGINE_DEFAULTS: dict[str, Any] = {"enable_prefix_caching": False}
SERVING_PATH = ("step_overhead_ms", "seq_overhead_ms", "request_overhead_ms")
DEFAULT_LM = 512  # DistServe §3.1: 512 tokens saturate an A100 for a 13B model


# ------------------------------------------------------------------------------- the problem
@dataclass(frozen=True)
class Problem:
    """What the planner is asked (DistServe §4: model, workload, SLOs, attainment target,
    traffic rate, cluster). ``rate``: the traffic to serve, each placement replicated to it;
    ``None``: each sized to the cluster (aiconfigurator's default mode, the most goodput per
    GPU); ``min_gpus``: rank by the fewest GPUs serving ``rate``, not by goodput per GPU.
    ``engine``: engine settings every instance shares (``EngineConfig``
    names); ``gpu_memory_gib`` overrides the device's memory (through the share of it the KV
    pool may use, so the one KV formula stays in charge); links ``None`` = the device's
    intra-node link and, across nodes, InfiniBand HDR (high affinity) or 25 Gb/s Ethernet
    (low affinity, DistServe §6.1)."""

    model: str = "opt-13b"
    profile: str | None = None
    hardware: str | None = None
    aic_system: str | None = None  # aiconfigurator-core's kernel database (pdserve.sim.aic_latency)
    aic_backend: str = "vllm"
    quantization: str | None = None  # fp8 (aic only: pdserve.sim.target.SimulationConfig)
    kv_cache_dtype: str = "auto"
    workload: str = "distserve-chatbot"
    num_requests: int = 300  # judged requests per probe, at least (steady())
    seed: int = 0
    slo: SLO = SLO(0.25, 0.1)
    target: float = 0.9
    rate: float | None = 1.0
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float | None = None
    intra_node_link: Link | None = None
    inter_node_link: Link | None = None
    affinity: str = "high"
    engine: tuple[tuple[str, Any], ...] = ()
    lm: int = DEFAULT_LM
    precision: float = 0.04  # relative width of the goodput bracket
    max_probes: int = 10
    max_tp: int | None = None
    max_pp: int | None = None
    joint: bool = True  # simulate the best placements of each strategy whole (_simulate_whole)
    top_k: int = 2
    traces_dir: str | None = None
    output_scale: float = 1.0  # every output length times this (the advisor's length ratio)
    horizon: float = DEFAULT_STEADY.horizon  # lifetimes a probe's arrivals span (steady())
    min_confidence: float = DEFAULT_STEADY.min_confidence  # of a pass, else extended (steady())
    # the choice (and each strategy's best) confirmed over this many probe lengths (steady-state
    # rule 7, pdserve.planner.placements.confirm_goodput); 0: not confirmed
    confirm: int = CONFIRM
    macro_size: int = 2  # temporal instances per PaDG macro instance (EcoServe's N_l)
    early_probes: bool = True  # end a probe's simulation once its verdict is certain (run_probe)
    criterion: str = "both"  # "distserve": P90 TTFT and P90 TPOT checked separately
    # the serving path (SimulationConfig names): per step, per sequence in a step, per request
    step_overhead_ms: float = 0.0
    seq_overhead_ms: float = 0.0
    request_overhead_ms: float = 0.0
    min_gpus: bool = False  # rank by the fewest GPUs that serve the rate (needs a rate)

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        if self.affinity not in AFFINITIES:
            raise ValueError(f"node affinity must be one of {AFFINITIES}, got {self.affinity!r}")
        if self.min_gpus and self.rate is None:
            raise ValueError("the fewest GPUs (min_gpus) needs a rate to serve")
        for name in ("rate", "precision", "output_scale", "horizon"):
            if name == "rate" and self.rate is None:
                continue
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("nodes", "gpus_per_node", "num_requests", "max_probes", "lm", "top_k",
                     "macro_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not (isinstance(self.confirm, int) and self.confirm >= 0):
            raise ValueError(f"confirm must be an integer >= 0 (probe lengths; 0: off), got "
                             f"{self.confirm!r}")
        if not 0 < self.target <= 1:
            raise ValueError(f"attainment target must be in (0, 1], got {self.target!r}")
        for name in SERVING_PATH:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        object.__setattr__(self, "engine", tuple(sorted(dict(self.engine).items())))
        if sum(x is not None for x in (self.profile, self.hardware, self.aic_system)) > 1:
            raise ValueError("give one latency source: a profile, a hardware spec or an aic "
                             "system")
        if self.aic_system is not None:
            aic_version()  # a clear error (pip install 'pdserve[aic]') when it is absent
            if self.aic_backend not in BACKENDS:
                raise ValueError(f"aic backend {self.aic_backend!r} is not one of "
                                 f"{', '.join(BACKENDS)}")
        check_fp8(self.quantization, self.kv_cache_dtype, self.aic_system)

    def objective(self) -> str:
        """What the plan maximises, in words."""
        if self.rate is None:
            return "the most goodput per GPU on the cluster (no rate given)"
        if self.min_gpus:
            return f"the fewest GPUs serving {self.rate:g} req/s"
        return f"the most goodput per GPU serving {self.rate:g} req/s"

    def steady(self) -> SteadyState:
        """The steady-state rule of every probe (:mod:`pdserve.bench.steady`)."""
        return SteadyState(self.horizon, self.num_requests,
                           min_confidence=self.min_confidence)

    def source(self) -> dict[str, Any]:
        """The latency source alone, as ``simulation:`` keys (``SimulationConfig`` names)."""
        if self.profile is not None:
            return {"profile": self.profile}
        if self.aic_system is not None:
            return {"aic_system": self.aic_system, "aic_backend": self.aic_backend,
                    **fp8_settings(self.quantization, self.kv_cache_dtype)}
        return {"hardware": self.hardware or "A100-80GB"}

    def serving_path(self) -> dict[str, float]:
        """The serving-path terms that are set (``SimulationConfig`` names, milliseconds)."""
        return {k: getattr(self, k) for k in SERVING_PATH if getattr(self, k) > 0}

    def simulation(self) -> dict[str, Any]:
        """The ``simulation:`` section: the latency source and the serving-path terms set, so
        that ``pdserve simulate --config`` prices steps as the planner did."""
        return {**self.source(), **self.serving_path()}

    def sim_settings(self) -> dict[str, Any]:
        """The latency source and serving path as ``SimulationConfig`` keywords (``None`` =
        its default): what every probe of the planner simulates."""
        return {"profile": self.profile, "hardware": self.hardware,
                "aic_system": self.aic_system, "aic_backend": self.aic_backend,
                "quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype,
                **{k: getattr(self, k) for k in SERVING_PATH}}

    def latency_source(self) -> str:
        """What prices the planner's steps, in words (the plan's ``latency source``), with the
        serving-path terms added to it."""
        if self.aic_system is not None:
            src = (f"{PACKAGE} {aic_version()} kernel database "
                   f"{self.aic_system}/{self.aic_backend} (kernel sums"
                   f"{fp8_label(self.quantization, self.kv_cache_dtype)})")
        else:
            src = self.profile or self.hardware or "A100-80GB (analytic)"
        terms = [f"{self.step_overhead_ms:g} ms per step" if self.step_overhead_ms else "",
                 f"{self.seq_overhead_ms:g} ms per sequence in a step"
                 if self.seq_overhead_ms else "",
                 f"{self.request_overhead_ms:g} ms per request" if self.request_overhead_ms
                 else ""]
        terms = [t for t in terms if t]
        return f"{src} + serving path {' + '.join(terms)}" if terms else \
            f"{src}, no serving-path terms"

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def engine_settings(self) -> dict[str, Any]:
        """Shared engine settings with the simulation defaults (the dtype the checkpoint's,
        :func:`~pdserve.sim.target.auto_dtype`) and the memory override."""
        e = {**ENGINE_DEFAULTS, **dict(self.engine)}
        e.setdefault("dtype", auto_dtype(model_config(self.model)))
        if self.gpu_memory_gib is not None:
            dev = device_memory_gib(self)
            share = e.get("gpu_memory_utilization", 0.9) * self.gpu_memory_gib / dev
            if share > 1:
                raise ValueError(f"gpu memory {self.gpu_memory_gib:g} GiB x utilisation exceeds "
                                 f"the {dev:g} GiB the latency source's device has")
            e["gpu_memory_utilization"] = share
        return e

    def links(self) -> tuple[Link | None, Link]:
        """``(intra-node, cross-node)`` KV links."""

        inter = self.inter_node_link
        if inter is None:
            inter = get_link("ib-hdr" if self.affinity == "high" else "eth-25g")
        return self.intra_node_link, inter


def device_memory_gib(p: Problem) -> float:
    sim = SimulationConfig(ClusterConfig(model=p.model), **p.sim_settings())
    tp = available_tps(p, get_model_config(p.model))[0]
    dev = device_of(sim, base_model(step_model(sim, model_config(p.model), tp, 1, "float16")))
    if dev is None:
        raise ValueError("the latency source has no GPU device: --gpu-memory-gib needs one")
    return dev.memory_bytes / (1 << 30)


@lru_cache(maxsize=8)
def model_config(name: str) -> ModelConfig:
    return get_model_config(name)


def available_tps(p: Problem, model: ModelConfig) -> list[int]:
    """TP degrees a latency source can price: a profile's entries for the model, or (analytic)
    the powers of two dividing the heads, up to a node."""
    cap = min(p.gpus_per_node, p.max_tp or p.gpus_per_node)
    if p.profile is not None:
        import json

        path = resolve_profile(p.profile)
        with open(path) as f:
            data = json.load(f)
        if data.get("format") == "pdserve-latency-profile":
            tps = [int(data.get("tp", 1))]
        else:
            tps = sorted(int(t) for t in data[match_model_key(data, model)])
    else:
        tps = [t for t in (1, 2, 4, 8, 16) if model.num_heads % t == 0]
    out = [t for t in tps if t <= cap]
    if not out:
        raise ValueError(f"no tensor-parallel degree of {p.model} fits {cap} GPUs per node "
                         f"(the latency source has tp {tps})")
    return out


def available_pps(p: Problem, model: ModelConfig, tp: int, span_nodes: bool) -> list[int]:
    """PP degrees: dividing the layers; within a node (``tp·pp ≤ M``) unless ``span_nodes``
    (Alg. 2: one stage per node, ``pp ≤ nodes``)."""
    limit = p.nodes if span_nodes else p.gpus_per_node // tp
    limit = min(limit, p.max_pp or limit)
    return [k for k in range(1, limit + 1) if model.num_layers % k == 0]


# recent workloads, bounded by their prompt tokens: each holds every prompt's token ids, and a
# steady-state probe's request count differs with its rate (64 cached 4,000-token workloads of
# ~10,000 requests grew a plan worker past 10 GB)
WORKLOAD_CACHE_TOKENS = 20_000_000
_workloads: OrderedDict[tuple[Problem, int | None], tuple[Workload, int]] = OrderedDict()
_workloads_lock = threading.Lock()


def clear_workloads() -> None:
    """Forget the workloads :func:`base_workload` keeps (a benchmark timing plans from cold)."""
    with _workloads_lock:
        _workloads.clear()


def base_workload(p: Problem, num_requests: int | None = None) -> Workload:
    """The problem's workload of ``num_requests`` (default ``p.num_requests``), untimed
    (``retimed(rate)`` gives each probe's arrivals); the most recent ones are kept while their
    prompts hold at most :data:`WORKLOAD_CACHE_TOKENS` tokens (the newest always)."""
    key = (p, num_requests)
    with _workloads_lock:  # advise plans its cells in threads
        if key in _workloads:
            _workloads.move_to_end(key)
            return _workloads[key][0]
    w = _make_workload(p, num_requests)
    with _workloads_lock:
        _workloads[key] = (w, sum(r.prompt_len for r in w.requests))
        while len(_workloads) > 1 and \
                sum(n for _, n in _workloads.values()) > WORKLOAD_CACHE_TOKENS:
            _workloads.popitem(last=False)
    return w


def _make_workload(p: Problem, num_requests: int | None) -> Workload:
    model = model_config(p.model)
    w = make_workload(p.workload, num_requests or p.num_requests, seed=p.seed, rate=1.0,
                      vocab_size=model.vocab_size, max_model_len=max_model_len(p),
                      prompt_mode="ids", traces_dir=p.traces_dir)
    if p.output_scale != 1.0:  # longer or shorter answers, still inside the context
        limit = max_model_len(p)
        w = replace(w, requests=[
            replace(r, output_len=max(1, min(round(r.output_len * p.output_scale),
                                             limit - r.prompt_len)))
            for r in w.requests])
    return w


def max_model_len(p: Problem) -> int:
    e = dict(p.engine)
    return int(e.get("max_model_len") or model_config(p.model).max_position_embeddings)

