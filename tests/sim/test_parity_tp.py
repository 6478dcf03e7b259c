"""The simulator and the live runtime make the same scheduling decisions for tensor-parallel
instances: the same batches (request ids, start and token count of every entry) in the same
order on every instance, and the same tokens per request, for the same arrivals.

The approach of :mod:`tests.sim.test_parity`, on the real model: the live instances run the
real :class:`ModelExecutor` of a tiny llama (TP2: two gloo ranks, one torch thread each), each
step padded to a fixed time on a grid; the simulator runs the same deployment (``tp: 2`` in its
roles) with that fixed time per step. Decisions are taken at step ends; the scenarios are checked
on the simulated timeline to keep every input clear of every step end — an arrival ``MARGIN``
before it or ``LAG`` after it, a prefill hand-off ``HANDOFF_LAG`` after it (a TP2 prefill
instance exports its KV once the step it is in has computed, a gather over its ranks).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from pdserve.cluster.instances import InProcessInstance
from pdserve.cluster.runtime import ClusterRuntime
from pdserve.cluster.worker import InstanceWorker
from pdserve.config import ClusterConfig, EngineConfig, ModelConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.sim.simulator import SimInstance, SimRequest, Simulator
from tests.sim.test_parity import FixedStep, per_instance, replay, shift_until_race_free

MARGIN, LAG, HANDOFF_LAG = 0.015, 0.035, 0.09
# a few times a real step of the tiny model, TP2 included (an overrun shifts the live grid)
STEP = {"colocated": 0.2, "prefill": 0.15, "decode": 0.2}
BLOCKS = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdserve.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig.from_kwargs(model_dir, block_size=8, num_kv_blocks=BLOCKS,
                                    max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=512)


@pytest.fixture(scope="module")
def executors(model_dir: str) -> Any:
    """One real executor per TP degree, shared by the scenarios (each run builds fresh
    engines, so nothing of a block pool survives)."""
    from pdserve.engine.model_executor import ModelExecutor

    cfg = engine_config(model_dir)
    exs = {tp: ModelExecutor(cfg, num_threads=1, tp=tp) for tp in (1, 2)}
    yield exs
    for ex in exs.values():
        ex.close()


class GridExecutor:
    """A real executor whose steps each take ``d`` seconds: it computes, then sleeps until the
    step's end on a grid (a step starting right after the previous one ends ``d`` after that
    one's end), as :class:`tests.sim.test_parity.SleepingExecutor` does without a model.
    ``overruns``: seconds by which a step's computation passed its end (none expected)."""

    def __init__(self, inner: Any, d: float) -> None:
        self.inner, self.d = inner, d
        self.num_kv_blocks = inner.num_kv_blocks
        self.eos_token_ids = inner.eos_token_ids
        self.model_config = inner.model_config
        self.overruns: list[float] = []
        self._end: float | None = None

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        now = time.monotonic()
        back_to_back = self._end is not None and now - self._end < self.d / 4
        end = (self._end if back_to_back else now) + self.d  # type: ignore[operator]
        res = self.inner.execute(batch)
        late = time.monotonic() - end
        if late > 0:
            self.overruns.append(late)
        time.sleep(max(end - time.monotonic(), 0.0))
        self._end = end
        return ExecuteResult(res.sampled, self.d, res.logprobs)

    def export_kv(self, block_ids: list[int]) -> Any:
        return self.inner.export_kv(block_ids)

    def import_kv(self, block_ids: list[int], payload: Any) -> None:
        self.inner.import_kv(block_ids, payload)


def cluster_config(model_dir: str, roles: list[dict]) -> ClusterConfig:
    return ClusterConfig.from_dict({"engine": engine_config(model_dir), "roles": roles,
                                    "backend": "inproc"})


def prompt(i: int, n: int) -> list[int]:
    return [(i * 131 + j * 7) % 500 + 5 for j in range(n)]


def run_sim(cfg: ClusterConfig, model: ModelConfig, reqs: list[tuple[float, int, int]]):
    insts = [SimInstance(s.instance_id, s.engine, FixedStep(STEP[s.role]), BLOCKS, s.num_gpus)
             for s in cfg.instance_specs()]
    sim = Simulator(insts, model, record_batches=True, deployment=cfg)
    res = sim.run([SimRequest(f"r{i}", t, prompt(i, p), o) for i, (t, p, o) in enumerate(reqs)])
    assert all(r.error is None and r.finish_reason == "length" for r in res.records)
    return res


