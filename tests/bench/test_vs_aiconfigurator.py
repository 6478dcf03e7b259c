"""pdserve.bench.experiments.vs_aiconfigurator (benchmarks/vs_aiconfigurator.py): aiconfigurator's
saved outputs parsed, the peer's choice, the pdserve and simulate command lines and the long
run's length, without aiconfigurator (no timings asserted). The adapter's static run needs the
optional aiconfigurator-core (``pdserve[aic]``) and skips without it; the peer itself runs only
where ``PDSERVE_AICONFIGURATOR`` names its venv's Python (CI never has it)."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest

from pdserve.bench.experiments import vs_aiconfigurator as vs
from pdserve.sim.model_catalogue import get_model_config

# aiconfigurator 0.12.0's best_config_topn.csv (first rows) for Llama-3.1-8B, 4000/500,
# TTFT 1000 ms / TPOT 20 ms, 8 x h100_sxm, vllm
AGG = (
    "model,isl,osl,prefix,concurrency,request_rate,bs,global_bs,ttft,tpot,request_latency,"
    "encoder_latency,encoder_memory,seq/s,seq/s/gpu,tokens/s,tokens/s/gpu,tokens/s/user,"
    "num_total_gpus,tp,pp,dp,moe_tp,moe_ep,cp,parallel,gemm,kvcache,fmha,moe,comm,memory,"
    "balance_score,num_ctx_reqs,num_gen_reqs,num_tokens,ctx_tokens,gen_tokens,backend,version,"
    "system,power_w,tokens/s/gpu_cluster\n"
    "meta-llama/Meta-Llama-3.1-8B,4000,500,0,64,7.437,64,64,155.519,16.935,8605.926,0,0.0,"
    "7.437,3.718,3710.931,1855.466,59.05,2,2,1,1,1,1,1,tp2pp1dp1etp1ep1,bfloat16,bfloat16,"
    "bfloat16,bfloat16,half,29.092,0.128,1.0,63.0,4063.0,4000,63.0,vllm,0.24.0,h100_sxm,0.0,"
    "1855.466\n"
    "meta-llama/Meta-Llama-3.1-8B,4000,500,0,32,3.523,32,32,195.383,17.81,9082.561,0,0.0,"
    "3.523,3.523,1758.094,1758.094,56.148,1,1,1,1,1,1,1,tp1pp1dp1etp1ep1,bfloat16,bfloat16,"
    "bfloat16,bfloat16,half,36.373,0.064,1.0,31.0,4031.0,4000,31.0,vllm,0.24.0,h100_sxm,0.0,"
    "1758.094\n")
DISAGG = (
    "model,isl,osl,prefix,concurrency,request_rate,(p)bs,(p)global_bs,(p)workers,(d)bs,"
    "(d)global_bs,(d)workers,ttft,tpot,request_latency,encoder_latency,seq/s,seq/s/gpu,"
    "tokens/s,tokens/s/gpu,tokens/s/user,(p)seq/s/worker,(d)seq/s/worker,num_total_gpus,(p)tp,"
    "(p)pp,(p)dp,(p)moe_tp,(p)moe_ep,(p)cp,(p)parallel,(p)gemm,(p)kvcache,(p)fmha,(p)moe,"
    "(p)comm,(p)memory,(p)backend,(p)version,(p)system,(d)tp,(d)pp,(d)dp,(d)moe_tp,(d)moe_ep,"
    "(d)parallel,(d)gemm,(d)kvcache,(d)fmha,(d)moe,(d)comm,(d)memory,(d)backend,(d)version,"
    "(d)system,(e)workers,(e)tp,(e)pp,(e)bs,(e)parallel,(e)memory,power_w,tokens/s/gpu_cluster\n"
    "meta-llama/Meta-Llama-3.1-8B,4000,500,0,144,13.872,1,1,2,144,144,1,174.422,19.139,"
    "9724.783,0.0,13.872,3.468,6935.88,1733.97,52.249,10.32,15.078,4,1,1,1,1,1,1,"
    "tp1pp1dp1etp1ep1,bfloat16,bfloat16,bfloat16,bfloat16,half,19.281,vllm,0.24.0,h100_sxm,"
    "2,1,1,1,1,tp2pp1dp1etp1ep1,bfloat16,bfloat16,bfloat16,bfloat16,half,42.847,vllm,0.24.0,"
    "h100_sxm,0,0,0,0,,0.0,0.0,1733.97\n")
ESTIMATE = """
============================================================
  Performance Estimate (static)
