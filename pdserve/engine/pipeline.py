"""Pipeline parallelism as virtual engines (vLLM v0's design), the one design of live and
simulated PP.

An instance with PP = k runs k *virtual engines* (lanes) over its k pipeline stages. Each lane
is a scheduler of its own requests with ``1/k`` of the instance's KV blocks
(:func:`lane_blocks`), and each has at most one micro-batch in flight, so up to k are::

    stage 0 | b0 | b1 | b0'| b1'|        lane 0: b0, b0', ...   lane 1: b1, b1', ...
    stage 1 |    | b0 | b1 | b0'| b1'    a lane schedules again once its batch's logits are back

- Live, :class:`PipelinedEngine` is the instance's engine: k :class:`Engine` lanes over one
  pipelined :class:`~pdserve.engine.model_executor.ModelExecutor` (each lane's
  :class:`LaneExecutor` shifts its block ids into its share of the one KV cache). The instance
  keeps one id: the controller, routers and metrics see one instance with all its blocks;
  requests go to the lane with the fewest unfinished requests (vLLM v0's rule) and stay there;
  KV events, stats and pulls are the lanes' together.
- Simulated, the lanes are workers named :func:`lane_id` sharing one
  :class:`pdserve.sim.simulator.PipelineStages` (the simulator's controller routes to lanes).

Torch-free: this module only drives executors.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.engine.engine import Engine, EngineStats, KVPayload, StepResult
from pdserve.engine.kv_cache import KVEvent
from pdserve.request import Request, RequestOutput, SamplingParams


def lane_blocks(num_blocks: int, pp: int) -> list[tuple[int, int]]:
    """``(first block, blocks)`` of each of the ``pp`` virtual engines of an instance with
    ``num_blocks`` KV blocks: an equal share each (at least one), in order."""
    n = max(1, num_blocks // pp)
    return [(j * n, n) for j in range(pp)]


def lane_id(instance_id: str, lane: int) -> str:
    """The name of virtual engine ``lane`` of ``instance_id`` (its step log's instance id; the
    simulator's worker id)."""
    return f"{instance_id}.v{lane}"


class PipelineExecutor(Protocol):
    """What :class:`PipelinedEngine` needs of a pipeline-parallel executor."""

    pp: int
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]

    def submit(self, batch: ScheduledBatch, block_offset: int = 0) -> Any: ...

    def collect(self, handle: Any) -> ExecuteResult: ...

    def export_kv(self, block_ids: list[int]) -> Any: ...

    def import_kv(self, block_ids: list[int], payload: Any) -> None: ...


class LaneExecutor:
    """One virtual engine's view of the shared executor: blocks ``0 .. num_kv_blocks - 1`` of
    the lane are the executor's ``offset ..``."""

    def __init__(self, shared: PipelineExecutor, offset: int, num_kv_blocks: int) -> None:
        self.shared, self.offset, self.num_kv_blocks = shared, offset, num_kv_blocks
        self.eos_token_ids = tuple(shared.eos_token_ids)
        self.model_config = getattr(shared, "model_config", None)

    def submit(self, batch: ScheduledBatch) -> Any:
        return self.shared.submit(batch, self.offset)

    def collect(self, handle: Any) -> ExecuteResult:
        return self.shared.collect(handle)

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        return self.collect(self.submit(batch))

    def export_kv(self, block_ids: list[int]) -> Any:
        return self.shared.export_kv([b + self.offset for b in block_ids])

    def import_kv(self, block_ids: list[int], payload: Any) -> None:
        self.shared.import_kv([b + self.offset for b in block_ids], payload)


_SUMMED = ("num_running", "num_waiting", "num_held", "num_pending_kv", "num_kv_blocks",
           "num_free_blocks", "num_used_blocks", "prefix_queries", "prefix_hits",
           "num_preemptions", "num_steps", "step_log_errors")


