"""EcoServe's partial disaggregation: temporal phases, Algorithm 2's constraints (hand-worked),
rolling activation (Algorithm 1), mitosis split/merge at the N_l/N_u boundaries, migration
under load, and the settings' errors."""

import pytest

from pdserve.cluster.controller import ClusterRequest, Controller, Send
from pdserve.cluster.macro import MacroRolling
from pdserve.cluster.routing import InstanceView
from pdserve.cluster.scaling import Mitosis, Move, check_bounds
from pdserve.cluster.worker import InstanceWorker, StepReport, TokenDelta
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import EngineStats
from pdserve.request import SamplingParams, Timeline
from tests.engine.fakes import FakeExecutor

P = SamplingParams(max_tokens=4, ignore_eos=True)


# ------------------------------------------------------------------ settings
def test_partial_strategy_builds_temporal_instances_with_the_router():
    c = ClusterConfig.from_dict({"model": "m", "strategy": "partial", "num_instances": 4,
                                 "slo_ttft": 1.0, "slo_tpot": 0.1, "max_model_len": 2048})
    assert c.strategy == "partial" and c.prefill_router == "macro_rolling"
    specs = c.instance_specs()
    assert [s.role for s in specs] == ["temporal"] * 4
    assert not specs[0].engine.scheduler.enable_chunked_prefill
    assert c.router_options()["slo_ttft"] == 1.0
    assert ClusterConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("kw, msg", [
    ({"mitosis_lower": 3, "mitosis_upper": 2}, "must be <= mitosis_upper"),
    ({"mitosis_lower": 3, "mitosis_upper": 4}, "2\\*N_l - 1"),
    ({"slo_ttft": 0}, "slo_ttft must be > 0"),
    ({"slo_tpot": -0.1}, "slo_tpot must be > 0"),
    ({"macro_instance_size": 0}, "macro_instance_size must be an integer >= 1"),
])
def test_bad_settings_get_a_clear_error(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ClusterConfig.from_dict({"model": "m", "strategy": "partial", **kw})


def test_bad_router_and_scheduler_settings():
    with pytest.raises(ValueError, match="N_l=3 must be <= N_u=2"):
        check_bounds(3, 2)
    with pytest.raises(ValueError, match="slo_tpot must be > 0"):
        MacroRolling(slo_tpot=0)
    with pytest.raises(ValueError, match="enable_chunked_prefill must be false"):
        SchedulerConfig(role="temporal", enable_chunked_prefill=True)


# ------------------------------------------------------------------ temporal disaggregation
def temporal_worker(budget=64, blocks=32):
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64,
                                                 enable_chunked_prefill=False, role="temporal"))
    return InstanceWorker("t0", cfg, FakeExecutor(blocks, 4, step_time=1.0))


def add(rid, n, t, out=3):
    from pdserve.cluster.worker import AddRequest

    base = 100 * ord(rid[0])  # distinct prompts: no prefix-cache hits between requests
    return AddRequest(rid, list(range(base, base + n)),
                      SamplingParams(max_tokens=out, ignore_eos=True), t)


def test_temporal_phases_never_mix_and_report_progress():
    w = temporal_worker()
    r1 = w.handle([add("A", 8, 0.0)], now=0.0)
    assert r1.batch == [("A", 0, 8)] and (r1.phase, r1.phase_switch_time) == ("prefill", 0.0)
    assert r1.progress == [("A", 1.0, 1)]  # first token at the step's end
    r2 = w.handle([], now=1.0)
    assert r2.batch == [("A", 8, 1)] and (r2.phase, r2.phase_switch_time) == ("decode", 1.0)
    # B arrives: the next step is prefill-only (A's decode waits), then both decode
    r3 = w.handle([add("B", 5, 2.0)], now=2.0)
    assert r3.batch == [("B", 0, 5)] and (r3.phase, r3.phase_switch_time) == ("prefill", 2.0)
    assert r3.progress == [("A", 1.0, 2), ("B", 3.0, 1)]
    r4 = w.handle([], now=3.0)
    assert r4.batch == [("A", 9, 1), ("B", 5, 1)] and r4.phase == "decode"
    assert r4.phase_switch_time == 3.0
    w.check_integrity()
    for rep in (r1, r2, r3, r4):  # never a prompt and a decode in one batch
        kinds = {start == 0 for _, start, _ in rep.batch}
        assert len(kinds) == 1


