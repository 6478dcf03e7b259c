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
    printed = capsys.readouterr().out
    for word in ("colocated (2 instances)", "disaggregated (1P + 1D)", "TTFT P90", "TPOT mean",
                 "SLO attainment"):
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
