"""``from_metrics_log``: engine steps from Prometheus scrapes (pdserve's or vLLM's names), worked
by hand on a four-scrape log."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.sim.measurements import from_metrics_log


def exposition(prefix: str, running: int, waiting: int, gen: float, prompt: float,
               finished: float, prefill_sum: float, prefill_count: float,
               split: bool = False) -> str:
    """A scrape in Prometheus text format; ``split`` spreads every series over two label
    sets (two finish reasons / two model names), which must be summed."""
    def series(name: str, kind: str, value: float) -> str:
        head = f"# TYPE {name.removesuffix('_total')} {kind}\n"
        if not split:
            return head + f"{name} {value}\n"
        return head + f'{name}{{k="a"}} {value / 2}\n{name}{{k="b"}} {value / 2}\n'

    hist = (f"# TYPE {prefix}:request_prefill_time_seconds histogram\n"
            f'{prefix}:request_prefill_time_seconds_bucket{{le="+Inf"}} {prefill_count}\n'
            f"{prefix}:request_prefill_time_seconds_count {prefill_count}\n"
            f"{prefix}:request_prefill_time_seconds_sum {prefill_sum}\n")
    return (series(f"{prefix}:num_requests_running", "gauge", running)
            + series(f"{prefix}:num_requests_waiting", "gauge", waiting)
            + series(f"{prefix}:generation_tokens_total", "counter", gen)
            + series(f"{prefix}:prompt_tokens_total", "counter", prompt)
            + series(f"{prefix}:request_success_total", "counter", finished) + hist)


def write_log(path: Path, prefix: str, split: bool = False) -> Path:
    # t=0 → 1: 2 running, 40 tokens, nothing else moves: 20 steps of 2 → 50 ms per step
    # t=1 → 2: the batch grows to 3 (not steady); t=2 → 3: 5 requests finish (not steady)
    # over the log: 5 finished, 1000 prompt and 200 generated tokens → mean prompt 200, mean
    # output 40 → context 200 + 40/2 = 220; prefill histogram: 1.0 s over 5 → 0.2 s
    rows = [(0.0, (2, 0, 100, 1000, 5, 1.0, 5)), (1.0, (2, 0, 140, 1000, 5, 1.0, 5)),
            (2.0, (3, 0, 180, 1200, 6, 1.2, 6)), (3.0, (0, 0, 300, 2000, 10, 2.0, 10))]
    path.write_text("".join(json.dumps({"time": t, "metrics": exposition(prefix, *v,
                                                                         split=split)}) + "\n"
                            for t, v in rows))
    return path


@pytest.mark.parametrize("prefix,split", [("pdserve", False), ("vllm", False), ("vllm", True)])
def test_steady_interval_and_mean_prefill(tmp_path: Path, prefix: str, split: bool) -> None:
    ms = from_metrics_log(write_log(tmp_path / "m.jsonl", prefix, split), "opt-13b")
    assert [(m.sample.prefill_chunks, m.sample.decode_context_lens) for m in ms] == [
        ((), (220, 220)), (((0, 200),), ())]
    assert ms[0].seconds == pytest.approx(0.05) and ms[1].seconds == pytest.approx(0.2)
    assert {m.group for m in ms} == {"metrics"}


def test_a_waiting_request_or_a_new_prompt_breaks_steadiness(tmp_path: Path) -> None:
    rows = [(0.0, (2, 1, 100, 1000, 5, 1.0, 5)), (1.0, (2, 1, 140, 1000, 5, 1.0, 5)),
            (2.0, (2, 0, 180, 1100, 5, 1.0, 5)), (3.0, (0, 0, 300, 2000, 10, 2.0, 10))]
    log = tmp_path / "m.jsonl"
    log.write_text("".join(json.dumps({"time": t, "metrics": exposition("vllm", *v)}) + "\n"
                           for t, v in rows))
    ms = from_metrics_log(log, "opt-13b")
    assert [m.sample.kind for m in ms] == ["prefill"]  # no decode interval qualifies


def test_bad_logs_get_clear_errors(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    log.write_text('{"time": 1}\n')
    with pytest.raises(ValueError, match="line 1: not a metrics scrape"):
        from_metrics_log(log, "opt-13b")
    log.write_text(json.dumps({"time": 0, "metrics": exposition("vllm", 0, 0, 0, 0, 0, 0, 0)})
                   + "\n")
    with pytest.raises(ValueError, match="need at least two scrapes, found 1"):
        from_metrics_log(log, "opt-13b")
    log.write_text("".join(json.dumps({"time": t, "metrics": "# TYPE other gauge\nother 1\n"})
                           + "\n" for t in (0, 1)))
    with pytest.raises(ValueError, match="vllm:|pdserve:num_requests_running"):
        from_metrics_log(log, "opt-13b")


def test_cli_calibrates_from_a_metrics_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdserve calibrate --metrics-log``: fits the log's two samples and writes a spec that
    loads back; without ``--model`` it says so."""
    import argparse

    from pdserve.sim.calibrate import register
    from pdserve.sim.hardware import load_hardware

    def parse(argv: list[str]) -> argparse.Namespace:
        ap = argparse.ArgumentParser()
        register(ap.add_subparsers(dest="cmd"))
        return ap.parse_args(["calibrate", *argv])

    log = write_log(tmp_path / "m.jsonl", "vllm")
    out = tmp_path / "cal.yaml"
    args = parse(["--hardware", "L40S", "--metrics-log", str(log), "--model", "opt-13b",
                  "-o", str(out), "--report-json", str(tmp_path / "r.json")])
    args.func(args)
    assert json.loads((tmp_path / "r.json").read_text())["fit"]["n"] == 2
    assert load_hardware(str(out)).device.name == "L40S"
    capsys.readouterr()
    missing = parse(["--hardware", "L40S", "--metrics-log", str(log)])
    assert missing.func(missing) == 2  # one line, exit 2
    err = capsys.readouterr().err
    assert re.search("--metrics-log .* pass --model", err), err
