"""Arrival processes: Poisson, Gamma with a chosen CV, constant rate, and trace replay.

Every process returns ``n`` arrival offsets in seconds, the first at 0. Random processes draw
unit-rate gaps from the generator and divide them by the rate, so the same seed gives the same
arrival *pattern* at every rate (common random numbers): a goodput search compares rates, not
luck. ``parse_arrival('gamma:cv=2')`` builds one from a CLI string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class ArrivalProcess(Protocol):
    name: str

    def times(self, n: int, rate: float | None, rng: np.random.Generator) -> np.ndarray:
        """``n`` non-decreasing arrival offsets (seconds, first = 0) at mean ``rate`` req/s."""
        ...


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if len(gaps) else np.zeros(0)


def _check(n: int, rate: float | None) -> float:
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if rate is None or not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"arrival rate must be a positive number of requests/s, got {rate!r}")
    return float(rate)


@dataclass(frozen=True)
class Poisson:
    """Exponential inter-arrival gaps (CV 1); DistServe §6.1 generates arrivals this way."""

    name: str = "poisson"

    def times(self, n: int, rate: float | None, rng: np.random.Generator) -> np.ndarray:
        rate = _check(n, rate)
        return _from_gaps(rng.exponential(1.0, n) / rate)


@dataclass(frozen=True)
class Gamma:
    """Gamma inter-arrival gaps with mean ``1/rate`` and coefficient of variation ``cv``
    (shape ``1/cv²``): ``cv > 1`` is burstier than Poisson, ``cv < 1`` smoother."""

    cv: float = 1.0
    name: str = "gamma"

    def __post_init__(self) -> None:
        if not self.cv > 0 or not np.isfinite(self.cv):
            raise ValueError(f"gamma arrivals need cv > 0, got {self.cv!r}")

    def times(self, n: int, rate: float | None, rng: np.random.Generator) -> np.ndarray:
        rate = _check(n, rate)
        shape = 1.0 / self.cv**2
        return _from_gaps(rng.gamma(shape, 1.0 / shape, n) / rate)


@dataclass(frozen=True)
class Constant:
    """Evenly spaced arrivals, ``1/rate`` apart."""

    name: str = "constant"

    def times(self, n: int, rate: float | None, rng: np.random.Generator) -> np.ndarray:
        rate = _check(n, rate)
        return np.arange(n, dtype=float) / rate


@dataclass(frozen=True)
class TraceReplay:
    """A trace's own timestamps (offsets from its first request). With a ``rate``, time is
    stretched uniformly so that the mean rate ``(n − 1) / span`` equals it; burstiness (the CV
    of the gaps) is unchanged."""

    timestamps: tuple[float, ...]
    name: str = "trace"

    @staticmethod
    def native_rate(times: np.ndarray) -> float | None:
        span = float(times[-1] - times[0]) if len(times) > 1 else 0.0
        return (len(times) - 1) / span if span > 0 else None

    def times(self, n: int, rate: float | None, rng: np.random.Generator) -> np.ndarray:
        if n > len(self.timestamps):
            raise ValueError(f"the trace has {len(self.timestamps)} timestamps; {n} requested")
        t = np.asarray(self.timestamps[:n], dtype=float)
        t = t - t[0] if n else t
        if rate is None:
            return t
        _check(n, rate)
        native = self.native_rate(t)
        if native is None:  # all at one instant: spread them at the requested rate
            return np.arange(n, dtype=float) / rate
        return t * (native / rate)


ARRIVALS = ("poisson", "gamma", "constant", "trace")


def parse_arrival(spec: str, timestamps: np.ndarray | None = None,
                  cv: float | None = None) -> ArrivalProcess:
    """``poisson`` | ``gamma[:cv=X]`` (or ``gamma:X``) | ``constant`` | ``trace``. ``cv`` (from
    ``--cv``) applies to gamma when the spec gives none; ``trace`` needs ``timestamps``."""
    name, _, arg = spec.partition(":")
    name = name.strip().lower()
    if name == "poisson":
        return Poisson()
    if name == "constant":
        return Constant()
    if name == "gamma":
        if arg:
            key, eq, val = arg.partition("=")
            text = val if eq else key
            if eq and key.strip() != "cv":
                raise ValueError(f"gamma arrivals take only cv=..., got {arg!r}")
            try:
                cv = float(text)
            except ValueError:
                raise ValueError(f"gamma cv must be a number, got {text!r}") from None
        return Gamma(cv if cv is not None else 1.0)
    if name == "trace":
        if timestamps is None:
            raise ValueError("arrival 'trace' needs a workload with timestamps (azure-*, "
                             "splitwise-*, mooncake, apex-*)")
        return TraceReplay(tuple(float(t) for t in timestamps))
    raise ValueError(f"unknown arrival process {spec!r}; choose one of {', '.join(ARRIVALS)}")
