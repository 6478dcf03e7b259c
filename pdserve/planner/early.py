"""Exact early decision of a planner probe (a simulation at one rate: does attainment meet the
target?).

A probe judges ``n`` requests, those after its warm-up in arrival order (the steady-state rule,
:mod:`pdserve.bench.steady`), and passes when
``ok / n >= target``, ``ok`` counting the judged requests that meet the SLO
(:func:`pdserve.planner.units.judged_oks`). Let ``max_miss`` be the largest ``m`` with
``(n - m) / n >= target`` (the same floating-point expression). Then:

* the probe **fails** as soon as more than ``max_miss`` judged requests are known to miss, or
  more than ``max_misses(N, target)`` of all its ``N`` requests (the rule's whole-run test:
  an empty start only flatters a server), and
* it **passes** as soon as ``n - max_miss`` judged requests are known to meet the SLO (the
  whole run then attains at least as much: its warm-up requests met an emptier server; the
  full run checks it anyway) — unless ``pass_early`` is off, as it is when a pass must be
  confident (:func:`pdserve.bench.steady.until_confident`: the batch means that give a pass
  its confidence need every judged request),

whatever the rest of the run does, so the simulation can stop there with the same verdict
(:meth:`pdserve.sim.simulator.Simulator.run`'s ``stop``). A request's fate is known

* when it has finished: its record is final (same ``ok`` and ``meets`` as the full run's
  record, :func:`pdserve.sim.target.to_records`);
* for the TTFT (``prefill`` and ``both`` probes), once ``now + d - arrival > TTFT SLO`` with no
  token yet: every later token is stamped at a virtual time ``>= now`` (events run in time
  order), so its TTFT will exceed the SLO. ``d`` is the front end's cost per request
  (``request_overhead_ms``), which the client sees on every token
  (:func:`pdserve.sim.target.to_records`).

The attainment a stopped probe reports is the bound it stopped on (an upper bound for a fail, a
lower bound for a pass), marked ``early`` in the probe's details; its ``confidence`` is that of
the attainment of the requests decided so far (:attr:`AttainmentWatch.confidence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdserve.bench.metrics import SLO, RequestRecord, meets
from pdserve.bench.steady import SteadyState, confidence
from pdserve.sim.simulator import SimRequest, Simulator


def max_misses(n: int, target: float) -> int:
    """The largest ``m`` in ``[0, n]`` with ``(n - m) / n >= target`` (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"a probe needs at least one request, got {n}")
    if not 0 < target <= 1:
        raise ValueError(f"attainment target must be in (0, 1], got {target!r}")
    m = 0
    while m < n and (n - m - 1) / n >= target:
        m += 1
    return m