def test_phase_switch_wait_is_in_the_timeline_and_the_stages():
    w = temporal_worker()
    w.handle([add("A", 8, 0.0, out=2)], now=0.0)  # A: prefill 0 → 1
    w.handle([add("B", 8, 1.0, out=2)], now=1.0)  # B's prefill 1 → 2: A waits for it
    last = w.handle([], now=2.0)  # both decode 2 → 3 and finish
    [a_fin] = [d for d in last.deltas if d.request_id == "A"]
    a = a_fin.timeline
    assert (a.prefill_start, a.prefill_end, a.decode_start, a.finish) == (0.0, 1.0, 2.0, 3.0)
    a.arrival = 0.0
    assert a.stages() == {"prefill_queue": 0.0, "prefill": 1.0, "transfer": 0.0,
                          "decode_queue": 1.0, "decode": 1.0}
    assert a.switch_wait == 1.0
    # disaggregated: the wait is the transfer plus the decode queue
    d = Timeline(arrival=0.0, prefill_start=0.0, prefill_end=1.0, transfer_start=1.5,
                 transfer_end=2.5, decode_admitted=2.5, decode_start=2.75,
                 token_times=[1.0, 3.0], finish=3.0)
    assert d.stages()["transfer"] == 1.0 and d.stages()["decode_queue"] == 0.75
    assert d.switch_wait == 1.75


# ------------------------------------------------------------------ Algorithm 2
def creq(rid, n, stage="prefill", instance="i0", first=None):
    r = ClusterRequest(rid, [1] * n, P, Timeline(arrival=0.0), stage=stage, instance=instance)
    if first is not None:
        r.timeline.token_times.append(first)
    return r


def stats(free):
    return EngineStats(0, 0, 0, 0, 100, free, 100 - free, 0.0, 0, 0, 0, 0)


def view(progress=(), free=100, iid="i0"):
    v = InstanceView(iid, "temporal", num_kv_blocks=100, block_size=4, stats=stats(free))
    v.report = StepReport(iid, "temporal", 0.0, progress=list(progress))
    return v


def router(**kw):
    # 10 ms per prompt token; SLOs 1 s / 100 ms
    return MacroRolling(slo_ttft=1.0, slo_tpot=0.1, prefill_time=lambda n: 0.01 * n, **kw)


def test_ttft_constraint_sums_the_pending_prefills():
    r = router()
    r.pending["i0"] = {"p": creq("p", 60)}
    v = view(progress=[("d", 0.0, 100)])  # a decode with plenty of slack (10 s saved)
    assert r.check(v, creq("new", 40), now=0.0)  # 0.6 + 0.4 = 1.0 <= 1.0
    assert not r.check(v, creq("new", 41), now=0.0)  # 0.6 + 0.41 > 1.0


def test_ttft_passes_and_saved_tpot_fails():
    r = router()
    r.pending["i0"] = {"p": creq("p", 30)}
    # t_total = 0.3 + 0.2 = 0.5 s (TTFT holds). Saved TPOT at now = 1.0:
    #   d1: L=10, first token at 0.2 → 10·0.1 − 0.8 = 0.2;  d2: L=5, first at 0.7 → 0.5 − 0.3 = 0.2
    v = view(progress=[("d1", 0.2, 10), ("d2", 0.7, 5)])
    assert not r.check(v, creq("new", 20), now=1.0)  # mean 0.2 < 0.5
    # d1 generated 20 tokens: 2.0 − 0.8 = 1.2 → mean (1.2 + 0.2) / 2 = 0.7 >= 0.5
    v = view(progress=[("d1", 0.2, 20), ("d2", 0.7, 5)])
    assert r.check(v, creq("new", 20), now=1.0)


