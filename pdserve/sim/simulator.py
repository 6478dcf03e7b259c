"""Discrete-event simulator: the real scheduler, block pool, controller and routers on a virtual
clock, with a latency model in place of the model executor (DESIGN.md "Simulator").

Every instance is a real :class:`~pdserve.cluster.worker.InstanceWorker` whose executor returns
the latency model's step time; the cluster is the real :class:`Controller`, and when each
instance steps is decided by the driver core the live runtime uses too
(:class:`~pdserve.cluster.driver.DriverCore`: an idle instance that receives a command steps at
once; at a step's end an instance with more work starts its next step with the commands queued
so far, and then the report takes effect — the pipelining of the live runtime).
KV transfers take ``bytes / bandwidth + latency`` of the link between the two instances' nodes.

Heap key: ``(time, event priority, sequence)`` — priority before sequence, so that at equal
times step ends (which free resources and emit tokens) precede transfers and arrivals.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.cluster.controller import Controller, Fail, Transfer
from pdserve.cluster.driver import DriverCore, Effect, StartStep
from pdserve.cluster.routing import InstanceView
from pdserve.cluster.worker import InstanceWorker
from pdserve.config import EngineConfig, Link, ModelConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.request import SamplingParams, Timeline
from pdserve.sim.latency import LatencyModel

STEP_END, TRANSFER_END, ARRIVAL = 0, 1, 2


class StepTimeModel(Protocol):
    def batch_time(self, batch: ScheduledBatch) -> float: ...


class SimExecutor:
    """Executor whose only output is time: ``latency.batch_time(batch)`` seconds per step, and a
    fixed token for every sampled position (output lengths come from the workload via
    ``max_tokens`` + ``ignore_eos``)."""

    def __init__(self, latency: StepTimeModel, num_kv_blocks: int, token_id: int = 1) -> None:
        self.latency = latency
        self.num_kv_blocks = num_kv_blocks
        self.token_id = token_id
        self.eos_token_ids: tuple[int, ...] = ()
        # a LatencyModel prices the batch's shape, computed with the sample count in one pass
        self._step_time = latency.step_time if isinstance(latency, LatencyModel) else None

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        if self._step_time is None:
            n = sum(1 for s in batch.seqs if s.sample)
            return ExecuteResult([self.token_id] * n, self.latency.batch_time(batch))
        prefills, decodes, n = batch.shape_and_samples()
        return ExecuteResult([self.token_id] * n, self._step_time(prefills, decodes))

    def export_kv(self, block_ids: list[int]) -> None:
        return None

    def import_kv(self, block_ids: list[int], payload: Any) -> None:
        return None


@dataclass(frozen=True)
class SimInstance:
    """One simulated instance: its engine config (role inside), step-time model, GPUs, node."""

    instance_id: str
    engine: EngineConfig
    latency: StepTimeModel
    num_kv_blocks: int
    num_gpus: int = 1
    node: int = 0


@dataclass
class SimRequest:
    """A workload request: token ids (prefix sharing is real) and a forced output length."""

    request_id: str
    arrival: float
    prompt_token_ids: list[int]
    output_len: int
    params: SamplingParams | None = None

    def sampling_params(self) -> SamplingParams:
        return self.params or SamplingParams(max_tokens=self.output_len, temperature=0.0,
                                             ignore_eos=True)


@dataclass
class SimRecord:
    request_id: str
    prompt_len: int
    output_len: int
    timeline: Timeline
    finish_reason: str | None
    error: str | None = None
    num_cached_tokens: int = 0


@dataclass
class SimResult:
    records: list[SimRecord]
    duration: float  # virtual seconds until the last event
    num_events: int
    instance_stats: dict[str, Any] = field(default_factory=dict)
    batch_log: list[tuple[str, float, list[tuple[str, int, int]]]] | None = None


@dataclass
class _Inst:
    spec: SimInstance
    worker: InstanceWorker


class Simulator:
    """Runs a workload on simulated instances. ``intra_node_link`` joins instances on the same
    node, ``inter_node_link`` the others (DistServe §4.1/§4.2 placements)."""

    def __init__(self, instances: Sequence[SimInstance], model: ModelConfig,
                 prefill_router: str = "shortest_queue", decode_router: str = "least_load",
                 intra_node_link: Link | None = None, inter_node_link: Link | None = None,
                 kv_dtype: str = "float16", record_batches: bool = False,
                 controller_kw: dict[str, Any] | None = None) -> None:
        self.model = model
        self.kv_dtype = kv_dtype
        self.intra = intra_node_link or Link()
        self.inter = inter_node_link or Link()
        self.insts: dict[str, _Inst] = {}
        for spec in instances:
            ex = SimExecutor(spec.latency, spec.num_kv_blocks)
            worker = InstanceWorker(spec.instance_id, spec.engine, executor=ex,
                                    stream_tokens=False, log_batches=record_batches)
            self.insts[spec.instance_id] = _Inst(spec, worker)
        self.controller = Controller(
            [InstanceView(i.spec.instance_id, i.worker.role, i.spec.num_kv_blocks,
                          i.spec.engine.cache.block_size) for i in self.insts.values()],
            prefill_router, decode_router, keep_history=True, **(controller_kw or {}))
        self.core = DriverCore(self.controller, self.insts)
        self.num_gpus = sum(s.num_gpus for s in instances)
        self.record_batches = record_batches
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._errors: dict[str, str] = {}
        self._batch_log: list[tuple[str, float, list[tuple[str, int, int]]]] = []

    # ------------------------------------------------------------------ events
    def _push(self, t: float, prio: int, data: Any) -> None:
        heapq.heappush(self._heap, (t, prio, next(self._seq), data))

    def run(self, requests: Sequence[SimRequest],
            progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate ``requests`` to completion. ``progress(n)`` is called as requests finish."""
        for r in requests:
            self._push(r.arrival, ARRIVAL, r)
        now, n_events, done = 0.0, 0, 0
        core = self.core
        while self._heap:
            now, prio, _, data = heapq.heappop(self._heap)
            n_events += 1
            if prio == STEP_END:
                iid, rep = data
                core.step_done(iid, rep, lambda effects, now=now: self._run(effects, now))
            elif prio == TRANSFER_END:
                rid, dst, payload = data
                self._run(core.transfer_done(rid, dst, payload, now), now)
            else:
                r = data
                self._run(core.dispatch(self.controller.on_arrival(
                    r.request_id, r.prompt_token_ids, r.sampling_params(), now)), now)
            if progress is not None:
                finished = len(self.controller.history) - len(self.controller.requests)
                if finished != done:
                    progress(finished - done)
                    done = finished
        for rid, req in self.controller.requests.items():
            # the event queue ran dry with the request unfinished: the cluster deadlocked
            self._errors.setdefault(rid, f"simulation stalled with the request in stage "
                                         f"{req.stage!r} on {req.instance}")
        records = [
            SimRecord(rid, len(r.prompt_token_ids), len(r.output_token_ids), r.timeline,
                      r.finish_reason, self._errors.get(rid), r.num_cached_tokens)
            for rid, r in self.controller.history.items()
        ]
        stats = {iid: i.worker.stats() for iid, i in self.insts.items()}
        return SimResult(records, now, n_events, stats,
                         self._batch_log if self.record_batches else None)

    def _run(self, effects: list[Effect], now: float) -> None:
        """Carry out the driver core's effects at virtual time ``now``."""
        for e in effects:
            if isinstance(e, StartStep):
                inst = self.insts[e.instance_id]
                rep = inst.worker.handle(e.commands, now)
                if rep.stepped:
                    if self.record_batches:
                        self._batch_log.append((e.instance_id, now, rep.batch))
                    self._push(now + rep.elapsed, STEP_END, (e.instance_id, rep))
                else:  # nothing to compute: the report takes effect now
                    self.core.step_done(e.instance_id, rep,
                                        lambda effects: self._run(effects, now))
            elif isinstance(e, Transfer):
                src, dst = self.insts[e.src], self.insts[e.dst]
                payload = src.worker.export_kv(e.request_id, e.first_block)
                nbytes = (payload.num_blocks * dst.spec.engine.cache.block_size
                          * self.model.kv_bytes_per_token(self.kv_dtype))
                link = self.intra if src.spec.node == dst.spec.node else self.inter
                self._push(now + link.min_time(nbytes), TRANSFER_END,
                           (e.request_id, e.dst, payload))
            elif isinstance(e, Fail):
                self._errors[e.request_id] = e.message
