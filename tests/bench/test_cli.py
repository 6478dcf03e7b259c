"""``bench``, ``goodput`` and ``compare`` end to end: a fake server and in-process fake targets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench.cli import main, register
from pdserve.bench.report import confirmation
from pdserve.bench.targets import register_target
from tests.bench.fakes import FakeServer, QueueTarget

SLO_FLAGS = ["--slo-ttft", "0.3", "--slo-tpot", "0.05"]


@pytest.fixture(autouse=True)
def queue_targets() -> None:
    register_target("queue10", lambda a: QueueTarget(10.0, num_gpus=a.num_gpus or 1,
                                                     name="queue10"))
    register_target("queue30", lambda a: QueueTarget(
        float(a.target_options.get("capacity", 30)), num_gpus=a.num_gpus or 1, name="queue30"))


def test_register_adds_three_subcommands() -> None:
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    for cmd in ("bench", "goodput", "compare"):
        args = parser.parse_args([cmd, "--target", "sim"] if cmd != "compare" else [cmd])
        assert callable(args.func)


def test_bench_against_http_server(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", fake_server.url, "--workload", "fixed:input=8,output=5",
               "--rate", "20", "--num-requests", "6", "--no-progress", *SLO_FLAGS,
               "--num-gpus", "2", "--output-json", str(out), "--output-md",
               str(tmp_path / "b.md"), "--plot", str(tmp_path / "plots"), "--save-records"])
    assert rc == 0
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["num_ok"] == 6 and s["num_gpus"] == 2
    # attainment recomputed from the saved token times (no wall-clock bound: a busy machine
    # may miss the SLO, and the summary must say so)
    met = 0
    for r in data["records"]:
        tl = r["timeline"]
        times = tl["token_times"]
        assert len(times) == 5 and times == sorted(times)
        ttft, tpot = times[0] - tl["arrival"], (times[-1] - times[0]) / 4
        met += ttft <= 0.3 and tpot <= 0.05
    assert s["attainment"] == pytest.approx(met / 6)
    assert s["ttft"]["mean"] >= 0.1  # the fake server waits 0.1 s before the first token
    assert s["breakdown"] is not None  # the fake server returns timelines
    assert data["workload"]["num_requests"] == 6 and data["slo"] == {"ttft": 0.3, "tpot": 0.05}
    assert len(data["records"]) == 6 and data["records"][0]["timeline"]["token_times"]
    assert data["slo_scale_sweep"]["tightest_scale"] is not None
    md = capsys.readouterr().out
    assert "| TTFT |" in md and "DistServe variant" in md
    assert (tmp_path / "b.md").read_text().strip() == md.strip()
    for png in ("latency_cdf.png", "breakdown.png", "attainment_vs_slo_scale.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000


def test_goodput_search_writes_required_fields(tmp_path: Path, capsys) -> None:
    out = tmp_path / "g.json"
    rc = main(["goodput", "--target", "queue10", "--workload", "fixed:input=8,output=5",
               "--num-requests", "400", *SLO_FLAGS, "--rate", "1", "--precision", "0.1",
               "--max-probes", "20", "--num-gpus", "2", "--output-json", str(out),
               "--plot", str(tmp_path / "p")])
    assert rc == 0
    d = json.loads(out.read_text())
    assert 3.0 < d["goodput_rps"] < 10.0  # a 10 req/s queue with a 3x-service TTFT SLO
    assert d["per_gpu_goodput_rps"] == pytest.approx(d["goodput_rps"] / 2)
    assert d["num_gpus"] == 2 and d["converged"]
    assert [p["phase"] for p in d["probes"]][:2] == ["expand", "expand"]
    c = d["confirmed"]  # rule 7 by default: the searched goodput probed 5 x longer (held)
    searched = max(p["rate"] for p in d["probes"] if p["passed"])
    assert (c["factor"], c["rate"], c["held"], c["judged"]) == (5, searched, True, 5 * 400)
    assert d["goodput_rps"] == searched and c["probes"] == [[searched, c["attainment"], True]]
    assert d["at_goodput"]["summary_of"] == "the 2000 judged requests (steady-state rule)"
    assert d["at_goodput"]["summary"]["attainment"] == c["attainment"] >= 0.9
    assert (tmp_path / "p" / "attainment_vs_rate.png").exists()
    assert "confirmed (steady-state rule 7): held over 5 x the probe length" in \
        capsys.readouterr().out


def test_goodput_distserve_criterion_is_labelled(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    assert main(["goodput", "--target", "queue10", "--workload", "fixed", "--num-requests",
                 "200", *SLO_FLAGS, "--criterion", "distserve", "--output-json",
                 str(out)]) == 0
    assert json.loads(out.read_text())["criterion"] == "distserve"


def test_compare_two_targets(tmp_path: Path, capsys) -> None:
    out = tmp_path / "c.json"
    cfg = tmp_path / "targets.json"
    cfg.write_text(json.dumps([{"name": "big", "target": "queue30", "num_gpus": 3,
                                "options": {"capacity": 30}}]))
    rc = main(["compare", "--target", "small=queue10", "--targets-config", str(cfg),
               "--workload", "fixed:input=8,output=5", "--num-requests", "300", *SLO_FLAGS,
               "--rates", "2,4,6,8,12,16,20,24", "--output-json", str(out),
               "--plot", str(tmp_path / "p")])
    assert rc == 0
    d = json.loads(out.read_text())
    by = {t["name"]: t for t in d["targets"]}
    assert set(by) == {"small", "big"}
    assert by["big"]["goodput_rps"] > by["small"]["goodput_rps"] > 0
    assert by["big"]["num_gpus"] == 3
    assert by["big"]["per_gpu_goodput_rps"] == pytest.approx(by["big"]["goodput_rps"] / 3)
    assert len(by["small"]["probes"]) == 8
    table = capsys.readouterr().out
    assert "| small |" in table and "| big |" in table
    for t in by.values():  # the grid's goodput confirmed over 5 probe lengths (rule 7)
        c = t["confirmed"]
        grid = max(p["rate"] for p in t["probes"] if p["passed"])
        assert c["factor"] == 5 and c["rate"] == grid
        assert t["goodput_rps"] == (grid if c["held"] else
                                    max((r for r, _, ok in c["probes"] if ok), default=0.0))
        assert confirmation(c) in table
    assert (tmp_path / "p" / "attainment_vs_rate.png").exists()
    assert (tmp_path / "p" / "attainment_vs_slo_scale.png").exists()


@pytest.mark.parametrize("argv,msg", [
    (["bench", "--target", "queue10", "--rate", "-1"], "--rate: must be > 0"),
    (["bench", "--target", "queue10", "--rate", "x"], "expected a number, got 'x'"),
    (["bench", "--target", "queue10", "--rate", "1", "--workload", "nope"],
     "unknown workload 'nope'"),
    (["bench", "--target", "nowhere", "--rate", "1"], "unknown target 'nowhere'"),
    (["bench", "--target", "queue10", "--rate", "1", "--attainment", "150"], "--attainment"),
    (["bench", "--target", "queue10", "--rate", "1", "--arrival", "weibull"], "invalid choice"),
    (["goodput", "--target", "queue10", "--workload", "fixed"], "no default SLO"),
    (["compare", "--workload", "fixed", *SLO_FLAGS], "compare needs targets"),
    (["compare", "--target", "a=queue10", "--num-gpus", "b=2", *SLO_FLAGS], "unknown target"),
    (["compare", "--target", "a=queue10", "--targets-config", "/nonexistent.json"],
     "does not exist"),
])
def test_bad_values_exit_2_with_a_message(argv: list[str], msg: str, capsys) -> None:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_unreachable_server_exits_1(capsys) -> None:
    rc = main(["bench", "--target", "http://127.0.0.1:9", "--workload", "fixed", "--rate", "1",
               "--num-requests", "2", "--timeout", "2"])
    assert rc == 1 and "cannot reach" in capsys.readouterr().err



def test_bench_learns_the_vocabulary_and_fails_loudly(fake_server: FakeServer, tmp_path: Path,
                                                      capsys) -> None:
    from tests.bench.fakes import VOCAB_SIZE

    args = ["bench", "--target", fake_server.url, "--workload", "fixed:input=30,output=3",
            "--rate", "50", "--num-requests", "6", "--no-progress", *SLO_FLAGS,
            "--prompt-mode", "ids"]
    fake_server.bodies.clear()
    assert main(args) == 0  # token ids drawn below the vocabulary /v1/models reports
    ids = [t for b in fake_server.bodies for t in b["prompt"]]
    assert len(ids) == 6 * 30 and max(ids) < VOCAB_SIZE
    capsys.readouterr()
    out = tmp_path / "b.json"
    # a wrong --vocab-size: every request fails, errors are grouped by kind, exit 1
    assert main([*args, "--vocab-size", "50000", "--output-json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "6 of 6 requests failed" in err and "--max-failed" in err
    errors = json.loads(out.read_text())["summary"]["errors"]
    assert errors == {"HTTP N: prompt token id N is outside the vocabulary [N, N)": 6}
    # ... unless the user accepts failures
    assert main([*args, "--vocab-size", "50000", "--max-failed", "1"]) == 0
