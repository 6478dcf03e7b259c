"""pdserve.bench.experiments.ecoserve (benchmarks/ecoserve.py): EcoServe's latency accounting
(§4.2.2) against the standard one (DESIGN.md), and the breakdown that says where a request
missed, on hand-worked timelines."""

import importlib

import pytest

from pdserve.bench.metrics import SLO, RequestRecord, attains
from pdserve.request import Timeline

SLO_CHAT = SLO(5.0, 0.1)


@pytest.fixture(scope="module")
def eco():
    return importlib.import_module("pdserve.bench.experiments.ecoserve")


def rec(first, decode_start, gaps, arrival=0.0, routed=None, ok=True):
    """Prefill from ``arrival`` to ``first`` (the first token), decoding from ``decode_start``;
    the later tokens ``gaps`` apart, the first of them one gap after ``decode_start``."""
    toks = [first]
    t = decode_start
    for g in gaps:
        t += g
        toks.append(t)
    tl = Timeline(arrival=arrival, routed=arrival if routed is None else routed,
                  prefill_start=arrival if routed is None else routed, prefill_end=first,
                  decode_start=decode_start, token_times=toks, finish=toks[-1])
    return RequestRecord("r", 10, len(toks), tl, ok=ok)


def test_the_phase_switch_wait_moves_from_tpot_into_ttft(eco):
    # first token at 1 s, decoding starts at 3 s (2 s of other prompts' prefills), then 10
    # tokens 50 ms apart: standard TPOT = (3.5 − 1.0) / 10 = 250 ms > 100 ms: a miss;
    # EcoServe: TTFT 1 + 2 = 3 s <= 5 s, TPOT (2.5 − 2.0) / 10 = 50 ms: met
    r = rec(1.0, 3.0, [0.05] * 10)
    assert r.timeline.switch_wait == pytest.approx(2.0)
    assert r.tpot == pytest.approx(0.25) and not attains(r, SLO_CHAT)
    assert eco.eco_ok(r, SLO_CHAT)
    assert eco.tpot_miss_own_wait(r, SLO_CHAT)  # its own wait made it miss
    b = eco.breakdown([r], SLO_CHAT)
    assert (b["miss_ttft"], b["miss_tpot"], b["miss_tpot_own_wait"]) == (0.0, 1.0, 1.0)
    # the wait uses 2 s of the (11 − 1) × 100 ms = 1 s TPOT budget
    assert b["wait_share_of_tpot_budget"] == pytest.approx(2.0)


def test_ecoserve_ttft_counts_the_wait_and_a_decode_stall_is_not_the_wait(eco):
    # first token at 4 s, decoding at 6 s: standard TTFT 4 s is met, EcoServe's 6 s is not
    slow = rec(4.0, 6.0, [0.05] * 100)
    assert slow.ttft == 4.0 and not eco.eco_ok(slow, SLO_CHAT)
    # no wait, but 200 ms between tokens (stalled by later phases): both definitions miss,
    # and not because of the request's own wait
    stall = rec(1.0, 1.0, [0.2] * 10)
    assert stall.timeline.switch_wait == 0.0
    assert not attains(stall, SLO_CHAT) and not eco.eco_ok(stall, SLO_CHAT)
    assert not eco.tpot_miss_own_wait(stall, SLO_CHAT)
    # a failed request attains under neither
    assert not eco.eco_ok(rec(1.0, 1.0, [0.05], ok=False), SLO_CHAT)


def test_breakdown_counts_router_holds(eco):
    held = rec(2.0, 2.0, [0.05] * 5, arrival=0.0, routed=1.5)  # held 1.5 s by the router
    free = rec(1.0, 1.0, [0.05] * 5)
    b = eco.breakdown([held, free], SLO_CHAT)
    assert b["held_share"] == 0.5 and b["hold_mean_s"] == pytest.approx(0.75)
    assert b["prefill_queue_mean_s"] == pytest.approx(0.75)