def test_kv_constraint_counts_pending_prompts_and_one_block_per_decode():
    r = router()
    r.pending["i0"] = {"p": creq("p", 10)}  # 3 blocks of 4 tokens
    v = view(progress=[("d", 0.0, 100)], free=10)  # free 10 − 3 − 1 (decode) = 6
    assert r.check(v, creq("new", 24), now=0.0)  # 6 blocks
    assert not r.check(v, creq("new", 25), now=0.0)  # 7 blocks


def test_prompts_prefilled_in_this_phase_count_until_they_decode():
    r = router()
    r.pending["i0"] = {"p": creq("p", 50), "q": creq("q", 40, stage="decode", first=0.5)}
    # q has its first token but has not decoded (one token in the report): 0.5 + 0.4 + 0.1
    v = view(progress=[("q", 0.5, 1), ("d", 0.0, 100)])
    assert r.check(v, creq("new", 10), now=1.0)
    assert not r.check(v, creq("new", 11), now=1.0)
    # once q decoded (two tokens) it leaves the phase and joins the decodes
    v = view(progress=[("q", 0.5, 2), ("d", 0.0, 100)])
    assert r.check(v, creq("new", 50), now=1.0)  # 0.5 + 0.5 = 1.0
    assert "q" not in r.pending["i0"]


def test_an_idle_instance_takes_a_prompt_over_the_ttft_slo():
    r = router()
    assert r.check(view(), creq("long", 200), now=0.0)  # 2 s alone: waiting cannot help
    r.pending["i0"] = {"p": creq("p", 1)}
    assert not r.check(view(), creq("long", 200), now=0.0)


# ------------------------------------------------------------------ Algorithm 1 + controller
def temporal_views(n):
    return [InstanceView(f"i{k}", "temporal", num_kv_blocks=100, block_size=4)
            for k in range(n)]


def test_rolling_activation_order_and_held_requests():
    # 0.4 s per 40-token prompt, SLO 1 s: an instance takes two pending prompts, then the next
    rt = router(macro_instance_size=3)
    c = Controller(temporal_views(3), rt)
    got = []
    for k in range(7):
        acts = c.on_arrival(f"r{k}", [1] * 40, P, now=0.0)
        got.append(acts[0].instance_id if acts else None)
    assert got == ["i0", "i0", "i1", "i1", "i2", "i2", None]
    assert [q.request_id for q in c.queued] == ["r6"] and c.requests["r6"].stage == "queued"
    # r7 arrives behind the held r6
    assert c.on_arrival("r7", [1] * 40, P, now=0.1) == []
    # i0 returns r0's first token at 1.0: i2 (last) is full; on i0, r0 has not decoded yet, so
    # its prompt still counts in the phase: 0.4 (r0) + 0.4 (r1) + 0.4 (new) > 1 s: still held
    rep = StepReport("i0", "temporal", 0.5, elapsed=0.5,
                     deltas=[TokenDelta("r0", [5], "", [1.0])], progress=[("r0", 1.0, 1)])
    acts, _ = c.on_report(rep)
    assert acts == [] and [q.request_id for q in c.queued] == ["r6", "r7"]
    # at 3.0 r0 has 30 tokens: saved 3.0 − 2.0 = 1.0 s >= 0.8 s, so i0 takes r6 (then is full)
    rep = StepReport("i0", "temporal", 2.5, elapsed=0.5, progress=[("r0", 1.0, 30)])
    acts, _ = c.on_report(rep)
    assert [(a.instance_id, a.command.request_id) for a in acts
            if isinstance(a, Send)] == [("i0", "r6")]
    assert [q.request_id for q in c.queued] == ["r7"]
    assert c.requests["r6"].timeline.routed == 3.0


def test_two_macro_instances_take_turns():
    rt = router(macro_instance_size=2)
    c = Controller(temporal_views(4), rt)
    assert rt.macros == [] and c.on_arrival("a", [1] * 10, P, now=0.0)[0].instance_id == "i0"
    assert rt.macros == [["i0", "i1"], ["i2", "i3"]]
    assert c.on_arrival("b", [1] * 10, P, now=0.0)[0].instance_id == "i2"
    assert c.on_arrival("c", [1] * 10, P, now=0.0)[0].instance_id == "i0"


