"""Arrival processes: sample means and CVs match their parameters on large samples."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.arrivals import Constant, Gamma, Poisson, TraceReplay, parse_arrival

N = 200_000


def gaps_of(t: np.ndarray) -> np.ndarray:
    return np.diff(t)


def cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_mean_and_cv(rate: float) -> None:
    t = Poisson().times(N, rate, np.random.default_rng(1))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    g = gaps_of(t)
    assert g.mean() == pytest.approx(1 / rate, rel=0.01)
    assert cv(g) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("cv_", [0.25, 1.0, 2.0, 4.0])
def test_gamma_mean_and_cv(cv_: float) -> None:
    g = gaps_of(Gamma(cv_).times(N, 3.0, np.random.default_rng(2)))
    assert g.mean() == pytest.approx(1 / 3.0, rel=0.02 * max(1, cv_))
    assert cv(g) == pytest.approx(cv_, rel=0.05)


def test_constant_is_exact() -> None:
    t = Constant().times(5, 2.0, np.random.default_rng(0))
    assert t.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]


def test_same_seed_same_pattern_at_every_rate() -> None:
    a = Poisson().times(100, 1.0, np.random.default_rng(7))
    b = Poisson().times(100, 4.0, np.random.default_rng(7))
    assert np.allclose(a, 4 * b)


def test_trace_replay_keeps_shape_and_overrides_rate() -> None:
    rng = np.random.default_rng(3)
    ts = np.cumsum(rng.gamma(0.25, 4.0, 50_000))  # CV 2, mean gap 1 s
    ts -= ts[0]
    replay = TraceReplay(tuple(ts))
    same = replay.times(len(ts), None, rng)
    assert np.allclose(same, ts)
    fast = replay.times(len(ts), 10.0, rng)
    assert (len(fast) - 1) / fast[-1] == pytest.approx(10.0)
    assert cv(gaps_of(fast)) == pytest.approx(cv(gaps_of(ts)))
    assert cv(gaps_of(fast)) == pytest.approx(2.0, rel=0.05)
    with pytest.raises(ValueError, match="timestamps"):
        replay.times(len(ts) + 1, None, rng)


def test_trace_replay_of_simultaneous_arrivals_spreads_them() -> None:
    t = TraceReplay((0.0, 0.0, 0.0)).times(3, 2.0, np.random.default_rng(0))
    assert t.tolist() == [0.0, 0.5, 1.0]


def test_parse_arrival() -> None:
    assert parse_arrival("poisson") == Poisson()
    assert parse_arrival("gamma:cv=2") == Gamma(2.0)
    assert parse_arrival("gamma:3") == Gamma(3.0)
    assert parse_arrival("gamma", cv=0.5) == Gamma(0.5)
    assert isinstance(parse_arrival("trace", np.array([0.0, 1.0])), TraceReplay)
    for bad, msg in [("weibull", "unknown arrival"), ("gamma:cv=-1", "cv > 0"),
                     ("gamma:k=2", "only cv"), ("gamma:x", "number"), ("trace", "timestamps")]:
        with pytest.raises(ValueError, match=msg):
            parse_arrival(bad)
    with pytest.raises(ValueError, match="rate"):
        Poisson().times(3, 0.0, np.random.default_rng(0))
