"""The serving overhead from a step log (``pdserve.sim.measurements``, used by
pdserve.bench.experiments.fidelity (benchmarks/fidelity.py) and ``pdserve calibrate --step-
log``): the gaps between consecutive steps of each instance, against the per-step and per-
sequence costs a synthetic log was made with."""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path

import pytest

from pdserve.sim.serving_path import overhead_from_step_log


def _fidelity():
    return importlib.import_module("pdserve.bench.experiments.fidelity")


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
    got = overhead_from_step_log(log)
    assert got["step_s"] == pytest.approx(0.0006, rel=0.02)
    assert got["seq_s"] == pytest.approx(0.00015, rel=0.02)
    # the 3-second waits (after steps 0, 97, 194, 291 and 388 of each instance) are left out
    assert got["gaps"] == 2 * (399 - 5)


def test_overhead_from_step_log_needs_consecutive_steps(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"instance_id": "x", "now": 1.0, "elapsed": 0.01,
                               "prefill_chunks": [], "decode_context_lens": [5]}) + "\n")
    with pytest.raises(ValueError, match="too few"):
        overhead_from_step_log(log)


def test_step_log_window_keeps_one_runs_steps(tmp_path: Path) -> None:
    """``from_step_log(window=...)`` keeps the steps that started within it (one measured run
    of a log that holds several), which the script's per-run step error is computed on."""
    from pdserve.sim.measurements import from_step_log

    log = tmp_path / "steps.jsonl"
    log.write_text("\n".join(json.dumps(
        {"instance_id": "colocated-0", "now": 100.0 + t, "elapsed": 0.01 * (1 + t),
         "prefill_chunks": [], "decode_context_lens": [16 + t]}) for t in range(10)))
    ms = from_step_log(log, "opt-13b", window=(103.0, 105.5))  # steps starting at 103, 104, 105
    assert [m.sample.decode_context_lens for m in ms] == [(19,), (20,), (21,)]
    assert len(from_step_log(log, "opt-13b")) == 10
    with pytest.raises(ValueError, match="no non-empty steps in"):
        from_step_log(log, "opt-13b", window=(200.0, 300.0))


def test_summarize_repeats_averages_live_and_keeps_each_errors_range() -> None:
    """Hand-worked: two live repeats (TTFT 0.2 and 0.3 s) against one simulation (0.2 s): the
    row's live mean is 0.25, its error 0.2/0.25 − 1 = −20 %, the range 0.2/0.3 − 1 .. 0."""
    fid = _fidelity()

    def rep(ttft: float, att: float, bias: float) -> dict:
        row = {"attainment_live": att, "attainment_sim": 0.9, "failed_live": 0, "failed_sim": 0}
        for metric, live, sim in (("ttft", ttft, 0.2), ("tpot", 0.01, 0.01), ("e2e", 1.0, 1.1)):
            for stat in ("mean", "p90"):
                row[f"{metric}_{stat}_live"], row[f"{metric}_{stat}_sim"] = live, sim
                row[f"{metric}_{stat}_rel_err"] = sim / live - 1
        row["step_error"] = {"median": bias, "weighted": 2 * bias, "mean_abs": abs(bias),
                             "steps": 10, "busy_s": 1.0}
        return row

    row = fid.summarize_repeats(2.0, [rep(0.2, 0.8, -0.1), rep(0.3, 1.0, 0.1)])
    assert row["rate"] == 2.0 and len(row["repeats"]) == 2
    assert row["ttft_mean_live"] == pytest.approx(0.25)
    assert row["ttft_mean_rel_err"] == pytest.approx(-0.2)
    assert row["ttft_mean_err_range"] == pytest.approx([0.2 / 0.3 - 1, 0.0])
    assert row["e2e_mean_rel_err"] == pytest.approx(0.1)
    assert row["attainment_live"] == pytest.approx(0.9)
    assert row["attainment_diff_points"] == pytest.approx(0.0)
    assert row["step_error"]["median"] == pytest.approx(0.0)
    assert row["step_error"]["weighted"] == pytest.approx(0.0)
    assert row["step_error"]["range"] == pytest.approx([-0.2, 0.2])
    one = fid.summarize_repeats(1.0, [rep(0.2, 0.8, 0.0)])
    assert one["ttft_mean_rel_err"] == pytest.approx(0.0) and "ttft_mean_err_range" not in one


@pytest.mark.parametrize("factor", [0.8, 2.0])
def test_at_speed_scales_every_step_time(tmp_path: Path, factor: float) -> None:
    """A device at ``factor`` times its speed prices every step — prefill, decode, mixed, and
    with fixed per-step/layer/sequence costs — at exactly ``1/factor`` of the original."""
    from dataclasses import replace

    from pdserve.sim.calibrate import predict
    from pdserve.sim.hardware import get_device, save_hardware
    from pdserve.sim.latency import ProfileSample
    from pdserve.sim.measurements import Measurement, model_config

    fid = _fidelity()
    base = get_device("cpu")
    base = replace(base, efficiency=replace(base.efficiency, step_overhead_s=1e-3,
                                            layer_overhead_s=2e-4, seq_overhead_s=5e-4,
                                            overlap=0.5))
    save_hardware(tmp_path / "base.yaml", base)
    cfg = model_config("llama-2-7b")
    ms = [Measurement(ProfileSample(p, d, 1.0), cfg, dtype="float32")
          for p, d in (([(0, 512)], ()), ((), (100, 900, 40)), ([(64, 128)], (300,)))]
    scaled = get_device(fid.at_speed(str(tmp_path / "base.yaml"), factor, tmp_path / "s.yaml"))
    assert predict(scaled, ms) == pytest.approx(predict(base, ms) / factor, rel=1e-9)


def test_step_error_weights_by_time(tmp_path: Path) -> None:
    """A run whose long step took twice its prediction and whose short step took exactly its
    prediction: the time-weighted bias is (p_long + p_short)/(2·p_long + p_short) − 1, not the
    median of −50 % and 0; only the steps in the window count."""
    from pdserve.sim.calibrate import predict
    from pdserve.sim.hardware import get_device
    from pdserve.sim.measurements import from_step_log

    fid = _fidelity()
    shapes = [([[0, 512]], []), ([], [100])]
    log = tmp_path / "steps.jsonl"

    def write(secs: list[float]) -> None:
        log.write_text("\n".join(json.dumps(
            {"instance_id": "colocated-0", "now": 10.0 + i, "elapsed": t,
             "prefill_chunks": pc, "decode_context_lens": dc})
            for i, ((pc, dc), t) in enumerate(zip(shapes + shapes, secs))))

    write([1.0] * 4)
    pred = predict(get_device("cpu"), from_step_log(log, "llama-2-7b", dtype="float32"))
    write([2 * pred[0], pred[1], 99.0, 99.0])  # the last two lie outside the window
    got = fid.step_error("cpu", log, "llama-2-7b", (9.5, 11.5))
    assert got["steps"] == 2
    assert got["weighted"] == pytest.approx((pred[0] + pred[1]) / (2 * pred[0] + pred[1]) - 1)
    assert got["median"] == pytest.approx(-0.25)
    assert got["prefill"]["median"] == pytest.approx(-0.5) and got["decode"]["median"] == 0

