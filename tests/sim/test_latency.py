
"""Latency models: DistServe's fitted form on hand-computed numbers, relative-LSQ fitting,
the analytic roofline (monotonicity, TP, GQA, bound against DistServe's measured profile),
KV transfer time and pipeline parallelism."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.batch import ScheduledBatch, ScheduledSeq
from pdserve.request import Request, SamplingParams
from pdserve.sim.analytic import AnalyticModel, Efficiency
from pdserve.sim.hardware import LinkSpec, get_link
from pdserve.sim.latency import (
    FittedProfile,
    PipelineModel,
    ProfileSample,
    fit_profile,
    kv_transfer_time,
    pipeline_finish_times,
    profile_grid,
)
from pdserve.sim.model_catalogue import get_model_config

# DistServe simdistserve/estimators/profile_data/profiler-a100-80g.distserve.json @ 82831f1,
# facebook/opt-13b, tp=1 (milliseconds), as shipped in /work/shared/profiles.
OPT13_TP1 = {
    "decoding_large_small_bs_threshold": 95,
    "prefill": [18.10254647486372, 0.1019122572698738, 7.122264314252114e-06],
    "decoding_smallbs": [19.934702624895458, 0.0006269356524350583, 0.03850697740828398],
    "decoding_largebs": [7.1661889468253595, 0.0005798000403396046, 0.15831096191764046],
}
SHIPPED = str(Path(__file__).resolve().parents[2] / "pdserve" / "data" / "profiles"
              / "distserve_profiler-a100-80g.distserve.json")  # shipped with pdserve
OPT13 = get_model_config("opt-13b")


@pytest.fixture
def ds_path(tmp_path):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"facebook/opt-13b": {"1": OPT13_TP1}}))
    return p


@pytest.fixture
def prof(ds_path):
    return FittedProfile.from_distserve_json(ds_path, OPT13, tp=1)


# ------------------------------------------------------------------ DistServe's fitted form
def test_distserve_prefill_hand_computed(prof):
    # lens 100 and 200: Σl = 300, Σl² = 10000 + 40000 = 50000
    ms = 18.10254647486372 + 0.1019122572698738 * 300 + 7.122264314252114e-06 * 50000
    assert prof.prefill_time([100, 200]) == pytest.approx(ms * 1e-3, rel=1e-12)
    assert prof.source.startswith("distserve:") and prof.model == "facebook/opt-13b"


def test_distserve_decode_small_large_split(prof):
    small = 19.934702624895458 + 0.0006269356524350583 * 94 * 300 + 0.03850697740828398 * 94
    large = 7.1661889468253595 + 0.0005798000403396046 * 95 * 300 + 0.15831096191764046 * 95
    assert prof.decode_time([300] * 94) == pytest.approx(small * 1e-3, rel=1e-12)
    assert prof.decode_time([300] * 95) == pytest.approx(large * 1e-3, rel=1e-12)
    assert prof.step_time([], []) == 0.0


def test_mixed_step_rule(prof):
    # chunk (start=100, n=50): quadratic feature (150² − 100²) = 12500; decodes 200 and 300:
    # prefill formula + decode marginal terms, no decode constant.
    a, b, c = OPT13_TP1["prefill"]
    _, bd, cd = OPT13_TP1["decoding_smallbs"]
    ms = a + b * 50 + c * 12500 + bd * 500 + cd * 2
    assert prof.step_time([(100, 50)], [200, 300]) == pytest.approx(ms * 1e-3, rel=1e-12)
    # chunks of one prompt add up to the whole prompt's quadratic term
    whole = prof.prefill_time([300]) - a * 1e-3
    parts = sum(prof.step_time([ch], []) - a * 1e-3 for ch in [(0, 100), (100, 100), (200, 100)])
    assert parts == pytest.approx(whole, rel=1e-12)


def test_batch_time_uses_scheduled_batch(prof):
    params = SamplingParams(max_tokens=4)
    pre = Request("p", list(range(300)), params)
    dec = Request("d", list(range(20)), params)
    dec.all_token_ids.append(7)  # one generated token: decoding position 20 (context 21)
    batch = ScheduledBatch(0, [ScheduledSeq(pre, 100, 50, False), ScheduledSeq(dec, 20, 1, True)])
    assert prof.batch_time(batch) == prof.step_time([(100, 50)], [21])


def test_loads_shipped_distserve_files():
    for engine in ("distserve", "vllm"):
        path = SHIPPED.replace("distserve.json", f"{engine}.json")
        for model, tps in (("facebook/opt-13b", (1, 2, 4)), ("opt-66b", (2, 3, 4, 8))):
            for tp in tps:
                p = FittedProfile.load(path, model, tp)
                assert p.tp == tp and p.decode_threshold == 95
                assert p.prefill_time([512]) > p.decode_time([512])
    p = FittedProfile.from_distserve_json(SHIPPED, OPT13, 1)
    assert p.prefill == pytest.approx(tuple(x * 1e-3 for x in OPT13_TP1["prefill"]))
    with pytest.raises(ValueError, match="no tp=8"):
        FittedProfile.from_distserve_json(SHIPPED, OPT13, 8)
    with pytest.raises(ValueError, match="not in profile"):
        FittedProfile.from_distserve_json(SHIPPED, "llama-2-7b", 1)


def test_own_format_roundtrip(prof, tmp_path):
    p = FittedProfile(prof.prefill, prof.decode_small, prof.decode_large, 95, model="m",
                      hardware="A100-80GB", tp=2, dtype="bfloat16", source="measured",
                      fit_error={"prefill": {"max_rel": 0.01, "mean_rel": 0.005, "n": 9}})
    path = tmp_path / "p.json"
    p.save(path)
    d = json.loads(path.read_text())
    assert d["format"] == "pdserve-latency-profile" and d["units"] == "s" and d["tp"] == 2
    q = FittedProfile.load(path)
    assert q == p and q.fit_error == p.fit_error
    other = tmp_path / "distserve-like.json"
    other.write_text(json.dumps({"facebook/opt-13b": {"1": OPT13_TP1}}))
    with pytest.raises(ValueError, match="pass model"):
        FittedProfile.load(other)
    with pytest.raises(ValueError, match="not a pdserve"):
        FittedProfile.from_dict({"format": "x"})


# ------------------------------------------------------------------------------ fitting
TRUE = FittedProfile((0.015, 1.0e-4, 5.0e-9), (0.020, 6.0e-7, 4.0e-5), (0.008, 5.0e-7, 1.5e-4))


def _samples(rng, noise):
    out = []
    for _ in range(150):
        lens = [int(x) for x in rng.integers(16, 2048, size=rng.integers(1, 5))]
        out.append(ProfileSample.prefill(lens, TRUE.prefill_time(lens)))
    for _ in range(150):
        bs = int(rng.integers(1, 256))
        ctx = [int(x) for x in rng.integers(32, 2048, size=bs)]
        out.append(ProfileSample.decode(ctx, TRUE.decode_time(ctx)))
    return [ProfileSample(s.prefill_chunks, s.decode_context_lens,
                          s.seconds * (1 + noise * rng.standard_normal())) for s in out]


@pytest.mark.parametrize("nonneg", [True, False])
def test_fit_recovers_noiseless(nonneg):
    fit = fit_profile(_samples(np.random.default_rng(0), 0.0), nonneg=nonneg)
    for part in ("prefill", "decode_small", "decode_large"):
        assert getattr(fit, part) == pytest.approx(getattr(TRUE, part), rel=1e-6)
        assert fit.fit_error[part]["max_rel"] < 1e-9


def test_fit_with_two_percent_noise():
    # A profiler-style design (profile_grid: batch and length varied independently), each shape
    # measured 5 times with 2 % multiplicative noise.
    rng = np.random.default_rng(0)
    samples = [ProfileSample(s.prefill_chunks, s.decode_context_lens,
                             TRUE.step_time(s.prefill_chunks, s.decode_context_lens)
                             * (1 + 0.02 * rng.standard_normal()))
               for s in profile_grid() for _ in range(5)]
    fit = fit_profile(samples, model="synthetic", tp=1)
    assert fit.model == "synthetic"
    # Intercepts and per-token slopes within 5 %; the quadratic / per-sequence terms, which
    # carry < 15 % of any step's time, are identified more loosely (within 25 %).
    for part in ("prefill", "decode_small", "decode_large"):
        got, want = getattr(fit, part), getattr(TRUE, part)
        assert got[:2] == pytest.approx(want[:2], rel=0.05), part
        assert got[2] == pytest.approx(want[2], rel=0.25), part
        assert 0.01 < fit.fit_error[part]["mean_rel"] < 0.025
    for s in profile_grid():  # predictions within 2 % of the truth on every shape
        args = (s.prefill_chunks, s.decode_context_lens)
        assert fit.step_time(*args) == pytest.approx(TRUE.step_time(*args), rel=0.02)


def test_fit_reports_mixed_and_needs_samples():
    s = _samples(np.random.default_rng(2), 0.0)
    mixed = ProfileSample(((100, 50),), (200, 300), TRUE.step_time([(100, 50)], [200, 300]))
    fit = fit_profile(s + [mixed])
    assert fit.fit_error["mixed"]["max_rel"] < 1e-6
    with pytest.raises(ValueError, match="need >= 3"):
        fit_profile(s[:2])


# ---------------------------------------------------------------------------- analytic
A100_TP1 = AnalyticModel(OPT13, "a100", tp=1)


def test_analytic_monotone():
    m = A100_TP1
    pre = [m.prefill_time([n]) for n in (1, 16, 128, 512, 1024, 2048, 4096)]
    assert all(x < y for x, y in zip(pre, pre[1:]))
    assert m.prefill_time([512] * 4) > m.prefill_time([512] * 2) > m.prefill_time([512])
    dec_ctx = [m.decode_time([c] * 8) for c in (16, 256, 1024, 4096)]
    assert all(x < y for x, y in zip(dec_ctx, dec_ctx[1:]))
    dec_bs = [m.decode_time([512] * b) for b in (1, 8, 64, 256)]
    assert all(x < y for x, y in zip(dec_bs, dec_bs[1:]))
    chunk = [m.step_time([(s, 256)], []) for s in (0, 512, 2048)]  # earlier context costs
    assert all(x < y for x, y in zip(chunk, chunk[1:]))
    assert m.step_time([(0, 256)], [512] * 8) > m.step_time([(0, 256)], [])
    assert m.step_time([], []) == 0.0


def test_analytic_tp_speeds_up_large_prefill():
    tp2 = AnalyticModel(OPT13, "a100", tp=2)
    assert tp2.prefill_time([2048]) < 0.75 * A100_TP1.prefill_time([2048])
    assert "allreduce" in tp2.breakdown([(0, 2048)], []) and tp2.link.name == "nvlink3"
    slow = AnalyticModel(OPT13, "a100", tp=2, link="pcie4")
    assert slow.prefill_time([2048]) > tp2.prefill_time([2048])


def test_analytic_factors_and_validation():
    fast = AnalyticModel(OPT13, "h100", tp=1)
    assert fast.prefill_time([2048]) < A100_TP1.prefill_time([2048])
    assert AnalyticModel(OPT13, "a100", mfu_gemm=0.35).prefill_time([2048]) > \
        A100_TP1.prefill_time([2048])
    assert AnalyticModel(OPT13, "a100", efficiency=Efficiency(step_overhead_s=0.0)) \
        .decode_time([1]) < A100_TP1.decode_time([1])
    with pytest.raises(TypeError, match="unknown efficiency"):
        AnalyticModel(OPT13, "a100", mfu=0.5)
    with pytest.raises(ValueError, match="not divisible"):
        AnalyticModel(OPT13, "a100", tp=3)  # 40 heads
    with pytest.raises(ValueError, match="mbu_kv"):
        Efficiency(mbu_kv=1.5)


def test_gqa_moves_fewer_kv_bytes():
    mha, gqa = get_model_config("llama-2-7b"), get_model_config("llama-3-8b")
    assert gqa.kv_bytes_per_token() * 4 == mha.kv_bytes_per_token()  # 8 vs 32 KV heads
    link = get_link("eth-25g")
    assert kv_transfer_time(512, gqa, "float16", link) < kv_transfer_time(512, mha, "float16",
                                                                           link)
    # decode attention reads the same fewer bytes
    t_mha = AnalyticModel(mha, "a100").breakdown([], [4096] * 64)["attn_decode"]
    t_gqa = AnalyticModel(gqa, "a100").breakdown([], [4096] * 64)["attn_decode"]
    assert t_gqa < t_mha / 3


def test_kv_transfer_time_hand_computed():
    # OPT-13B: 40 layers × 2 (K, V) × 5120 × 2 bytes = 819,200 bytes per token
    assert OPT13.kv_bytes_per_token("float16") == 40 * 2 * 5120 * 2
    link = LinkSpec(25 / 8, 1e-3, "25g")  # 25 Gb/s = 3.125 GB/s, 1 ms
    t = kv_transfer_time(512, OPT13, "float16", link)
    assert t == pytest.approx(512 * 819_200 / 3.125e9 + 1e-3, rel=1e-12)  # 0.13522 s
    assert kv_transfer_time(512, OPT13, "float16", link, streams=2) == \
        pytest.approx(512 * 819_200 / 6.25e9 + 1e-3, rel=1e-12)
    assert kv_transfer_time(0, OPT13, "float16", link) == 0.0


# Points of docs/fidelity.md; the bound there: ≤ 40 % at 1×128 (the roofline's ridge point,
# where the max() roofline is optimistic), ≤ 15 % at every other point.
PREFILL_POINTS = ([128], [512], [2048], [512] * 4)
DECODE_POINTS = ((1, 512), (16, 512), (64, 1024), (128, 1024))


def test_analytic_vs_distserve_opt13b_tp1(prof):
    errs = {}
    for lens in PREFILL_POINTS:
        errs[f"prefill {len(lens)}x{lens[0]}"] = A100_TP1.prefill_time(lens) / \
            prof.prefill_time(lens) - 1
    for bs, ctx in DECODE_POINTS:
        errs[f"decode {bs}x{ctx}"] = A100_TP1.decode_time([ctx] * bs) / \
            prof.decode_time([ctx] * bs) - 1
    assert abs(errs.pop("prefill 1x128")) <= 0.40
    assert all(abs(e) <= 0.15 for e in errs.values()), errs


def test_analytic_emits_fitted_profile():
    fp = A100_TP1.to_fitted_profile()
    assert fp.model == "facebook/opt-13b" and fp.hardware == "A100-80GB"
    assert fp.source.startswith("analytic")
    assert set(fp.fit_error) == {"prefill", "decode_small", "decode_large"}
    for bs, ctx in DECODE_POINTS:
        assert fp.decode_time([ctx] * bs) == pytest.approx(A100_TP1.decode_time([ctx] * bs),
                                                          rel=0.1)
    assert fp.prefill_time([2048]) == pytest.approx(A100_TP1.prefill_time([2048]), rel=0.1)


# ------------------------------------------------------------------------------ pipeline
def test_pipeline_model(prof):
    link = LinkSpec(10.0, 1e-4, "l")
    assert PipelineModel(prof, 1).step_time([(0, 512)], []) == prof.prefill_time([512])
    pm = PipelineModel(prof, pp=4, model=OPT13, link=link)
    send = 512 * 5120 * 2 / 10e9 + 1e-4
    base = prof.prefill_time([512])
    assert pm.stage_time([(0, 512)], []) == pytest.approx(base / 4 + send)
    assert pm.step_time([(0, 512)], []) == pytest.approx(base + 3 * send)
    assert pm.step_time([], []) == 0.0
    with pytest.raises(ValueError):
        PipelineModel(prof, 0)


def test_pipeline_bubbles():
    assert pipeline_finish_times([1.0, 1.0, 1.0], 2) == [2.0, 3.0, 4.0]
    # a long batch behind a short one: the last stage idles from 2 to 3
    fin = pipeline_finish_times([1.0, 2.0], 2)
    assert fin == [2.0, 5.0]
    assert fin[-1] - 3.0 - 1.0 == 1.0  # bubble beyond the fill
    assert pipeline_finish_times([3.0], 3) == [9.0]


def test_no_torch_import():
    code = "import sys, pdserve.sim.latency, pdserve.sim; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
