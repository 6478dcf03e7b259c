"""Placement search (DistServe §4.1 Algorithm 1, §4.2 Algorithm 2) and the colocated baseline.

A *placement* is the parallelism (TP, PP) of each phase, how many instances of each and how they
sit on nodes (§4). Every candidate is a :class:`~pdserve.config.ClusterConfig` built with
``ClusterConfig.from_dict`` and simulated through :mod:`pdserve.sim.target` — the very spec
``pdserve serve`` / ``pdserve simulate --config`` run — and its goodput comes from the
benchmark toolkit's rate search (:func:`pdserve.bench.goodput.search_goodput`).

The unit of work is a **phase unit**: one instance of one role at one (TP, PP), simulated alone.

* ``prefill`` (§3.1): one prefill instance; every request asks for one token, so nothing is
  decoded and the attainment is the share of requests whose TTFT meets the SLO.
* ``decode`` (§3.2): one decode instance fed by enough prefill instances (of the largest TP) that
  prefill is never the bottleneck; the attainment is the share whose TPOT meets the SLO. KV
  arrives over the link the algorithm implies (Alg. 1: the cross-node network when the cluster
  has several nodes, Alg. 2: the intra-node link).
* ``colocated``: one instance that runs both phases, prefill-first (vLLM v0) or chunked
  (Sarathi); the attainment counts both SLOs per request.

Per-GPU goodput of a unit = its goodput / its GPUs. Then:

* **Algorithm 1** (high node affinity): the best prefill unit and the best decode unit by per-GPU
  goodput, replicated to the traffic rate ``R``: ``n = ⌈R / g_p⌉``, ``m = ⌈R / g_d⌉``
  (:func:`replicate`).
* **Algorithm 2** (low node affinity): prefill and decode instances share the inter-op degree
  ``pp``; each of ``pp`` nodes holds one stage segment of ``n_p`` prefill and ``n_d`` decode
  instances (``n_p·tp_p + n_d·tp_d ≤ GPUs per node``), so KV moves per layer segment over the
  intra-node link only. A *node-group unit* (``pp`` nodes) is estimated from phase units priced
  with the intra-node link, the best few are simulated whole, the best is replicated.
* **Colocated** units (TP × PP, prefill-first and chunked) are always searched, so that every
  plan says which strategy wins and by how much.
* **Partial** units (EcoServe §4.2.1, PaDG): one macro instance of ``macro_size`` temporal
  instances routed by ``macro_rolling``, replicated to the rate; no KV crosses a link.

Pruning: a unit whose weights and KV do not fit (``kv_cache_blocks`` raises, or the KV cannot
hold one longest request) and a unit that misses the SLO even at zero load (each request alone
on the instance) are not simulated; a unit whose capacity bound is dominated is not simulated,
and a unit that fails at the rate tying the best per-GPU goodput of its kind so far stops after
that probe (:meth:`UnitCache.get_bounded`); stopped units that could still make a better Alg. 1
pair after ``⌈R/g⌉`` rounding, or a node group that could enter Alg. 2's choice, are then
searched in full (:func:`_research_pairs`, :func:`alg2_search`). Each probe's
simulation ends as soon as its verdict is certain (:func:`run_probe`,
:mod:`pdserve.planner.early`). Results are memoised per unit; units run on a process pool, each
started when a worker is free.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

from pdserve.bench.goodput import AttainmentResult, search_goodput
from pdserve.bench.metrics import SLO, RequestRecord, meets
from pdserve.bench.workloads import Workload, make_workload
from pdserve.config import ClusterConfig, Link, ModelConfig
from pdserve.sim.models import get_model_config
from pdserve.sim.simulator import gc_paused

KINDS = ("colocated", "prefill", "decode", "partial")
STRATEGIES = ("colocated", "disaggregated", "partial")
AFFINITIES = ("high", "low")
DEFAULT_LM = 512  # DistServe §3.1: 512 tokens saturate an A100 for a 13B model


# ------------------------------------------------------------------------------- the problem
@dataclass(frozen=True)
class Problem:
    """What the planner is asked (DistServe §4: model, workload, SLOs, attainment target,
    traffic rate, cluster). ``engine``: engine settings every instance shares (``EngineConfig``
    names); ``gpu_memory_gib`` overrides the device's memory (through the share of it the KV
    pool may use, so the one KV formula stays in charge); links ``None`` = the device's
    intra-node link and, across nodes, InfiniBand HDR (high affinity) or 25 Gb/s Ethernet
    (low affinity, DistServe §6.1)."""

    model: str = "opt-13b"
    profile: str | None = None
    hardware: str | None = None
    workload: str = "distserve-chatbot"
    num_requests: int = 300
    seed: int = 0
    slo: SLO = SLO(0.25, 0.1)
    target: float = 0.9
    rate: float = 1.0
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
    horizon: float = 2.0  # a probe spans at least this many request lifetimes (probe_requests)
    macro_size: int = 2  # temporal instances per PaDG macro instance (EcoServe's N_l)
    early_probes: bool = True  # end a probe's simulation once its verdict is certain (run_probe)

    def __post_init__(self) -> None:
        if self.affinity not in AFFINITIES:
            raise ValueError(f"node affinity must be one of {AFFINITIES}, got {self.affinity!r}")
        for name in ("rate", "precision", "output_scale", "horizon"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("nodes", "gpus_per_node", "num_requests", "max_probes", "lm", "top_k",
                     "macro_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not 0 < self.target <= 1:
            raise ValueError(f"attainment target must be in (0, 1], got {self.target!r}")
        object.__setattr__(self, "engine", tuple(sorted(dict(self.engine).items())))

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def engine_settings(self) -> dict[str, Any]:
        """Shared engine settings with the simulation defaults and the memory override."""
        e = {"dtype": "float16", "enable_prefix_caching": False, **dict(self.engine)}
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
        from pdserve.sim.hardware import get_link

        inter = self.inter_node_link
        if inter is None:
            inter = get_link("ib-hdr" if self.affinity == "high" else "eth-25g")
        return self.intra_node_link, inter


def device_memory_gib(p: Problem) -> float:
    from pdserve.sim.target import SimulationConfig, base_model, device_of, step_model

    sim = SimulationConfig(ClusterConfig(model=p.model), profile=p.profile, hardware=p.hardware)
    tp = available_tps(p, get_model_config(p.model))[0]
    dev = device_of(sim, base_model(step_model(sim, _model(p.model), tp, 1, "float16")))
    if dev is None:
        raise ValueError("the latency source has no GPU device: --gpu-memory-gib needs one")
    return dev.memory_bytes / (1 << 30)


@lru_cache(maxsize=8)
def _model(name: str) -> ModelConfig:
    return get_model_config(name)


def available_tps(p: Problem, model: ModelConfig) -> list[int]:
    """TP degrees a latency source can price: a profile's entries for the model, or (analytic)
    the powers of two dividing the heads, up to a node."""
    cap = min(p.gpus_per_node, p.max_tp or p.gpus_per_node)
    if p.profile is not None:
        import json

        from pdserve.sim.latency import _match_model_key
        from pdserve.sim.target import resolve_profile

        path = resolve_profile(p.profile)
        with open(path) as f:
            data = json.load(f)
        if data.get("format") == "pdserve-latency-profile":
            tps = [int(data.get("tp", 1))]
        else:
            tps = sorted(int(t) for t in data[_match_model_key(data, model)])
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


# ------------------------------------------------------------------------------- phase units
@dataclass(frozen=True, order=True)
class Unit:
    """One instance of one role alone: ``kind``, ``tp``, ``pp``; ``chunked`` (colocated);
    ``link`` (decode: ``intra`` or ``inter``, the KV's way in). A ``partial`` unit (EcoServe
    PaDG) is one macro instance of ``size`` temporal instances, PaDG's smallest serving unit
    (rolling activation needs two instances or more)."""

    kind: str
    tp: int
    pp: int = 1
    chunked: bool = False
    link: str = "intra"
    size: int = 1

    @property
    def num_gpus(self) -> int:
        return self.size * self.tp * self.pp

    @property
    def label(self) -> str:
        s = f"{self.kind} TP{self.tp} PP{self.pp}"
        if self.kind == "partial":
            s = f"partial {self.size}x(TP{self.tp} PP{self.pp}) macro instance"
        if self.kind == "colocated":
            s += " chunked" if self.chunked else " prefill-first"
        if self.kind == "decode" and self.link == "inter":
            s += " (KV cross-node)"
        return s


@dataclass
class UnitResult:
    unit: Unit
    goodput_rps: float = 0.0
    per_gpu_rps: float = 0.0
    pruned: str | None = None
    probes: list[dict[str, Any]] = field(default_factory=list)
    estimate_rps: float = 0.0
    wall_s: float = 0.0
    bound_rps: float | None = None  # lowest failing rate probed: the goodput lies below it
    stopped: str | None = None  # why the rate search stopped before converging

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["unit"] = {**asdict(self.unit), "label": self.unit.label}
        return d


def _sim(p: Problem, dep: dict[str, Any]) -> Any:
    from pdserve.sim.target import SimulationConfig

    return SimulationConfig(ClusterConfig.from_dict(dep), profile=p.profile, hardware=p.hardware)


def _link_dict(link: Link | None) -> dict[str, Any] | None:
    return None if link is None else {"bandwidth_gb_per_s": link.bandwidth_gb_per_s,
                                      "latency_s": link.latency_s}


def unit_deployment(p: Problem, u: Unit, num_prefill_helpers: int = 1,
                    helper_tp: int = 1) -> dict[str, Any]:
    """The ``ClusterConfig.from_dict`` mapping that simulates unit ``u`` (module docstring)."""
    intra, inter = p.links()
    engine = p.engine_settings()
    d: dict[str, Any] = {"model": p.model, "engine": engine, "kv_link": _link_dict(intra)}
    if u.kind == "colocated":
        d["engine"] = {**engine, "enable_chunked_prefill": u.chunked}
        d.update(strategy="colocated", num_instances=1, tp=u.tp, pp=u.pp)
    elif u.kind == "partial":  # one macro instance; no KV moves between its instances
        d.update(strategy="partial", num_instances=u.size, macro_instance_size=u.size, tp=u.tp,
                 pp=u.pp, slo_ttft=p.slo.ttft, slo_tpot=p.slo.tpot)
    elif u.kind == "prefill":
        d.update(strategy="disaggregated", num_prefill=1, prefill_tp=u.tp, prefill_pp=u.pp,
                 num_decode=1, decode_tp=u.tp, decode_pp=u.pp, prefill_token_target=p.lm)
    else:
        d.update(strategy="disaggregated", num_prefill=num_prefill_helpers,
                 prefill_tp=helper_tp, prefill_pp=1, num_decode=1, decode_tp=u.tp,
                 decode_pp=u.pp, prefill_token_target=p.lm)
        if u.link == "inter":
            d["kv_link"] = _link_dict(inter)
    return d


@lru_cache(maxsize=64)
def base_workload(p: Problem, num_requests: int | None = None) -> Workload:
    """The problem's workload of ``num_requests`` (default ``p.num_requests``), untimed
    (``retimed(rate)`` gives each probe's arrivals)."""
    model = _model(p.model)
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


def probe_requests(p: Problem, rate: float, kind: str = "colocated") -> int:
    """Requests in a probe at ``rate``: at least ``p.num_requests``, and enough to arrive over
    ``p.horizon`` request lifetimes at the SLO (``TTFT + mean output × TPOT``). A short burst
    fits in a large KV cache at once and never shows that the rate exceeds the instance's
    steady-state capacity (TPOT averages a queueing delay over the whole output); prefill
    backlogs show in TTFT at once, so a prefill unit needs no horizon."""
    if kind == "prefill":
        return p.num_requests
    w = base_workload(p)
    mean_out = sum(r.output_len for r in w.requests) / len(w.requests)
    life = p.slo.ttft + mean_out * p.slo.tpot
    return max(p.num_requests, math.ceil(rate * life * p.horizon))


def max_model_len(p: Problem) -> int:
    e = dict(p.engine)
    return int(e.get("max_model_len") or _model(p.model).max_position_embeddings)


def _unit_workload(p: Problem, u: Unit, rate: float) -> Workload:
    w = base_workload(p, probe_requests(p, rate, u.kind))
    if u.kind == "prefill":  # one token each: the request ends on the prefill instance
        w = replace(w, requests=[replace(r, output_len=1) for r in w.requests])
    return w


def _attained(records: Sequence[RequestRecord], slo: SLO, kind: str) -> float:
    if not records:
        return 0.0
    ok = 0
    for r in records:
        t_ok, p_ok = meets(r, slo)
        ok += (t_ok if kind == "prefill" else p_ok if kind == "decode" else t_ok and p_ok)
    return ok / len(records)


@dataclass
class UnitModel:
    """What the planner knows of a unit before simulating it: its step-time model, KV tokens
    (per virtual engine for PP), and the capacity and zero-load bounds derived from them."""

    latency: Any
    kv_tokens: int
    capacity_rps: float
    zero_load_attainment: float


@lru_cache(maxsize=256)
def unit_model(p: Problem, u: Unit) -> UnitModel:
    """Build the unit's deployment (raises ``ValueError`` when weights + KV do not fit) and its
    analytic bounds: capacity (prefill: batches of L_m tokens back to back on ``pp`` stages;
    decode: the KV-limited batch at the mean context every step; colocated: both in series)
    and the attainment with every request alone on the instance."""
    from pdserve.sim.target import build_simulator, step_model

    model = _model(p.model)
    dep = unit_deployment(p, u, 1, available_tps(p, model)[-1])
    built = build_simulator(_sim(p, dep))
    role = {"partial": "temporal"}.get(u.kind, u.kind)
    info = built.describe["roles"][role]
    block = dict(p.engine).get("block_size", 16)
    kv_tokens = info["num_kv_blocks"] * block // u.pp
    latency = step_model(_sim(p, dep), model, u.tp, u.pp, "float16")
    base = getattr(latency, "base", latency)
    w = base_workload(p)
    prompts = [r.prompt_len for r in w.requests]
    outputs = [r.output_len for r in w.requests]
    mp, mo = sum(prompts) / len(prompts), sum(outputs) / len(outputs)
    per_batch = max(1, int(p.lm // max(mp, 1)))
    cap_p = u.pp * per_batch / max(base.prefill_time([int(mp)] * per_batch), 1e-9)
    ctx = int(mp + mo / 2)
    seqs = max(1, min(dict(p.engine).get("max_num_seqs", 256) // 1, kv_tokens // max(ctx, 1)))
    cap_d = u.pp * seqs / max(base.decode_time([ctx] * seqs), 1e-9) / max(mo, 1)
    # colocated and temporal instances run both phases in series, a macro instance u.size times
    cap = cap_p if u.kind == "prefill" else cap_d if u.kind == "decode" else \
        u.size / (1 / cap_p + 1 / cap_d)
    longest = max(a + b for a, b in zip(prompts, outputs))
    if kv_tokens < longest:
        raise ValueError(f"{u.label}: KV cache holds {kv_tokens} tokens, fewer than the longest "
                         f"request ({longest})")
    ok = 0
    for a, b in zip(prompts, outputs):
        ttft = latency.prefill_time([a])
        tpot = latency.decode_time([a + 1]) if b > 1 else 0.0
        ok += (ttft <= p.slo.ttft if u.kind == "prefill" else tpot <= p.slo.tpot
               if u.kind == "decode" else ttft <= p.slo.ttft and tpot <= p.slo.tpot)
    return UnitModel(latency, kv_tokens, cap, ok / len(prompts))


def _helpers(p: Problem, rate: float) -> tuple[int, int]:
    """Prefill instances (of the largest TP) that keep up with ``rate`` three times over (a
    decode unit's feed; other units ignore them)."""
    tp = available_tps(p, _model(p.model))[-1]
    cap = unit_model(p, Unit("prefill", tp)).capacity_rps
    return max(1, math.ceil(3 * rate / cap)), tp


def run_probe(p: Problem, dep: Mapping[str, Any], requests: Sequence[Any], rate: float,
              kind: str, early: bool = True) -> AttainmentResult:
    """One probe: simulate ``requests`` (timed) on deployment ``dep`` and compare the
    attainment (``kind``: prefill = TTFT, decode = TPOT, else both SLOs) with the target.
    ``early``: stop the simulation as soon as the verdict is certain
    (:class:`pdserve.planner.early.AttainmentWatch`; same verdict, the attainment reported is
    then the bound it stopped on and ``details["early"]`` says which)."""
    from pdserve.planner.early import AttainmentWatch
    from pdserve.sim.target import build_simulator, to_records, to_sim_requests

    built = build_simulator(_sim(p, dict(dep)))
    sreqs = to_sim_requests(requests, _model(p.model).vocab_size)
    watch = None
    if early:
        watch = AttainmentWatch(built.simulator, sreqs, p.slo,
                                kind if kind in ("prefill", "decode") else "both", p.target)
    result = built.simulator.run(sreqs, None, watch)
    details: dict[str, Any] = {"num_requests": len(sreqs)}
    if result.stopped:
        assert watch is not None and watch.verdict is not None
        details.update(early="pass" if watch.verdict else "fail", stopped_at_s=watch.at)
        return AttainmentResult(rate, watch.attainment_bound, watch.verdict, details)
    a = _attained(to_records(requests, result), p.slo, kind)
    return AttainmentResult(rate, a, a >= p.target, details)


def evaluate_unit(p: Problem, u: Unit, incumbent: float = 0.0) -> UnitResult:
    """The unit's goodput by expanding bisection around its capacity bound (pruned units: 0).

    ``incumbent``: the best per-GPU goodput a unit of the same kind already reached. The unit
    is first probed at the rate that ties it, ``incumbent × GPUs``; if it fails there, its
    goodput is below that rate (attainment falls with the rate), it cannot beat the incumbent,
    and its search stops after that one probe (``stopped``, goodput 0, ``bound_rps`` = the
    failed rate). Otherwise the search runs exactly as without an incumbent, so the goodput of
    every unit that is searched does not depend on which units ran before it."""
    t0 = time.perf_counter()
    res = UnitResult(u)
    try:
        um = unit_model(p, u)
    except ValueError as e:
        res.pruned = f"does not fit: {e}"
        return res
    res.estimate_rps = um.capacity_rps
    if um.zero_load_attainment < p.target:
        res.pruned = (f"misses the SLO even at zero load (attainment "
                      f"{um.zero_load_attainment:.1%} < {p.target:.0%})")
        return res

    def at_rate(rate: float) -> AttainmentResult:
        with gc_paused():  # a probe builds millions of objects and no reference cycle
            dep = unit_deployment(p, u, *_helpers(p, rate))
            w = _unit_workload(p, u, rate)
            return run_probe(p, dep, w.retimed(rate).requests, rate, u.kind, p.early_probes)

    def row(q: Any, phase: str) -> dict[str, Any]:
        return {"rate": q.rate, "attainment": q.attainment, "passed": q.passed, "phase": phase,
                **q.details}

    if incumbent > 0:
        tie = at_rate(incumbent * u.num_gpus)
        res.probes.append(row(tie, "incumbent"))
        if not tie.passed:
            res.bound_rps = tie.rate
            res.stopped = (f"cannot beat {incumbent:.3f} req/s per GPU: fails at "
                           f"{tie.rate:.3f} req/s")
            res.wall_s = time.perf_counter() - t0
            return res
    hi = 0.7 * um.capacity_rps
    g = search_goodput(at_rate, hi=hi, precision=p.precision * hi, max_probes=p.max_probes,
                       growth=1.6, num_gpus=u.num_gpus)
    res.goodput_rps, res.per_gpu_rps, res.bound_rps = g.goodput_rps, g.per_gpu_goodput_rps, g.hi
    res.probes += [row(q, q.phase) for q in g.probes]
    res.wall_s = time.perf_counter() - t0
    return res


def _evaluate(args: tuple[Problem, Unit, float]) -> UnitResult:
    return evaluate_unit(*args)


class UnitCache:
    """Memoised phase units, evaluated on a process pool (``workers`` = 1: in this process)."""

    def __init__(self, p: Problem, workers: int = 1,
                 on_done: Callable[[UnitResult], None] | None = None) -> None:
        self.p, self.workers, self.on_done = p, workers, on_done
        self.results: dict[Unit, UnitResult] = {}
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> UnitCache:
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def get(self, units: Iterable[Unit], incumbents: Mapping[Unit, float] | None = None
            ) -> list[UnitResult]:
        """Every unit's result, evaluated once (``incumbents``: per unit, the per-GPU goodput
        to beat, :func:`evaluate_unit`)."""
        units = list(dict.fromkeys(units))
        todo = [(self.p, u, (incumbents or {}).get(u, 0.0)) for u in units
                if u not in self.results]
        if self._pool is not None and len(todo) > 1:
            for r in self._pool.map(_evaluate, todo):
                self._store(r)
        else:
            for job in todo:
                self._store(evaluate_unit(*job))
        return [self.results[u] for u in units]

    def get_bounded(self, units: Iterable[Unit], slack: float = 1.3,
                    early_stop: bool = True) -> list[UnitResult]:
        """Like :meth:`get`, branch and bound: units of one kind run best capacity bound per
        GPU first (kinds taking turns), each started as soon as a worker is free, and a unit
        is not simulated (``pruned``: dominated) when a unit of its kind on no more GPUs
        already reached a per-GPU goodput above the unit's bound per GPU (× ``slack``, the
        bound being approximate) — the smaller unit then beats it per GPU and replicates at a
        finer grain. With ``early_stop`` the others' rate searches stop once they cannot beat
        the best of their kind finished so far (:func:`evaluate_unit`'s ``incumbent``; a
        measured bound, no slack needed). On a pool, which units stop early depends on which
        finished first; every searched unit's goodput, and so each kind's best, does not."""
        units = list(dict.fromkeys(units))
        queues: dict[tuple[str, str], list[tuple[float, Unit]]] = {}
        for u in units:
            if u in self.results:
                continue
            try:
                bound = unit_model(self.p, u).capacity_rps / u.num_gpus
            except ValueError:
                bound = math.inf  # evaluate_unit records why it does not fit
            queues.setdefault((u.kind, u.link), []).append((bound, u))
        for q in queues.values():
            q.sort(key=lambda x: (-x[0], x[1]))
        done: dict[tuple[str, str], list[UnitResult]] = {}
        turn = list(queues)  # kinds take turns
        nxt = 0

        def dominator(key: tuple[str, str], bound: float, u: Unit) -> UnitResult | None:
            return next((r for r in done.get(key, []) if r.unit.num_gpus <= u.num_gpus
                         and r.per_gpu_rps > bound * slack), None)

        def next_job() -> tuple[Problem, Unit, float] | None:
            nonlocal nxt
            while any(queues.values()):
                key = turn[nxt % len(turn)]
                nxt += 1
                if not queues[key]:
                    continue
                bound, u = queues[key].pop(0)
                d = dominator(key, bound, u)
                if d is not None:
                    self._store(UnitResult(u, pruned=(
                        f"dominated: capacity bound {bound:.3f} req/s per GPU x {slack:g} "
                        f"< {d.per_gpu_rps:.3f} of {d.unit.label}"),
                        estimate_rps=bound * u.num_gpus))
                    continue
                inc = max((r.per_gpu_rps for r in done.get(key, [])), default=0.0)
                return self.p, u, inc if early_stop else 0.0
            return None

        def finish(r: UnitResult) -> None:
            self._store(r)
            done.setdefault((r.unit.kind, r.unit.link), []).append(r)

        if self._pool is None:
            while (job := next_job()) is not None:
                finish(evaluate_unit(*job))
        else:
            running: set[Future[UnitResult]] = set()
            while True:
                while len(running) < self.workers and (job := next_job()) is not None:
                    running.add(self._pool.submit(_evaluate, job))
                if not running:
                    break
                fin, running = wait(running, return_when=FIRST_COMPLETED)
                for f in sorted(fin, key=lambda f: f.result().unit):
                    finish(f.result())
        return [self.results[u] for u in units]

    def _store(self, r: UnitResult) -> None:
        self.results[r.unit] = r
        if self.on_done is not None:
            self.on_done(r)


# ------------------------------------------------------------------------------- placements
def replicate(rate: float, goodput_prefill: float, goodput_decode: float) -> tuple[int, int]:
    """DistServe Algorithm 1's last step: ``n = ⌈R / g_p⌉`` prefill and ``m = ⌈R / g_d⌉`` decode
    instances serve rate ``R``."""
    if goodput_prefill <= 0 or goodput_decode <= 0:
        raise ValueError("replication needs positive phase goodputs")
    return math.ceil(rate / goodput_prefill - 1e-9), math.ceil(rate / goodput_decode - 1e-9)


@dataclass
class Placement:
    """A candidate plan: the deployment (``deployment``: ``ClusterConfig.from_dict`` mapping),
    its capacity ``goodput_rps`` on ``num_gpus`` GPUs (estimated from phase units, or
    ``simulated`` whole), the node layout and where it came from."""

    name: str
    algorithm: str  # "alg1" | "alg2" | "colocated"
    strategy: str
    deployment: dict[str, Any]
    goodput_rps: float
    num_gpus: int
    layout: list[str]
    simulated: bool = False
    estimate_rps: float = 0.0
    fits: bool = True
    note: str = ""

    @property
    def per_gpu_rps(self) -> float:
        return self.goodput_rps / self.num_gpus if self.num_gpus else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "per_gpu_rps": self.per_gpu_rps}


def node_layout(roles: Sequence[tuple[str, int, int, int]], gpus_per_node: int
                ) -> tuple[list[str], int]:
    """Instances ``(role, count, tp, pp)`` filled onto nodes in order, as
    :meth:`ClusterConfig.instance_specs` places them: one line per node, and the node count."""
    nodes: list[list[str]] = [[]]
    used = 0
    for role, count, tp, pp in roles:
        for i in range(count):
            need = tp * pp
            if used + need > gpus_per_node:
                nodes.append([])
                used = 0
            nodes[-1].append(f"{role}-{i}(TP{tp}xPP{pp})")
            used += need
    return [f"node {k}: " + ", ".join(n) for k, n in enumerate(nodes)], len(nodes)


def _deployment(p: Problem, roles: dict[str, Any], gpus_per_node: int | None,
                chunked: bool | None = None) -> dict[str, Any]:
    intra, inter = p.links()
    engine = p.engine_settings()
    if chunked is not None:
        engine["enable_chunked_prefill"] = chunked
    d = {"model": p.model, "engine": engine, **roles, "kv_link": _link_dict(intra),
         "inter_node_link": _link_dict(inter), "gpus_per_node": gpus_per_node}
    ClusterConfig.from_dict(d)  # validates
    return d


def colocated_placements(p: Problem, results: Iterable[UnitResult]) -> list[Placement]:
    out = []
    for r in results:
        if r.goodput_rps <= 0:
            continue
        u = r.unit
        n = math.ceil(p.rate / r.goodput_rps - 1e-9)
        layout, used = node_layout([("colocated", n, u.tp, u.pp)], p.gpus_per_node)
        dep = _deployment(p, {"strategy": "colocated", "num_instances": n, "tp": u.tp,
                              "pp": u.pp}, p.gpus_per_node, u.chunked)
        out.append(Placement(f"colocated {n}x(TP{u.tp} PP{u.pp}"
                             f"{' chunked' if u.chunked else ''})", "colocated", "colocated",
                             dep, n * r.goodput_rps, n * u.num_gpus, layout,
                             estimate_rps=n * r.goodput_rps, fits=used <= p.nodes))
    return out


def partial_placements(p: Problem, results: Iterable[UnitResult]) -> list[Placement]:
    """PaDG (EcoServe §4.2.1): ``n = ⌈R / g⌉`` macro instances of the unit's ``size`` temporal
    instances, routed by ``macro_rolling`` against the problem's SLOs (``pdserve serve|simulate
    --strategy partial``)."""
    out = []
    for r in results:
        if r.goodput_rps <= 0:
            continue
        u = r.unit
        n = math.ceil(p.rate / r.goodput_rps - 1e-9)
        layout, used = node_layout([("temporal", n * u.size, u.tp, u.pp)], p.gpus_per_node)
        dep = _deployment(p, {"strategy": "partial", "num_instances": n * u.size,
                              "macro_instance_size": u.size, "tp": u.tp, "pp": u.pp,
                              "slo_ttft": p.slo.ttft, "slo_tpot": p.slo.tpot},
                          p.gpus_per_node)
        out.append(Placement(f"partial {n}x[{u.size}x temporal (TP{u.tp} PP{u.pp})]",
                             "partial", "partial", dep, n * r.goodput_rps, n * u.num_gpus,
                             layout, estimate_rps=n * r.goodput_rps, fits=used <= p.nodes))
    return out


def alg1_placements(p: Problem, prefill: Sequence[UnitResult], decode: Sequence[UnitResult]
                    ) -> list[Placement]:
    """Every (prefill, decode) pair replicated to the rate (Algorithm 1; the best pair is the
    pair of per-phase bests)."""
    out = []
    for a in prefill:
        for b in decode:
            if a.goodput_rps <= 0 or b.goodput_rps <= 0:
                continue
            n, m = replicate(p.rate, a.goodput_rps, b.goodput_rps)
            pu, du = a.unit, b.unit
            layout, used = node_layout([("prefill", n, pu.tp, pu.pp), ("decode", m, du.tp, du.pp)],
                                       p.gpus_per_node)
            dep = _deployment(p, {"strategy": "disaggregated", "num_prefill": n,
                                  "num_decode": m, "prefill_tp": pu.tp, "prefill_pp": pu.pp,
                                  "decode_tp": du.tp, "decode_pp": du.pp,
                                  "prefill_token_target": p.lm}, p.gpus_per_node)
            cap = min(n * a.goodput_rps, m * b.goodput_rps)
            out.append(Placement(f"disaggregated {n}xP(TP{pu.tp} PP{pu.pp}) + "
                                 f"{m}xD(TP{du.tp} PP{du.pp})", "alg1", "disaggregated", dep,
                                 cap, n * pu.num_gpus + m * du.num_gpus, layout,
                                 estimate_rps=cap, fits=used <= p.nodes))
    return out


def _replicas(p: Problem, r: UnitResult) -> list[tuple[int, float]]:
    """``(instances, capacity)`` choices of unit ``r`` replicated to ``p.rate``: one for a
    searched unit (``n = ⌈R/g⌉``, ``n·g``); for a unit whose search stopped at ``bound_rps``
    (goodput ``g < x``), each count ``n`` some ``g < x`` needs, with the highest capacity it
    can have (``n · sup g``: ``g < x`` and ``⌈R/g⌉ = n`` ⇔ ``R/n ≤ g < R/(n − 1)``)."""
    if r.goodput_rps > 0:
        n = math.ceil(p.rate / r.goodput_rps - 1e-9)
        return [(n, n * r.goodput_rps)]
    x = r.bound_rps
    if not r.stopped or x is None or x <= 0:
        return []
    out, n = [], max(1, math.ceil(p.rate / x - 1e-9))
    while n * r.unit.num_gpus <= p.num_gpus:
        sup = x if n == 1 else min(x, p.rate / (n - 1))
        if sup > p.rate / n - 1e-12:
            out.append((n, n * sup))
        n += 1
    return out


def _pair_ceiling(p: Problem, a: UnitResult, b: UnitResult) -> float:
    """The highest per-GPU goodput an Alg. 1 pair of ``a`` (prefill) and ``b`` (decode) can
    have given what is known of them (exact for searched units, bounds for stopped ones)."""
    best = 0.0
    for n, cap_p in _replicas(p, a):
        for m, cap_d in _replicas(p, b):
            best = max(best, min(cap_p, cap_d) / (n * a.unit.num_gpus + m * b.unit.num_gpus))
    return best


def _research_pairs(p: Problem, cache: UnitCache, results: list[UnitResult]
                    ) -> list[UnitResult]:
    """Make Alg. 1's best pair exact despite early stops. The incumbent stop ranks units per
    GPU, but a pair is replicated to the rate with ``⌈R/g⌉`` rounding, so a unit below its
    kind's best per GPU can still make the better pair (fewer GPUs after rounding). Every
    stopped unit that appears in a pair whose ceiling (:func:`_pair_ceiling`) reaches the best
    searched pair is searched in full, until no such pair is left — then no stopped unit can
    beat the best pair, whatever order the units ran in."""
    while True:
        pre = [r for r in results if r.unit.kind == "prefill"]
        dec = [r for r in results if r.unit.kind == "decode"]
        exact = [pl.per_gpu_rps for pl in alg1_placements(p, pre, dec) if pl.fits]
        floor = max(exact, default=0.0)
        redo = {r.unit for a in pre for b in dec
                if (a.stopped or b.stopped) and _pair_ceiling(p, a, b) >= floor
                for r in (a, b) if r.stopped}
        if not redo:
            return results
        for u in redo:
            cache.results.pop(u, None)
        fresh = {r.unit: r for r in cache.get(sorted(redo))}
        results = [fresh.get(r.unit, r) for r in results]


@dataclass(frozen=True)
class NodeGroup:
    """Algorithm 2's unit: ``pp`` nodes, each holding one stage segment of ``n_p`` prefill
    instances (TP ``tp_p``) and ``n_d`` decode instances (TP ``tp_d``)."""

    pp: int
    tp_p: int
    n_p: int
    tp_d: int
    n_d: int

    @property
    def num_gpus(self) -> int:
        return self.pp * (self.n_p * self.tp_p + self.n_d * self.tp_d)


def node_groups(p: Problem, tps: Sequence[int]) -> list[NodeGroup]:
    """Every way to fill one node with segments of the same stage (``get_intra_node_configs``
    of Algorithm 2), for each inter-op degree that spans at most the cluster's nodes."""
    model = _model(p.model)
    out = []
    pps = available_pps(p, model, 1, span_nodes=True)
    for pp in pps:
        for tp_p in tps:
            for tp_d in tps:
                for n_p in range(1, p.gpus_per_node // tp_p + 1):
                    for n_d in range(1, (p.gpus_per_node - n_p * tp_p) // tp_d + 1):
                        out.append(NodeGroup(pp, tp_p, n_p, tp_d, n_d))
    return out


def alg2_estimate(p: Problem, g: NodeGroup, units: Mapping[Unit, UnitResult]) -> float:
    a = units[Unit("prefill", g.tp_p, g.pp)].goodput_rps
    b = units[Unit("decode", g.tp_d, g.pp)].goodput_rps
    return min(g.n_p * a, g.n_d * b)


def _group_ceiling(g: NodeGroup, units: Mapping[Unit, UnitResult]) -> float:
    """The highest per-GPU estimate node group ``g`` can have given what is known of its two
    units: a searched unit's goodput, or the rate a stopped unit failed at (its goodput lies
    below it); 0 when a unit is missing, pruned or not known at all."""
    def top(u: Unit) -> float:
        r = units.get(u)
        if r is None:
            return 0.0
        if r.goodput_rps > 0:
            return r.goodput_rps
        return (r.bound_rps or 0.0) if r.stopped else 0.0

    a, b = top(Unit("prefill", g.tp_p, g.pp)), top(Unit("decode", g.tp_d, g.pp))
    return min(g.n_p * a, g.n_d * b) / g.num_gpus


GroupSim = Callable[[list[tuple[Problem, NodeGroup, float]]], Mapping[NodeGroup, float]]


def alg2_search(p: Problem, cache: Any, results: list[UnitResult], tps: Sequence[int],
                simulate: GroupSim, exact: bool = True
                ) -> tuple[list[UnitResult], list[NodeGroup], dict[NodeGroup, float],
                           dict[NodeGroup, float]]:
    """Algorithm 2 over the phase units: node groups estimated from their units
    (:func:`alg2_estimate`), ranked per GPU, the best ``p.top_k`` simulated whole
    (``simulate``; memoised here). Returns ``(results, ranked groups, estimates, simulated
    goodputs)``; the plan ranks the simulated groups by their simulated goodput and the rest
    by their estimate.

    ``exact``: make the choice independent of early stops. A stopped unit's goodput is only
    bounded above, so its groups have no estimate; one of them could still enter the top
    ``k`` (estimate ≥ the ``k``-th) or win on its estimate (≥ the best value the plan would
    rank). Every stopped unit in a group whose ceiling (:func:`_group_ceiling`) reaches the
    lower of those two is searched in full, until no such group is left."""
    sims: dict[NodeGroup, float] = {}
    while True:
        by_unit = {r.unit: r for r in results}
        groups = [g for g in node_groups(p, tps)
                  if Unit("prefill", g.tp_p, g.pp) in by_unit
                  and Unit("decode", g.tp_d, g.pp) in by_unit]
        est = {g: alg2_estimate(p, g, by_unit) for g in groups}
        ranked = sorted((g for g in groups if est[g] > 0),
                        key=lambda g: (-est[g] / g.num_gpus, g.num_gpus))
        top = ranked[:p.top_k]
        todo = [(p, g, est[g]) for g in top if g not in sims]
        if todo:
            sims.update(simulate(todo))
        if not exact:
            return results, ranked, est, sims
        kth = est[top[-1]] / top[-1].num_gpus if len(top) == p.top_k else 0.0
        final = max([sims[g] / g.num_gpus for g in top]
                    + [est[g] / g.num_gpus for g in ranked[p.top_k:]], default=0.0)
        floor = min(kth, final)
        redo = set()
        for g in groups:
            pair = (by_unit[Unit("prefill", g.tp_p, g.pp)],
                    by_unit[Unit("decode", g.tp_d, g.pp)])
            if any(r.stopped for r in pair) and \
                    (c := _group_ceiling(g, by_unit)) > 0 and c >= floor - 1e-12:
                redo |= {r.unit for r in pair if r.stopped}
        if not redo:
            return results, ranked, est, sims
        for u in redo:
            cache.results.pop(u, None)
        fresh = {r.unit: r for r in cache.get(sorted(redo))}
        results = [fresh.get(r.unit, r) for r in results]


def alg2_placement(p: Problem, g: NodeGroup, goodput: float, simulated: bool,
                   estimate: float) -> Placement:
    k = math.ceil(p.rate / goodput - 1e-9) if goodput > 0 else 0
    roles = {"strategy": "disaggregated", "num_prefill": k * g.n_p, "num_decode": k * g.n_d,
             "prefill_tp": g.tp_p, "prefill_pp": g.pp, "decode_tp": g.tp_d, "decode_pp": g.pp,
             "prefill_token_target": p.lm}
    # one node group: every KV transfer stays on the intra-node link (per stage segment), so
    # the spec has no cross-node hop to price (gpus_per_node unset); the layout says where
    dep = _deployment(p, roles, None)
    seg = (f"{g.n_p} prefill segment(s) TP{g.tp_p} + {g.n_d} decode segment(s) TP{g.tp_d}")
    layout = [f"group {j} nodes {j * g.pp}..{(j + 1) * g.pp - 1}: each node holds stage s "
              f"of the group's instances: {seg}" for j in range(k)]
    return Placement(f"disaggregated (Alg. 2) {k}x[{g.pp} node(s): {g.n_p}xP(TP{g.tp_p}) + "
                     f"{g.n_d}xD(TP{g.tp_d}) per stage, PP{g.pp}]", "alg2", "disaggregated",
                     dep, k * goodput, k * g.num_gpus, layout, simulated=simulated,
                     estimate_rps=k * estimate, fits=k * g.pp <= p.nodes)


def simulate_goodput(p: Problem, dep: Mapping[str, Any], hi: float) -> tuple[float, list[Any]]:
    """Goodput (both SLOs per request) of a whole deployment, by the rate search."""
    def at_rate(rate: float) -> AttainmentResult:
        with gc_paused():
            w = base_workload(p, probe_requests(p, rate))
            return run_probe(p, dep, w.retimed(rate).requests, rate, "both", p.early_probes)

    g = search_goodput(at_rate, hi=hi, precision=p.precision * hi, max_probes=p.max_probes,
                       growth=1.6, num_gpus=ClusterConfig.from_dict(dep).num_gpus)
    return g.goodput_rps, [asdict(q) for q in g.probes]


def _group_eval(args: tuple[Problem, NodeGroup, float]) -> tuple[NodeGroup, float]:
    p, g, est = args
    roles = {"strategy": "disaggregated", "num_prefill": g.n_p, "num_decode": g.n_d,
             "prefill_tp": g.tp_p, "prefill_pp": g.pp, "decode_tp": g.tp_d, "decode_pp": g.pp,
             "prefill_token_target": p.lm}
    return g, simulate_goodput(p, _deployment(p, roles, None), 0.9 * est)[0]


def _pair_eval(args: tuple[Problem, Placement]) -> tuple[str, float]:
    p, pl = args
    return pl.name, simulate_goodput(p, pl.deployment, 0.9 * pl.estimate_rps)[0]


def _whole_eval(args: tuple[Problem, str, dict[str, Any], float]) -> dict[str, Any]:
    p, name, dep, hi = args
    goodput, probes = simulate_goodput(p, dep, hi)
    gpus = ClusterConfig.from_dict(dep).num_gpus
    return {"name": name, "num_gpus": gpus, "goodput_rps": goodput,
            "per_gpu_rps": goodput / gpus, "probes": probes}


def measure_whole(p: Problem, deployments: Sequence[tuple[str, Mapping[str, Any]]],
                  per_gpu_guess: float, workers: int = 1) -> list[dict[str, Any]]:
    """Goodput of each ``(name, deployment)`` simulated whole by :func:`simulate_goodput`: the
    problem's workload, seed, requests per probe (with the horizon floor), attainment target,
    precision and early probes, the first bracket at ``per_gpu_guess`` × its GPUs (so the
    bracket's relative width is the same for every deployment) — the same probes a plan's
    units get, for comparing a plan's choice with hand-picked placements."""
    jobs = [(p, name, dict(dep), per_gpu_guess * ClusterConfig.from_dict(dict(dep)).num_gpus)
            for name, dep in deployments]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as ex:
            return list(ex.map(_whole_eval, jobs))
    return [_whole_eval(j) for j in jobs]


# ------------------------------------------------------------------------------------ plan
@dataclass
class Plan:
    problem: Problem
    best: Placement
    alternatives: list[Placement]
    best_colocated: Placement | None
    best_disaggregated: Placement | None
    units: list[UnitResult]
    wall_s: float
    notes: list[str] = field(default_factory=list)
    best_partial: Placement | None = None

    def best_of(self, strategy: str) -> Placement | None:
        """The best fitting placement of ``strategy`` (None: none searched or none fits)."""
        return {"colocated": self.best_colocated, "disaggregated": self.best_disaggregated,
                "partial": self.best_partial}[strategy]

    @property
    def advantage(self) -> float | None:
        """Per-GPU goodput of the best disaggregated over the best colocated placement."""
        if self.best_colocated is None or self.best_disaggregated is None or \
                self.best_colocated.per_gpu_rps <= 0:
            return None
        return self.best_disaggregated.per_gpu_rps / self.best_colocated.per_gpu_rps

    def to_dict(self) -> dict[str, Any]:
        prob = asdict(self.problem)
        prob["slo"] = {"ttft": self.problem.slo.ttft, "tpot": self.problem.slo.tpot}
        prob["engine"] = dict(self.problem.engine)
        return {"problem": prob, "best": self.best.to_dict(),
                "alternatives": [a.to_dict() for a in self.alternatives],
                "best_colocated": self.best_colocated.to_dict() if self.best_colocated else None,
                "best_disaggregated": (self.best_disaggregated.to_dict()
                                       if self.best_disaggregated else None),
                "best_partial": self.best_partial.to_dict() if self.best_partial else None,
                "disaggregated_over_colocated": self.advantage,
                "units": [u.to_dict() for u in self.units], "wall_s": self.wall_s,
                "notes": self.notes}


def _rank(pls: Iterable[Placement], simulated_first: bool = False) -> list[Placement]:
    return sorted(pls, key=lambda x: (not x.fits, simulated_first and not x.simulated,
                                      -round(x.per_gpu_rps, 9), x.num_gpus, x.name))


def _simulate_whole(p: Problem, cache: UnitCache, pls: Sequence[Placement]) -> None:
    """``--joint``: simulate ``pls`` whole at their replica counts (first bracket 0.9 × the
    estimate from units) and keep the simulated goodput. A unit alone and ``n`` replicas of
    it behind a router are not the same server: on EcoServe's L20 testbed 8 colocated TP4
    chunked instances of OPT-30B reach 0.24–0.25 req/s per GPU whole against 0.20–0.21 for
    one alone, with probes of 6–20 request lifetimes (docs/benchmarks.md), while a
    disaggregated pair there falls short of its estimate."""
    pls = [pl for pl in pls if pl.fits]  # one that does not fit the cluster is never chosen
    one = {id(pl) for pl in pls if _one_unit(pl)}
    done = dict(_map(cache, _pair_eval, [(p, pl) for pl in pls if id(pl) not in one]))
    for pl in pls:
        gpus = ClusterConfig.from_dict(pl.deployment).num_gpus
        pl.simulated = True
        if id(pl) in one:  # the whole deployment is the unit its goodput was simulated on
            pl.note = f"one unit: simulated whole as the unit ({gpus} GPUs)"
            continue
        pl.goodput_rps = done[pl.name]
        pl.note = (f"simulated whole ({gpus} GPUs); estimate from units "
                   f"{pl.estimate_rps:.3f} req/s")


def _simulate_best(p: Problem, cache: UnitCache, ranked: Sequence[Sequence[Placement]]
                   ) -> None:
    """``--joint``, per strategy (each list ranked by its estimates from units): the best
    ``p.top_k`` placements that fit are simulated whole, then, a round at a time, the next
    ones whose estimate per GPU still beats the best whole simulation of their strategy, up to
    ``3 × p.top_k`` per strategy. A pair's estimate takes each phase at its own goodput and
    is optimistic for the pair, by more for some pairs than for others, so a lower-ranked one
    can come out best whole (OPT-13B on 1 × 4 A100: the first two pairs by estimate,
    1.99 and 1.97 req/s per GPU, came to 1.86 and 1.84 whole; the third, 1.97 estimated,
    to 1.90). Strategies are simulated side by side, so the pool's workers stay busy."""
    queues = [[pl for pl in pls if pl.fits][:3 * p.top_k] for pls in ranked]
    upto = [0] * len(queues)
    batch = [q[:p.top_k] for q in queues]
    while any(batch):
        _simulate_whole(p, cache, [pl for b in batch for pl in b])
        for i, q in enumerate(queues):
            upto[i] += len(batch[i])
            best = max((pl.per_gpu_rps for pl in q[:upto[i]]), default=0.0)
            batch[i] = list(itertools.takewhile(lambda pl, b=best: pl.per_gpu_rps > b,
                                                q[upto[i]:upto[i] + p.top_k]))


def _one_unit(pl: Placement) -> bool:
    """Whether ``pl`` is a single colocated instance or a single PaDG macro instance: the
    deployment its unit was simulated as (no KV moves, no router choice between replicas),
    so the unit's rate search already is its whole simulation."""
    d = pl.deployment
    if pl.strategy == "colocated":
        return d["num_instances"] == 1
    return pl.strategy == "partial" and d["num_instances"] == d["macro_instance_size"]


def plan(p: Problem, workers: int | None = None,
         on_unit: Callable[[UnitResult], None] | None = None,
         strategies: Sequence[str] = STRATEGIES, prune: bool = True,
         early_stop: bool = True) -> Plan:
    """Search the placements for ``p`` (module docstring) and rank them by per-GPU goodput.
    ``prune``: skip units whose capacity bound is dominated and stop rate searches that cannot
    beat the best unit of their kind (:meth:`UnitCache.get_bounded`); ``prune=False`` searches
    every unit to convergence (full per-phase rankings); ``early_stop=False`` keeps the
    dominance pruning only (the search before early stops existed)."""
    t0 = time.perf_counter()
    workers = workers or min(2, os.cpu_count() or 1)
    tps = available_tps(p, _model(p.model))
    base_workload(p)  # a bad workload fails here, before any pool starts
    notes: list[str] = []
    units = candidate_units(p, strategies)
    alg2 = "disaggregated" in strategies and p.affinity == "low"
    alg1 = "disaggregated" in strategies and p.affinity == "high"
    with UnitCache(p, workers, on_unit) as cache:
        if prune:
            for r in unpaired_units(p, units):
                cache._store(r)
        results = cache.get_bounded(units, early_stop=early_stop) if prune else cache.get(units)
        by_unit = {r.unit: r for r in results}
        placements: list[Placement] = []
        colo = _rank(colocated_placements(p, [r for r in results if r.unit.kind == "colocated"]))
        part = _rank(partial_placements(p, [r for r in results if r.unit.kind == "partial"]))
        if p.joint:
            _simulate_best(p, cache, [colo, part])
        placements += colo + part
        if alg1:
            if prune and early_stop:
                results = _research_pairs(p, cache, results)
                by_unit = {r.unit: r for r in results}
            pre = [r for r in results if r.unit.kind == "prefill"]
            dec = [r for r in results if r.unit.kind == "decode"]
            pairs = _rank(alg1_placements(p, pre, dec))
            if p.joint:
                _simulate_best(p, cache, [pairs])
            placements += pairs
        if alg2:
            def simulate(jobs: list[tuple[Problem, NodeGroup, float]]) -> dict[NodeGroup, float]:
                return dict(_map(cache, _group_eval, jobs))

            results, ranked, est, sims = alg2_search(p, cache, results, tps, simulate,
                                                     exact=prune and early_stop)
            by_unit = {r.unit: r for r in results}
            groups = [g for g in node_groups(p, tps)
                      if Unit("prefill", g.tp_p, g.pp) in by_unit
                      and Unit("decode", g.tp_d, g.pp) in by_unit]
            top = ranked[:p.top_k]  # groups simulated in an earlier round and since overtaken
            for g in ranked:        # rank by their estimates, as in a search without stops
                if g in top:
                    placements.append(alg2_placement(p, g, sims[g], True, est[g]))
                else:
                    placements.append(alg2_placement(p, g, est[g], False, est[g]))
            notes.append(f"Alg. 2: {len(groups)} node configurations, {len(top)} simulated "
                         "whole, the rest estimated from phase units")
    ranked_all = _rank(placements, simulated_first=p.joint)
    if not ranked_all:
        pruned = "; ".join(f"{r.unit.label}: {r.pruned}" for r in results if r.pruned)[:600]
        raise ValueError(f"no placement of {p.model} meets TTFT {p.slo.ttft:g} s / TPOT "
                         f"{p.slo.tpot:g} s for {p.target:.0%} of requests on "
                         f"{p.nodes}x{p.gpus_per_node} GPUs ({pruned or 'every goodput is 0'})")
    fitting = [x for x in ranked_all if x.fits]
    if not fitting:
        need = min(x.num_gpus for x in ranked_all)
        raise ValueError(f"the cluster ({p.nodes} node(s) x {p.gpus_per_node} GPUs) is too small "
                         f"to serve {p.rate:g} req/s of {p.model}: the best placement needs "
                         f"{need} GPUs ({ranked_all[0].name})")
    best = fitting[0]
    colo = next((x for x in fitting if x.strategy == "colocated"), None)
    dis = next((x for x in fitting if x.strategy == "disaggregated"), None)
    part = next((x for x in fitting if x.strategy == "partial"), None)
    return Plan(p, best, fitting[1:], colo, dis, sorted(results, key=lambda r: r.unit),
                time.perf_counter() - t0, notes, part)


def unpaired_units(p: Problem, units: Sequence[Unit]) -> list[UnitResult]:
    """The phase units no disaggregated placement on ``p``'s cluster can hold, as pruned
    results: with high node affinity (Alg. 1) the unit and the smallest unit of the other
    phase together need more GPUs than the cluster has; with low affinity (Alg. 2) a node
    cannot hold the unit's segment beside the other phase's narrowest one (the two segments of
    a stage share a node). Every placement holding such a unit holds at least one instance of
    the other phase too, so none would fit and none could be chosen; :func:`plan` skips them
    when it prunes (``prune=False`` keeps the full per-phase rankings)."""
    low = p.affinity == "low"
    width = (lambda u: u.tp) if low else (lambda u: u.num_gpus)
    room = p.gpus_per_node if low else p.num_gpus
    where = " per node, a node" if low else ", the cluster"
    out = []
    for kind, other in (("prefill", "decode"), ("decode", "prefill")):
        theirs = [width(u) for u in units if u.kind == other]
        if not theirs:
            continue
        for u in units:
            need = width(u) + min(theirs)
            if u.kind == kind and need > room:
                out.append(UnitResult(u, pruned=(
                    f"no room beside the smallest {other} unit: {need} GPUs{where} has "
                    f"{room}")))
    return out


def candidate_units(p: Problem, strategies: Sequence[str] = STRATEGIES) -> list[Unit]:
    """The units :func:`plan` searches. Colocated: every TP × PP within a node, prefill-first
    and chunked. Disaggregated, high affinity (Alg. 1): prefill and decode at every TP × PP
    within a node, decode receiving KV over the cross-node network when the cluster has
    several nodes; low affinity (Alg. 2): PP spans up to the cluster's nodes (one stage per
    node) and KV stays on the intra-node link. Partial (EcoServe): a macro instance of
    ``p.macro_size`` temporal instances at every TP × PP within a node, as long as the macro
    instance fits the cluster (its instances exchange no KV, so they may sit on any nodes)."""
    bad = set(strategies) - set(STRATEGIES)
    if bad or not strategies:
        raise ValueError(f"strategies must be among {STRATEGIES}, got {list(strategies)}")
    model = _model(p.model)
    tps = available_tps(p, model)
    within = [(tp, pp) for tp in tps for pp in available_pps(p, model, tp, False)]
    units: list[Unit] = []
    if "colocated" in strategies:
        units += [Unit("colocated", tp, pp, ch) for tp, pp in within for ch in (False, True)]
    if "partial" in strategies:
        units += [Unit("partial", tp, pp, size=p.macro_size) for tp, pp in within
                  if p.macro_size * tp * pp <= p.num_gpus]
    if "disaggregated" in strategies and p.affinity == "high":
        link = "inter" if p.nodes > 1 else "intra"
        for tp, pp in within:
            units += [Unit("prefill", tp, pp), Unit("decode", tp, pp, link=link)]
    if "disaggregated" in strategies and p.affinity == "low":
        pps = available_pps(p, model, 1, span_nodes=True)
        units += [Unit(k, tp, pp) for tp in tps for pp in pps for k in ("prefill", "decode")]
    return units


def _map(cache: UnitCache, fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    if cache._pool is not None and len(jobs) > 1:
        return list(cache._pool.map(fn, jobs))
    return [fn(j) for j in jobs]


def deployment_file(plan_: Plan, placement: Placement | None = None) -> dict[str, Any]:
    """The deployment spec of ``placement`` (default: the best) — ``ClusterConfig.to_dict()``
    plus the ``simulation:`` section — which ``pdserve serve --config`` and
    ``pdserve simulate --config`` run as is."""
    pl = placement or plan_.best
    p = plan_.problem
    d = ClusterConfig.from_dict(pl.deployment).to_dict()
    d["simulation"] = {"profile": p.profile} if p.profile else {"hardware": p.hardware
                                                                 or "A100-80GB"}
    return d

