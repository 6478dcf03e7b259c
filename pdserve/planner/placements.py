"""Placements from phase units: replicas of one unit (colocated, PaDG), Algorithm 1's
(prefill, decode) pairs (DistServe §4.1, high node affinity: ``n = ⌈R / g_p⌉``,
``m = ⌈R / g_d⌉``), their node layouts and deployment specs, and whole-deployment goodput
(:func:`simulate_goodput`) for ``--joint`` and ``--against``. Stopped units that could still
make a better Alg. 1 pair after ``⌈R/g⌉`` rounding are searched in full
(:func:`research_pairs`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.bench.goodput import AttainmentResult, search_goodput
from pdserve.config import ClusterConfig
from pdserve.planner.problem import Problem, base_workload
from pdserve.planner.units import (
    Unit,
    UnitCache,
    UnitResult,
    confirm,
    link_dict,
    probe_requests,
    run_probe,
    steady_probe,
)
from pdserve.sim.simulator import gc_paused


def instances(p: Problem, u: Unit, goodput: float) -> int:
    """How many of colocated or partial unit ``u`` a placement has: ``n = ⌈R / g⌉`` to serve
    ``p.rate``; without a rate, as many as the cluster's nodes hold (every unit of a kind has
    the same goodput per GPU, so the whole cluster gives the most goodput at it)."""
    if p.rate is not None:
        return math.ceil(p.rate / goodput - 1e-9)
    return p.nodes * (p.gpus_per_node // (u.tp * u.pp)) // u.size


def pair_instances(p: Problem, pu: Unit, du: Unit, goodput_prefill: float,
                   goodput_decode: float) -> tuple[int, int] | None:
    """Prefill and decode instances of an Alg. 1 pair: :func:`replicate` to serve ``p.rate``;
    without a rate, the counts ``(n, m)`` whose placement fits the cluster's nodes with the
    most goodput per GPU, ``min(n·g_p, m·g_d) / GPUs`` (ties: the most goodput, then the
    fewest GPUs); ``None`` when none fits."""
    if p.rate is not None:
        return replicate(p.rate, goodput_prefill, goodput_decode)
    best, key = None, (0.0, 0.0)
    gp, gd = pu.num_gpus, du.num_gpus
    for n in range(1, p.num_gpus // gp + 1):
        for m in range(1, (p.num_gpus - n * gp) // gd + 1):
            cap = min(n * goodput_prefill, m * goodput_decode)
            k = (round(cap / (n * gp + m * gd), 9), cap)
            if k > key and node_layout([("prefill", n, pu.tp, pu.pp),
                                        ("decode", m, du.tp, du.pp)],
                                       p.gpus_per_node)[1] <= p.nodes:
                best, key = (n, m), k
    return best


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
    # steady-state rule 7 (confirm_goodput): the long probe's factor, attainment, ...; None:
    # not confirmed
    confirmed: dict[str, Any] | None = None

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


def placement_deployment(p: Problem, roles: dict[str, Any], gpus_per_node: int | None,
                chunked: bool | None = None) -> dict[str, Any]:
    intra, inter = p.links()
    engine = p.engine_settings()
    if chunked is not None:
        engine["enable_chunked_prefill"] = chunked
    d = {"model": p.model, "engine": engine, **roles, "kv_link": link_dict(intra),
         "inter_node_link": link_dict(inter), "gpus_per_node": gpus_per_node}
    ClusterConfig.from_dict(d)  # validates
    return d


def replica_placements(p: Problem, results: Iterable[UnitResult]) -> list[Placement]:
    """Each searched colocated or partial unit replicated to the rate: ``n = ⌈R / g⌉`` colocated
    instances, or ``n`` PaDG macro instances (EcoServe §4.2.1) of the unit's ``size`` temporal
    instances routed by ``macro_rolling`` against the problem's SLOs (``pdserve serve|simulate
    --strategy partial``)."""
    out = []
    for r in results:
        if r.goodput_rps <= 0:
            continue
        u = r.unit
        n = instances(p, u, r.goodput_rps)
        if n < 1:
            continue
        if u.kind == "colocated":
            layout, used = node_layout([("colocated", n, u.tp, u.pp)], p.gpus_per_node)
            dep = placement_deployment(p, {"strategy": "colocated", "num_instances": n,
                                           "tp": u.tp, "pp": u.pp}, p.gpus_per_node, u.chunked)
            name = f"colocated {n}x(TP{u.tp} PP{u.pp}{' chunked' if u.chunked else ''})"
        elif u.kind == "partial":
            layout, used = node_layout([("temporal", n * u.size, u.tp, u.pp)], p.gpus_per_node)
            dep = placement_deployment(p, {"strategy": "partial", "num_instances": n * u.size,
                                           "macro_instance_size": u.size, "tp": u.tp,
                                           "pp": u.pp, "slo_ttft": p.slo.ttft,
                                           "slo_tpot": p.slo.tpot}, p.gpus_per_node)
            name = f"partial {n}x[{u.size}x temporal (TP{u.tp} PP{u.pp})]"
        else:
            raise ValueError(f"{u.label}: a phase unit is placed in pairs (alg1_placements)")
        out.append(Placement(name, u.kind, u.kind, dep, n * r.goodput_rps, n * u.num_gpus,
                             layout, estimate_rps=n * r.goodput_rps, fits=used <= p.nodes))
    return out


def alg1_placements(p: Problem, prefill: Sequence[UnitResult], decode: Sequence[UnitResult]
                    ) -> list[Placement]:
    """Every (prefill, decode) pair replicated to the rate, or sized to the cluster without
    one (:func:`pair_instances`; Algorithm 1; the best pair is the pair of per-phase
    bests)."""
    out = []
    for a in prefill:
        for b in decode:
            if a.goodput_rps <= 0 or b.goodput_rps <= 0:
                continue
            pu, du = a.unit, b.unit
            nm = pair_instances(p, pu, du, a.goodput_rps, b.goodput_rps)
            if nm is None:
                continue
            n, m = nm
            layout, used = node_layout([("prefill", n, pu.tp, pu.pp), ("decode", m, du.tp, du.pp)],
                                       p.gpus_per_node)
            dep = placement_deployment(p, {"strategy": "disaggregated", "num_prefill": n,
                                  "num_decode": m, "prefill_tp": pu.tp, "prefill_pp": pu.pp,
                                  "decode_tp": du.tp, "decode_pp": du.pp,
                                  "prefill_token_target": p.lm}, p.gpus_per_node)
            cap = min(n * a.goodput_rps, m * b.goodput_rps)
            out.append(Placement(f"disaggregated {n}xP(TP{pu.tp} PP{pu.pp}) + "
                                 f"{m}xD(TP{du.tp} PP{du.pp})", "alg1", "disaggregated", dep,
                                 cap, n * pu.num_gpus + m * du.num_gpus, layout,
                                 estimate_rps=cap, fits=used <= p.nodes))
    return out


def replicas(p: Problem, r: UnitResult) -> list[tuple[int, float]]:
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


def pair_ceiling(p: Problem, a: UnitResult, b: UnitResult) -> float:
    """The highest per-GPU goodput an Alg. 1 pair of ``a`` (prefill) and ``b`` (decode) can
    have given what is known of them (exact for searched units, bounds for stopped ones)."""
    if p.rate is None:  # the best counts' goodput per GPU grows with each phase's goodput
        top = [r.goodput_rps if r.goodput_rps > 0 else
               (r.bound_rps or 0.0) if r.stopped else 0.0 for r in (a, b)]
        if min(top) <= 0:
            return 0.0
        nm = pair_instances(p, a.unit, b.unit, *top)
        if nm is None:
            return 0.0
        n, m = nm
        return min(n * top[0], m * top[1]) / (n * a.unit.num_gpus + m * b.unit.num_gpus)
    best = 0.0
    for n, cap_p in replicas(p, a):
        for m, cap_d in replicas(p, b):
            best = max(best, min(cap_p, cap_d) / (n * a.unit.num_gpus + m * b.unit.num_gpus))
    return best


def research_pairs(p: Problem, cache: UnitCache, results: list[UnitResult]
                    ) -> list[UnitResult]:
    """Make Alg. 1's best pair exact despite early stops. The incumbent stop ranks units per
    GPU, but a pair is replicated to the rate with ``⌈R/g⌉`` rounding, so a unit below its
    kind's best per GPU can still make the better pair (fewer GPUs after rounding). Every
    stopped unit that appears in a pair whose ceiling (:func:`pair_ceiling`) reaches the best
    searched pair is searched in full, until no such pair is left — then no stopped unit can
    beat the best pair, whatever order the units ran in."""
    while True:
        pre = [r for r in results if r.unit.kind == "prefill"]
        dec = [r for r in results if r.unit.kind == "decode"]
        exact = [pl.per_gpu_rps for pl in alg1_placements(p, pre, dec) if pl.fits]
        floor = max(exact, default=0.0)
        redo = {r.unit for a in pre for b in dec
                if (a.stopped or b.stopped) and pair_ceiling(p, a, b) >= floor
                for r in (a, b) if r.stopped}
        if not redo:
            return results
        for u in redo:
            cache.results.pop(u, None)
        fresh = {r.unit: r for r in cache.get(sorted(redo))}
        results = [fresh.get(r.unit, r) for r in results]



def whole_probe(q: Problem, dep: Mapping[str, Any], rate: float) -> AttainmentResult:
    """One probe of a whole deployment at ``rate`` (both SLOs per request), ``q``'s length."""
    with gc_paused():
        w = base_workload(q, probe_requests(q, rate))
        return run_probe(q, dep, w.retimed(rate).requests, rate, "both", q.early_probes)


