"""Preble's E2 router and the cache-aware baselines: hand-worked decisions, triggers, failures."""

import pytest

from pdserve.cluster.cache_routing import CacheAwareRouter, KVOverlapRouter
from pdserve.cluster.controller import ClusterRequest, Controller, Send
from pdserve.cluster.prefix_routing import E2Router, LinearPrefillTime
from pdserve.cluster.routing import InstanceView, make_router
from pdserve.cluster.worker import AddRequest, StepReport, TokenDelta
from pdserve.engine.engine import EngineStats
from pdserve.engine.kv_cache import BlockRemoved, BlockStored
from pdserve.request import NO_PARENT, SamplingParams, Timeline, block_hashes

BS = 4
P = SamplingParams(max_tokens=4, ignore_eos=True)
S1 = list(range(100, 132))  # 32 tokens = 8 blocks
S2 = list(range(200, 232))


def views(*ids, blocks=100):
    return [InstanceView(i, "colocated", num_kv_blocks=blocks, block_size=BS) for i in ids]


def creq(rid, prompt, t=0.0, max_tokens=4):
    return ClusterRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True),
                          Timeline(arrival=t))


def stored(prompt, n_blocks=None):
    hs = block_hashes(prompt, BS)[:n_blocks]
    return [BlockStored(hs, NO_PARENT, list(prompt[:len(hs) * BS]), BS)]


def used(n):
    return EngineStats(num_running=0, num_waiting=0, num_held=0, num_pending_kv=0,
                       num_kv_blocks=100, num_free_blocks=100 - n, num_used_blocks=n,
                       kv_usage=n / 100, prefix_queries=0, prefix_hits=0, num_preemptions=0,
                       num_steps=0)


def e2(**kw):
    kw.setdefault("prefill_time", float)  # PT(n) = n seconds: costs are token counts
    kw.setdefault("tpot", 0.0)
    kw.setdefault("rebalance_interval", 0.0)  # hand cases route many requests at one time
    return E2Router(**kw)


def test_exploit_goes_to_the_least_loaded_holder_of_the_key_portion():
    r = e2()
    cands = views("a", "b", "c")
    r.on_kv_events("a", stored(S1))
    r.load = {"a": 50.0, "b": 0.0, "c": 0.0}
    # 32 of 36 tokens cached on a: exploit, although a is the busiest
    assert r.select(creq("x", S1 + [1, 2, 3, 4]), cands).instance_id == "a"
    r.on_kv_events("c", stored(S1))
    r.load["c"] = 10.0
    assert r.select(creq("y", S1 + [5, 6, 7, 8]), cands).instance_id == "c"
    assert r.decisions["exploit"] == 2


def test_explore_minimises_load_plus_own_prefill():
    """8 of 32 tokens cached on a: explore. cost_i = L_i + M_i + R_i with PT(n) = n."""
    prompt = S1
    r = e2()
    r.on_kv_events("a", stored(prompt, 2))
    r.load = {"a": 20.0, "b": 0.0}
    # a: 20 + 0 + PT(24) = 44;  b: 0 + 0 + PT(32) = 32
    assert r.select(creq("x", prompt), views("a", "b")).instance_id == "b"
    r2 = e2()
    r2.on_kv_events("a", stored(prompt, 2))
    r2.load = {"a": 5.0, "b": 0.0}
    # a: 5 + 24 = 29 < b: 32
    assert r2.select(creq("x", prompt), views("a", "b")).instance_id == "a"
    assert r2.decisions["explore"] == 1 and r2.decisions["exploit"] == 0


def test_eviction_cost_steers_away_from_a_full_instance():
    """b and c each served 3 requests of their own 16-token prompt (equal L); b's cache is
    full, so the new 32-token prompt would evict b's prefix: M_b = PT(16) · 3 = 48."""
    qb, qc = list(range(300, 316)), list(range(400, 416))
    for blocks, want in ((4, "c"), (100, "b")):
        r = e2()
        cands = [InstanceView("b", "colocated", blocks, BS),
                 InstanceView("c", "colocated", 100, BS)]
        for k in range(3):
            assert r.select(creq(f"b{k}", qb), cands[:1]).instance_id == "b"
            assert r.select(creq(f"c{k}", qc), cands[1:]).instance_id == "c"
        r.on_kv_events("b", stored(qb))
        r.on_kv_events("c", stored(qc))
        assert r.load["b"] == r.load["c"] == 3 * 16.0  # routed before anything was cached
        assert r._evict_cost(cands[0], 32) == (48.0 if blocks == 4 else 0.0)
        assert r.select(creq("new", S2), cands).instance_id == want


