"""Running workloads against targets: one rate, a goodput search, or a grid of rates.

The CLI (:mod:`.cli`) is a thin layer over these functions; scripts can call them directly::

    target = HttpTarget("http://localhost:8000", num_gpus=2)
    s = Settings(workload="chatbot", num_requests=300, slo=SLO(0.25, 0.1))
    run = find_goodput(target, s, hi=4.0, precision=0.1)
    print(run.result.goodput_rps, run.result.per_gpu_goodput_rps)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pdserve.bench.goodput import (
    AttainmentResult,
    GoodputResult,
    Probe,
    ScaleSweep,
    confirm_goodput,
    search_goodput,
    slo_scale_sweep,
)
from pdserve.bench.metrics import SLO, RequestRecord, Summary, attainment, meets, summarize
from pdserve.bench.steady import DEFAULT as DEFAULT_STEADY
from pdserve.bench.steady import SteadyState, confidence, until_confident
from pdserve.bench.targets import Target
from pdserve.bench.workloads import Workload, make_workload

DEFAULT_SCALES = tuple(float(s) for s in np.round(np.arange(0.2, 3.01, 0.2), 2))


@dataclass
class Settings:
    """Workload and SLO settings shared by every run of a command."""

    workload: str = "chatbot"
    num_requests: int = 200
    seed: int = 0
    arrival: str | None = None
    cv: float | None = None
    vocab_size: int | None = None  # None: the target's, else DEFAULT_VOCAB_SIZE
    max_model_len: int | None = None
    length_scale: float | str = 1.0
    prompt_mode: str = "auto"
    tokenizer: Callable[[str], list[int]] | None = None
    traces_dir: str | None = None
    slo: SLO | None = None
    target: float = 0.9
    criterion: str = "both"
    scales: Sequence[float] = DEFAULT_SCALES
    horizon: float = DEFAULT_STEADY.horizon  # a goodput probe's length in lifetimes

    def steady(self) -> SteadyState:
        """The steady-state rule of a goodput probe (:mod:`pdserve.bench.steady`):
        ``num_requests`` judged at least."""
        return SteadyState(self.horizon, self.num_requests)


@dataclass
class Run:
    """One run at one rate."""

    rate: float | None
    records: list[RequestRecord]
    summary: Summary
    sweep: ScaleSweep | None = None
    judged: int | None = None  # a goodput probe: the summary is of its judged requests


    def to_dict(self, with_records: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"rate": self.rate, "summary": self.summary.to_dict(),
                             "summary_of": ("all requests" if self.judged is None else
                                            f"the {self.judged} judged requests "
                                            "(steady-state rule)"),
                             "slo_scale_sweep": self.sweep.to_dict() if self.sweep else None}
        if with_records:
            d["records"] = [r.to_dict() for r in self.records]
        return d


@dataclass
class SearchRun:
    """A goodput search (or rate grid) on one target; ``best`` is the run at the goodput."""

    result: GoodputResult
    best: Run | None
    runs: list[Run] = field(default_factory=list)
    confirmed: dict[str, Any] | None = None  # rule 7 (find_goodput's ``confirm``)


def prepare(target: Target) -> None:
    """Let the target look itself up (an HTTP target asks for its model and context)."""
    prep = getattr(target, "prepare", None)
    if prep is not None:
        asyncio.run(prep())


DEFAULT_VOCAB_SIZE = 32000


def vocab_size_for(target: Target, s: Settings) -> int:
    """Synthetic token ids are drawn below this: ``--vocab-size``, else what the target
    reports (pdserve's ``/v1/models``, the simulated model), else 32000."""
    return s.vocab_size or getattr(target, "vocab_size", None) or DEFAULT_VOCAB_SIZE


def build_workload(target: Target, s: Settings, rate: float | None) -> Workload:
    """The settings' workload at ``rate``, scaled to ``s.max_model_len`` or else to the
    target's reported context length, with token ids inside the target's vocabulary."""
    max_len = s.max_model_len or getattr(target, "max_model_len", None)
    return make_workload(s.workload, s.num_requests, seed=s.seed, rate=rate, arrival=s.arrival,
                         cv=s.cv, vocab_size=vocab_size_for(target, s), max_model_len=max_len,
                         length_scale=s.length_scale, prompt_mode=s.prompt_mode,
                         tokenizer=s.tokenizer, traces_dir=s.traces_dir)


def resolve_slo(s: Settings, w: Workload, ttft: float | None, tpot: float | None) -> SLO | None:
    """Explicit SLO values, completed from the workload's default SLO."""
    d = w.default_slo
    if ttft is None and tpot is None:
        return d
    if (ttft is None or tpot is None) and d is None:
        raise ValueError(f"workload {w.name!r} has no default SLO: give both --slo-ttft and "
                         "--slo-tpot")
    return SLO(ttft if ttft is not None else d.ttft,  # type: ignore[union-attr]
               tpot if tpot is not None else d.tpot)  # type: ignore[union-attr]


def run_workload(target: Target, w: Workload, s: Settings) -> Run:
    records = asyncio.run(target.run(list(w.requests)))
    if len(records) != len(w.requests):
        raise RuntimeError(f"target {target.name} returned {len(records)} records for "
                           f"{len(w.requests)} requests")
    summary = summarize(records, s.slo, s.target, target.num_gpus)
    summary.num_gpus_note = getattr(target, "num_gpus_note", None)
    sweep = None
    if s.slo is not None:
        slo = s.slo
        sweep = slo_scale_sweep(lambda k: attainment(records, slo.scaled(k), s.criterion),
                                list(s.scales), s.target)
    return Run(w.rate, records, summary, sweep)


def _details(run: Run) -> dict[str, Any]:
    sm = run.summary
    return {"num_failed": sm.num_failed, "offered_rate_rps": sm.offered_rate_rps,
            "p90_ttft_s": sm.ttft.p90, "p90_tpot_s": sm.tpot.p90,
            "ttft_attainment": sm.ttft_attainment, "tpot_attainment": sm.tpot_attainment,
            "attainment_distserve": sm.attainment_distserve}


def _prober(target: Target, base: Workload, s: Settings, runs: list[Run]
            ) -> Callable[..., AttainmentResult]:
    """Runs one probe per rate by the steady-state rule (:mod:`pdserve.bench.steady`): as many
    requests as the rule asks at that rate (``base`` when it has that many, else the same
    workload and seed with more), the attainment and the verdict's confidence from the
    requests after the warm-up in arrival order; a pass confident or the probe extended
    (:func:`~pdserve.bench.steady.until_confident`). ``rule``: another rule than
    ``s.steady()`` (a confirmation's, rule 7)."""
    if s.slo is None:
        raise ValueError("a goodput search needs an SLO (--slo-ttft and --slo-tpot)")
    slo = s.slo
    life = SteadyState.lifetime(slo, sum(r.output_len for r in base.requests) / max(len(base), 1))
    workloads = {len(base.requests): base}

    def run_at(rate: float, rule: SteadyState) -> AttainmentResult:
        n = rule.num_requests(rate, life)
        if n not in workloads:
            workloads[n] = build_workload(target, replace(s, num_requests=n), rate)
        run = run_workload(target, workloads[n].retimed(rate), s)
        runs.append(run)
        recs = sorted(run.records, key=lambda r: r.timeline.arrival or 0.0)
        judged = recs[rule.first_judged(len(recs), rule.warmup(rate, life)):]
        run.summary = summarize(judged, slo, s.target, target.num_gpus)  # the steady window
        run.summary.num_gpus_note = getattr(target, "num_gpus_note", None)
        run.judged = len(judged)
        if s.criterion == "both":
            every = [all(meets(r, slo)) for r in recs]
            v = rule.verdict(every[len(recs) - len(judged):], s.target,
                             sum(every) / max(len(every), 1))
            a, conf = v.attainment, v.confidence
        else:  # DistServe's variant: P90 TTFT and P90 TPOT checked separately
            a = float(run.summary.attainment_distserve or 0.0)
            conf = confidence(a, s.target, len(judged))
        return AttainmentResult(rate, a, a >= s.target,
                                {**_details(run), "num_requests": len(recs),
                                 "judged": len(judged), "confidence": conf})

    def run_at_rate(rate: float, rule: SteadyState | None = None
                    ) -> AttainmentResult:  # a pass confident or extended
        return until_confident(rule or s.steady(), lambda r: run_at(rate, r))

    return run_at_rate


def _best(runs: list[Run], goodput: float) -> Run | None:
    """The run the goodput was judged on (an extended probe's last)."""
    return next((r for r in reversed(runs) if r.rate == goodput and goodput > 0), None)


def find_goodput(target: Target, s: Settings, hi: float, lo: float | None = None,
                 precision: float = 0.1, max_probes: int = 16,
                 on_probe: Callable[[Probe], None] | None = None,
                 base: Workload | None = None, confirm: int = 0) -> SearchRun:
    """Expanding bisection on the rate (:func:`~pdserve.bench.goodput.search_goodput`); every
    probe replays the same requests (same seed) at a new rate. ``confirm`` > 0: the goodput
    found is confirmed over that many probe lengths, and lowered if it does not hold
    (steady-state rule 7, :func:`~pdserve.bench.goodput.confirm_goodput`; ``SearchRun.
    confirmed``); ``best`` is then the confirmation's run."""
    base = base or build_workload(target, s, hi)
    runs: list[Run] = []
    prober = _prober(target, base, s, runs)
    result = search_goodput(prober, lo=lo, hi=hi, precision=precision,
                            max_probes=max_probes, num_gpus=target.num_gpus, on_probe=on_probe)
    return _confirmed(SearchRun(result, None, runs), prober, s, target, confirm, precision,
                      max_probes, on_probe)


def _confirmed(sr: SearchRun, prober: Callable[..., AttainmentResult], s: Settings,
               target: Target, confirm: int, precision: float, max_probes: int,
               on_probe: Callable[[Probe], None] | None) -> SearchRun:
    """``sr`` with its goodput confirmed over ``confirm`` probe lengths (rule 7; 0: as is) and
    its ``best`` run set."""
    if confirm and sr.result.goodput_rps > 0:
        long = s.steady().confirming(confirm)
        g, info = confirm_goodput(lambda rate: prober(rate, long), sr.result.goodput_rps,
                                  precision, max_probes, num_gpus=target.num_gpus,
                                  on_probe=on_probe)
        sr.confirmed = {"factor": confirm, **info}
        if not info["held"]:  # the bracket is the confirmation's: [g, its lowest fail]
            fails = [r for r, _, ok in info["probes"] if not ok and r > g]
            sr.result = replace(sr.result, lo=g, hi=min(fails, default=None))
        sr.result = replace(sr.result, goodput_rps=g, per_gpu_goodput_rps=g / target.num_gpus)
    sr.best = _best(sr.runs, sr.result.goodput_rps)
    return sr


def rate_grid(target: Target, s: Settings, rates: Sequence[float],
              on_probe: Callable[[Probe], None] | None = None,
              base: Workload | None = None, confirm: int = 0,
              precision: float = 0.1, max_probes: int = 16) -> SearchRun:
    """Attainment at each rate; goodput = the highest rate below the first failing one,
    confirmed as :func:`find_goodput` confirms it (``confirm``, ``precision``,
    ``max_probes``)."""
    rates = sorted(set(rates))
    base = base or build_workload(target, s, rates[0])
    runs: list[Run] = []
    prober = _prober(target, base, s, runs)
    probes, goodput, fail = [], 0.0, None
    for i, rate in enumerate(rates):
        r = prober(rate)
        p = Probe(i, rate, r.attainment, r.passed, "grid", r.details)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        if r.passed and fail is None:
            goodput = rate
        elif not r.passed and fail is None:
            fail = rate
    g = target.num_gpus
    result = GoodputResult(goodput, g, goodput / g, goodput, fail, 0.0, fail is not None,
                           probes, "" if fail is not None else "every grid rate passed")
    return _confirmed(SearchRun(result, None, runs), prober, s, target, confirm, precision,
                      max_probes, on_probe)
