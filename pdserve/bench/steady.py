"""Steady-state probes: how long a goodput probe runs and which of its requests are judged.

Goodput is a property of the server in steady state (DESIGN.md "Goodput definitions"), but a
probe starts from an empty server: its first requests meet no queue, and a rate above capacity
only shows once its backlog has grown past what the SLO allows. One rule, used by every goodput
search (``pdserve goodput``, ``plan``, ``advise``, the replanner):

1. **Lifetime.** ``L = TTFT SLO + (mean output − 1) × TPOT SLO``: how long a mean request may
   live and still attain both objectives.
2. **Warm-up.** A probe at rate ``λ`` first runs ``w = ⌈λ × horizon/2 × L⌉`` requests that
   warm the server up and are not judged (half the horizon: 6 lifetimes by default).
3. **Judged.** Then ``max(min_judged, w)`` more, whose attainment (in arrival order after the
   warm-up) is the probe's: the arrivals span at least ``horizon`` lifetimes (default 12) and
   at least ``min_judged`` requests are judged.
4. **Verdict.** The probe passes when the judged requests' attainment meets the target and
   so does the whole run's: a server started empty serves its first requests at least as well
   as in steady state, so a whole run that misses the target already says the steady state
   does (it lets an overloaded probe fail during its warm-up). A simulated probe stops as
   soon as its verdict is certain whatever the rest does (:mod:`pdserve.planner.early`).
5. **Confidence.** Each verdict carries the probability that the steady-state attainment lies
   on the side of the target the verdict says: the judged requests in ``batches`` consecutive
   batches, the attainment's standard error from the batch means (which carries the
   correlation of neighbouring requests), at least the binomial one; normal approximation.
6. **A pass must be confident.** A pass whose confidence is below ``min_confidence`` (0.9) is
   not taken: the probe runs again with twice the horizon and twice the judged minimum (its
   warm-up and judged requests both doubled), up to ``extensions`` times (2: 4 × the length);
   a pass still below ``min_confidence`` at the longest length fails (:func:`until_confident`).
   Near capacity a server's attainment comes in episodes longer than a probe: Llama-3.1-8B
   32000/1000 on one TP4 PP2 H100 instance at 2.34 req/s (the plan of
   ``benchmarks/vs_aiconfigurator.py``'s long-context question) meets both SLOs for 100 % of
   the requests in some stretches of 230 and 19–66 % in others, 87.6 % over 4,640 requests,
   while its 928-request probe attains 96.6 % of 464 judged with confidence 0.97 (its judged
   window was calm: this rule does not catch it; longer probes or independent replications
   near capacity would: rule 7). A fail is not extended: a rate that fails is not planned
   on.
7. **A goodput is confirmed.** The goodput a search reports — ``pdserve goodput`` and
   ``compare``'s, a plan's for its choice and for the best placement of each strategy (whole),
   ``plan --against``'s, each role's unit in the live replanner — is probed once more for
   ``confirm`` (:data:`CONFIRM`, 5)
   times the probe's length: its warm-up and judged requests both ``confirm`` times rule 2
   and 3's (the same workload and seed, as rule 6 extends a probe), judged by rules 4 and 5; a
   pass below ``min_confidence`` fails, with no extension (:meth:`SteadyState.confirming`).
   A goodput that fails is searched again downwards with such probes, and the highest rate
   that passed is kept (:func:`pdserve.bench.goodput.confirm_goodput`).
   Short probes screen the many candidates; the one a plan bets GPUs on is judged on a run
   long enough to hold the episodes of rule 6's example (its 5-times run attains 87.6 %).

Why this length. At ``λ = (1 + ε) μ`` (``μ`` the capacity) the backlog of work grows by ``ε``
seconds per second, so a request arriving at ``t`` waits about ``ε t`` more than in the first
moments; it misses its SLO once ``ε t`` exceeds its slack, at most ``L``. The judged span
``[T/2, T]`` (``T ≥ horizon × L``) then misses more than ``1 − target`` of its requests as soon
as ``ε > 1 / (horizon × (1 − (1 − target)/2))``: with the defaults (12, 90 %), any rate more
than ~9 % above a TTFT-bound capacity fails; a KV-bound decode capacity first fills its KV pool
(about as long again), so ~18 % there. The 300-request probe it replaces judged every request
of a run whose length did not depend on the SLO: on an M/D/1 server of capacity 10 req/s with a
5 s TTFT SLO it passes 11 req/s (10 % overloaded) and its goodput search lands at 11.6 req/s,
where the rule's lands at 10.5 (tests/bench/test_steady.py). Rule 7's probes span 60
lifetimes: they reject a rate ~1.8 % over a TTFT-bound capacity, and the planner's search on
such a server (10.35 req/s, past capacity) is confirmed at 9.73 against 9.96 in closed form
(tests/planner/test_confirm.py), ``pdserve goodput``'s (10.5) at 9.72 (tests/bench/
test_steady.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdserve.bench.metrics import SLO

if TYPE_CHECKING:
    from pdserve.bench.goodput import AttainmentResult


@dataclass(frozen=True)
class Verdict:
    """A probe's verdict on its judged requests."""

    attainment: float
    passed: bool
    confidence: float
    judged: int