def test_long_missed_prompt_goes_to_a_decode_heavy_instance():
    """Decode shares of L: a 0.9, b 0.2, c 1/6; a's L (10) is below the mean (15). Explore's
    cost alone would pick b (5 + 32 < 10 + 32); a's decode-heavy mix stands out."""
    loads, decode = {"a": 10.0, "b": 5.0, "c": 30.0}, {"a": 9.0, "b": 1.0, "c": 5.0}
    cands = views("a", "b", "c")
    r = e2(pd_tokens=16, pd_margin=0.2)
    r.load, r.decode_load = dict(loads), dict(decode)
    assert r.select(creq("x", S1), cands).instance_id == "a"
    assert r.decisions["pd_balance"] == 1
    r = e2(pd_tokens=64)  # 32 missed tokens are not "long": plain explore
    r.load, r.decode_load = dict(loads), dict(decode)
    assert r.select(creq("x", S1), cands).instance_id == "b"
    r = e2(pd_tokens=16)  # a busy decode-heavy instance does not take it
    r.load, r.decode_load = {**loads, "a": 20.0}, {**decode, "a": 19.0}
    assert r.select(creq("x", S1), cands).instance_id == "b"
    r = e2(pd_tokens=16)  # an idle instance: nothing to balance, explore (it wins)
    r.load, r.decode_load = {"a": 10.0, "b": 5.0}, {"a": 9.0, "b": 1.0}
    assert r.select(creq("x", S1), cands).instance_id == "c"


def test_rebalance_moves_a_prefix_subtrees_future_requests():
    """Th_bal = 1.5. a holds S1 and S2 (b nothing), PT(n) = n:
    x: S1 + 4 new -> a (exploit), L = (a 4, b 0), gap 2: S1's load 4 does not fit, no move;
    y: S2 + 8 new -> a, L = (a 12, b 0), gap 6: S1 (4) fits -> S1's future requests go to b;
    z: S1 + 4 new -> b although only a caches S1."""
    r = e2(rebalance_min_per_instance=0)
    cands = views("a", "b")
    r.on_kv_events("a", stored(S1) + stored(S2))
    assert r.select(creq("x", S1 + [1] * 4), cands).instance_id == "a"
    assert r.decisions["rebalance"] == 0
    assert r.select(creq("y", S2 + [2] * 8), cands).instance_id == "a"
    assert r.decisions["rebalance"] == 1
    assert r.load == {"a": 8.0, "b": 4.0}  # S1's window load moved along
    assert r.select(creq("z", S1 + [3] * 4), cands).instance_id == "b"
    # before the trigger threshold nothing moves
    r = e2(rebalance_min_per_instance=50)
    r.on_kv_events("a", stored(S1) + stored(S2))
    for rid, p in (("x", S1 + [1] * 4), ("y", S2 + [2] * 8), ("z", S1 + [3] * 4)):
        assert r.select(creq(rid, p), cands).instance_id == "a"


def test_a_prefix_moved_while_new_keeps_its_requests_moved():
    """x: a new 16-token prompt X (no match) -> a, keyed by its first block; z: exploit on a
    (S1 + S2 cached, 40 new). L = (a 56, b 0), half the gap 28: X's load (16) fits and moves to
    b. x2 = X + 8 new exploits X's blocks on a, but X's future requests go to b."""
    r = e2(rebalance_min_per_instance=0)
    cands = views("a", "b")
    x = list(range(500, 516))
    r.on_kv_events("a", stored(S1 + S2))
    assert r.select(creq("x", x), cands).instance_id == "a"
    r.on_kv_events("a", stored(x))
    assert r.select(creq("z", S1 + S2 + [1] * 40), cands).instance_id == "a"
    assert r.decisions["rebalance"] == 1
    assert r.select(creq("x2", x + [2] * 8), cands).instance_id == "b"


