"""The virtual engines of a PP instance (torch-free): each lane holds its own share of the KV
blocks (no two lanes write the same slot), requests spread over the lanes, up to ``pp``
micro-batches are in flight in the order the pipeline takes them, and the worker reports the
instance as one (one id, all its blocks)."""

from __future__ import annotations

from typing import Any

from pdserve.cluster.worker import AddRequest, InstanceWorker
from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.engine.kv_cache import BlockStored
from pdserve.engine.pipeline import LaneExecutor, PipelinedEngine, lane_blocks, lane_id
from pdserve.request import SamplingParams
from tests.engine.fakes import FakeExecutor, reference_generate

BLOCK = 4


class FakePipe(FakeExecutor):
    """:class:`FakeExecutor` as a pipelined executor: a batch computes at :meth:`submit` (its
    block ids shifted by the lane's offset, so the KV check fails if lanes share slots) and its
    tokens come back at :meth:`collect`; ``events`` is the order of both."""

    def __init__(self, num_kv_blocks: int, pp: int = 2) -> None:
        super().__init__(num_kv_blocks, BLOCK)
        self.pp = pp
        self.offset = 0
        self.offsets: list[int] = []
        self.events: list[tuple[str, int]] = []

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return super()._slot([b + self.offset for b in block_ids], pos)

    def submit(self, batch: ScheduledBatch, block_offset: int = 0) -> Any:
        self.offset = block_offset
        n = len(self.offsets)
        self.offsets.append(block_offset)
        self.events.append(("submit", n))
        return n, self.execute(batch)

    def collect(self, handle: Any) -> ExecuteResult:
        self.events.append(("collect", handle[0]))
        return handle[1]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def config(blocks: int) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=BLOCK, num_kv_blocks=blocks))


def test_lane_split_is_the_simulators() -> None:
    assert lane_blocks(10, 2) == [(0, 5), (5, 5)]
    assert lane_blocks(12, 3) == [(0, 4), (4, 4), (8, 4)]
    assert lane_id("colocated-0", 1) == "colocated-0.v1"


def test_lanes_keep_pp_micro_batches_in_flight_and_their_own_blocks() -> None:
    ex = FakePipe(40)
    eng = PipelinedEngine(config(40), ex)
    prompts = {f"r{i}": list(range(1 + i, 9 + 3 * i)) for i in range(4)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy(6))
    # fewest unfinished first: r0, r2 on lane 0; r1, r3 on lane 1
    assert [sorted(e.scheduler.requests) for e in eng.lanes] == [["r0", "r2"], ["r1", "r3"]]
    first = eng.step(0.0)
    assert first.started is not None and first.batch.empty and not first.requests
    assert eng.step(0.0).started is not None  # lane 1 joins: two in flight
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step(0.0).outputs:
            if o.finished:
                out[o.request_id] = o.token_ids
        eng.check_integrity()
    assert out == {rid: reference_generate(p, 6) for rid, p in prompts.items()}
    # lanes alternate: submit 0, submit 1, then collect j and submit j + 2 (the same lane)
    steady = [("submit", 0), ("submit", 1)]
    for j in range(len(ex.offsets) - 2):
        steady += [("collect", j), ("submit", j + 2)]
    steady += [("collect", len(ex.offsets) - 2), ("collect", len(ex.offsets) - 1)]
    assert ex.events == steady
    assert ex.offsets == [0, 20] * (len(ex.offsets) // 2)


def test_one_lane_busy_runs_one_micro_batch_at_a_time() -> None:
    ex = FakePipe(40)
    eng = PipelinedEngine(config(40), ex)
    eng.add_request("a", [1, 2, 3, 4, 5], greedy(3))
    while eng.has_unfinished():
        eng.step(0.0)
    assert ex.events == [("submit", 0), ("collect", 0), ("submit", 1), ("collect", 1),
                         ("submit", 2), ("collect", 2)]


def test_lane_executor_shifts_kv_block_ids() -> None:
    ex = FakePipe(8)
    ex.import_kv([5, 6], [[1, 2, 3, 4], [5, 6, 7, 8]])
    lane = LaneExecutor(ex, 4, 4)
    assert lane.export_kv([1, 2]) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    lane.import_kv([0], [[9, 9, 9, 9]])
    assert ex.export_kv([4]) == [[9, 9, 9, 9]]


def test_the_worker_reports_a_pp_instance_as_one() -> None:
    """One id, every block; a step that only started a micro-batch still counts as a step (the
    instance loop steps again at once)."""
    w = InstanceWorker("pp-0", config(40), FakePipe(40), record_events=True)
    assert isinstance(w.engine, PipelinedEngine) and w.num_kv_blocks == 40
    rep = w.handle([AddRequest("a", [1, 2, 3], greedy(2), 0.0),
                    AddRequest("b", [4, 5, 6], greedy(2), 0.0)], 0.0)
    assert rep.instance_id == "pp-0" and rep.stepped and rep.has_work and not rep.deltas
    assert rep.stats is not None and rep.stats.num_kv_blocks == 40
    assert rep.stats.num_running + rep.stats.num_waiting == 2
    reps = [rep]
    while reps[-1].has_work:
        reps.append(w.handle([], 0.0))
    # both lanes' block pools report through the instance: a and b's full block (4 tokens)
    stored = [e for r in reps for e in r.kv_events if isinstance(e, BlockStored)]
    ta, tb = reference_generate([1, 2, 3], 1), reference_generate([4, 5, 6], 1)
    assert sorted(e.token_ids for e in stored) == sorted([[1, 2, 3, *ta], [4, 5, 6, *tb]])
    tokens: dict[str, list[int]] = {d.request_id: [] for r in reps for d in r.deltas}
    for r in reps:
        for d in r.deltas:
            tokens[d.request_id] += d.token_ids
    assert tokens == {"a": reference_generate([1, 2, 3], 2), "b": reference_generate([4, 5, 6], 2)}
    assert w.check_integrity() == {"used_blocks": 0, "num_blocks": 40, "num_requests": 0}
