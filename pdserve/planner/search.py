"""Placement search (DistServe §4.1 Algorithm 1, §4.2 Algorithm 2) and the colocated baseline:
:func:`plan` and the :class:`Plan` it returns.

A *placement* is the parallelism (TP, PP) of each phase, how many instances of each and how they
sit on nodes (§4). Every candidate is a :class:`~pdserve.config.ClusterConfig` built with
``ClusterConfig.from_dict`` and simulated through :mod:`pdserve.sim.target` — the very spec
``pdserve serve`` / ``pdserve simulate --config`` run — and its goodput comes from the
benchmark toolkit's rate search (:func:`pdserve.bench.goodput.search_goodput`).

The pieces, one idea per module: :mod:`.problem` (what is asked), :mod:`.units` (phase units
simulated alone, pruning, the unit cache), :mod:`.placements` (replicas of a unit, Algorithm 1's
pairs, whole-deployment simulation), :mod:`.alg2` (Algorithm 2's node groups). Here: which
units to search (:func:`candidate_units`), and the plan — every strategy's placements ranked by
per-GPU goodput, the best of each simulated whole (``--joint``). Colocated and partial units are
always searched, so that every plan says which strategy wins and by how much.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.config import ClusterConfig
from pdserve.planner import units
from pdserve.planner.alg2 import NodeGroup, alg2_placement, alg2_search, group_eval, node_groups
from pdserve.planner.placements import (
    Placement,
    alg1_placements,
    confirm_eval,
    pair_eval,
    replica_placements,
    research_pairs,
)
from pdserve.planner.problem import STRATEGIES, Problem, available_tps, base_workload, model_config
from pdserve.planner.units import (
    Unit,
    UnitCache,
    UnitResult,
    candidate_units,
    unpaired_units,
)


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
    strategies: tuple[str, ...] = STRATEGIES  # the strategies searched

    def best_of(self, strategy: str) -> Placement | None:
        """The best fitting placement of ``strategy`` (None: none searched or none fits)."""
        return {"colocated": self.best_colocated, "disaggregated": self.best_disaggregated,
                "partial": self.best_partial}[strategy]

    def why_none(self, strategy: str) -> str:
        """Why ``strategy`` has no fitting placement, from its units' results."""
        kinds = {"colocated": ("colocated",), "disaggregated": ("prefill", "decode"),
                 "partial": ("partial",)}[strategy]
        rs = [r for r in self.units if r.unit.kind in kinds]
        if not rs:
            return "not searched"
        if all(r.pruned for r in rs):
            reasons = list(dict.fromkeys(r.pruned.split(":")[0] for r in rs if r.pruned))
            return f"every unit pruned ({', '.join(reasons)}; see the unit table)"
        for kind in kinds:
            if not any(r.goodput_rps > 0 for r in rs if r.unit.kind == kind):
                return (f"no {kind} unit reaches a goodput (each misses the SLO at every rate "
                        "probed, or was pruned)")
        if self.problem.rate is None:
            return f"no placement of it fits the cluster's {self.problem.num_gpus} GPUs"
        return (f"its placements need more GPUs than the cluster's {self.problem.num_gpus} "
                f"at {self.problem.rate:g} req/s")

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


def serves(p: Problem, pl: Placement) -> bool:
    """Whether ``pl``'s goodput (simulated whole where it was, else estimated from units)
    reaches the rate to serve (always, without a rate)."""
    return p.rate is None or pl.goodput_rps >= p.rate * (1 - 1e-9)


def _primary(p: Problem, pl: Placement) -> tuple[Any, ...]:
    """The objective, lower is better: the most goodput per GPU, or (``min_gpus``) the
    fewest GPUs; with a rate, among the placements that serve it first (a placement whose
    whole simulation falls short of the rate never beats one that serves it)."""
    if p.min_gpus:
        return (not serves(p, pl), pl.num_gpus)
    return (not serves(p, pl), -round(pl.per_gpu_rps, 9))


def _rank(p: Problem, pls: Iterable[Placement], simulated_first: bool = False,
          confirmed_first: bool = False) -> list[Placement]:
    return sorted(pls, key=lambda x: (not x.fits, confirmed_first and x.confirmed is None,
                                      simulated_first and not x.simulated,
                                      *_primary(p, x), -round(x.per_gpu_rps, 9), x.num_gpus,
                                      x.name))


CONFIRM_ROUNDS = 3  # placements confirmed per strategy, at most (_confirm_leaders)