@pytest.mark.parametrize("b_load, moved", [(6.0, True), (11.0, False)])
def test_rebalance_threshold_is_relative(b_load, moved):
    """After x (S1, 4 new) and y (S2, 12 new) on a: L_a = 16. Th_bal = 1.5: 16 > 1.5 · 6 moves
    S1 (its load 4 fits in half the gap, 5); 16 ≤ 1.5 · 11 does not."""
    r = e2(rebalance_min_per_instance=0)
    cands = views("a", "b")
    r.on_kv_events("a", stored(S1) + stored(S2))
    r.load["b"] = b_load
    r.select(creq("x", S1 + [1] * 4), cands)
    r.select(creq("y", S2 + [2] * 12), cands)
    assert r.decisions["rebalance"] == moved
    assert r.select(creq("z", S1 + [3] * 4), cands).instance_id == ("b" if moved else "a")


@pytest.mark.parametrize("late_ttft, want", [(3.0, "b"), (1.5, "a")])
def test_hot_prefix_is_replicated_when_its_queueing_delay_rises(late_ttft, want):
    """Window 180 s; at t = 150 the halves are [-30, 60) and [60, 150]. TTFTs of S1's requests
    on a: 1 s (first token at 11) then ``late_ttft`` (at 100 + late_ttft). Replicate when
    the second half's mean ≥ 2 × the first half's."""
    r = e2()
    cands = views("a", "b")
    r.on_kv_events("a", stored(S1))
    early, late = creq("e", S1 + [1] * 4, t=10.0), creq("l", S1 + [2] * 4, t=100.0)
    assert r.select(early, cands).instance_id == "a"
    early.timeline.token_times.append(11.0)
    assert r.select(late, cands).instance_id == "a"
    late.timeline.token_times.append(100.0 + late_ttft)
    assert r.select(creq("n", S1 + [3] * 4, t=150.0), cands).instance_id == want
    assert r.decisions["replicate"] == (want == "b")
    if want == "b":  # the replica now counts as a holder of the prefix
        r.load["a"] = 100.0
        assert r.select(creq("m", S1 + [4] * 4, t=151.0), cands).instance_id == "b"


def test_a_moved_hot_prefix_is_replicated_too():
    """Every instance holds S1 (one hot prefix) and a rebalance sent S1's requests to b. The
    same trigger as above (TTFT 1 s, then 3 s on b) replicates it to the least loaded other
    instance (a; c ties and comes later), which then shares S1's requests with b."""
    r = e2()
    cands = views("a", "b", "c")
    for iid in "abc":
        r.on_kv_events(iid, stored(S1))
    r.moved[block_hashes(S1, BS)[-1]] = "b"  # S1 is one radix node: its last block keys it
    early, late = creq("e", S1 + [1] * 4, t=10.0), creq("l", S1 + [2] * 4, t=100.0)
    assert r.select(early, cands).instance_id == "b"
    early.timeline.token_times.append(11.0)
    assert r.select(late, cands).instance_id == "b"
    late.timeline.token_times.append(103.0)
    assert r.select(creq("n", S1 + [3] * 4, t=150.0), cands).instance_id == "a"
    assert r.decisions["replicate"] == 1
    r.load["b"] = 100.0
    assert r.select(creq("m", S1 + [4] * 4, t=151.0), cands).instance_id == "a"
    r.load["a"] = 200.0
    assert r.select(creq("k", S1 + [5] * 4, t=152.0), cands).instance_id == "b"


def test_window_expires_load():
    r = e2(window=180.0)
    cands = views("a")
    r.select(creq("x", S1, t=0.0), cands)
    assert r.load["a"] == 32.0
    r.select(creq("y", S2, t=200.0), cands)
    assert r.load["a"] == 32.0 and len(r._win) == 1  # x left the window, y entered