class PipelinedEngine:
    """The engine of a live PP instance: ``executor.pp`` :class:`Engine` lanes (module
    docstring) behind :class:`Engine`'s interface. :meth:`step` first fills the pipeline (a
    lane with work and nothing in flight starts a micro-batch, while fewer than ``pp`` are in
    flight); otherwise it completes the oldest micro-batch in flight and starts that lane's
    next one. A step that only started a micro-batch reports it in ``StepResult.started``."""

    def __init__(self, config: EngineConfig, executor: PipelineExecutor, tokenizer: Any = None,
                 eos_token_ids: tuple[int, ...] | None = None, record_events: bool = False,
                 name: str = "engine") -> None:
        self.config, self.executor, self.tokenizer, self.name = config, executor, tokenizer, name
        self.pp = executor.pp
        self._views = [LaneExecutor(executor, first, n)
                       for first, n in lane_blocks(executor.num_kv_blocks, self.pp)]
        self.lanes = [Engine(config, v, tokenizer, eos_token_ids, record_events, lane_id(name, j))
                      for j, v in enumerate(self._views)]
        self.max_model_len = self.lanes[0].max_model_len
        # (lane number, batch, executor handle, when it was scheduled), oldest first
        self._flight: deque[tuple[int, ScheduledBatch, Any, float]] = deque()
        self._next = 0  # the lane the next fill tries first
        self.busy_time = 0.0

    # ------------------------------------------------------------------ requests
    def _find(self, request_id: str) -> Engine | None:
        return next((e for e in self.lanes if request_id in e.scheduler.requests), None)

    def _pick(self, request_id: str) -> Engine:
        if self._find(request_id) is not None:
            raise ValueError(f"request {request_id!r} is already on this instance")
        return min(self.lanes, key=lambda e: e.scheduler.num_unfinished)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.lanes[0].validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    now: float = 0.0, arrival_time: float | None = None,
                    output_token_ids: list[int] | None = None) -> Request:
        return self._pick(request_id).add_request(request_id, prompt_token_ids, params, now,
                                                  arrival_time, output_token_ids)

    def add_transfer_request(self, request_id: str, prompt_token_ids: list[int],
                             output_token_ids: list[int], params: SamplingParams,
                             now: float = 0.0, arrival_time: float | None = None,
                             predicted: Any = None) -> Request:
        return self._pick(request_id).add_transfer_request(
            request_id, prompt_token_ids, output_token_ids, params, now, arrival_time, predicted)

    def abort(self, request_id: str, now: float = 0.0, discard_kv: bool = False
              ) -> RequestOutput | None:
        lane = self._find(request_id)
        return None if lane is None else lane.abort(request_id, now, discard_kv)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.lanes)

    def has_work(self) -> bool:
        return bool(self._flight) or any(e.has_work() for e in self.lanes)

    # ------------------------------------------------------------------ stepping
    def step(self, now: float = 0.0) -> StepResult:
        if len(self._flight) < self.pp:
            busy = {f[0] for f in self._flight}
            for k in range(self.pp):
                j = (self._next + k) % self.pp
                if j not in busy and self.lanes[j].has_work():
                    started = self._begin(j, now)
                    if started is not None:
                        self._next = (j + 1) % self.pp
                        return StepResult(ScheduledBatch(-1), 0.0, started=started)
        if not self._flight:
            return StepResult(ScheduledBatch(-1), 0.0)
        j, batch, handle, t = self._flight.popleft()
        result = self._views[j].collect(handle)
        res = self.lanes[j].finish_step(batch, result, t)
        res.elapsed = max(0.0, t + result.elapsed - now)  # from this step's start
        self.busy_time += res.elapsed
        if self.lanes[j].has_work():
            res.started = self._begin(j, now + res.elapsed)
        return res

    def _begin(self, j: int, now: float) -> ScheduledBatch | None:
        got = self.lanes[j].begin_step(now, self._views[j].submit)
        if got is None:
            return None
        self._flight.append((j, got[0], got[1], now))
        return got[0]

    # ------------------------------------------------------------------ KV hand-off
    def holds(self, request_id: str) -> bool:
        return any(e.holds(request_id) for e in self.lanes)

    def is_pulling(self, request_id: str) -> bool:
        return any(e.is_pulling(request_id) for e in self.lanes)

    def export_kv(self, request_id: str, first_block: int = 0) -> KVPayload:
        lane = next((e for e in self.lanes if e.holds(request_id)), self.lanes[0])
        return lane.export_kv(request_id, first_block)

    def release(self, request_id: str, now: float = 0.0) -> None:
        lane = next((e for e in self.lanes if e.holds(request_id)), self.lanes[0])
        lane.release(request_id, now)

    def reserve_pulls(self, now: float = 0.0,
                      limit: int | None = None) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for e in self.lanes:
            if limit is not None and len(out) >= limit:
                break
            out += e.reserve_pulls(now, None if limit is None else limit - len(out))
        return out

    def import_kv(self, payload: KVPayload, now: float = 0.0) -> None:
        lane = next((e for e in self.lanes if e.is_pulling(payload.request_id)), self.lanes[0])
        lane.import_kv(payload, now)

    # ------------------------------------------------------------------ the instance as one
    def reconfigure(self, scheduler: SchedulerConfig) -> None:
        for e in self.lanes:
            e.reconfigure(scheduler)

    def take_kv_events(self) -> list[KVEvent]:
        return [ev for e in self.lanes for ev in e.take_kv_events()]

    def temporal_state(self) -> tuple[str, float, list[tuple[str, float, int]]]:
        phase, since, _ = self.lanes[0].temporal_state()
        return phase, since, [p for e in self.lanes for p in e.temporal_state()[2]]

    @property
    def num_kv_blocks(self) -> int:
        return sum(e.num_kv_blocks for e in self.lanes)

    @property
    def num_steps(self) -> int:
        return sum(e.num_steps for e in self.lanes)

    def stats(self) -> EngineStats:
        """The lanes' stats summed (``kv_usage`` over all blocks; ``busy_time``: the seconds
        this engine's steps took, micro-batches overlapping)."""
        parts = [e.stats() for e in self.lanes]
        summed = {f: sum(getattr(p, f) for p in parts) for f in _SUMMED}
        used, n = summed["num_used_blocks"], summed["num_kv_blocks"]
        return EngineStats(**summed, kv_usage=used / n, busy_time=self.busy_time)

    def check_integrity(self) -> None:
        for e in self.lanes:
            e.check_integrity()

    def integrity(self) -> dict[str, int]:
        counts = [e.integrity() for e in self.lanes]
        return {k: sum(c[k] for c in counts) for k in counts[0]}


def make_engine(config: EngineConfig, executor: Any, tokenizer: Any = None,
                record_events: bool = False, name: str = "engine") -> Engine | PipelinedEngine:
    """The engine of one instance: :class:`PipelinedEngine` over a pipeline-parallel executor
    (``executor.pp > 1``), else :class:`Engine`."""
    if getattr(executor, "pp", 1) > 1:
        return PipelinedEngine(config, executor, tokenizer, record_events=record_events,
                               name=name)
    return Engine(config, executor, tokenizer, record_events=record_events, name=name)
