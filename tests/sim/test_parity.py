"""The simulator and the live runtime make the same scheduling decisions (same batches in the same
order on every instance) for the same arrivals when every step takes a fixed time.

The live side is the real asyncio ClusterRuntime with in-process workers whose executor sleeps
the fixed step time (aligned to a grid, so thread hops do not accumulate drift). Decisions are
taken at step ends; the scenarios are checked (on the simulated timeline) to keep every input —
an arrival, or a prefill hand-off for the decode instance — clear of every step end (``MARGIN``
before it, ``LAG`` after it), so that wall-clock jitter cannot reorder them.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.cluster.instances import InProcessInstance
from pdserve.cluster.runtime import ClusterRuntime
from pdserve.cluster.worker import InstanceWorker
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.request import SamplingParams
from pdserve.sim.simulator import SimInstance, SimRequest, Simulator

MODEL = ModelConfig(family="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
# Live step ends lag the simulated ones by the thread hops that started the step (dispatch,
# hand-off); an input may come MARGIN before a step end, or LAG after it.
MARGIN, LAG = 0.015, 0.035
STEP = {"colocated": 0.15, "prefill": 0.06, "decode": 0.15}


class FixedStep:
    """Simulator step model: every batch takes ``d`` seconds."""

    def __init__(self, d: float) -> None:
        self.d = d

    def batch_time(self, batch: ScheduledBatch) -> float:
        return self.d


class SleepingExecutor:
    """Live executor: reports ``d`` seconds per step and sleeps until the step's end on a grid
    (a step starting right after the previous one ends ``d`` after that one's end)."""

    def __init__(self, d: float, num_kv_blocks: int) -> None:
        self.d = d
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids: tuple[int, ...] = ()
        self._end: float | None = None

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        now = time.monotonic()
        back_to_back = self._end is not None and now - self._end < self.d / 4
        end = (self._end if back_to_back else now) + self.d  # type: ignore[operator]
        time.sleep(max(end - now, 0.0))
        self._end = end
        return ExecuteResult([1] * sum(1 for s in batch.seqs if s.sample), self.d)

    def export_kv(self, block_ids: list[int]) -> None:
        return None

    def import_kv(self, block_ids: list[int], payload: object) -> None:
        return None


def cluster_config(strategy: str, n: int = 1) -> ClusterConfig:
    eng = EngineConfig(cache=CacheConfig(block_size=8, num_kv_blocks=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                                 max_model_len=512))
    counts = ({"num_instances": n} if strategy == "colocated" else
              {"num_prefill": 1, "num_decode": 1})
    return ClusterConfig.from_dict({"engine": eng, "strategy": strategy, **counts})


def prompt(i: int, n: int) -> list[int]:
    return [(i * 131 + j * 7) % 990 + 5 for j in range(n)]


def run_sim(cfg: ClusterConfig, reqs: list[tuple[float, int, int]]):
    insts = [SimInstance(s.instance_id, s.engine, FixedStep(STEP[s.role]), 256)
             for s in cfg.instance_specs()]
    sim = Simulator(insts, MODEL, record_batches=True)
    res = sim.run([SimRequest(f"r{i}", t, prompt(i, p), o) for i, (t, p, o) in enumerate(reqs)])
    assert all(r.error is None and r.finish_reason == "length" for r in res.records)
    return res


async def run_live(cfg: ClusterConfig, reqs: list[tuple[float, int, int]]):
    clients = [InProcessInstance(InstanceWorker(
        s.instance_id, s.engine, executor=SleepingExecutor(STEP[s.role], 256)))
        for s in cfg.instance_specs()]
    rt = ClusterRuntime(cfg, clients, tokenizer=None, model_config=MODEL, model_name="fixed")
    rt.batch_log = []
    await rt.start()

    await replay(rt, reqs, prompt)
    return rt.batch_log


async def replay(rt: ClusterRuntime, reqs, prompt) -> dict[str, int]:
    """Send each ``(arrival, prompt length, output length)`` of ``reqs`` at its time (greedy,
    to its length), drain and shut ``rt`` down; the tokens each request got."""
    tokens: dict[str, int] = {}

    async def one(i: int, t: float, p: int, o: int, t0: float) -> None:
        await asyncio.sleep(max(t0 + t - time.monotonic(), 0.0))
        params = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
        outs = [x async for x in rt.generate(f"r{i}", prompt(i, p), params)]
        assert outs[-1].finish_reason == "length"
        tokens[f"r{i}"] = len(outs[-1].token_ids)

    try:
        t0 = time.monotonic()
        await asyncio.gather(*(one(i, t, p, o, t0) for i, (t, p, o) in enumerate(reqs)))
        await rt.drain()
    finally:
        await rt.shutdown()
    return tokens


def per_instance(log) -> dict[str, list]:
    out: dict[str, list] = {}
    for entry in log:
        iid, batch = entry[0], entry[-1]
        out.setdefault(iid, []).append([tuple(x) for x in batch])
    return out


def first_race(res, reqs, strategy: str) -> float | None:
    """The earliest input too close to a step end, if any."""
    ends: dict[str, list[float]] = {}
    for iid, start, _ in res.batch_log:
        ends.setdefault(iid, []).append(start + STEP[iid.split("-")[0]])
    every_end = [e for es in ends.values() for e in es]
    def near(t: float, step_ends: list[float]) -> bool:
        return any(-MARGIN < t - e < LAG for e in step_ends)

    races = [t for t, _, _ in reqs if near(t, every_end)]
    if strategy == "disaggregated":
        races += [e for e in ends["prefill-0"] if near(e, ends["decode-0"])]
    return min(races, default=None)


def race_free(cfg: ClusterConfig, reqs: list[tuple[float, int, int]], strategy: str):
    """Delay arrivals (from the last one before the earliest race on) until no input is near
    another instance's step end; returns the requests and the simulated result."""
    return shift_until_race_free(reqs, lambda r: run_sim(cfg, r),
                                 lambda res, r: first_race(res, r, strategy))


def shift_until_race_free(reqs, simulate, earliest_race):
    """:func:`race_free` for any simulation (``simulate(reqs)``) and race test
    (``earliest_race(result, reqs)``: a time or ``None``)."""
    for _ in range(100):
        res = simulate(reqs)
        race = earliest_race(res, reqs)
        if race is None:
            return reqs, res
        pivot = max(t for t, _, _ in reqs if t <= race + 1e-9)
        reqs = [(t + 0.007 if t >= pivot else t, p, o) for t, p, o in reqs]
    raise AssertionError("no race-free timing found")


SCENARIOS = {
    # colocated, two instances: routing by queue length, chunked prefill (budget 64)
    ("colocated", 2): [(0.0, 40, 8), (0.03, 90, 6), (0.1, 20, 8), (0.13, 70, 5), (0.27, 30, 6),
                       (0.29, 12, 8)],
    ("disaggregated", 1): [(0.0, 40, 8), (0.03, 30, 6), (0.1, 60, 8), (0.2, 20, 5),
                           (0.33, 50, 6), (0.34, 16, 8)],
}


@pytest.mark.parametrize("strategy,n", list(SCENARIOS))
async def test_same_batches_as_live_runtime(strategy: str, n: int) -> None:
    reqs = SCENARIOS[(strategy, n)]
    cfg = cluster_config(strategy, n)
    reqs, res = race_free(cfg, reqs, strategy)
    sim_batches = per_instance(res.batch_log)
    assert len(sim_batches) == len(cfg.instance_specs())  # every instance worked
    assert any(len(b) > 1 for bs in sim_batches.values() for b in bs)  # real batching
    live_batches = per_instance(await run_live(cfg, reqs))
    assert live_batches == sim_batches
