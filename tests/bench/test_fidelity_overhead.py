"""benchmarks/fidelity.py's serving overhead from a step log: the gaps between consecutive steps
of each instance, against the per-step and per-sequence costs a synthetic log was made with."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fidelity():
    spec = importlib.util.spec_from_file_location("fidelity_bench",
                                                  ROOT / "benchmarks" / "fidelity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def synthetic_log(path: Path, a: float, b: float) -> None:
    """Two instances whose steps' sizes vary at random; after a step of ``n`` sequences the
    next one starts ``a + b·n`` later, except for a few idle waits (0.1 s: below the cut, left
    to the median; 3 s: above it). Lines interleaved across instances, as a shared log is."""
    rng = random.Random(7)
    lines = []
    for iid in ("decode-0", "colocated-1"):
        t = 100.0
        for i in range(400):
            n = rng.randint(1, 8)
            elapsed = rng.uniform(0.01, 0.05)
            lines.append({"instance_id": iid, "now": t, "elapsed": elapsed,
                          "prefill_chunks": [[0, 16]] if n > 6 else [],
                          "decode_context_lens": [40] * (n - 1 if n > 6 else n)})
            idle = 3.0 if i % 97 == 0 else 0.1 if i % 23 == 0 else 0.0
            t += elapsed + a + b * n + idle
    rng.shuffle(lines)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_overhead_from_step_log_recovers_the_costs(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    synthetic_log(log, a=0.0006, b=0.00015)
    got = _fidelity().overhead_from_step_log(log)
    assert got["step_s"] == pytest.approx(0.0006, rel=0.02)
    assert got["seq_s"] == pytest.approx(0.00015, rel=0.02)
    # the 3-second waits (after steps 0, 97, 194, 291 and 388 of each instance) are left out
    assert got["gaps"] == 2 * (399 - 5)


def test_overhead_from_step_log_needs_consecutive_steps(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"instance_id": "x", "now": 1.0, "elapsed": 0.01,
                               "prefill_chunks": [], "decode_context_lens": [5]}) + "\n")
    with pytest.raises(ValueError, match="too few"):
        _fidelity().overhead_from_step_log(log)
