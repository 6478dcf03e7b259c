"""Algorithm 2 (DistServe §4.2, low node affinity): prefill and decode instances share the
inter-op degree ``pp``; each of ``pp`` nodes holds one stage segment of ``n_p`` prefill and
``n_d`` decode instances (``n_p·tp_p + n_d·tp_d ≤ GPUs per node``), so KV moves per layer
segment over the intra-node link only. A *node-group unit* (``pp`` nodes) is estimated from
phase units priced with the intra-node link, the best few are simulated whole, the best is
replicated."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.planner.placements import Placement, placement_deployment, simulate_goodput
from pdserve.planner.problem import Problem, available_pps, model_config
from pdserve.planner.units import Unit, UnitResult


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
    model = model_config(p.model)
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


def group_ceiling(g: NodeGroup, units: Mapping[Unit, UnitResult]) -> float:
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
    rank). Every stopped unit in a group whose ceiling (:func:`group_ceiling`) reaches the
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
                    (c := group_ceiling(g, by_unit)) > 0 and c >= floor - 1e-12:
                redo |= {r.unit for r in pair if r.stopped}
        if not redo:
            return results, ranked, est, sims
        for u in redo:
            cache.results.pop(u, None)
        fresh = {r.unit: r for r in cache.get(sorted(redo))}
        results = [fresh.get(r.unit, r) for r in results]


def alg2_placement(p: Problem, g: NodeGroup, goodput: float, simulated: bool,
                   estimate: float) -> Placement:
    if p.rate is None:  # no rate: as many node groups as the cluster holds
        k = p.nodes // g.pp if goodput > 0 else 0
    else:
        k = math.ceil(p.rate / goodput - 1e-9) if goodput > 0 else 0
    roles = {"strategy": "disaggregated", "num_prefill": k * g.n_p, "num_decode": k * g.n_d,
             "prefill_tp": g.tp_p, "prefill_pp": g.pp, "decode_tp": g.tp_d, "decode_pp": g.pp,
             "prefill_token_target": p.lm}
    # one node group: every KV transfer stays on the intra-node link (per stage segment), so
    # the spec has no cross-node hop to price (gpus_per_node unset); the layout says where
    dep = placement_deployment(p, roles, None)
    seg = (f"{g.n_p} prefill segment(s) TP{g.tp_p} + {g.n_d} decode segment(s) TP{g.tp_d}")
    layout = [f"group {j} nodes {j * g.pp}..{(j + 1) * g.pp - 1}: each node holds stage s "
              f"of the group's instances: {seg}" for j in range(k)]
    return Placement(f"disaggregated (Alg. 2) {k}x[{g.pp} node(s): {g.n_p}xP(TP{g.tp_p}) + "
                     f"{g.n_d}xD(TP{g.tp_d}) per stage, PP{g.pp}]", "alg2", "disaggregated",
                     dep, k * goodput, k * g.num_gpus, layout, simulated=simulated,
                     estimate_rps=k * estimate, fits=k * g.pp <= p.nodes)



def group_eval(args: tuple[Problem, NodeGroup, float]) -> tuple[NodeGroup, float]:
    p, g, est = args
    roles = {"strategy": "disaggregated", "num_prefill": g.n_p, "num_decode": g.n_d,
             "prefill_tp": g.tp_p, "prefill_pp": g.pp, "decode_tp": g.tp_d, "decode_pp": g.pp,
             "prefill_token_target": p.lm}
    return g, simulate_goodput(p, placement_deployment(p, roles, None), 0.9 * est)[0]