def simulate_goodput(p: Problem, dep: Mapping[str, Any], hi: float) -> tuple[float, list[Any]]:
    """Goodput (both SLOs per request) of a whole deployment, by the rate search."""
    def at_rate(rate: float) -> AttainmentResult:
        return steady_probe(p, lambda q: whole_probe(q, dep, rate))

    g = search_goodput(at_rate, hi=hi, precision=p.precision * hi, max_probes=p.max_probes,
                       growth=1.6, num_gpus=ClusterConfig.from_dict(dep).num_gpus)
    return g.goodput_rps, [asdict(q) for q in g.probes]



def confirm_goodput(p: Problem, dep: Mapping[str, Any], goodput: float
                    ) -> tuple[float, dict[str, Any]]:
    """Steady-state rule 7 for a whole deployment: its planned ``goodput`` probed for
    ``p.confirm`` × the probe length, lowered if it does not hold (:func:`~pdserve.planner.
    units.confirm`)."""
    return confirm(p, lambda rate, rule: steady_probe(p, lambda q: whole_probe(q, dep, rate),
                                                      rule),
                   goodput, ClusterConfig.from_dict(dict(dep)).num_gpus)


def confirm_eval(args: tuple[Problem, Placement]) -> tuple[str, float, dict[str, Any]]:
    p, pl = args
    return (pl.name, *confirm_goodput(p, pl.deployment, pl.goodput_rps))