async def run_live(cfg: ClusterConfig, model: ModelConfig, executors: dict[int, Any],
                   reqs: list[tuple[float, int, int]]):
    specs = cfg.instance_specs()
    assert len({s.tp for s in specs}) == len(specs)  # one instance per shared executor
    grids = {s.instance_id: GridExecutor(executors[s.tp], STEP[s.role]) for s in specs}
    clients = [InProcessInstance(InstanceWorker(s.instance_id, s.engine,
                                                executor=grids[s.instance_id]))
               for s in specs]
    rt = ClusterRuntime(cfg, clients, tokenizer=None, model_config=model, model_name="tiny")
    rt.batch_log = []
    await rt.start()
    tokens = await replay(rt, reqs, prompt)
    overruns = {iid: g.overruns for iid, g in grids.items() if g.overruns}
    return rt.batch_log, tokens, overruns


def first_race(res, reqs, roles: set[str]) -> float | None:
    """The earliest input too close to a step end, if any."""
    ends: dict[str, list[float]] = {}
    for iid, start, _ in res.batch_log:
        ends.setdefault(iid, []).append(start + STEP[iid.rsplit("-", 1)[0]])
    every_end = [e for es in ends.values() for e in es]

    def near(t: float, step_ends: list[float], lag: float) -> bool:
        return any(-MARGIN < t - e < lag for e in step_ends)

    races = [t for t, _, _ in reqs if near(t, every_end, LAG)]
    if "prefill" in roles:
        races += [e for e in ends["prefill-0"] if near(e, ends["decode-0"], HANDOFF_LAG)]
    return min(races, default=None)


def race_free(cfg: ClusterConfig, model: ModelConfig, reqs: list[tuple[float, int, int]]):
    """Delay arrivals (from the last one before the earliest race on) until no input is near
    another instance's step end; returns the requests and the simulated result."""
    roles = {s.role for s in cfg.instance_specs()}
    return shift_until_race_free(reqs, lambda r: run_sim(cfg, model, r),
                                 lambda res, r: first_race(res, r, roles))


# (arrival s, prompt tokens, output tokens); colocated: 64 tokens a step, so long prompts chunk
COLOCATED = [(0.0, 40, 8), (0.05, 90, 6), (0.17, 20, 8), (0.22, 70, 5), (0.45, 30, 6),
             (0.48, 12, 8)]
DISAGGREGATED = [(0.0, 40, 8), (0.03, 30, 6), (0.06, 20, 8), (0.2, 60, 5), (0.24, 16, 8),
                 (0.5, 50, 6)]
SCENARIOS = {
    "colocated-tp2": ([{"role": "colocated", "tp": 2}], COLOCATED),
    "prefill-tp2-decode-tp1": ([{"role": "prefill", "tp": 2}, {"role": "decode", "tp": 1}],
                               DISAGGREGATED),
    "prefill-tp1-decode-tp2": ([{"role": "prefill", "tp": 1}, {"role": "decode", "tp": 2}],
                               DISAGGREGATED),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_tp2_same_batches_as_live_runtime(name: str, model_dir: str,
                                                executors: dict[int, Any]) -> None:
    roles, arrivals = SCENARIOS[name]
    cfg = cluster_config(model_dir, roles)
    assert any(s.tp == 2 for s in cfg.instance_specs())
    model = ModelConfig.from_dir(model_dir)
    reqs, res = race_free(cfg, model, arrivals)
    sim_batches = per_instance(res.batch_log)
    assert len(sim_batches) == len(cfg.instance_specs())  # every instance worked
    assert all(any(len(b) > 1 for b in bs) for bs in sim_batches.values())  # real batching
    if name.startswith("colocated"):
        assert any(s > 0 and n > 1 for b in sim_batches["colocated-0"]  # a later chunk
                   for _, s, n in b)
    log, tokens, overruns = await run_live(cfg, model, executors, reqs)
    assert per_instance(log) == sim_batches, f"steps that overran their fixed time: {overruns}"
    assert tokens == {r.request_id: r.output_len for r in res.records}
    assert tokens == {f"r{i}": o for i, (_, _, o) in enumerate(reqs)}
