"""Simulator: closed-form queueing (M/D/1), hand-computed timelines, disaggregated flow."""

import random

import pytest

from pdserve.config import CacheConfig, EngineConfig, Link, ModelConfig, SchedulerConfig
from pdserve.sim.simulator import SimInstance, SimRequest, Simulator

MODEL = ModelConfig(family="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=4096)


class Const:
    """Every step takes ``d`` seconds."""

    def __init__(self, d):
        self.d = d

    def batch_time(self, batch):
        return self.d


class Linear:
    """prefill: a + b * tokens; decode step: c (whole batch)."""

    def __init__(self, a, b, c):
        self.a, self.b, self.c = a, b, c

    def batch_time(self, batch):
        prefills, _ = batch.shape()
        toks = sum(n for _, n in prefills)
        return (self.a + self.b * toks) if toks else self.c


def engine(role="colocated", seqs=256, budget=4096, chunked=False, blocks=4096):
    return EngineConfig(cache=CacheConfig(block_size=16, num_kv_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                  max_num_seqs=seqs, max_model_len=4096,
                                                  enable_chunked_prefill=chunked, role=role))


def prompt(i, n):
    return [(i * 7919 + j) % 1000 for j in range(n)]


@pytest.mark.parametrize("rate", [5.0, 8.0])
def test_md1_mean_ttft_matches_distserve_eq1(rate):
    """DistServe Eq. 1: one prefill server, deterministic service D, Poisson arrivals R:
    mean TTFT = D + R D^2 / (2 (1 - R D))."""
    d, n = 0.1, 20000
    rng = random.Random(42)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        reqs.append(SimRequest(f"r{i}", t, prompt(i, 32), 1))
    sim = Simulator([SimInstance("c0", engine(seqs=1), Const(d), 4096)], MODEL)
    res = sim.run(reqs)
    ttft = [r.timeline.ttft for r in res.records]
    mean = sum(ttft) / len(ttft)
    expected = d + rate * d * d / (2 * (1 - rate * d))
    assert mean == pytest.approx(expected, rel=0.05)


def test_hand_computed_colocated_timeline():
    # prefill time 0.01 + 0.001/token, decode step 0.005; whole-prompt (prefill-first) batching
    sim = Simulator([SimInstance("c0", engine(), Linear(0.01, 0.001, 0.005), 4096)], MODEL)
    res = sim.run([SimRequest("a", 0.0, prompt(1, 100), 3),
                   SimRequest("b", 0.05, prompt(2, 50), 2)])
    a, b = {r.request_id: r.timeline for r in res.records}.values()
    # a: prefill [0, 0.11] -> token 1; b arrives during it and waits (prefill-first): b's
    # prefill [0.11, 0.17] -> b token 1; then decode steps of 0.005 for both
    assert a.token_times == pytest.approx([0.11, 0.175, 0.18])
    assert b.token_times == pytest.approx([0.17, 0.175])
    # routed on arrival; the instance takes the command when its running step ends
    assert b.routed == pytest.approx(0.05) and b.prefill_queued == pytest.approx(0.11)
    assert b.prefill_start == pytest.approx(0.11)
    assert res.duration == pytest.approx(0.18)


def test_hand_computed_disaggregated_timeline_with_link():
    # 1 prefill + 1 decode on different nodes, link 1 GB/s + 1 ms latency
    kv_per_token = MODEL.kv_bytes_per_token("float16")  # 2 * 2 layers * 2 heads * 16 dim * 2 B
    assert kv_per_token == 256
    sim = Simulator([SimInstance("p0", engine("prefill"), Linear(0.01, 0.001, 0.0), 4096,
                                 node=0),
                     SimInstance("d0", engine("decode"), Linear(0.0, 0.0, 0.004), 4096, node=1)],
                    MODEL, inter_node_link=Link(1.0, 0.001))
    res = sim.run([SimRequest("a", 0.0, prompt(3, 40), 3)])
    tl = res.records[0].timeline
    # prefill 0.01 + 0.04 = 0.05; KV of 40 tokens = 3 blocks of 16 = 48 tokens * 256 B
    transfer = 0.001 + 48 * 256 / 1e9
    assert tl.prefill_end == pytest.approx(0.05) and tl.transfer_start == pytest.approx(0.05)
    assert tl.transfer_end == pytest.approx(0.05 + transfer)
    assert tl.token_times == pytest.approx([0.05, 0.05 + transfer + 0.004,
                                            0.05 + transfer + 0.008])
    assert tl.decode_queued == pytest.approx(0.05) and tl.decode_admitted == pytest.approx(
        0.05 + transfer)
    for st in res.instance_stats.values():
        assert st.num_used_blocks == 0


def test_transfer_end_is_the_link_time_not_the_decode_step_in_flight():
    """b's KV arrives while the decode instance is in the middle of a step for a: the transfer
    takes exactly the link time, the wait for the step in flight is decode queue, and b's next
    token comes one decode step after its admission."""
    sim = Simulator([SimInstance("p0", engine("prefill"), Linear(0.01, 0.001, 0.0), 4096,
                                 node=0),
                     SimInstance("d0", engine("decode"), Linear(0.0, 0.0, 0.004), 4096, node=1)],
                    MODEL, inter_node_link=Link(1.0, 0.001))
    res = sim.run([SimRequest("a", 0.0, prompt(3, 40), 50),
                   SimRequest("b", 0.06, prompt(4, 40), 3)])
    tl = {r.request_id: r.timeline for r in res.records}["b"]
    transfer = 0.001 + 48 * 256 / 1e9
    assert tl.prefill_end == pytest.approx(0.11)  # prefill [0.06, 0.11]
    assert tl.transfer_end - tl.transfer_start == pytest.approx(transfer)
    # the decode instance is busy with a's steps: b is admitted at the next step boundary
    assert tl.decode_admitted > tl.transfer_end + 1e-4
    assert tl.token_times[1] == pytest.approx(tl.decode_admitted + 0.004)


def test_driver_overhead_adds_to_every_step_and_nothing_to_idle():
    from pdserve.sim.latency import DriverOverhead, LatencyModel

    class LinearSteps(LatencyModel):
        def step_time(self, prefill_chunks, decode_context_lens):
            toks = sum(n for _, n in prefill_chunks)
            return 0.01 + 0.001 * toks if toks else (0.005 if decode_context_lens else 0.0)

    lat = DriverOverhead(LinearSteps(), 0.002, 0.0005)
    assert lat.step_time([], []) == 0.0
    assert lat.step_time([], [10, 20, 30]) == pytest.approx(0.005 + 0.002 + 3 * 0.0005)
    with pytest.raises(ValueError, match="-0.1"):
        DriverOverhead(LinearSteps(), -0.1)
    sim = Simulator([SimInstance("c0", engine(), lat, 4096)], MODEL)
    res = sim.run([SimRequest("a", 0.0, prompt(1, 100), 3)])
    # prefill 0.01 + 0.1 + 0.0025, then two decode steps of 0.005 + 0.0025
    assert res.records[0].timeline.token_times == pytest.approx([0.1125, 0.12, 0.1275])


def test_stop_ends_the_run_where_it_returns_true():
    """``run(stop=...)``: the callback sees every event's time in order; the run ends at the
    first true, with the state of that moment (no stall errors for unfinished requests), and
    the events before it are exactly those of the full run."""
    reqs = [SimRequest(f"r{i}", 0.05 * i, prompt(i, 32), 4) for i in range(20)]

    def sim():
        return Simulator([SimInstance("c0", engine(seqs=2), Const(0.1), 4096)], MODEL)

    full_times: list[float] = []
    full = sim().run(reqs, stop=lambda now: full_times.append(now) or False)
    assert not full.stopped and len(full_times) == full.num_events
    assert full_times == sorted(full_times)
    seen: list[float] = []
    part = sim().run(reqs, stop=lambda now: seen.append(now) or len(seen) == 30)
    assert part.stopped and part.num_events == 30 and seen == full_times[:30]
    assert part.duration == full_times[29] < full.duration
    assert all(r.error is None for r in part.records)
    assert sum(r.finish_reason is None for r in part.records) > 0  # some were mid-flight
