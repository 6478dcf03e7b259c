"""Metrics on hand-computed timelines (DESIGN.md "Goodput definitions")."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import (
    SLO,
    RequestRecord,
    attainment,
    latency_breakdown,
    meets,
    stage_durations,
    summarize,
    tightest_slo_scale,
)
from pdserve.request import Timeline

SLO_ = SLO(ttft=0.2, tpot=0.06)


def rec(rid: str, arrival: float, tokens: list[float], ok: bool = True,
        **tl: float) -> RequestRecord:
    return RequestRecord(rid, 10, len(tokens), Timeline(arrival=arrival, token_times=tokens,
                                                        **tl),
                         ok=ok, error=None if ok else "aborted")


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        rec("a", 0.0, [0.10, 0.15, 0.20, 0.25]),  # TTFT 0.10, TPOT 0.05: attains
        rec("b", 1.0, [1.15]),  # one token: TTFT 0.15, TPOT undefined = met
        rec("c", 2.0, [2.01, 2.02], ok=False),  # aborted: never attains
        rec("d", 3.0, [3.05, 3.25, 3.45]),  # TTFT 0.05, TPOT 0.20 > 0.06
    ]


def test_ttft_tpot_itl_e2e_by_hand(records: list[RequestRecord]) -> None:
    a, b, _, d = records
    assert a.ttft == pytest.approx(0.10) and a.tpot == pytest.approx(0.05)
    assert a.itls == pytest.approx([0.05, 0.05, 0.05])
    assert a.e2e == pytest.approx(0.25)
    assert b.ttft == pytest.approx(0.15) and b.tpot is None and b.itls == []
    assert d.tpot == pytest.approx(0.20)
    a.timeline.finish = 0.30  # finish, when known, ends the request
    assert a.e2e == pytest.approx(0.30)


def test_attainment_counts_one_token_as_met_and_failures_as_missed(
        records: list[RequestRecord]) -> None:
    assert [meets(r, SLO_) for r in records] == [(True, True), (True, True), (False, False),
                                                 (True, False)]
    assert attainment(records, SLO_) == 0.5
    # DistServe's variant: TTFT met by 3/4, TPOT by 2/4 -> min = 0.5
    assert attainment(records, SLO_, "distserve") == 0.5
    assert attainment(records, SLO(0.2, 1.0), "distserve") == 0.75
    assert attainment([], SLO_) == 0.0
    with pytest.raises(ValueError, match="criterion"):
        attainment(records, SLO_, "p50")


def test_ok_request_without_tokens_does_not_attain() -> None:
    assert attainment([rec("e", 0.0, [])], SLO_) == 0.0


def test_tightest_slo_scale_is_exact(records: list[RequestRecord]) -> None:
    # required scales: a max(0.5, 0.833) b 0.75, c inf, d max(0.25, 3.33)
    assert tightest_slo_scale(records, SLO_, 0.5) == pytest.approx(0.05 / 0.06)
    assert tightest_slo_scale(records, SLO_, 0.75) == pytest.approx(0.20 / 0.06)
    assert math.isinf(tightest_slo_scale(records, SLO_, 1.0))
    s = tightest_slo_scale(records, SLO_, 0.5)
    assert attainment(records, SLO_.scaled(s), "both") == 0.5
    assert attainment(records, SLO_.scaled(s * 0.999), "both") == 0.25


def test_summary_statistics_and_per_gpu(records: list[RequestRecord]) -> None:
    s = summarize(records, SLO_, target=0.5, num_gpus=2)
    assert (s.num_requests, s.num_ok, s.num_failed) == (4, 3, 1)
    assert s.ttft.count == 3 and s.ttft.mean == pytest.approx((0.10 + 0.15 + 0.05) / 3)
    assert s.ttft.median == pytest.approx(0.10)
    assert s.tpot.count == 2 and s.tpot.mean == pytest.approx(0.125)
    assert s.itl.count == 5 and s.itl.max == pytest.approx(0.20)
    assert s.duration_s == pytest.approx(3.45)  # first arrival 0 to last token 3.45
    assert s.offered_rate_rps == pytest.approx(1.0)  # 3 gaps over 3 s
    assert s.throughput_rps == pytest.approx(3 / 3.45)
    assert s.per_gpu_throughput_rps == pytest.approx(3 / 3.45 / 2)
    assert s.output_tokens_per_s == pytest.approx(8 / 3.45)
    assert s.attainment == 0.5 and s.attainment_distserve == 0.5
    assert s.ttft_attainment == 0.75 and s.tpot_attainment == 0.5
    assert s.ttft_percentile == pytest.approx(0.10)  # 2nd smallest of 0.05, 0.10, 0.15, inf
    assert s.tpot_percentile == pytest.approx(0.05)  # 2nd smallest of 0 (b), 0.05, 0.2, inf
    assert s.errors == {"aborted": 1}
    d = s.to_dict()
    assert d["ttft"]["count"] == 3 and d["slo"] == {"ttft": 0.2, "tpot": 0.06}


def test_summary_without_slo_has_no_attainment(records: list[RequestRecord]) -> None:
    s = summarize(records)
    assert s.attainment is None and s.slo is None and s.num_gpus == 1


def test_breakdown_disaggregated_by_hand() -> None:
    tl = Timeline(arrival=0.0, prefill_start=0.1, prefill_end=0.3, transfer_start=0.35,
                  transfer_end=0.40, decode_admitted=0.45, token_times=[0.3, 0.5, 0.6],
                  finish=0.6)
    d = stage_durations(tl)
    assert d == pytest.approx({"prefill_queue": 0.1, "prefill": 0.2, "transfer": 0.05,
                               "decode_queue": 0.1, "decode": 0.15})
    assert sum(d.values()) == pytest.approx(0.6)


def test_breakdown_colocated_and_missing() -> None:
    tl = Timeline(arrival=1.0, prefill_start=1.2, prefill_end=1.5, token_times=[1.5, 1.6, 1.7])
    assert stage_durations(tl) == pytest.approx({"prefill_queue": 0.2, "prefill": 0.3,
                                                 "transfer": 0.0, "decode_queue": 0.0,
                                                 "decode": 0.2})
    assert stage_durations(Timeline(arrival=0.0, token_times=[0.1])) is None
    r1 = RequestRecord("x", 1, 3, tl)
    r2 = RequestRecord("y", 1, 0, Timeline(arrival=0.0), ok=False)
    b = latency_breakdown([r1, r2])
    assert b is not None and b["count"] == 1
    assert b["mean_s"]["prefill"] == pytest.approx(0.3)
    assert sum(b["share"].values()) == pytest.approx(1.0)
    assert b["share"]["prefill_queue"] == pytest.approx(0.2 / 0.7)
    assert latency_breakdown([r2]) is None


def test_breakdown_prefers_server_timeline() -> None:
    client = Timeline(arrival=0.0, token_times=[0.5, 0.6])
    server = Timeline(arrival=100.0, prefill_start=100.1, prefill_end=100.4,
                      token_times=[100.4, 100.5], finish=100.5)
    r = RequestRecord("s", 1, 2, client, server_timeline=server)
    b = latency_breakdown([r])
    assert b is not None and b["mean_s"]["prefill"] == pytest.approx(0.3)


def test_record_round_trip() -> None:
    r = RequestRecord("r", 5, 2, Timeline(arrival=0.0, token_times=[0.1, 0.2]),
                      server_timeline=Timeline(arrival=7.0), note="n")
    back = RequestRecord.from_dict(r.to_dict())
    assert back == r


def test_slo_validation() -> None:
    with pytest.raises(ValueError, match="ttft"):
        SLO(0.0, 0.1)
    with pytest.raises(ValueError, match="tpot"):
        SLO(1.0, float("nan"))
    assert SLO(1.0, 0.1).scaled(2) == SLO(2.0, 0.2)