# ------------------------------------------------------------------ mitosis
def test_expansion_splits_past_n_u():
    m = Mitosis(2, 4, [["a", "b", "c", "d"]])
    moves = m.expand("e")  # 5 > N_u: the last N_l split off
    assert m.groups == [["a", "b", "c"], ["d", "e"]]
    assert moves == [Move("e", None, 0), Move("d", 0, 1), Move("e", 0, 1)]
    m.expand("f")
    assert m.sizes() == [4, 2]  # the first below N_u fills first
    m.expand("g")
    m.expand("h")
    assert m.sizes() == [4, 4]
    m.expand("i")
    assert m.groups == [["a", "b", "c", "f"], ["d", "e", "g"], ["h", "i"]]


def test_contraction_shrinks_the_smallest_then_merges_at_n_u():
    m = Mitosis(2, 4, [["a", "b", "c", "d"], ["e", "f", "g"]])
    assert m.contract() == [Move("g", 1, None)]  # the smallest, down to N_l
    assert m.sizes() == [4, 2]
    assert m.contract() == [Move("d", 0, None)]  # then the full one: 3 + 2 = 5 > N_u
    assert m.sizes() == [3, 2]
    moves = m.contract()  # 2 + 2 = 4 = N_u after removing one more: merge
    assert moves == [Move("c", 0, None), Move("e", 1, 0), Move("f", 1, 0)]
    assert m.groups == [["a", "b", "e", "f"]]
    m.contract()
    m.contract()
    assert m.sizes() == [2] and m.contract() == []  # a lone macro instance keeps N_l


def test_scaling_on_a_load_ramp_migrates_under_load_and_loses_nothing():
    from pdserve.sim.simulator import SimRequest
    from pdserve.sim.target import SimulationConfig, build_simulator

    dep = ClusterConfig.from_dict({
        "model": "llama-2-7b", "strategy": "partial", "num_instances": 6, "slo_ttft": 0.5,
        "slo_tpot": 0.1, "mitosis": True, "mitosis_lower": 1, "mitosis_upper": 2,
        "mitosis_interval": 1.0, "max_model_len": 2048})
    built = build_simulator(SimulationConfig(dep, hardware="A100-80GB"))
    sim = built.simulator
    reqs, t = [], 0.0
    for k in range(600):  # 5 req/s, then 40 req/s, then 5 req/s again
        t += 0.2 if k < 50 or k >= 450 else 0.025
        reqs.append(SimRequest(f"r{k}", t, [(7 * k + j) % 30000 + 3 for j in range(600)], 200))
    res = sim.run(reqs)
    assert all(r.error is None and r.finish_reason == "length" and r.output_len == 200
               for r in res.records) and len(res.records) == 600
    rt = sim.controller.prefill_router
    migrations = [m for _, m in rt.moves if m.src is not None and m.dst is not None]
    assert migrations, "the ramp should split a macro instance"
    assert max(n for _, n, _ in rt.scale_log) > 1 and rt.scale_log[0][1] == 1
    for inst in sim.insts.values():  # no block leaked anywhere
        assert inst.worker.check_integrity() == {
            "used_blocks": 0, "num_blocks": inst.spec.num_kv_blocks, "num_requests": 0}


def test_ttft_constraint_predicts_one_prefill_batch_when_it_can():
    # one batch: 0.2 s + 5 ms per token; pending 60 + new 40 tokens → 0.7 s (the per-prompt sum
    # would be 0.5 + 0.4 = 0.9 s)
    r = MacroRolling(slo_ttft=0.75, slo_tpot=0.1, prefill_time=lambda n: 0.2 + 0.005 * n,
                     prefill_batch_time=lambda lens: 0.2 + 0.005 * sum(lens))
    r.pending["i0"] = {"p": creq("p", 60)}
    v = view(progress=[("d", 0.0, 100)])
    assert r.check(v, creq("new", 40), now=0.0)
    assert not r.check(v, creq("new", 51), now=0.0)  # 0.2 + 0.555 > 0.75