def test_per_prefix_state_is_bounded_by_the_window():
    """Everything E2 keeps per prefix (window counts, sizes, TTFTs, moves, replicas, LRU order)
    leaves with the prefix's last request in the window."""
    r = e2(rebalance_min_per_instance=0)
    cands = views("a", "b")
    for k in range(50):
        q = creq(f"x{k}", [1000 + k] * 8 + [k] * 24, t=float(k))
        r.select(q, cands)
        q.timeline.token_times.append(k + 0.5)
    assert len(r.key_stats) == 50
    r.select(creq("late", S1, t=1000.0), cands)
    r.select(creq("later", S1, t=1001.0), cands)  # observes x49's TTFT, already forgotten
    assert len(r._win) == 2 and len(r.key_stats) == len(r.key_tokens) == 1
    assert len(r._ttft) <= 1 and not r.moved and not r.replicas
    assert set().union(*r._lru.values()) == set(r.key_stats)  # one prefix, on a and b


def test_dead_instance_leaves_the_index_and_no_request_is_lost():
    r = e2()
    c = Controller(views("a", "b"), prefill_router=r)
    c.on_report(StepReport("a", "colocated", 0.0, kv_events=stored(S1)))
    [s] = c.on_arrival("x", S1 + [1] * 4, P, 1.0)
    [t] = c.on_arrival("y", S1 + [2] * 4, P, 1.0)
    assert s.instance_id == t.instance_id == "a"
    acts = c.on_instance_failed("a", 2.0)
    assert sorted(a.command.request_id for a in acts) == ["x", "y"]
    assert all(isinstance(a, Send) and a.instance_id == "b" and isinstance(a.command, AddRequest)
               for a in acts)
    assert r.index.match(S1).lengths == {}  # a's blocks left the index
    # a late report from the dead instance does not bring its blocks back
    c.on_report(StepReport("a", "colocated", 2.5, kv_events=stored(S2)))
    assert r.index.match(S2).lengths == {}
    [u] = c.on_arrival("z", S1 + [3] * 4, P, 3.0)
    assert u.instance_id == "b"
    for rid in ("x", "y", "z"):
        c.on_report_delta("b", TokenDelta(rid, [7], "", [4.0], finished=True,
                                          finish_reason="length"), 4.0)
    assert c.requests == {}


def test_sglang_cache_aware_router():
    r = CacheAwareRouter(cache_threshold=0.3, balance_abs=2, balance_rel=1.5)
    a, b = views("a", "b")
    assert r.select(creq("x", S1), [a, b]) is a  # no match: smallest tree (tie: first)
    assert r.select(creq("y", S2), [a, b]) is b  # no match: b's tree is smaller
    # 16 of 40 tokens (40 %) match a: above the 0.3 threshold
    assert r.select(creq("z", S1[:16] + [9] * 24), [a, b]) is a
    # 8 of 40 (20 %): below, smallest tree = b
    assert r.select(creq("w", S1[:8] + [8] * 32), [a, b]) is b
    a.active, b.active = 5, 1  # 5 - 1 > 2 and 5 > 1.5 · 1: imbalanced, least loaded wins
    assert r.select(creq("v", S1), [a, b]) is b
    r.on_instance_removed("a")
    assert r.tree.match(S1).lengths == {"b": 8}


def test_sglang_tree_is_bounded_per_instance():
    r = CacheAwareRouter(max_tree_blocks=10)
    a = views("a")
    for k in range(5):
        r.select(creq(f"x{k}", [k] * 32), a)  # 8 blocks each
    assert r.tree.num_blocks("a") <= 10 + 8 and len(r.tree.nodes) <= 18


def test_kv_overlap_router_cost():
    """cost = (prompt blocks - cached on i) + used/promised blocks on i."""
    r = KVOverlapRouter()
    a, b = views("a", "b")
    r.on_kv_events("a", stored(S1))
    a.stats = used(6)
    # a: (9 - 8) + 6 = 7;  b: 9 + 0 = 9
    assert r.select(creq("x", S1 + [1] * 4), [a, b]) is a
    b.pending_tokens = 0
    a.stats = used(9)  # a: 1 + 9 = 10 > b: 9
    assert r.select(creq("y", S1 + [1] * 4), [a, b]) is b
    r.on_kv_events("a", [BlockRemoved(block_hashes(S1, BS)[:1])])
    assert r.index.match(S1).lengths == {}


