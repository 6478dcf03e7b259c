"""A synthetic latency source: DistServe's profile format with constant step times, so that a
prefill instance is an exact M/D/1 server (DistServe §3.1)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest


def write_profile(path: Path, prefill_ms: dict[int, float], decode_ms: float = 5.0,
                  decode_per_seq_ms: float = 0.0) -> str:
    """``prefill_ms[tp]``: every prefill batch takes this long; every decode step ``decode_ms``
    plus ``decode_per_seq_ms`` per sequence in the batch."""
    dec = [decode_ms, 0.0, decode_per_seq_ms]
    entry = lambda ms: {"prefill": [ms, 0.0, 0.0], "decoding_smallbs": dec,  # noqa: E731
                        "decoding_largebs": dec}
    data = {"facebook/opt-13b": {str(tp): entry(ms) for tp, ms in prefill_ms.items()}}
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture
def const_profile(tmp_path: Path):
    def make(prefill_ms: dict[int, float], decode_ms: float = 5.0,
             decode_per_seq_ms: float = 0.0) -> str:
        return write_profile(tmp_path / "const.json", prefill_ms, decode_ms, decode_per_seq_ms)
    return make


def stand_in_units(monkeypatch: pytest.MonkeyPatch, units: Mapping[Any, float],
                   capacity: Callable[[Any], float] = lambda u: 1.0) -> None:
    """Unit goodputs worked by hand, no simulator: ``evaluate_unit`` gives ``units[u]`` (a unit
    not in it is pruned) and ``unit_model`` the capacity bound ``capacity(u)``."""
    import pdserve.planner.units as unit_mod
    from pdserve.planner.units import UnitResult

    def evaluate_unit(p: Any, u: Any, incumbent: float = 0.0) -> UnitResult:
        g = units.get(u)
        if g is None:
            return UnitResult(u, pruned="stand-in: not searched")
        return UnitResult(u, goodput_rps=g, per_gpu_rps=g / u.num_gpus)

    monkeypatch.setattr(unit_mod, "evaluate_unit", evaluate_unit)
    monkeypatch.setattr(unit_mod, "unit_model",
                        lambda p, u: SimpleNamespace(capacity_rps=capacity(u)))
