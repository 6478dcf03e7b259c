"""Adding and removing instances goes through the same driver-core operations in the simulator
and in the live runtime (``DriverCore.add_instance`` / ``remove_instance`` / ``drained`` /
``forget``), so for the same arrivals and the same scaling times they form the same batches on
every instance — the removed one drains the same requests, the added one takes the same ones.
The harness is the simulator-parity test's (fixed step times, arrivals kept clear of step
ends)."""

from __future__ import annotations

import asyncio
import time

from pdserve.cluster.instances import InProcessInstance
from pdserve.cluster.runtime import ClusterRuntime
from pdserve.cluster.worker import InstanceWorker
from pdserve.config import ClusterConfig
from pdserve.request import SamplingParams
from pdserve.sim.simulator import SimInstance, SimRequest, Simulator
from tests.sim.test_parity import (
    LAG,
    MARGIN,
    MODEL,
    STEP,
    FixedStep,
    SleepingExecutor,
    cluster_config,
    per_instance,
    prompt,
)

# colocated, two instances; colocated-0 is removed at 0.2 s while it decodes, colocated-2 is
# added at 0.23 s; the arrivals after that go to colocated-1 and colocated-2 only
REQS = [(0.0, 40, 8), (0.03, 90, 6), (0.1, 20, 8), (0.13, 70, 5), (0.3, 30, 6), (0.33, 12, 8),
        (0.45, 25, 6), (0.5, 18, 5)]
REMOVE_AT, ADD_AT = 0.2, 0.23
SCALE_GAP = 0.03  # no arrival this close to a scaling event


def run_sim(cfg: ClusterConfig, reqs: list[tuple[float, int, int]]):
    insts = [SimInstance(s.instance_id, s.engine, FixedStep(STEP[s.role]), 256)
             for s in cfg.instance_specs()]
    sim = Simulator(insts, MODEL, record_batches=True)
    sim.remove_instance(REMOVE_AT, "colocated-0")
    engine = cfg.instance_specs()[0].engine
    sim.add_instance(ADD_AT, SimInstance("colocated-2", engine, FixedStep(STEP["colocated"]),
                                         256))
    res = sim.run([SimRequest(f"r{i}", t, prompt(i, p), o) for i, (t, p, o) in enumerate(reqs)])
    assert all(r.error is None and r.finish_reason == "length" for r in res.records)
    return sim, res


async def run_live(cfg: ClusterConfig, reqs: list[tuple[float, int, int]]):
    clients = [InProcessInstance(InstanceWorker(
        s.instance_id, s.engine, executor=SleepingExecutor(STEP[s.role], 256)))
        for s in cfg.instance_specs()]
    rt = ClusterRuntime(cfg, clients, tokenizer=None, model_config=MODEL, model_name="fixed")
    rt.batch_log = []
    await rt.start()
    engine = cfg.instance_specs()[0].engine

    async def one(i: int, t: float, p: int, o: int, t0: float) -> None:
        await asyncio.sleep(max(t0 + t - time.monotonic(), 0.0))
        params = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
        outs = [x async for x in rt.generate(f"r{i}", prompt(i, p), params)]
        assert outs[-1].finish_reason == "length"

    async def remove(t0: float):
        await asyncio.sleep(max(t0 + REMOVE_AT - time.monotonic(), 0.0))
        return await rt.remove_instance("colocated-0")

    async def add(t0: float) -> None:
        await asyncio.sleep(max(t0 + ADD_AT - time.monotonic(), 0.0))
        client = InProcessInstance(InstanceWorker(
            "colocated-2", engine, executor=SleepingExecutor(STEP["colocated"], 256)))
        await rt.add_instance("colocated", "colocated-2", client=client)

    try:
        t0 = time.monotonic()
        rec, *_ = await asyncio.gather(remove(t0), add(t0),
                                       *(one(i, t, p, o, t0) for i, (t, p, o) in enumerate(reqs)))
        await rt.drain()
    finally:
        await rt.shutdown()
    return rt, rec