class AttainmentWatch:
    """``stop`` callback for :meth:`Simulator.run` (module docstring). ``kind``: which SLO a
    request must meet, ``prefill`` (TTFT), ``decode`` (TPOT) or ``both``; ``pass_early``:
    whether it may stop on a pass (else only on a fail);
    ``request_overhead_s``: the front end's cost per request, added to every token's time as
    the client's record has it."""

    def __init__(self, sim: Simulator, requests: Sequence[SimRequest], slo: SLO, kind: str,
                 target: float, warmup: int = 0, request_overhead_s: float = 0.0,
                 pass_early: bool = True) -> None:
        if kind not in ("prefill", "decode", "both"):
            raise ValueError(f"kind must be prefill, decode or both, got {kind!r}")
        self.sim, self.slo, self.kind, self.target = sim, slo, kind, target
        self.pass_early = pass_early
        self.delay = request_overhead_s
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)  # = event order
        every = [requests[i] for i in order]
        self.order = every[SteadyState.first_judged(len(every), warmup):]  # the judged ones
        self.judged = {r.request_id for r in self.order}
        self.n = len(self.order)
        self.max_miss = max_misses(self.n, target)
        self.need_ok = self.n - self.max_miss
        self.undecided: dict[str, SimRequest] = {r.request_id: r for r in every}
        self.every = every
        self.all_max_miss = max_misses(len(every), target)
        self.all_misses = 0
        self.ttft_ptr = 0
        self.finished_seen = 0
        self.misses = 0
        self.oks = 0
        self.verdict: bool | None = None
        self.settled = False  # a call has said go on (what it saw is counted)
        self.at: float | None = None

    def __call__(self, now: float) -> bool:
        ctl = self.sim.controller
        hist = ctl.history
        assert hist is not None
        finished = len(hist) - len(ctl.requests)
        if self.settled and finished == self.finished_seen and (
                self.kind == "decode" or self.ttft_ptr == len(self.every)
                or (now + self.delay) - self.every[self.ttft_ptr].arrival <= self.slo.ttft):
            return False  # no request finished or passed its TTFT since a call said go on
        if finished > self.finished_seen:
            new, found = finished - self.finished_seen, []
            for rid in self.undecided:
                creq = hist.get(rid)
                if creq is None:  # not arrived yet, nor anything after it
                    break
                if creq.stage == "done":
                    found.append((rid, creq))
                    if len(found) == new:
                        break
            self.finished_seen = finished
            for rid, creq in found:
                del self.undecided[rid]
                ok = self._meets(rid, creq)
                self.all_misses += not ok
                if rid in self.judged:
                    self._count(ok)
        if self.kind != "decode":
            limit, d = self.slo.ttft, self.delay
            order, ptr = self.every, self.ttft_ptr
            while ptr < len(order) and (now + d) - order[ptr].arrival > limit:
                rid = order[ptr].request_id
                ptr += 1
                if rid in self.undecided:
                    tl = hist[rid].timeline
                    if not tl.token_times or (tl.token_times[0] + d) - tl.arrival > limit:
                        del self.undecided[rid]
                        self.all_misses += 1
                        if rid in self.judged:
                            self._count(False)
            self.ttft_ptr = ptr
        if self.misses > self.max_miss or self.all_misses > self.all_max_miss:
            self.verdict = False
        elif self.oks >= self.need_ok and self.pass_early:
            self.verdict = True
        else:
            self.settled = True
            return False
        self.at = now
        return True

    def _count(self, ok: bool) -> None:
        if ok:
            self.oks += 1
        else:
            self.misses += 1

    def _meets(self, rid: str, creq: Any) -> bool:
        err = self.sim._errors.get(rid)
        ok = err is None and creq.finish_reason in ("length", "stop")
        tl = creq.timeline
        if self.delay:  # the client's timeline (as pdserve.sim.target.to_records makes it)
            tl = replace(tl, token_times=[t + self.delay for t in tl.token_times],
                         finish=None if tl.finish is None else tl.finish + self.delay)
        rec = RequestRecord(rid, len(creq.prompt_token_ids), len(creq.output_token_ids),
                            tl, ok, err)
        t_ok, p_ok = meets(rec, self.slo)
        return t_ok if self.kind == "prefill" else p_ok if self.kind == "decode" else \
            t_ok and p_ok

    @property
    def confidence(self) -> float:
        """Of the stopped verdict, for the steady-state attainment: the attainment of the
        requests decided so far, over as many requests (judged ones; the whole run's when it
        failed on the whole run)."""
        d = self.oks + self.misses
        if self.verdict is False and self.misses <= self.max_miss:  # failed on the whole run
            d_all = len(self.every) - len(self.undecided)
            return confidence((d_all - self.all_misses) / max(d_all, 1), self.target,
                              max(d_all, 1))
        return confidence(self.oks / max(d, 1), self.target, max(d, 1))

    @property
    def attainment_bound(self) -> float:
        """After a stop: the upper bound (fail) or lower bound (pass) on the judged
        attainment (a fail on the whole run: on the whole run's)."""
        if self.verdict is False:
            return min((self.n - self.misses) / self.n,
                       (len(self.every) - self.all_misses) / len(self.every))
        return self.oks / self.n