@dataclass(frozen=True)
class SteadyState:
    """The rule (module docstring). ``horizon``: lifetimes the arrivals span; ``min_judged``:
    judged requests at least; ``batches``: batch means for the confidence; ``min_confidence``
    and ``extensions``: rule 6 (``min_confidence`` 0: every pass is taken)."""

    horizon: float = 12.0
    min_judged: int = 300
    batches: int = 10
    min_confidence: float = 0.9
    extensions: int = 2

    def __post_init__(self) -> None:
        if not (self.horizon > 0 and math.isfinite(self.horizon)):
            raise ValueError(f"horizon must be a positive number of lifetimes, got "
                             f"{self.horizon!r}")
        if not (isinstance(self.min_judged, int) and self.min_judged >= 1):
            raise ValueError(f"min_judged must be an integer >= 1, got {self.min_judged!r}")
        if not (isinstance(self.batches, int) and self.batches >= 2):
            raise ValueError(f"batches must be an integer >= 2, got {self.batches!r}")
        if not 0 <= self.min_confidence < 1:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence!r}")
        if not (isinstance(self.extensions, int) and self.extensions >= 0):
            raise ValueError(f"extensions must be an integer >= 0, got {self.extensions!r}")

    def extended(self, k: int) -> SteadyState:
        """The rule of a probe's ``k``-th extension (rule 6): ``2**k`` × the horizon and the
        judged minimum."""
        return replace(self, horizon=self.horizon * 2 ** k, min_judged=self.min_judged * 2 ** k)

    @staticmethod
    def lifetime(slo: SLO, mean_output: float) -> float:
        """``L``: how long a mean request may live and attain both objectives."""
        return slo.ttft + max(mean_output - 1.0, 0.0) * slo.tpot

    def confirming(self, factor: int) -> SteadyState:
        """The rule of a confirmation probe (rule 7): ``factor`` × the horizon and the judged
        minimum, and a pass below ``min_confidence`` fails rather than being extended."""
        if not (isinstance(factor, int) and factor >= 1):
            raise ValueError(f"a confirmation's length must be an integer >= 1 probe lengths, "
                             f"got {factor!r}")
        return replace(self, horizon=self.horizon * factor,
                       min_judged=self.min_judged * factor, extensions=0)

    def warmup(self, rate: float, lifetime: float) -> int:
        """Requests at the start of a probe at ``rate`` that are not judged (rule 2)."""
        return math.ceil(rate * self.horizon / 2 * lifetime - 1e-9)

    def num_requests(self, rate: float, lifetime: float) -> int:
        """Requests in a probe at ``rate``: the warm-up and the judged ones (rule 3)."""
        w = self.warmup(rate, lifetime)
        return w + max(self.min_judged, w)

    @staticmethod
    def first_judged(n: int, warmup: int) -> int:
        """Index (in arrival order) of the first judged request of ``n`` with ``warmup``
        requests of warm-up: at most half of them are not judged."""
        return min(warmup, n // 2)

    def verdict(self, oks: Sequence[bool], target: float, whole: float = 1.0) -> Verdict:
        """Attainment of the judged requests ``oks`` (in arrival order), pass/fail against
        ``target`` (``whole``: the whole run's attainment, rule 4) and its confidence
        (rule 5)."""
        n = len(oks)
        if n == 0:
            return Verdict(0.0, False, 0.0, 0)
        a = sum(oks) / n
        k = min(self.batches, n)
        means = [sum(oks[i * n // k:(i + 1) * n // k]) / max((i + 1) * n // k - i * n // k, 1)
                 for i in range(k)]
        mu = sum(means) / k
        se_batch = math.sqrt(sum((m - mu) ** 2 for m in means) / (k - 1) / k) if k > 1 else 0.0
        if whole < target <= a:  # failed on the whole run: the judged attainment flatters
            return Verdict(whole, False, confidence(whole, target, n), n)
        return Verdict(a, a >= target, confidence(a, target, n, se_batch), n)


def until_confident(rule: SteadyState, probe: Callable[[SteadyState], AttainmentResult]
                    ) -> AttainmentResult:
    """Rule 6: ``probe(rule)``, and while it passes with a confidence (``details
    ["confidence"]``) below ``rule.min_confidence``, ``probe(rule.extended(k))`` for ``k`` = 1,
    2, ... ``rule.extensions``; a pass still uncertain at the last fails (``details
    ["uncertain"]``). The result's ``details["extensions"]`` is the ``k`` it was judged at."""
    k = 0
    while True:
        r = probe(rule.extended(k))
        conf = r.details.get("confidence")
        if not r.passed or conf is None or conf >= rule.min_confidence:
            break
        if k == rule.extensions:
            r = replace(r, passed=False, details={**r.details, "uncertain": True})
            break
        k += 1
    r.details["extensions"] = k
    return r


def confidence(attainment: float, target: float, n: int, se: float = 0.0) -> float:
    """Probability that the steady-state attainment is on the side of ``target`` where
    ``attainment`` lies (normal approximation; standard error ``se``, at least the binomial
    one of ``n`` requests, itself at least that of one request in ``n`` missing or not)."""
    p = min(max(attainment, 1.0 / (n + 1)), n / (n + 1))
    se = max(se, math.sqrt(p * (1 - p) / max(n, 1)))
    z = (attainment - target) / se
    if attainment >= target:
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))
    return 0.5 * (1 + math.erf(-z / math.sqrt(2)))


DEFAULT = SteadyState()
CONFIRM = 5  # rule 7: a confirmation's length in probe lengths
