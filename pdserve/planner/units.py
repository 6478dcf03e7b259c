"""Phase units: the planner's unit of work (DistServe §4.1), one instance of one role at one
(TP, PP), simulated alone, and its goodput by the rate search.

* ``prefill`` (§3.1): one prefill instance; every request asks for one token, so nothing is
  decoded and the attainment is the share of requests whose TTFT meets the SLO.
* ``decode`` (§3.2): one decode instance fed by enough prefill instances (of the largest TP) that
  prefill is never the bottleneck; the attainment is the share whose TPOT meets the SLO. KV
  arrives over the link the algorithm implies (Alg. 1: the cross-node network when the cluster
  has several nodes, Alg. 2: the intra-node link).
* ``colocated``: one instance that runs both phases, prefill-first (vLLM v0) or chunked
  (Sarathi); the attainment counts both SLOs per request.
* ``partial`` (EcoServe §4.2.1, PaDG): one macro instance of ``macro_size`` temporal instances.

Per-GPU goodput of a unit = its goodput / its GPUs. A unit whose weights and KV do not fit
(``simulated_kv_blocks`` raises, or the KV cannot hold one longest request) and a unit that misses
the SLO even at zero load (each request alone on the instance) are not simulated; a unit whose
capacity bound is dominated is not simulated, and a unit that fails at the rate tying the best
per-GPU goodput of its kind so far stops after that probe (:meth:`UnitCache.get_bounded`).
Each probe follows the steady-state rule (:mod:`pdserve.bench.steady`: a warm-up, then the judged
requests) and its simulation ends as soon as its verdict is certain (:func:`run_probe`,
:mod:`pdserve.planner.early`). Results are memoised per unit; units run on a process pool, each
started when a worker is free.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache, partial
from typing import Any

from pdserve.bench.goodput import AttainmentResult, confirm_goodput, search_goodput
from pdserve.bench.metrics import SLO, RequestRecord, attainment, meets
from pdserve.bench.steady import SteadyState, confidence, until_confident
from pdserve.bench.workloads import Workload
from pdserve.config import ClusterConfig, Link
from pdserve.planner.early import AttainmentWatch
from pdserve.planner.problem import (
    STRATEGIES,
    Problem,
    available_pps,
    available_tps,
    base_workload,
    model_config,
)
from pdserve.sim.latency import DriverOverhead
from pdserve.sim.simulator import gc_paused
from pdserve.sim.target import (
    SimulationConfig,
    build_simulator,
    step_model,
    to_records,
    to_sim_requests,
)


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
    return SimulationConfig(ClusterConfig.from_dict(dep), **p.sim_settings())


def link_dict(link: Link | None) -> dict[str, Any] | None:
    return None if link is None else {"bandwidth_gb_per_s": link.bandwidth_gb_per_s,
                                      "latency_s": link.latency_s}


def unit_deployment(p: Problem, u: Unit, num_prefill_helpers: int = 1,
                    helper_tp: int = 1) -> dict[str, Any]:
    """The ``ClusterConfig.from_dict`` mapping that simulates unit ``u`` (module docstring)."""
    intra, inter = p.links()
    engine = p.engine_settings()
    d: dict[str, Any] = {"model": p.model, "engine": engine, "kv_link": link_dict(intra)}
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
            d["kv_link"] = link_dict(inter)
    return d


def probe_lifetime(p: Problem, kind: str = "colocated") -> float:
    """The steady-state rule's lifetime ``L`` of a probe's mean request
    (:mod:`pdserve.bench.steady`). A prefill unit's requests end at their first token, so its
    lifetime is the TTFT objective."""
    mean_out = 1.0
    if kind != "prefill":
        w = base_workload(p)
        mean_out = sum(r.output_len for r in w.requests) / len(w.requests)
    return p.steady().lifetime(p.slo, mean_out)


def probe_requests(p: Problem, rate: float, kind: str = "colocated") -> int:
    """Requests in a probe at ``rate`` by the steady-state rule: ``p.horizon / 2`` lifetimes
    of warm-up, then at least as many (and at least ``p.num_requests``) judged."""
    return p.steady().num_requests(rate, probe_lifetime(p, kind))


def probe_warmup(p: Problem, rate: float, kind: str = "colocated") -> int:
    """Requests at the start of a probe at ``rate`` that are not judged."""
    return p.steady().warmup(rate, probe_lifetime(p, kind))


def unit_workload(p: Problem, u: Unit, rate: float) -> Workload:
    w = base_workload(p, probe_requests(p, rate, u.kind))
    if u.kind == "prefill":  # one token each: the request ends on the prefill instance
        w = replace(w, requests=[replace(r, output_len=1) for r in w.requests])
    return w


def judged_oks(records: Sequence[RequestRecord], slo: SLO, kind: str, warmup: int
               ) -> tuple[list[bool], float]:
    """Whether each judged request (after ``warmup`` in arrival order,
    :meth:`SteadyState.first_judged`) meets the SLO: TTFT (``prefill``), TPOT (``decode``) or
    both; and the whole run's attainment."""
    recs = sorted(records, key=lambda r: r.timeline.arrival or 0.0)  # stable: as the watch
    out = []
    for r in recs:
        t_ok, p_ok = meets(r, slo)
        out.append(t_ok if kind == "prefill" else p_ok if kind == "decode" else t_ok and p_ok)
    return out[SteadyState.first_judged(len(recs), warmup):], sum(out) / max(len(out), 1)


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

    model = model_config(p.model)
    dep = unit_deployment(p, u, 1, available_tps(p, model)[-1])
    built = build_simulator(_sim(p, dep))
    role = {"partial": "temporal"}.get(u.kind, u.kind)
    info = built.describe["roles"][role]
    block = dict(p.engine).get("block_size", 16)
    kv_tokens = info["num_kv_blocks"] * block // u.pp
    latency = step_model(_sim(p, dep), model, u.tp, u.pp, "float16")
    over = latency if isinstance(latency, DriverOverhead) else None
    base = over.base if over is not None else latency
    base = getattr(base, "base", base)  # a pipeline's whole-model step (pp batches in flight)

    def busy(t: float, seqs: int) -> float:  # a step of ``seqs`` sequences, serving path added
        return t + (over.overhead_s + over.per_seq_s * seqs if over is not None else 0.0)

    w = base_workload(p)
    prompts = [r.prompt_len for r in w.requests]
    outputs = [r.output_len for r in w.requests]
    mp, mo = sum(prompts) / len(prompts), sum(outputs) / len(outputs)
    per_batch = max(1, int(p.lm // max(mp, 1)))
    cap_p = u.pp * per_batch / max(busy(base.prefill_time([int(mp)] * per_batch), per_batch),
                                   1e-9)
    ctx = int(mp + mo / 2)
    seqs = max(1, min(dict(p.engine).get("max_num_seqs", 256) // 1, kv_tokens // max(ctx, 1)))
    cap_d = u.pp * seqs / max(busy(base.decode_time([ctx] * seqs), seqs), 1e-9) / max(mo, 1)
    # colocated and temporal instances run both phases in series, a macro instance u.size times
    cap = cap_p if u.kind == "prefill" else cap_d if u.kind == "decode" else \
        u.size / (1 / cap_p + 1 / cap_d)
    longest = max(a + b for a, b in zip(prompts, outputs))
    if kv_tokens < longest:
        raise ValueError(f"{u.label}: KV cache holds {kv_tokens} tokens, fewer than the longest "
                         f"request ({longest})")
    ok = 0
    front = p.request_overhead_ms / 1000  # the front end's cost is on every TTFT (to_records)
    for a, b in zip(prompts, outputs):
        ttft = latency.prefill_time([a]) + front
        tpot = latency.decode_time([a + 1]) if b > 1 else 0.0
        ok += (ttft <= p.slo.ttft if u.kind == "prefill" else tpot <= p.slo.tpot
               if u.kind == "decode" else ttft <= p.slo.ttft and tpot <= p.slo.tpot)
    return UnitModel(latency, kv_tokens, cap, ok / len(prompts))


def decode_feed(p: Problem, rate: float) -> tuple[int, int]:
    """Prefill instances (of the largest TP) that keep up with ``rate`` three times over (a
    decode unit's feed; other units ignore them)."""
    tp = available_tps(p, model_config(p.model))[-1]
    cap = unit_model(p, Unit("prefill", tp)).capacity_rps
    return max(1, math.ceil(3 * rate / cap)), tp


def run_probe(p: Problem, dep: Mapping[str, Any], requests: Sequence[Any], rate: float,
              kind: str, early: bool = True) -> AttainmentResult:
    """One probe: simulate ``requests`` (timed) on deployment ``dep`` and compare the
    attainment of the judged requests (those after the warm-up in arrival order, the
    steady-state rule of :mod:`pdserve.bench.steady`; ``kind``: prefill = TTFT, decode = TPOT,
    else both SLOs)
    with the target. ``early``: stop the simulation as soon as the verdict is certain
    (:class:`pdserve.planner.early.AttainmentWatch`; same verdict, the attainment reported is
    then the bound it stopped on and ``details["early"]`` says which). ``details`` carry the
    verdict's ``confidence``, the requests simulated and judged."""

    built = build_simulator(_sim(p, dict(dep)))
    sreqs = to_sim_requests(requests, model_config(p.model).vocab_size)
    rule = p.steady()
    warm = probe_warmup(p, rate, kind)
    distserve = p.criterion == "distserve" and kind not in ("prefill", "decode")
    watch = None
    if early and not distserve:  # (the watch decides per request: the "both" criterion)
        watch = AttainmentWatch(built.simulator, sreqs, p.slo,
                                kind if kind in ("prefill", "decode") else "both", p.target,
                                warm, p.request_overhead_ms / 1000,
                                pass_early=rule.min_confidence <= 0)
    result = built.simulator.run(sreqs, None, watch)
    details: dict[str, Any] = {"num_requests": len(sreqs)}
    if result.stopped:
        assert watch is not None and watch.verdict is not None
        details.update(early="pass" if watch.verdict else "fail", stopped_at_s=watch.at,
                       judged=watch.n, confidence=watch.confidence)
        return AttainmentResult(rate, watch.attainment_bound, watch.verdict, details)
    records = to_records(requests, result, p.request_overhead_ms / 1000)
    if distserve:  # P90 TTFT and P90 TPOT separately, on the judged requests and the whole run
        recs = sorted(records, key=lambda r: r.timeline.arrival or 0.0)
        judged = recs[SteadyState.first_judged(len(recs), warm):]
        a, whole = attainment(judged, p.slo, "distserve"), attainment(recs, p.slo, "distserve")
        ok = a >= p.target and whole >= p.target
        a = a if whole >= p.target or a < p.target else whole
        details.update(judged=len(judged), confidence=confidence(a, p.target, len(judged)),
                       criterion="distserve")
        return AttainmentResult(rate, a, ok, details)
    oks, whole = judged_oks(records, p.slo, kind, warm)
    v = rule.verdict(oks, p.target, whole)
    details.update(judged=v.judged, confidence=v.confidence)
    return AttainmentResult(rate, v.attainment, v.passed, details)


def steady_probe(p: Problem, probe: Callable[[Problem], AttainmentResult],
                 rule: SteadyState | None = None) -> AttainmentResult:
    """A probe by the steady-state rule (``rule``, default ``p.steady()``), a pass confident or
    extended (:func:`pdserve.bench.steady.until_confident`): ``probe(q)`` runs it on ``q``,
    ``p`` with the (extended) rule's horizon and judged minimum."""
    return until_confident(rule or p.steady(), lambda r: probe(
        replace(p, horizon=r.horizon, num_requests=r.min_judged)))


def unit_probe(p: Problem, u: Unit, rate: float, rule: SteadyState | None = None
               ) -> AttainmentResult:
    """One steady-state probe of unit ``u`` alone at ``rate`` (``rule``: as
    :func:`steady_probe`), its decode instance fed by as many prefill helpers as the rate
    needs (:func:`decode_feed`)."""
    dep = unit_deployment(p, u, *decode_feed(p, rate))

    def probe(q: Problem) -> AttainmentResult:
        with gc_paused():  # a probe builds millions of objects and no reference cycle
            w = unit_workload(q, u, rate)
            return run_probe(q, dep, w.retimed(rate).requests, rate, u.kind, p.early_probes)

    return steady_probe(p, probe, rule)


def confirm(p: Problem, at_rate: Callable[[float, SteadyState], AttainmentResult],
            goodput: float, num_gpus: int) -> tuple[float, dict[str, Any]]:
    """Steady-state rule 7 (:mod:`pdserve.bench.steady`): the searched ``goodput`` probed by
    ``at_rate(rate, rule)`` at ``p.confirm`` × the probe length and, if it fails, searched
    downwards with such probes to ``p.precision`` (:func:`pdserve.bench.goodput.
    confirm_goodput`). The details add the factor to that function's."""
    long = p.steady().confirming(p.confirm)
    g, info = confirm_goodput(lambda rate: at_rate(rate, long), goodput,
                              p.precision * goodput, p.max_probes, num_gpus=num_gpus)
    return g, {"factor": p.confirm, **info}


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
    if u.kind == "decode" and max(r.output_len for r in base_workload(p).requests) <= 1:
        # a decode instance would do nothing, and its TPOT objective holds vacuously at any
        # rate: the search would grow its probes without bound
        res.pruned = ("no decode phase: every request's output is its first token, which the "
                      "prefill instance makes")
        return res
    if um.zero_load_attainment < p.target:
        res.pruned = (f"misses the SLO even at zero load (attainment "
                      f"{um.zero_load_attainment:.1%} < {p.target:.0%})")
        return res

    at_rate = partial(unit_probe, p, u)

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
        if self._pool is not None:  # (one job too: this thread may share the process with
            for r in self._pool.map(_evaluate, todo):  # other plans, advise's cells)
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
        measured bound, no slack needed). On a pool, units of different kinds run side by side
        and one unit of a kind at a time, so each unit is pruned or stopped against the same
        units as in one process: the results do not depend on the workers."""
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

        busy: set[tuple[str, str]] = set()  # kinds with a unit running

        def next_job() -> tuple[Problem, Unit, float] | None:
            nonlocal nxt
            skipped = 0
            while any(queues.values()) and skipped < len(turn):
                key = turn[nxt % len(turn)]
                nxt += 1
                if not queues[key] or key in busy:
                    skipped += 1
                    continue
                skipped = 0
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
        else:  # one unit of a kind at a time: each sees the same units before it as in order
            running: set[Future[UnitResult]] = set()
            while True:
                while len(running) < self.workers and (job := next_job()) is not None:
                    running.add(self._pool.submit(_evaluate, job))
                    busy.add((job[1].kind, job[1].link))
                if not running:
                    break
                fin, running = wait(running, return_when=FIRST_COMPLETED)
                for f in sorted(fin, key=lambda f: f.result().unit):
                    r = f.result()
                    busy.discard((r.unit.kind, r.unit.link))
                    finish(r)
        return [self.results[u] for u in units]

    def _store(self, r: UnitResult) -> None:
        self.results[r.unit] = r
        if self.on_done is not None:
            self.on_done(r)


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
    model = model_config(p.model)
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