def race_free(cfg: ClusterConfig, reqs: list[tuple[float, int, int]]):
    """Delay arrivals until none is near a step end of any instance (tests/sim/test_parity)."""
    for _ in range(100):
        sim, res = run_sim(cfg, reqs)
        ends = [start + STEP["colocated"] for _, start, _ in res.batch_log]
        races = [t for t, _, _ in reqs if any(-MARGIN < t - e < LAG for e in ends)]
        if not races:
            return reqs, sim, res
        pivot = max(t for t, _, _ in reqs if t <= min(races) + 1e-9)
        reqs = [(t + 0.007 if t >= pivot else t, p, o) for t, p, o in reqs]
    raise AssertionError("no race-free timing found")


async def test_scaling_makes_the_same_batches_in_both_drivers() -> None:
    cfg = cluster_config("colocated", 2)
    reqs, sim, res = race_free(cfg, REQS)
    assert all(abs(t - s) > SCALE_GAP for t, _, _ in reqs for s in (REMOVE_AT, ADD_AT))
    sim_batches = per_instance(res.batch_log)
    # the scenario exercises what it claims: colocated-0 still worked after its removal began,
    # stopped taking requests, and the added instance served
    starts0 = [start for iid, start, _ in res.batch_log if iid == "colocated-0"]
    assert max(starts0) > REMOVE_AT
    assert "colocated-2" in sim_batches
    (iid, asked, drained, pool), = sim.removals
    assert iid == "colocated-0" and asked == REMOVE_AT and drained > REMOVE_AT
    assert pool == {"used_blocks": 0, "num_blocks": 256, "num_requests": 0}
    assert "colocated-0" not in sim.controller.instances
    rt, rec = await run_live(cfg, reqs)
    assert per_instance(rt.batch_log) == sim_batches
    assert rec.pool == pool


def test_simulated_replanning_in_place_follows_a_shift() -> None:
    """The shift detector on a trace that goes from 4 to 24 req/s and back; each shift's window
    rate is planned as ``ceil(rate / 6)`` instances and applied in place in the simulator
    (``simulate_scaling``: add, remove with drain). Nothing is lost, removed pools are clean,
    and the fast phase meets the SLO more often than on the one instance of the start."""
    import math

    from pdserve.bench.metrics import SLO, attains
    from pdserve.bench.workloads import WorkloadRequest
    from pdserve.planner.replan import ShiftDetector, detect, simulate_scaling
    from pdserve.sim.target import SimulationConfig

    dep = ClusterConfig.from_dict({"model": "llama-2-7b", "num_instances": 1,
                                   "max_model_len": 2048})
    sim = SimulationConfig(dep, hardware="A100-80GB")
    reqs, t = [], 0.0
    for k in range(500):
        t += 0.25 if k < 60 or k >= 420 else 1 / 24
        reqs.append(WorkloadRequest(f"r{k}", t, 512, 128,
                                    prompt_token_ids=[(7 * k + j) % 30000 + 3
                                                      for j in range(512)]))
    shifts = detect(reqs, ShiftDetector(window_s=4.0, min_requests=10))
    changes = [(s.time, {"colocated": math.ceil(s.after.rate / 6 - 1e-9)}) for s in shifts]
    assert [c for _, c in changes] == [{"colocated": 4}, {"colocated": 1}]
    slo = SLO(1.0, 0.1)
    fast = [i for i, r in enumerate(reqs) if changes[0][0] + 5 < r.arrival_time < t - 20]
    recs, s = simulate_scaling(sim, reqs, changes, 32000)
    static, _ = simulate_scaling(sim, reqs, [], 32000)
    assert all(r.ok for r in recs) and len(recs) == 500
    assert sorted(iid for iid, *_ in s.removals) == ["colocated-1", "colocated-2",
                                                     "colocated-3"]
    assert all(pool["used_blocks"] == 0 and pool["num_requests"] == 0
               for *_, pool in s.removals)
    scaled = sum(attains(recs[i], slo) for i in fast) / len(fast)
    alone = sum(attains(static[i], slo) for i in fast) / len(fast)
    assert scaled > alone + 0.2, (scaled, alone)
