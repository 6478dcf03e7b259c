"""``pdserve demo`` end to end on a tiny workload (in-process instances, real HTTP servers)."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from tests.cluster.realstack import tiny_model


def test_demo_inprocess(tmp_path_factory: pytest.TempPathFactory, tmp_path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model(tmp_path_factory)
    out = tmp_path / "demo.json"
    code = main(["demo", "--backend", "inproc", "--model", model, "--no-chat",
                 "--num-requests", "6", "--rate", "20", "--length-scale", "0.1", "--no-progress",
                 "--slo-ttft", "5", "--slo-tpot", "1", "--output-json", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    printed = captured.out
    # not a terminal: plain progress lines, at once, with each step's time
    assert "pdserve demo: loading 4 model instances" in captured.err
    assert "pdserve demo: replaying the workload against colocated" in captured.err
    for word in ("colocated (2 instances)", "disaggregated (1P + 1D)", "TTFT P90", "TPOT mean",
                 "SLO attainment", "request-to-request noise", "share the same CPU cores"):
        assert word in printed
    data = json.loads(out.read_text())
    assert data["backend"] == "inproc" and data["slo"] == {"ttft": 5, "tpot": 1}
    for s in data["summaries"].values():
        assert s["num_ok"] == 6 and s["num_failed"] == 0 and s["attainment"] == 1.0
        assert s["ttft"]["p90"] > 0 and s["tpot"]["mean"] > 0


@pytest.mark.parametrize("flag", ["--rate", "--num-requests", "--attainment"])
def test_demo_bad_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["demo", flag, "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and len(err.strip().splitlines()) == 1


def test_noise_notes_judge_differences_against_the_spread() -> None:
    from types import SimpleNamespace

    from pdserve.demo import _noise_notes

    def run(ttfts: list[float]) -> list[SimpleNamespace]:
        return [SimpleNamespace(ok=True, ttft=t, tpot=0.01) for t in ttfts]

    # repeats: per-repeat means 0.10/0.12 vs 0.30/0.31 do not overlap; TPOTs are equal
    notes = _noise_notes({"a": [run([0.1] * 5), run([0.12] * 5)],
                          "b": [run([0.3] * 5), run([0.31] * 5)]})
    assert "beyond run-to-run noise" in notes[0] and "+195.0 ms" in notes[0]
    assert "within run-to-run noise" in notes[1]
    # overlapping repeats are noise
    notes = _noise_notes({"a": [run([0.1] * 5), run([0.3] * 5)],
                          "b": [run([0.2] * 5), run([0.25] * 5)]})
    assert "within run-to-run noise" in notes[0]
    # one run each: a bootstrap over requests, labelled as such
    notes = _noise_notes({"a": [run([0.1, 0.11, 0.09, 0.1])], "b": [run([0.5, 0.52, 0.49, 0.5])]})
    assert "beyond request-to-request noise" in notes[0] and "--repeats" in notes[0]