def test_registry_and_bad_parameters():
    assert isinstance(make_router("preble-paper"), E2Router)
    assert isinstance(make_router("sglang_cache_aware"), CacheAwareRouter)
    assert isinstance(make_router("kv_overlap"), KVOverlapRouter)
    with pytest.raises(ValueError, match="unknown router 'prebel'"):
        make_router("prebel")
    with pytest.raises(ValueError, match="balance_threshold"):
        E2Router(balance_threshold=0.5)
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwareRouter(cache_threshold=2)
    with pytest.raises(ValueError, match="per_token"):
        LinearPrefillTime(per_token=-1)
    assert LinearPrefillTime()(1000) == pytest.approx(0.11)


@pytest.mark.parametrize("router", ["preble-paper", "prefix_aware", "kv_overlap"])
def test_simulated_cluster_keeps_the_index_exact(router, monkeypatch):
    """End to end: real workers (simulated executor) forward their KV events through the
    controller; with small caches (evictions) every request finishes and the router's index
    holds exactly the blocks each instance's pool caches. Each prompt is hashed once: the
    engines take the chain the router made and hash only the blocks their outputs fill."""
    from pdserve.config import ClusterConfig
    from pdserve.sim.simulator import SimRequest
    from pdserve.sim.target import SimulationConfig, build_simulator
    from tests.engine.test_kv_hash_once import spy

    engine_hashed = spy(monkeypatch)

    sim = build_simulator(SimulationConfig(ClusterConfig.from_dict(
        {"model": "opt-13b", "num_instances": 2, "prefill_router": router,
         "engine": {"num_kv_blocks": 96, "max_model_len": 512}}))).simulator
    r = sim.controller.prefill_router  # the simulator turned the workers' KV events on
    reqs = [SimRequest(f"q{k}", 0.05 * k, S1[:8 * (k % 4 + 1)] + [k] * 40, 8)
            for k in range(60)]
    res = sim.run(reqs)
    assert all(x.error is None and x.finish_reason == "length" for x in res.records)
    assert len(res.records) == 60
    hits = sum(x.num_cached_tokens for x in res.records)
    assert hits > 0
    for iid, inst in sim.insts.items():
        pool = inst.worker.engine.scheduler.pool
        assert r.index.num_blocks(iid) == len(pool.cached)
        for h in pool.cached:
            assert iid in r.index.holders(h)
    bs = pool.block_size
    by_output = sum((len(q.prompt_token_ids) + 7) // bs - len(q.prompt_token_ids) // bs
                    for q in reqs)  # 8 output tokens, the last one never computed
    assert sum(engine_hashed) == by_output


# ------------------------------------------------------------------ the command line
def test_serve_flags_select_preble_router_and_local_policy():
    """`pdserve serve --prefill-router preble-paper --policy preble` reaches the deployment spec
    (E2 in front, Preble's priority groups on every instance); the live run of that spec is
    tests/cluster/test_runtime_real.py::test_preble_router_is_fed_by_the_instances_kv_events."""
    from pdserve.cli import build_parser
    from pdserve.flags import deployment_from_args

    args = build_parser().parse_args(["serve", "--model", "opt-13b", "--num-instances", "2",
                                      "--prefill-router", "preble-paper", "--policy", "preble"])
    spec = deployment_from_args(args)
    assert spec.prefill_router == "preble-paper"
    assert spec.engine["policy"] == "preble"
    assert all(s.engine.scheduler.policy == "preble" for s in spec.instance_specs(2048))


def test_simulate_with_preble_flags(tmp_path, capsys):
    """`pdserve simulate` with the same flags: the spec carries both and every request
    finishes (that E2 then sees the simulated caches is
    tests/sim/test_target_cli.py::test_preble_router_in_the_simulator_sees_the_cache)."""
    import json

    from pdserve.cli import main as pdserve_main

    out = tmp_path / "preble.json"
    rc = pdserve_main(["simulate", "--hardware", "A100-80GB", "--model", "opt-13b",
                       "--num-instances", "3", "--prefill-router", "preble-paper",
                       "--policy", "preble", "--workload",
                       "prefix:num_prefixes=4,shared_len=1024,unique_len=64,output_len=8",
                       "--num-requests", "60", "--rate", "6", "--no-progress",
                       "--output-json", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    spec = data["deployment"]["spec"]
    assert spec["prefill_router"] == "preble-paper" and spec["engine"]["policy"] == "preble"
    assert data["deployment"]["routers"][0] == "preble-paper"
    assert data["summary"]["num_ok"] == 60
