"""Algorithm 2's choice made exact despite early stops (``alg2_search``), checked against
node-group estimates worked out by hand. Stand-ins replace the unit cache and the whole-group
simulation, so the test runs no simulator.

One node of 4 GPUs (low affinity, PP 1, top 1). Units as an early-stopping search may leave
them: prefill TP2 searched, 4.0 req/s (2.0 per GPU, the prefill incumbent); prefill TP1 stopped
after failing at the tie rate 2.0; decode TP1 searched, 1.0; decode TP2 stopped after failing at
1.4. A node group ``n_p × P(TP a) + n_d × D(TP b)`` (``n_p·a + n_d·b ≤ 4``) is estimated at
``min(n_p·g_P, n_d·g_D)``, per GPU over ``n_p·a + n_d·b``:

* searched units only: 1×P2 + 1×D1 = min(4, 1) / 3 = 0.333; 1×P2 + 2×D1 = min(4, 2) / 4 = 0.5
  — the best, 0.5;
* with stopped P1 (g < 2.0): 1×P1 + 2×D1 ≤ min(2.0, 2) / 3 = 0.667 ≥ 0.5, so P1 must be searched;
* with stopped D2 (g < 1.4): 1×P1 + 1×D2 ≤ min(2.0, 1.4) / 3 = 0.467 and 1×P2 + 1×D2 ≤
  min(4, 1.4) / 4 = 0.35, both < 0.5: D2 can never be in the best group and is not searched.

P1 searched in full reaches 1.9 (0.95 per GPU, below the incumbent's 2.0): 1×P1 + 2×D1 =
min(1.9, 2) / 3 = 0.633 beats 0.5 — a 3-GPU group the incumbent TP2 prefill cannot make (on
4 GPUs it leaves room for two TP1 decodes only, and is 2× faster than they are). After that the
floor is 0.633 and D2's best ceiling, min(1.9, 1.4) / 3 = 0.467, stays below it.
"""

from __future__ import annotations

import pytest

from pdserve.planner.alg2 import NodeGroup, alg2_search, group_ceiling
from pdserve.planner.problem import Problem
from pdserve.planner.units import Unit, UnitResult

P = Problem(affinity="low", nodes=1, gpus_per_node=4, max_pp=1, top_k=1, rate=1.0)
PRE2 = UnitResult(Unit("prefill", 2), goodput_rps=4.0, per_gpu_rps=2.0)
PRE1 = UnitResult(Unit("prefill", 1), bound_rps=2.0, stopped="fails at 2.0")
DEC1 = UnitResult(Unit("decode", 1), goodput_rps=1.0, per_gpu_rps=1.0)
DEC2 = UnitResult(Unit("decode", 2), bound_rps=1.4, stopped="fails at 1.4")
TRUE = {Unit("prefill", 1): 1.9, Unit("decode", 2): 1.3}


class StandInCache:
    """The unit cache's ``results`` and ``get`` (a full search returns the unit's true
    goodput)."""

    def __init__(self, results: list[UnitResult]) -> None:
        self.results = {r.unit: r for r in results}
        self.asked: list[Unit] = []

    def get(self, units):
        self.asked += list(units)
        out = [UnitResult(u, goodput_rps=TRUE[u], per_gpu_rps=TRUE[u] / u.num_gpus)
               for u in units]
        self.results.update((r.unit, r) for r in out)
        return out


def _simulate_as_estimated(calls: list):
    def simulate(jobs):
        calls.extend(g for _, g, _ in jobs)
        return {g: est for _, g, est in jobs}
    return simulate


def test_group_ceiling_by_hand():
    units = {r.unit: r for r in (PRE2, PRE1, DEC1, DEC2)}
    assert group_ceiling(NodeGroup(1, 2, 1, 1, 2), units) == pytest.approx(0.5)
    assert group_ceiling(NodeGroup(1, 2, 1, 1, 1), units) == pytest.approx(1 / 3)
    assert group_ceiling(NodeGroup(1, 1, 1, 1, 2), units) == pytest.approx(2 / 3)
    assert group_ceiling(NodeGroup(1, 1, 1, 2, 1), units) == pytest.approx(1.4 / 3)
    assert group_ceiling(NodeGroup(1, 2, 1, 2, 1), units) == pytest.approx(0.35)
    pruned = {**units, DEC1.unit: UnitResult(DEC1.unit, pruned="dominated")}
    assert group_ceiling(NodeGroup(1, 2, 1, 1, 2), pruned) == 0.0


def test_alg2_researches_exactly_the_stopped_units_that_could_win():
    cache = StandInCache([PRE2, PRE1, DEC1, DEC2])
    sims: list = []
    results, ranked, est, _ = alg2_search(P, cache, [PRE2, PRE1, DEC1, DEC2], [1, 2],
                                          _simulate_as_estimated(sims))
    assert cache.asked == [PRE1.unit]  # D2 is never searched
    got = {r.unit: r for r in results}
    assert got[PRE1.unit].goodput_rps == 1.9 and got[DEC2.unit].stopped
    best = ranked[0]
    assert best == NodeGroup(1, 1, 1, 1, 2)  # 1 x P(TP1) + 2 x D(TP1), 3 GPUs
    assert est[best] / best.num_gpus == pytest.approx(1.9 / 3)
    # the old best was simulated first, then the new one; the ranking keeps both estimates
    assert sims == [NodeGroup(1, 2, 1, 1, 2), best]


def test_without_the_exact_step_the_stopped_unit_is_missed():
    """The search as it was (``exact=False``): the stopped prefill's groups have no estimate
    and the best group is the incumbent's, 0.5 per GPU instead of 0.633."""
    cache = StandInCache([PRE2, PRE1, DEC1, DEC2])
    _, ranked, est, _ = alg2_search(P, cache, [PRE2, PRE1, DEC1, DEC2], [1, 2],
                                    _simulate_as_estimated([]), exact=False)
    assert cache.asked == []
    assert ranked[0] == NodeGroup(1, 2, 1, 1, 2)
    assert est[ranked[0]] / 4 == pytest.approx(0.5)


def test_a_group_simulated_below_its_estimate_lowers_the_floor():
    """Top 1 simulated whole at 0.3 per GPU (below its 0.5 estimate): the plan would then rank
    the second group by its estimate, 1×P2 + 1×D1 = 0.333, so a stopped unit matters once its
    ceiling reaches 0.333 — D2 (1×P1 + 1×D2 ≤ 0.467 before P1 is searched, then
    min(1.9, 1.4) / 3 = 0.467) is searched too."""
    cache = StandInCache([PRE2, PRE1, DEC1, DEC2])

    def simulate(jobs):
        return {g: 0.3 * g.num_gpus if g == NodeGroup(1, 2, 1, 1, 2) else est
                for _, g, est in jobs}

    alg2_search(P, cache, [PRE2, PRE1, DEC1, DEC2], [1, 2], simulate)
    assert sorted(cache.asked) == [DEC2.unit, PRE1.unit]