============================================================
  Batch Size:       64
  TP Size:          2
------------------------------------------------------------
  TTFT:             3445.690 ms
  TPOT:             10.113 ms
  Request Latency:  8491.923 ms
  tokens/s:         3,768.29
"""
Q8B = vs.BY_KEY["llama-8b"]


def test_peer_rows_parse_into_layouts_on_the_cluster() -> None:
    agg = vs.parse_topn(AGG, "agg")
    assert [c.label for c in agg] == ["aggregated 4 × TP2", "aggregated 8 × TP1"]
    a = agg[0]
    assert (a.tp, a.pp, a.batch_size) == (2, 1, 64)
    assert a.tokens_per_gpu == 1855.466 and a.tokens_per_user == 59.05
    assert a.req_s == pytest.approx(4 * 7.437)  # one row prices one replica of 2 GPUs
    assert (a.ttft_ms, a.tpot_ms) == (155.519, 16.935)
    (d,) = vs.parse_topn(DISAGG, "disagg")
    assert d.label == "disaggregated 2 × [2P(TP1) + 1D(TP2)]"
    assert (d.tp, d.batch_size) == (2, 144) and d.req_s == pytest.approx(2 * 13.872)
    assert vs.peer_choice(agg, [d]) == a
    assert vs.peer_choice([], [d]) == d
    with pytest.raises(ValueError, match="no configuration"):
        vs.peer_choice([], [])
    with pytest.raises(ValueError, match="agg or disagg"):
        vs.peer_config({}, "afd")


def test_moe_row_names_its_attention_dp_and_moe_tp() -> None:
    # Qwen3-30B-A3B's aggregated choice: attention DP 4 with MoE TP 4 on a 4-GPU worker
    head = AGG.splitlines()[0].split(",")
    vals = dict(zip(head, AGG.splitlines()[1].split(",")))
    vals.update(tp="1", dp="4", moe_tp="4", num_total_gpus="4", bs="28", request_rate="11.245")
    c = vs.peer_config(vals, "agg")
    assert c.label == "aggregated 2 × TP1 DP4, MoE TP4"
    assert (c.tp, c.dp, c.moe_tp, c.moe_ep, c.batch_size) == (1, 4, 4, 1, 28)
    assert c.req_s == pytest.approx(2 * 11.245)
    # pdserve prices it as 2 x TP4 (attention DP as TP, the experts at TP4 as the peer's)
    assert vs.worker_tp(c) == 4
    k = vs.cross_args(vs.BY_KEY["qwen-moe"], c, 2000, "c.json", serving=True)
    f = dict(zip(k[1::2], k[2::2]))
    assert (f["--model"], f["--num-instances"], f["--tp"], f["--rate"]) == (
        "qwen3-30b-a3b", "2", "4", "22.49")


def test_estimate_report_and_saved_files(tmp_path: Path) -> None:
    assert vs.parse_estimate(ESTIMATE) == {"ttft_ms": 3445.69, "tpot_ms": 10.113}
    noisy = ("x.py:8: DeprecationWarning: `aiconfigurator cli` is running from the deprecated "
             "AIConfigurator distribution\n  sys.exit(main())\n" + ESTIMATE)
    assert vs.peer_report(noisy) == ESTIMATE.rstrip("\n")
    with pytest.raises(ValueError, match="TTFT"):
        vs.parse_estimate("no numbers")
    run = tmp_path / "meta-llama" / "Meta-Llama-3.1-8B_h100_sxm_vllm_isl4000_osl500"
    for mode, text in (("agg", AGG), ("disagg", DISAGG)):
        (run / mode).mkdir(parents=True)
        (run / mode / "best_config_topn.csv").write_text(text)
    files = vs.topn_files(tmp_path)
    assert sorted(files) == ["agg", "disagg"]
    assert vs.parse_topn(files["agg"].read_text(), "agg")[0].tp == 2


def test_commands_ask_both_planners_the_same_question() -> None:
    peer = vs.peer_command("/venv/bin/python", Q8B, "/tmp/save")
    assert peer[:5] == ["/venv/bin/python", "-m", "aiconfigurator.main", "cli", "default"]
    assert peer[-1] == "--no-color"
    assert dict(zip(peer[5:-1:2], peer[6:-1:2])) == {
        "--model": "meta-llama/Meta-Llama-3.1-8B", "--total-gpus": "8", "--system": "h100_sxm",
        "--backend": "vllm", "--isl": "4000", "--osl": "500", "--ttft": "1000", "--tpot": "20",
        "--save-dir": "/tmp/save"}
    est = vs.estimate_command("py", Q8B, 2, 64)
    assert est[est.index("--estimate-mode") + 1] == "static"
    assert est[est.index("--tp-size") + 1] == "2" and est[est.index("--batch-size") + 1] == "64"
    assert "--moe-tp-size" not in est
    moe = vs.estimate_command("py", vs.BY_KEY["qwen-moe"], 4, 28)
    assert moe[moe.index("--moe-tp-size") + 1] == "4" and moe[moe.index("--moe-ep-size") + 1] == "1"
    plan = vs.plan_args(Q8B, "p.yaml", "p.json", 2)
    assert plan[0] == "plan" and "--rate" not in plan
    f = dict(zip(plan[1::2], plan[2::2]))
    assert f == {"--aic-system": "h100_sxm", "--aic-backend": "vllm",
                 "--step-overhead-ms": "1.5", "--seq-overhead-ms": "0.09",
                 "--model": "llama-3.1-8b", "--workload": "fixed:input=4000,output=500",
                 "--slo-ttft": "1", "--slo-tpot": "0.02", "--nodes": "1",
                 "--gpus-per-node": "8", "--workers": "2", "--out": "p.yaml",
                 "--output-json": "p.json"}
    sim = vs.simulate_args(Q8B, "p.yaml", 29.5, 1234, "s.json")
    assert sim[:3] == ["simulate", "--config", "p.yaml"]
    assert sim[sim.index("--rate") + 1] == "29.5"
    assert sim[sim.index("--num-requests") + 1] == "1234"


def test_cross_check_simulates_the_peers_layout_at_its_rate() -> None:
    a = vs.parse_topn(AGG, "agg")[0]  # 4 x TP2 at 4 x 7.437 req/s
    k = vs.cross_args(Q8B, a, 2000, "c.json", serving=False)
    f = dict(zip(k[1::2], k[2::2]))
    assert k[0] == "simulate" and "--step-overhead-ms" not in k
    assert (f["--model"], f["--num-instances"], f["--tp"], f["--pp"]) == ("llama-3.1-8b", "4",
                                                                         "2", "1")
    assert f["--rate"] == "29.748" and f["--num-requests"] == "2000"
    s = vs.cross_args(Q8B, a, 2000, "c.json", serving=True)
    assert s[s.index("--step-overhead-ms") + 1] == "1.5"
    assert s[s.index("--seq-overhead-ms") + 1] == "0.09"
    with pytest.raises(ValueError, match="aggregated"):
        vs.cross_args(Q8B, vs.parse_topn(DISAGG, "disagg")[0], 10, "c.json", serving=False)


def test_long_run_is_five_probe_lengths() -> None:
    # lifetime 1 + 499 x 0.02 = 10.98 s; at 10 req/s the warm-up is 6 lifetimes: 659 requests,
    # then as many judged
    assert vs.long_run_requests(Q8B, 10.0) == 5 * (659 + 659)
    # at a low rate the judged part is the 300-request floor
    assert vs.long_run_requests(Q8B, 1.0) == 5 * (66 + 300)


def test_plan_and_simulate_outputs_are_read() -> None:
    plan = {"best": {"name": "colocated 4 x TP2", "strategy": "colocated", "num_gpus": 8,
                     "goodput_rps": 20.0, "per_gpu_rps": 2.5, "simulated": True},
            "wall_s": 123.0}
    c = vs.parse_plan(plan, 500)
    assert (c.label, c.num_gpus, c.tokens_per_gpu, c.simulated) == (
        "colocated 4 x TP2", 8, 1250.0, True)
    sim = {"workload": {}, "runs": {"sim": {
        "num_requests": 100, "attainment": 0.95,
        "ttft": {"count": 100, "mean": 0.1, "p90": 0.2},
        "tpot": {"count": 100, "mean": 0.01, "p90": 0.015}}}}
    r = vs.long_run_result(sim)
    assert r["meets"] and r["num_requests"] == 100
    assert r["ttft_p90_ms"] == pytest.approx(200) and r["tpot_mean_ms"] == pytest.approx(10)
    assert not vs.long_run_result(sim, target=0.99)["meets"]
    with pytest.raises(ValueError):
        vs.summary_of({"x": [1, 2]})
    row = {"question": {"label": Q8B.label},
           "peer": {"label": "aggregated 4 × TP2", "tokens_per_gpu": 1855.5, "ttft_ms": 155.5,
                    "tpot_ms": 16.9},
           "pdserve": {"label": "colocated 4 x TP2", "tokens_per_gpu": 1250.0,
                       "goodput_rps": 20.0},
           "long_run": r,
           "adapter": {"tp": 2, "batch_size": 64, "peer": {"ttft_ms": 100.0, "tpot_ms": 10.0},
                       "pdserve": {"ttft_ms": 99.0, "tpot_ms": 10.1},
                       "error": {"ttft": -0.01, "tpot": 0.01}}}
    md = vs.table([row, {"question": {"label": "empty"}}])
    assert "| aggregated 4 × TP2 | 1,856 | 156 / 16.9 | colocated 4 x TP2 | 1,250 | 20.00 |" in md
    assert "95.0% of 100, 200 / 15.0" in md and "| empty | – |" in md
    assert "| TP2, bs 64 | 100.0 / 10.00 | 99.0 / 10.10 | -1.0% / +1.0% |" in vs.adapter_table(
        [row])


def test_questions_are_in_both_catalogues() -> None:
    assert len(vs.QUESTIONS) == 5 and len(vs.BY_KEY) == 5
    for q in vs.QUESTIONS:
        assert get_model_config(q.model).name
        assert math.isfinite(q.ttft_s) and q.osl > 1


def test_adapter_static_run_needs_the_optional_package() -> None:
    pytest.importorskip("aiconfigurator_core", reason="optional package (pdserve[aic])",
                        exc_type=ImportError)
    q = vs.Question("t", "llama-3.1-8b", "meta-llama/Meta-Llama-3.1-8B", 2000, 4, 1.0, 0.02)
    out = vs.adapter_static(q, 1, 4)
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0
    assert out["tpot_ms"] < out["ttft_ms"]


@pytest.mark.skipif(not os.environ.get(vs.ENV), reason=f"${vs.ENV} (aiconfigurator's venv)")
def test_peer_estimate_runs() -> None:
    cmd = vs.estimate_command(os.environ[vs.ENV], vs.Question(
        "t", "llama-3.1-8b", "meta-llama/Meta-Llama-3.1-8B", 2000, 4, 1.0, 0.02), 1, 4)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    est = vs.parse_estimate(out.stdout + out.stderr)
    assert est["ttft_ms"] > est["tpot_ms"] > 0


def test_adapter_prices_the_moe_worker_at_its_tp() -> None:
    # the peer's Qwen3-30B-A3B worker (TP1 DP4, MoE TP4) as pdserve's TP4 with experts at TP4
    pytest.importorskip("aiconfigurator_core", reason="optional package (pdserve[aic])",
                        exc_type=ImportError)
    q = vs.Question("t", "qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 2000, 4, 1.0, 0.02, "MoE")
    tp1, tp4 = vs.adapter_static(q, 1, 8), vs.adapter_static(q, 4, 8)
    assert 0 < tp4["tpot_ms"] < tp1["tpot_ms"] and 0 < tp4["ttft_ms"] < tp1["ttft_ms"]