def _confirm_leaders(p: Problem, cache: UnitCache, pls: Sequence[Placement],
                     say: Callable[[str], None] = lambda _: None) -> None:
    """Steady-state rule 7: the leading fitting placement of each strategy (ranked as the
    plan ranks) is probed whole for ``p.confirm`` × the probe length at its goodput
    (:func:`~pdserve.planner.placements.confirm_goodput`) and keeps the goodput that holds
    there. A leader whose goodput falls can lose its lead; the new leader is confirmed in the
    next round, up to :data:`CONFIRM_ROUNDS` per strategy. Strategies are confirmed side by
    side on the pool. ``say``: a line before each round and one per placement confirmed."""
    fitting = [pl for pl in pls if pl.fits]
    rounds: dict[str, int] = {}
    while True:
        leaders: dict[str, Placement] = {}
        for pl in _rank(p, fitting, simulated_first=p.joint):
            leaders.setdefault(pl.strategy, pl)
        todo = [pl for s, pl in leaders.items()
                if pl.confirmed is None and rounds.get(s, 0) < CONFIRM_ROUNDS]
        if not todo:
            return
        say(f"confirming over {p.confirm} x the probe length: "
            + ", ".join(f"{pl.name} at {pl.goodput_rps:.3f} req/s" for pl in todo))
        for pl, (_, goodput, info) in zip(todo, _map(cache, confirm_eval,
                                                       [(p, pl) for pl in todo])):
            rounds[pl.strategy] = rounds.get(pl.strategy, 0) + 1
            was = pl.goodput_rps
            pl.goodput_rps, pl.confirmed, pl.simulated = goodput, info, True
            seen = (f"stopped once certain: at most {info['attainment']:.1%} of "
                    f"{info['judged']} judged" if info.get("early") == "fail" else
                    f"{info['attainment']:.1%} of {info['judged']} judged, confidence "
                    f"{info['confidence']:.2f}")
            lowest = min(r for r, _, _ in info["probes"])
            held = (f"holds over {p.confirm} x the probe length ({seen})" if info["held"] else
                    f"failed over {p.confirm} x the probe length at {was:.3f} req/s ({seen}): "
                    + (f"confirmed at {goodput:.3f} req/s" if goodput > 0 else
                       f"no rate held down to {lowest:.3f} req/s: dropped"))
            pl.note = f"{pl.note}; {held}" if pl.note else held
            say(f"{pl.name}: {held}")


def _simulate_whole(p: Problem, cache: UnitCache, pls: Sequence[Placement],
                    say: Callable[[str], None] = lambda _: None) -> None:
    """``--joint``: simulate ``pls`` whole at their replica counts (first bracket 0.9 × the
    estimate from units) and keep the simulated goodput. A unit alone and ``n`` replicas of
    it behind a router are not the same server: on EcoServe's L20 testbed 8 colocated TP4
    chunked instances of OPT-30B reach 0.24–0.25 req/s per GPU whole against 0.20–0.21 for
    one alone, with probes of 6–20 request lifetimes (the 2026-11-23 runs in
    `git show 9de3c0b:docs/benchmarks.md`), while a
    disaggregated pair there falls short of its estimate."""
    pls = [pl for pl in pls if pl.fits]  # one that does not fit the cluster is never chosen
    one = {id(pl) for pl in pls if _one_unit(pl)}
    if len(one) < len(pls):
        say("simulating whole: " + ", ".join(pl.name for pl in pls if id(pl) not in one))
    done = dict(_map(cache, pair_eval, [(p, pl) for pl in pls if id(pl) not in one]))
    for pl in pls:
        gpus = ClusterConfig.from_dict(pl.deployment).num_gpus
        pl.simulated = True
        if id(pl) in one:  # the whole deployment is the unit its goodput was simulated on
            pl.note = f"one unit: simulated whole as the unit ({gpus} GPUs)"
            continue
        pl.goodput_rps = done[pl.name]
        pl.note = (f"simulated whole ({gpus} GPUs); estimate from units "
                   f"{pl.estimate_rps:.3f} req/s")


def _simulate_best(p: Problem, cache: UnitCache, ranked: Sequence[Sequence[Placement]],
                   say: Callable[[str], None] = lambda _: None) -> None:
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
        _simulate_whole(p, cache, [pl for b in batch for pl in b], say)
        for i, q in enumerate(queues):
            upto[i] += len(batch[i])
            if p.min_gpus:  # the next ones on fewer GPUs than the fewest serving whole
                best: Any = min((_primary(p, pl) for pl in q[:upto[i]]), default=(True, 0))
                ahead: Any = lambda pl, b=best: _primary(p, pl) < b  # noqa: E731
            else:
                top = max((pl.per_gpu_rps for pl in q[:upto[i]]), default=0.0)
                ahead = lambda pl, b=top: pl.per_gpu_rps > b  # noqa: E731
            batch[i] = list(itertools.takewhile(ahead, q[upto[i]:upto[i] + p.top_k]))