def pair_eval(args: tuple[Problem, Placement]) -> tuple[str, float]:
    p, pl = args
    return pl.name, simulate_goodput(p, pl.deployment, 0.9 * pl.estimate_rps)[0]


def _whole_eval(args: tuple[Problem, str, dict[str, Any], float]) -> dict[str, Any]:
    p, name, dep, hi = args
    goodput, probes = simulate_goodput(p, dep, hi)
    confirmed = None
    if p.confirm and goodput > 0:  # as a plan's leaders are (rule 7)
        goodput, confirmed = confirm_goodput(p, dep, goodput)
    gpus = ClusterConfig.from_dict(dep).num_gpus
    return {"name": name, "num_gpus": gpus, "goodput_rps": goodput,
            "per_gpu_rps": goodput / gpus, "probes": probes, "confirmed": confirmed}


def measure_whole(p: Problem, deployments: Sequence[tuple[str, Mapping[str, Any]]],
                  per_gpu_guess: float, workers: int = 1) -> list[dict[str, Any]]:
    """Goodput of each ``(name, deployment)`` simulated whole by :func:`simulate_goodput`: the
    problem's workload, seed, steady-state probes (pdserve.bench.steady), attainment target,
    precision and early probes, the first bracket at ``per_gpu_guess`` × its GPUs (so the
    bracket's relative width is the same for every deployment) — the same probes a plan's
    units get, and the goodput confirmed over ``p.confirm`` probe lengths as a plan's leaders'
    (:func:`confirm_goodput`), for comparing a plan's choice with hand-picked placements."""
    jobs = [(p, name, dict(dep), per_gpu_guess * ClusterConfig.from_dict(dict(dep)).num_gpus)
            for name, dep in deployments]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as ex:
            return list(ex.map(_whole_eval, jobs))
    return [_whole_eval(j) for j in jobs]

