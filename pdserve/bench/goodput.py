"""Goodput search and SLO-scale sweep (DESIGN.md "Goodput definitions"; DistServe §6.2).

Both are pure functions of a callable that measures attainment, so they are tested with
synthetic attainment curves and driven by real runs in the CLI.

``search_goodput`` — expanding bisection on the arrival rate:

1. probe ``hi``; while it passes, raise ``lo`` to it and multiply ``hi`` by ``growth``;
2. if the first ``hi`` fails, probe ``lo`` (default ``hi / growth``) and, while it fails, move
   ``hi`` down to it and divide ``lo`` by ``growth`` (down to ``min_rate``: goodput 0);
3. bisect the bracket [highest pass, lowest fail] until it is narrower than ``precision``.

The goodput is the highest rate that passed. Every probe is kept (and reported through
``on_probe``); a rate is never probed twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AttainmentResult:
    """One measurement: attainment at ``rate`` (or SLO scale) and whether it meets the target."""

    rate: float
    attainment: float
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Probe:
    index: int
    rate: float
    attainment: float
    passed: bool
    phase: str  # "expand" | "shrink" | "bisect"
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class GoodputResult:
    goodput_rps: float
    num_gpus: int
    per_gpu_goodput_rps: float
    lo: float  # highest passing rate probed (0 if none)
    hi: float | None  # lowest failing rate probed (None if none failed)
    precision: float
    converged: bool
    probes: list[Probe]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive(name: str, v: float) -> float:
    if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a positive number, got {v!r}")
    return float(v)


def search_goodput(
    run_at_rate: Callable[[float], AttainmentResult],
    lo: float | None = None,
    hi: float = 1.0,
    precision: float = 0.05,
    max_probes: int = 20,
    *,
    growth: float = 2.0,
    min_rate: float | None = None,
    max_rate: float = 1e6,
    num_gpus: int = 1,
    on_probe: Callable[[Probe], None] | None = None,
) -> GoodputResult:
    """Highest rate whose ``run_at_rate(rate).passed`` is true (module docstring).

    ``precision`` is the absolute width (req/s) the bracket is narrowed to; ``max_probes`` caps
    the number of runs (the result says whether it converged).
    """
    hi = _positive("upper rate", hi)
    lo = hi / growth if lo is None else _positive("lower rate", lo)
    precision = _positive("precision", precision)
    if lo >= hi:
        raise ValueError(f"lower rate {lo:g} must be below upper rate {hi:g}")
    if growth <= 1:
        raise ValueError(f"growth must be > 1, got {growth!r}")
    if max_probes < 1:
        raise ValueError(f"max_probes must be >= 1, got {max_probes!r}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus!r}")
    min_rate = precision / 4 if min_rate is None else min_rate
    probes: list[Probe] = []
    seen: dict[float, bool] = {}

    def probe(rate: float, phase: str) -> bool:
        if rate in seen:
            return seen[rate]
        res = run_at_rate(rate)
        p = Probe(len(probes), rate, float(res.attainment), bool(res.passed), phase,
                  dict(res.details))
        probes.append(p)
        seen[rate] = p.passed
        if on_probe is not None:
            on_probe(p)
        return p.passed

    best: float | None = None  # highest pass
    fail: float | None = None  # lowest fail above best
    note = ""
    if probe(hi, "expand"):
        best = hi
        while len(probes) < max_probes:
            nxt = best * growth
            if nxt > max_rate:
                note = f"every probe passed up to the rate cap {max_rate:g} req/s"
                break
            if probe(nxt, "expand"):
                best = nxt
            else:
                fail = nxt
                break
    else:
        fail = hi
        rate = lo
        while len(probes) < max_probes:
            if probe(rate, "shrink"):
                best = rate
                break
            fail = rate
            rate /= growth
            if rate < min_rate:
                note = f"no rate passed down to {fail:g} req/s"
                break
    while (best is not None and fail is not None and fail - best > precision
           and len(probes) < max_probes):
        mid = (best + fail) / 2
        if probe(mid, "bisect"):
            best = mid
        else:
            fail = mid
    goodput = best or 0.0
    if best is None:
        converged = bool(note)  # every rate down to min_rate failed: goodput is 0
    else:
        converged = fail is not None and fail - best <= precision
    if not converged and not note:
        note = f"stopped after {len(probes)} probes (max_probes)"
    return GoodputResult(goodput, num_gpus, goodput / num_gpus, goodput, fail, precision,
                         converged, probes, note)


def confirm_goodput(
    run_at_rate: Callable[[float], AttainmentResult],
    goodput: float,
    precision: float,
    max_probes: int = 20,
    *,
    num_gpus: int = 1,
    on_probe: Callable[[Probe], None] | None = None,
) -> tuple[float, dict[str, Any]]:
    """Steady-state rule 7 (:mod:`pdserve.bench.steady`): ``run_at_rate`` probes at a
    confirmation's length (:meth:`~pdserve.bench.steady.SteadyState.confirming`). The searched
    ``goodput`` is probed first; it holds: it is returned. It fails: the search continues
    downwards with such probes — first one ``precision`` (req/s) bracket lower (a pass there
    ends it), then by 1.1 at a time, then bisection to ``precision`` — and the highest rate
    that passed is returned (0 if none did). The details: the first probe's rate, verdict,
    attainment, judged requests and confidence, whether it stopped early, and every probe's
    ``(rate, attainment, passed)``. ``on_probe`` sees each probe (phase ``"confirm"``)."""
    goodput = _positive("goodput", goodput)
    probes: list[tuple[float, float, bool]] = []
    results: dict[float, AttainmentResult] = {}

    def probe(rate: float) -> AttainmentResult:
        if rate not in results:
            r = results[rate] = run_at_rate(rate)
            probes.append((rate, float(r.attainment), bool(r.passed)))
            if on_probe is not None:
                on_probe(Probe(len(probes) - 1, rate, float(r.attainment), bool(r.passed),
                               "confirm", dict(r.details)))
        return results[rate]

    first = probe(goodput)
    info: dict[str, Any] = {"rate": goodput, "held": bool(first.passed),
                            "attainment": float(first.attainment),
                            "judged": first.details.get("judged"),
                            "confidence": first.details.get("confidence"),
                            "early": first.details.get("early"),  # "fail": stopped once certain
                            "probes": probes}
    if first.passed:
        return goodput, info
    g = search_goodput(probe, lo=goodput / (1 + precision / goodput), hi=goodput,
                       precision=precision, max_probes=max_probes, growth=1.1,
                       max_rate=goodput, num_gpus=num_gpus)
    return g.goodput_rps, info


@dataclass
class ScaleSweep:
    """Attainment at each SLO scale and the tightest scale meeting the target."""

    points: list[AttainmentResult]
    tightest_scale: float | None  # None: no scale in the sweep met the target

    def to_dict(self) -> dict[str, Any]:
        return {"points": [asdict(p) for p in self.points], "tightest_scale": self.tightest_scale}


def slo_scale_sweep(
    attainment_at_scale: Callable[[float], float],
    scales: Sequence[float],
    target: float,
    precision: float | None = None,
) -> ScaleSweep:
    """Evaluate attainment with both SLOs multiplied by each scale (DistServe §6.2, "SLO
    Scale"). The tightest scale is the smallest passing scale above the largest failing one
    (so that all looser scales in the sweep pass); with ``precision`` it is refined by
    bisection between the two to that absolute width."""
    if not scales:
        raise ValueError("the SLO-scale sweep needs at least one scale")
    for s in scales:
        _positive("SLO scale", s)
    points = []
    for s in sorted(set(scales)):
        a = float(attainment_at_scale(s))
        points.append(AttainmentResult(s, a, a >= target))
    fails = [p.rate for p in points if not p.passed]
    passes = [p.rate for p in points if p.passed and (not fails or p.rate > max(fails))]
    if not passes:
        return ScaleSweep(points, None)
    tight = min(passes)
    if precision is not None and fails:
        lo = max(fails)
        while tight - lo > precision:
            mid = (lo + tight) / 2
            if attainment_at_scale(mid) >= target:
                tight = mid
            else:
                lo = mid
    return ScaleSweep(points, tight)