def _one_unit(pl: Placement) -> bool:
    """Whether ``pl`` is a single colocated instance or a single PaDG macro instance: the
    deployment its unit was simulated as (no KV moves, no router choice between replicas),
    so the unit's rate search already is its whole simulation."""
    d = pl.deployment
    if pl.strategy == "colocated":
        return d["num_instances"] == 1
    return pl.strategy == "partial" and d["num_instances"] == d["macro_instance_size"]


CEILING_SLACK = 1.5  # capacity bounds are approximate (UnitCache.get_bounded uses 1.3)


def rate_ceiling(p: Problem, cands: Sequence[Unit]) -> tuple[float, str]:
    """An upper bound of the rate any placement of ``units`` on ``p``'s cluster serves: their
    capacity bounds (:func:`~pdserve.planner.units.unit_model`, no simulation) filling the
    cluster (:func:`cluster_rate`). Returns the bound and the placement giving it."""

    caps = {}
    for u in cands:
        try:
            caps[u] = units.unit_model(p, u).capacity_rps
        except ValueError:  # does not fit
            continue
    return cluster_rate(p, caps)


def cluster_rate(p: Problem, rates: Mapping[Unit, float]) -> tuple[float, str]:
    """The most ``p``'s cluster serves with units of the given ``rates`` (req/s each):
    colocated and partial units replicated onto every GPU; prefill and decode units in the
    best split of the GPUs between the two. Returns the rate and the placement giving it."""
    best, how = 0.0, "no unit fits"  # (a unit at 0 req/s adds nothing: best starts at 0)
    g = p.num_gpus
    for u, c in rates.items():
        k = g // u.num_gpus
        if u.kind in ("colocated", "partial") and k and k * c > best:
            best, how = k * c, f"{k} x {u.label}"
    pre = [(u, c) for u, c in rates.items() if u.kind == "prefill"]
    dec = [(u, c) for u, c in rates.items() if u.kind == "decode"]
    for a, ca in pre:
        for b, cb in dec:
            for n in range(1, g // a.num_gpus + 1):
                m = (g - n * a.num_gpus) // b.num_gpus
                if m and min(n * ca, m * cb) > best:
                    best, how = min(n * ca, m * cb), f"{n} x {a.label} + {m} x {b.label}"
    return best, how


def plan(p: Problem, workers: int | None = None,
         on_unit: Callable[[UnitResult], None] | None = None,
         strategies: Sequence[str] = STRATEGIES, prune: bool = True,
         early_stop: bool = True, on_stage: Callable[[str], None] | None = None) -> Plan:
    """Search the placements for ``p`` (module docstring) and rank them by per-GPU goodput.
    ``prune``: skip units whose capacity bound is dominated and stop rate searches that cannot
    beat the best unit of their kind (:meth:`UnitCache.get_bounded`); ``prune=False`` searches
    every unit to convergence (full per-phase rankings); ``early_stop=False`` keeps the
    dominance pruning only (the search before early stops existed). ``on_unit`` hears of each
    unit's result, ``on_stage`` of the whole-placement simulations and confirmations (a
    line each, for progress)."""
    t0 = time.perf_counter()
    say = on_stage or (lambda _: None)
    notes: list[str] = []
    if p.min_gpus and prune:  # a unit dominated per GPU can still give the fewest GPUs
        prune = False
        notes.append("--min-gpus: every unit searched in full (the pruning and early stops "
                     "compare goodput per GPU, which does not bound a GPU count)")
    workers = workers or min(2, os.cpu_count() or 1)
    tps = available_tps(p, model_config(p.model))
    base_workload(p)  # a bad workload fails here, before any pool starts
    units = candidate_units(p, strategies)
    ceiling, how = rate_ceiling(p, units)
    # (none fits: said below, per unit)
    if p.rate is not None and ceiling > 0 and p.rate > CEILING_SLACK * ceiling:
        raise ValueError(f"{p.rate:g} req/s is beyond what {p.nodes}x{p.gpus_per_node} GPUs can "
                         f"serve of {p.model} on this workload: at most ~{ceiling:.3g} req/s "
                         f"by the units' capacity bounds ({how}); nothing was simulated")
    alg2 = "disaggregated" in strategies and p.affinity == "low"
    alg1 = "disaggregated" in strategies and p.affinity == "high"
    with UnitCache(p, workers, on_unit) as cache:
        if prune:
            for r in unpaired_units(p, units):
                cache._store(r)
        results = cache.get_bounded(units, early_stop=early_stop) if prune else cache.get(units)
        by_unit = {r.unit: r for r in results}
        placements: list[Placement] = []
        colo = _rank(p, replica_placements(p, [r for r in results
                                                 if r.unit.kind == "colocated"]))
        part = _rank(p, replica_placements(p, [r for r in results
                                                 if r.unit.kind == "partial"]))
        if p.joint:
            _simulate_best(p, cache, [colo, part], say)
        placements += colo + part
        if alg1:
            if prune and early_stop:
                results = research_pairs(p, cache, results)
                by_unit = {r.unit: r for r in results}
            pre = [r for r in results if r.unit.kind == "prefill"]
            dec = [r for r in results if r.unit.kind == "decode"]
            pairs = _rank(p, alg1_placements(p, pre, dec))
            if p.joint:
                _simulate_best(p, cache, [pairs], say)
            placements += pairs
        if alg2:
            def simulate(jobs: list[tuple[Problem, NodeGroup, float]]) -> dict[NodeGroup, float]:
                return dict(_map(cache, group_eval, jobs))

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
        if p.confirm:
            _confirm_leaders(p, cache, placements, say)
            notes += [f"{pl.name}: {pl.note.rsplit('; ', 1)[-1]}" for pl in placements
                      if pl.confirmed is not None and not pl.confirmed["held"]]
            placements = [pl for pl in placements if pl.goodput_rps > 0]  # none held
    ranked_all = _rank(p, placements, simulated_first=p.joint, confirmed_first=p.confirm > 0)
    if not ranked_all:
        pruned = "; ".join(f"{r.unit.label}: {r.pruned}" for r in results if r.pruned)[:600]
        raise ValueError(f"no placement of {p.model} meets TTFT {p.slo.ttft:g} s / TPOT "
                         f"{p.slo.tpot:g} s for {p.target:.0%} of requests on "
                         f"{p.nodes}x{p.gpus_per_node} GPUs ({pruned or 'every goodput is 0'})")
    fitting = [x for x in ranked_all if x.fits]
    if not fitting:
        fewest = min(ranked_all, key=lambda x: (x.num_gpus, -x.per_gpu_rps, x.name))
        what = "hold any placement" if p.rate is None else f"serve {p.rate:g} req/s"
        most = ""
        if p.rate is not None:  # what it does serve, from the units' searched goodputs
            rate, how = cluster_rate(p, {r.unit: r.goodput_rps for r in results})
            if rate > 0:
                most = (f"; by its units' simulated goodputs it serves about {rate:.3g} req/s "
                        f"({how}): plan without --rate to rank the placements that fill it")
        raise ValueError(f"the cluster ({p.nodes} node(s) x {p.gpus_per_node} GPUs) is too small "
                         f"to {what} of {p.model}: the placement needing the "
                         f"fewest GPUs, {fewest.name}, needs {fewest.num_gpus}{most}")
    best = fitting[0]
    if not serves(p, best):
        notes.append(f"no placement's goodput reaches {p.rate:g} req/s when simulated whole: "
                     f"the chosen one, {best.name}, serves {best.goodput_rps:.3f}")
    colo = next((x for x in fitting if x.strategy == "colocated"), None)
    dis = next((x for x in fitting if x.strategy == "disaggregated"), None)
    part = next((x for x in fitting if x.strategy == "partial"), None)
    return Plan(p, best, fitting[1:], colo, dis, sorted(results, key=lambda r: r.unit),
                time.perf_counter() - t0, notes, part, tuple(strategies))


def _map(cache: UnitCache, fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    if cache._pool is not None:  # (one job too: see UnitCache.get)
        return list(cache._pool.map(fn, jobs))
    return [fn(j) for j in jobs]


def deployment_file(plan_: Plan, placement: Placement | None = None) -> dict[str, Any]:
    """The deployment spec of ``placement`` (default: the best) — ``ClusterConfig.to_dict()``
    plus the ``simulation:`` section — which ``pdserve serve --config`` and
    ``pdserve simulate --config`` run as is."""
    pl = placement or plan_.best
    p = plan_.problem
    d = ClusterConfig.from_dict(pl.deployment).to_dict()
    d["simulation"] = p.simulation()
    return d

