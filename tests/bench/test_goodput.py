"""Goodput search and SLO-scale sweep on synthetic monotone attainment curves."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.goodput import AttainmentResult, Probe, search_goodput, slo_scale_sweep


def threshold(t: float, target: float = 0.9):
    """Attainment 1 up to rate ``t``, then falling smoothly; passes iff rate <= t."""
    calls: list[float] = []

    def run(rate: float) -> AttainmentResult:
        calls.append(rate)
        a = 1.0 if rate <= t else max(0.0, target - (rate - t))
        return AttainmentResult(rate, a, a >= target)

    return run, calls


@pytest.mark.parametrize("t", [0.37, 1.0, 3.7, 12.3, 250.0])
@pytest.mark.parametrize("precision", [0.01, 0.2])
def test_finds_threshold_within_precision(t: float, precision: float) -> None:
    run, calls = threshold(t)
    r = search_goodput(run, hi=1.0, precision=precision, max_probes=60)
    assert r.converged
    assert r.goodput_rps <= t < r.goodput_rps + precision + 1e-12
    assert r.hi is not None and r.hi > t and r.hi - r.goodput_rps <= precision
    assert len(calls) == len(set(calls)) == len(r.probes)  # each rate probed once, all logged
    assert [p.rate for p in r.probes] == calls


def test_grows_upper_bound_while_top_probe_passes() -> None:
    run, calls = threshold(20.0)
    r = search_goodput(run, hi=1.0, precision=0.5)
    assert calls[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    assert [p.phase for p in r.probes[:6]] == ["expand"] * 6
    assert all(p.phase == "bisect" for p in r.probes[6:])
    assert 19.5 < r.goodput_rps <= 20.0


def test_shrinks_when_first_upper_bound_fails() -> None:
    run, calls = threshold(0.3)
    r = search_goodput(run, hi=10.0, precision=0.01, max_probes=40)
    assert calls[:4] == [10.0, 5.0, 2.5, 1.25]
    assert r.probes[1].phase == "shrink"
    assert 0.29 < r.goodput_rps <= 0.3 and r.converged


def test_nothing_passes_gives_zero() -> None:
    r = search_goodput(lambda x: AttainmentResult(x, 0.0, False), hi=1.0, precision=0.1)
    assert r.goodput_rps == 0.0 and r.per_gpu_goodput_rps == 0.0 and r.converged
    assert "no rate passed" in r.note


def test_max_probes_stops_and_says_so() -> None:
    run, calls = threshold(1000.0)
    r = search_goodput(run, hi=1.0, precision=0.001, max_probes=5)
    assert len(calls) == 5 and not r.converged
    assert r.goodput_rps == 16.0 and "max_probes" in r.note


def test_per_gpu_and_callback() -> None:
    seen: list[Probe] = []
    run, _ = threshold(6.0)
    r = search_goodput(run, lo=1.0, hi=4.0, precision=0.05, num_gpus=4, on_probe=seen.append)
    assert seen == r.probes
    assert r.per_gpu_goodput_rps == pytest.approx(r.goodput_rps / 4)
    assert r.num_gpus == 4


@pytest.mark.parametrize("kwargs", [{"hi": 0.0}, {"hi": 1.0, "lo": 2.0}, {"precision": -1},
                                    {"max_probes": 0}, {"num_gpus": 0}, {"hi": math.inf}])
def test_bad_arguments(kwargs: dict) -> None:
    run, _ = threshold(1.0)
    with pytest.raises(ValueError):
        search_goodput(run, **kwargs)


def test_slo_scale_sweep_grid_and_refinement() -> None:
    att = lambda s: 1.0 if s >= 1.37 else 0.5
    sweep = slo_scale_sweep(att, [2.0, 0.5, 1.0, 1.5], 0.9)
    assert [p.rate for p in sweep.points] == [0.5, 1.0, 1.5, 2.0]
    assert [p.passed for p in sweep.points] == [False, False, True, True]
    assert sweep.tightest_scale == 1.5
    fine = slo_scale_sweep(att, [0.5, 1.0, 1.5, 2.0], 0.9, precision=0.01)
    assert 1.37 <= fine.tightest_scale < 1.38


def test_slo_scale_sweep_requires_looser_scales_to_pass() -> None:
    # a non-monotone blip at 0.5 does not count: 1.0 fails above it
    att = {0.5: 1.0, 1.0: 0.0, 2.0: 1.0}.__getitem__
    assert slo_scale_sweep(att, [0.5, 1.0, 2.0], 0.9).tightest_scale == 2.0
    assert slo_scale_sweep(lambda s: 0.0, [1.0, 2.0], 0.9).tightest_scale is None
    with pytest.raises(ValueError):
        slo_scale_sweep(att, [], 0.9)
