"""The simulator's decode fast path (``Simulator(fast_forward=True)``, DecodeRun) against the
step-by-step path: identical request timelines, token ids, events, engine stats and block
pools on random workloads (colocated chunked and prefill-first, disaggregated with plain and
pipelined decode, EcoServe's temporal instances behind their macro router, prefix caching on
and off, KV pressure with preemption, early stop), with the simulator's quiet step ends
(``Simulator._quiet_step_end``) among them."""

import dataclasses
import gc
import random
import weakref

import pytest

from pdserve.cluster.macro import MacroRolling
from pdserve.config import CacheConfig, EngineConfig, Link, ModelConfig, SchedulerConfig
from pdserve.sim.latency import DriverOverhead, FittedProfile, PipelineModel
from pdserve.sim.simulator import SimInstance, SimRequest, Simulator

MODEL = ModelConfig(family="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=4096)
PROFILE = FittedProfile(prefill=(0.01, 2e-5, 1e-9), decode_small=(0.008, 3e-7, 1e-4),
                        decode_large=(0.009, 3.1e-7, 9e-5), decode_threshold=24)


def engine(role, chunked, caching, blocks, seqs=64, admission="greedy"):
    return EngineConfig(
        cache=CacheConfig(block_size=16, num_kv_blocks=blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=seqs,
                                  max_model_len=512, enable_chunked_prefill=chunked,
                                  role=role, admission=admission))


def workload(seed, n=120, rate=6.0):
    """Poisson arrivals; a third of the prompts share one of three prefixes (prefix hits)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([32, 48, 80]))]
                for _ in range(3)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        body = [rng.randrange(1000) for _ in range(rng.randint(4, 200))]
        prompt = (rng.choice(prefixes) + body) if rng.random() < 0.35 else body
        out.append(SimRequest(f"r{i}", t, prompt, rng.randint(1, 160)))
    return out


def setups(kind, caching, blocks):
    if kind == "colocated-chunked":
        return [SimInstance("c0", engine("colocated", True, caching, blocks), PROFILE, blocks)]
    if kind == "colocated-prefill-first":
        return [SimInstance("c0", engine("colocated", False, caching, blocks), PROFILE, blocks),
                SimInstance("c1", engine("colocated", False, caching, blocks),
                            DriverOverhead(PROFILE, 0.002, 1e-5), blocks)]
    if kind == "partial":  # one macro instance of three temporal instances
        return [SimInstance(f"t{i}", engine("temporal", False, caching, blocks), PROFILE,
                            blocks) for i in range(3)]
    pre = [SimInstance("p0", engine("prefill", False, caching, 4096), PROFILE, 4096)]
    if kind == "disaggregated-reserve-dynamic":  # its admission reads the running requests
        return pre + [SimInstance(f"d{i}", engine("decode", True, caching, blocks,
                                                  admission="reserve-dynamic"), PROFILE, blocks)
                      for i in range(2)]
    if kind == "disaggregated":
        return pre + [SimInstance("d0", engine("decode", True, caching, blocks), PROFILE,
                                  blocks),
                      SimInstance("d1", engine("decode", True, caching, blocks), PROFILE,
                                  blocks, node=1)]
    pipe = PipelineModel(PROFILE, pp=2, model=MODEL, link=Link(bandwidth_gb_per_s=100.0,
                                                                latency_s=1e-5))
    return pre + [SimInstance("d0", engine("decode", True, caching, 2 * blocks), pipe,
                              2 * blocks, num_gpus=2)]


def simulate(kind, caching, blocks, seed, fast, stop_at=None):
    # the macro router reads every temporal instance's decode progress from its reports
    router = (MacroRolling(slo_ttft=0.3, slo_tpot=0.02, macro_instance_size=3)
              if kind == "partial" else "shortest_queue")
    sim = Simulator(setups(kind, caching, blocks), MODEL, router, fast_forward=fast,
                    inter_node_link=Link(bandwidth_gb_per_s=10.0, latency_s=1e-4))
    stop = (lambda now: now >= stop_at) if stop_at is not None else None
    res = sim.run(workload(seed), stop=stop)
    return sim, res


def state(sim, res):
    """Everything the two paths must agree on."""
    records = [(r.request_id, r.prompt_len, r.output_len, dataclasses.asdict(r.timeline),
                r.finish_reason, r.error, r.num_cached_tokens) for r in res.records]
    tokens = {rid: list(r.output_token_ids) for rid, r in sim.controller.history.items()}
    pools = {}
    for iid, inst in sim.insts.items():
        s = inst.worker.engine.scheduler
        pools[iid] = (
            [(b.block_id, b.ref_cnt, b.block_hash, b.token_ids) for b in s.pool.materialize()],
            [b.block_id for b in s.pool.free_queue], sorted(s.pool.cached),
            {rid: (list(r.block_ids), list(r.block_hashes), r.num_computed_tokens,
                   list(r.all_token_ids), list(r.timeline.token_times))
             for rid, r in s.requests.items()},
            s.step_id, s.num_preemptions, s.phase, s.phase_switch_time)
    return (records, tokens, pools, res.duration, res.num_events, res.stopped,
            {k: dataclasses.asdict(v) for k, v in res.instance_stats.items()},
            {k: dataclasses.asdict(v.stats) if v.stats else None
             for k, v in sim.controller.instances.items()})


KINDS = ["colocated-chunked", "colocated-prefill-first", "disaggregated", "disaggregated-pp",
         "disaggregated-reserve-dynamic", "partial"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_path_matches_step_by_step(kind, caching, seed):
    slow_sim, slow = simulate(kind, caching, 4096, seed, fast=False)
    fast_sim, fast = simulate(kind, caching, 4096, seed, fast=True)
    assert slow_sim.num_folded == 0
    assert fast_sim.num_folded > 0  # the fast path was taken
    assert fast_sim.num_quiet_ends > 0  # and the quiet step ends with it
    assert slow_sim.num_quiet_ends == 0
    assert state(fast_sim, fast) == state(slow_sim, slow)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [3, 4])
def test_fast_path_under_kv_pressure(kind, seed):
    """Few blocks: decodes run out of blocks and preempt (recompute) each other."""
    slow_sim, slow = simulate(kind, True, 60, seed, fast=False)
    fast_sim, fast = simulate(kind, True, 60, seed, fast=True)
    assert fast_sim.num_folded > 0
    if kind.startswith("colocated"):
        assert sum(s.num_preemptions for s in slow.instance_stats.values()) > 0
    assert state(fast_sim, fast) == state(slow_sim, slow)


@pytest.mark.parametrize("kind", ["colocated-chunked", "disaggregated", "partial"])
@pytest.mark.parametrize("stop_at", [3.0, 7.77])
def test_fast_path_stops_where_step_by_step_stops(kind, stop_at):
    slow_sim, slow = simulate(kind, True, 4096, 5, fast=False, stop_at=stop_at)
    fast_sim, fast = simulate(kind, True, 4096, 5, fast=True, stop_at=stop_at)
    assert slow.stopped and fast.stopped
    assert state(fast_sim, fast) == state(slow_sim, slow)


@pytest.mark.parametrize("kind", KINDS)
def test_a_finished_simulation_is_freed_without_the_cycle_collector(kind):
    """No reference cycle: a dropped simulator, its block pools and requests go at once by
    reference counting (the planner runs probes with the collector paused), and the run
    leaves the collector as it found it."""
    simulate(kind, True, 60, 3, fast=True)  # warm: first-use caches may leave garbage
    assert gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        sim, res = simulate(kind, True, 60, 3, fast=True)
        assert not gc.isenabled()  # gc_paused restores the caller's state
        refs = [weakref.ref(sim), weakref.ref(sim.controller)] + [
            weakref.ref(i.worker.engine.scheduler.pool) for i in sim.insts.values()]
        del sim, res
        assert [r() for r in refs] == [None] * len(refs)
        assert gc.collect() == 0  # nothing else was left in a cycle (e.g. the blocks)
    finally:
        gc.enable()
