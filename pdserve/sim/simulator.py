"""Discrete-event simulator: the real scheduler, block pool, controller and routers on a virtual
clock, with a latency model in place of the model executor (DESIGN.md "Simulator").

Every instance is a real :class:`~pdserve.cluster.worker.InstanceWorker` whose executor returns
the latency model's step time; the cluster is the real :class:`Controller`, and when each
instance steps is decided by the driver core the live runtime uses too
(:class:`~pdserve.cluster.driver.DriverCore`: an idle instance that receives a command steps at
once; at a step's end an instance with more work starts its next step with the commands queued
so far, and then the report takes effect — the pipelining of the live runtime).
KV transfers take ``bytes / bandwidth + latency`` of the link between the two instances' nodes;
between two pipeline-parallel instances each inter-op stage sends its own layers' KV at once
(DistServe §4.2's per-segment transfer), so the bytes split over ``min(pp_src, pp_dst)`` links.

**Pipeline parallelism** (DistServe §3.1 Eq. 2, §3.2 Fig. 5): an instance with PP = k keeps up
to k batches in flight. It runs as k *virtual engines* (vLLM v0's design for PP; the split is
:mod:`pdserve.engine.pipeline`'s, as live): k workers, each with its own scheduler and ``1/k``
of the instance's KV blocks, that share the k stages of one :class:`PipelineStages`. A batch
occupies each stage for ``base / k`` (its share of the step) in turn, with an activation send
between stages; a stage takes the next batch as soon as it is free. So with equal stages the
pipeline completes a batch every ``base / k`` (k× the throughput) while each batch waits one
full pass (``base + (k − 1)·send``), and unequal batches leave bubbles (§3.3).

Heap key: ``(time, event priority, sequence)`` — priority before sequence, so that at equal
times step ends (which free resources and emit tokens) precede transfers and arrivals.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

from pdserve.cluster.controller import Controller, Fail, Transfer
from pdserve.cluster.driver import DriverCore, Effect, StartStep
from pdserve.cluster.routing import InstanceView, Router, make_routers, role_router
from pdserve.cluster.worker import (
    Command,
    InstanceWorker,
    StepReport,
)
from pdserve.config import ClusterConfig, EngineConfig, Link, ModelConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.engine.engine import Engine, StepResult
from pdserve.engine.pipeline import lane_blocks, lane_id
from pdserve.request import Request, SamplingParams, Timeline
from pdserve.sim.fast_forward import DecodeRun, open_decode_run
from pdserve.sim.latency import DriverOverhead, LatencyModel, PipelineModel

STEP_END, TRANSFER_END, ARRIVAL, SCALE = 0, 1, 2, 3
# the default of ``Simulator(fast_forward=...)``; PDSERVE_SIM_FAST_FORWARD=0 turns it off
FAST_FORWARD = os.environ.get("PDSERVE_SIM_FAST_FORWARD", "1") != "0"


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
        self.now = 0.0  # set by the driver before each step (pipelined executors use it)
        self.eos_token_ids: tuple[int, ...] = ()
        # a LatencyModel prices the batch's shape, computed with the sample count in one pass
        self._step_time = latency.step_time if isinstance(latency, LatencyModel) else None
        self._sum_time = latency.decode_sum_time if isinstance(latency, LatencyModel) else None

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        if self._step_time is None:
            n = sum(1 for s in batch.seqs if s.sample)
            return ExecuteResult([self.token_id] * n, self.latency.batch_time(batch))
        prefills, decodes, n = batch.shape_and_samples()
        return ExecuteResult([self.token_id] * n, self.price(prefills, decodes))

    @property
    def can_price(self) -> bool:
        """Whether :meth:`price` prices a batch from its shape (the decode fast path needs it)."""
        return self._step_time is not None

    def price(self, prefills: list[tuple[int, int]], decodes: list[int]) -> float:
        """The step time of a batch of this shape at :attr:`now` (what :meth:`execute` returns
        as ``elapsed``); the simulator's decode fast path prices its steps with it."""
        return self._step_time(prefills, decodes)  # type: ignore[misc]

    def price_decode(self, run: DecodeRun) -> float:
        """:meth:`price` of the decode step ``run`` takes next (from its batch size and total
        context when the latency model allows, else from its context lengths)."""
        if self._sum_time is not None:
            t = self._sum_time(len(run.ctx), run.total_context())
            if t is not None:
                return t
        return self.price([], run.contexts())

    def export_kv(self, block_ids: list[int]) -> None:
        return None

    def import_kv(self, block_ids: list[int], payload: Any) -> None:
        return None


class PipelineStages:
    """The ``pp`` stages of one pipeline-parallel instance: when each is next free."""

    def __init__(self, pp: int) -> None:
        self.free = [0.0] * pp

    def enter(self, now: float, stage_s: float, send_s: float) -> float:
        """A batch enters stage 0 at ``now``; each stage computes it for ``stage_s`` once the
        stage is free, then sends it on (``send_s``; the stage is free again while it sends).
        Returns when the last stage is done: ``now + pp·stage_s + (pp − 1)·send_s`` on an
        empty pipeline. A negative ``send_s`` (a measured pipeline whose first stage, the
        driver's, costs more than the others: :func:`~pdserve.sim.latency.pipeline_send`)
        starts the next stage before this one is done."""
        ready = now
        last = len(self.free) - 1
        for s, free in enumerate(self.free):
            ready = max(ready, free) + stage_s
            self.free[s] = ready
            if s < last:
                ready += send_s
        return ready


class PipelinedExecutor(SimExecutor):
    """One virtual engine of a PP instance: its batch's time is when it leaves the shared
    :class:`PipelineStages` (module docstring); the driver sets :attr:`now` before each step.
    A :class:`DriverOverhead` around the pipeline is the serving path's cost: it delays the
    batch's report, not the stages."""

    def __init__(self, latency: LatencyModel, num_kv_blocks: int, stages: PipelineStages
                 ) -> None:
        super().__init__(latency, num_kv_blocks)
        pipe, over = pipeline_of(latency)
        assert pipe is not None
        self.pipe, self.over, self.stages = pipe, over, stages
        self.now = 0.0

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        prefills, decodes, n = batch.shape_and_samples()
        return ExecuteResult([self.token_id] * n, self.price(prefills, decodes))

    @property
    def can_price(self) -> bool:
        return True

    def price_decode(self, run: DecodeRun) -> float:
        n = len(run.ctx)
        split = self.pipe.split_decode_sum(n, run.total_context())
        if split is None:
            return self.price([], run.contexts())
        return self._through_stages(*split, 0 + n)

    def price(self, prefills: list[tuple[int, int]], decodes: list[int]) -> float:
        """Enters the batch into the shared stages at :attr:`now` (a side effect)."""
        return self._through_stages(*self.pipe.split(prefills, decodes),
                                    len(prefills) + len(decodes))

    def _through_stages(self, stage_s: float, send_s: float, seqs: int) -> float:
        """A step that each stage computes for ``stage_s`` and hands on in ``send_s``
        (:meth:`PipelineModel.split`), of ``seqs`` sequences, through the stages from
        :attr:`now`."""
        if stage_s <= 0.0:
            return 0.0
        done = self.stages.enter(self.now, stage_s, send_s)
        extra = 0.0
        if self.over is not None:
            extra = self.over.overhead_s + self.over.per_seq_s * seqs
        return done - self.now + extra


def pipeline_of(latency: Any) -> tuple[PipelineModel | None, DriverOverhead | None]:
    """The :class:`PipelineModel` of a step-time model (inside a :class:`DriverOverhead`, whose
    wrapper is returned too), or ``(None, None)``."""
    over = latency if isinstance(latency, DriverOverhead) else None
    inner = over.base if over is not None else latency
    if isinstance(inner, PipelineModel):
        return inner, over
    return None, None


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
    instance: str | None = None  # the instance that computed its prefill


@dataclass
class SimResult:
    records: list[SimRecord]
    duration: float  # virtual seconds until the last event
    num_events: int
    instance_stats: dict[str, Any] = field(default_factory=dict)
    batch_log: list[tuple[str, float, list[tuple[str, int, int]]]] | None = None
    stopped: bool = False  # ended early by ``run``'s ``stop`` (records hold the state then)
    # instance -> virtual second -> seconds of it spent computing steps (per-instance reporting,
    # :mod:`pdserve.sim.instance_stats`)
    busy: dict[str, dict[int, float]] = field(default_factory=dict)


@dataclass
class _Inst:
    spec: SimInstance
    worker: InstanceWorker
    executor: SimExecutor
    pp: int = 1
    shortcut: DecodeShortcut | None = None


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector. A run allocates millions of objects that all
    live until it ends (blocks, requests, timelines), so every collection during it traverses
    live objects in vain, and the older generations' grow with the heap: a third of a plan's
    CPU time went there (2026-11-24, `git show 9de3c0b:docs/benchmarks.md`).
    Refcounting still frees what is acyclic (a simulation leaves no cycle). On the way out,
    what the run allocated moves to the oldest generation at once (``gc.freeze`` and
    ``unfreeze``, unless the caller froze objects itself): else the first collection after the
    run would traverse every object still alive from it, the caller's simulator included."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class DecodeShortcut:
    """The exact decode fast path of one simulated instance, as the worker's
    :class:`~pdserve.cluster.worker.StepShortcut`: when the step is pure decode with an
    unchanged batch, a :class:`~pdserve.sim.fast_forward.DecodeRun` advances it
    (no batch is built, one price call; the same block-pool calls in the same order). The run
    stays open over the instance's next steps; the scheduler closes it (catches its requests
    up) before it reads them: a step it schedules, an abort, a release, a role flip, and a
    decode instance's KV pulls when the admission policy reads the running requests'
    lengths."""

    def __init__(self, engine: Engine, executor: SimExecutor) -> None:
        # no reference back to the simulator or its instance: a finished simulation is then
        # acyclic and freed by reference counting, without the cyclic collector
        self.engine, self.executor = engine, executor
        self.num_folded = 0  # steps advanced without a batch

    def run(self) -> DecodeRun | None:
        """The instance's open :class:`DecodeRun`, synced with its running requests (opened if
        need be), or ``None`` when its next step is not pure decode."""
        sched = self.engine.scheduler
        run = cast(DecodeRun | None, sched.open_run)  # only ever a DecodeRun in a simulation
        if run is not None and not run.sync():  # the batch changed other than by imports
            run.close()
            run = None
        if run is None:
            run = open_decode_run(sched, self.executor.token_id)
        return run

    def quiet_step(self, now: float) -> float | None:
        """Take the instance's next step at ``now`` if it is pure decode and no request
        finishes in it (its report would say nothing but its time and stats): its elapsed
        time, or ``None`` (nothing was done)."""
        run = self.run()
        if run is None or run.j >= run.limit or not run.safe():
            return None
        return self._advance(run, now)[0]

    def step(self, now: float) -> tuple[float, StepResult | None] | None:
        """Advance the instance's next step with its :class:`DecodeRun` (opened if need be):
        its elapsed time and the requests that finished in it, or ``None`` when the step must
        be scheduled (the scheduler catches the run up if it reads the running requests)."""
        run = self.run()
        if run is None or not run.safe():  # a scheduled step; the scheduler closes the run
            return None                      # if it reads it
        elapsed, finished = self._advance(run, now)
        if not finished:
            return elapsed, None
        return elapsed, StepResult(ScheduledBatch(self.engine.scheduler.step_id), elapsed,
                                   finished, [""] * len(finished))

    def _advance(self, run: DecodeRun, now: float) -> tuple[float, list[Request]]:
        eng = self.engine
        elapsed = self.executor.price_decode(run)
        finished = run.advance(now, now + elapsed)
        self.num_folded += 1
        eng.num_steps += 1
        eng.busy_time += elapsed
        return elapsed, finished


class Simulator:
    """Runs a workload on simulated instances. ``intra_node_link`` joins instances on the same
    node, ``inter_node_link`` the others (DistServe §4.1/§4.2 placements). With ``deployment``
    the controller is built as the live runtime builds it (:meth:`Controller.from_config`);
    without, from the routers and ``controller_kw`` (tests)."""

    def __init__(self, instances: Sequence[SimInstance], model: ModelConfig,
                 prefill_router: str | Router = "shortest_queue",
                 decode_router: str | Router = "least_load",
                 intra_node_link: Link | None = None, inter_node_link: Link | None = None,
                 kv_dtype: str = "float16", record_batches: bool = False,
                 controller_kw: dict[str, Any] | None = None,
                 fast_forward: bool | None = None,
                 deployment: ClusterConfig | None = None) -> None:
        self.model = model
        # the exact decode fast path (:class:`DecodeShortcut`); off: every step is scheduled
        self.fast_forward = (FAST_FORWARD if fast_forward is None else fast_forward)
        self.kv_dtype = kv_dtype
        self.intra = intra_node_link or Link()
        self.inter = inter_node_link or Link()
        self.record_batches = record_batches
        routers = make_routers(prefill_router, decode_router)
        self.routers = routers
        self.insts: dict[str, _Inst] = {}
        for spec in instances:
            self.insts.update((i.spec.instance_id, i) for i in self._build(spec))
        views = [InstanceView(i.spec.instance_id, i.worker.role, i.spec.num_kv_blocks,
                              i.spec.engine.cache.block_size) for i in self.insts.values()]
        if deployment is not None:  # the live runtime's construction path
            self.controller = Controller.from_config(
                deployment, views, routers=routers,
                model_max_len=model.max_position_embeddings, keep_history=True)
        else:
            self.controller = Controller(views, *routers, keep_history=True,
                                         **(controller_kw or {}))
        self.core = DriverCore(self.controller, self.insts)
        self.num_gpus = sum(s.num_gpus for s in instances)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._errors: dict[str, str] = {}
        self._batch_log: list[tuple[str, float, list[tuple[str, int, int]]]] = []
        self._busy: dict[str, dict[int, float]] = {}
        self._removing: dict[str, float] = {}  # instance -> when its removal was asked
        self.num_quiet_ends = 0  # step ends taken by :meth:`_quiet_step_end`
        # (instance, asked, drained, its block pool's check_integrity()) per removal
        self.removals: list[tuple[str, float, float, dict[str, int]]] = []

    def _build(self, spec: SimInstance) -> list[_Inst]:
        """The worker(s) of one instance: one, or k virtual engines for PP = k."""
        pipe, _ = pipeline_of(spec.latency)
        pp = pipe.pp if pipe is not None else 1
        lanes = [spec]
        if pp > 1:  # k virtual engines over one pipeline (module docstring)
            stages = PipelineStages(pp)
            lanes = [replace(spec, instance_id=lane_id(spec.instance_id, j), num_kv_blocks=n)
                     for j, (_, n) in enumerate(lane_blocks(spec.num_kv_blocks, pp))]
        router = role_router(spec.engine.scheduler.role, *self.routers)
        out = []
        for lane in lanes:
            ex = (PipelinedExecutor(lane.latency, lane.num_kv_blocks, stages) if pp > 1
                  else SimExecutor(lane.latency, lane.num_kv_blocks))
            worker = InstanceWorker(lane.instance_id, lane.engine, executor=ex,
                                    stream_tokens=False, log_batches=self.record_batches,
                                    record_events=router.wants_kv_events)
            out.append(_Inst(lane, worker, ex, pp))
        return out

    # ------------------------------------------------------------------ scaling
    def add_instance(self, at: float, spec: SimInstance) -> None:
        """Start ``spec`` at virtual time ``at`` (live: ``ClusterRuntime.add_instance``)."""
        self._push(at, SCALE, ("add", spec))

    def remove_instance(self, at: float, instance_id: str) -> None:
        """Remove ``instance_id`` at ``at``: it drains, then leaves (live:
        ``ClusterRuntime.remove_instance``); ``removals`` records when it had drained."""
        self._push(at, SCALE, ("remove", instance_id))

    def _scale(self, op: str, arg: Any, now: float) -> None:
        if op == "add":
            for inst in self._build(arg):
                self.insts[inst.spec.instance_id] = inst
                view = InstanceView(inst.spec.instance_id, inst.worker.role,
                                    inst.spec.num_kv_blocks, inst.spec.engine.cache.block_size)
                self._run(self.core.add_instance(view, now), now)
        else:
            self._run(self.core.remove_instance(arg, now), now)
            self._removing[arg] = now

    def _forget_drained(self, now: float) -> None:
        for iid in [i for i in self._removing if self.core.drained(i)]:
            self._close(iid)
            self.core.forget(iid)
            self.removals.append((iid, self._removing.pop(iid), now,
                                  self.insts[iid].worker.check_integrity()))

    # ------------------------------------------------------------------ events
    def _push(self, t: float, prio: int, data: Any) -> None:
        heapq.heappush(self._heap, (t, prio, next(self._seq), data))

    @property
    def num_folded(self) -> int:
        """Steps the decode fast path advanced without a batch."""
        return sum(i.shortcut.num_folded for i in self.insts.values() if i.shortcut is not None)

    def run(self, requests: Sequence[SimRequest],
            progress: Callable[[int], None] | None = None,
            stop: Callable[[float], bool] | None = None) -> SimResult:
        """Simulate ``requests`` to completion. ``progress(n)`` is called as requests finish.
        ``stop(now)`` is called after every event; when it returns true the run ends there
        (``SimResult.stopped``; unfinished requests keep their state, no error is recorded) —
        a caller that can already decide what it measures (the planner's probes,
        :class:`pdserve.planner.early.AttainmentWatch`) saves the rest of the run.

        The cyclic garbage collector is paused for the run (:func:`gc_paused`)."""
        with gc_paused():
            return self._run_events(requests, progress, stop)

    def _run_events(self, requests: Sequence[SimRequest],
                    progress: Callable[[int], None] | None,
                    stop: Callable[[float], bool] | None) -> SimResult:
        # arrivals are known in advance: a sorted list merged with the heap of the few events
        # in flight, in the same (time, priority, sequence) order as one heap of both
        arrivals = sorted((r.arrival, ARRIVAL, next(self._seq), r) for r in requests)
        heap, pop, a, n_arrivals = self._heap, heapq.heappop, 0, len(arrivals)
        now, n_events, done = 0.0, 0, 0
        core = self.core
        stopped = False
        quick = self.fast_forward and not self.record_batches
        while heap or a < n_arrivals:
            if a < n_arrivals and (not heap or arrivals[a] < heap[0]):  # (sequences differ)
                now, prio, _, data = arrivals[a]
                a += 1
            else:
                now, prio, _, data = pop(heap)
            n_events += 1
            if prio == STEP_END:
                iid, rep = data
                if not (quick and self._quiet_step_end(iid, rep, now, data)):
                    core.step_done(iid, rep, lambda effects, now=now: self._run(effects, now))
            elif prio == TRANSFER_END:
                rid, dst, payload = data
                self._run(core.transfer_done(rid, dst, payload, now), now)
            elif prio == SCALE:
                self._scale(*data, now)
            else:
                r = data
                self._run(core.dispatch(self.controller.on_arrival(
                    r.request_id, r.prompt_token_ids, r.sampling_params(), now)), now)
            if self._removing:
                self._forget_drained(now)
            if progress is not None:
                finished = len(self.controller.history) - len(self.controller.requests)
                if finished != done:
                    progress(finished - done)
                    done = finished
            if stop is not None and stop(now):
                stopped = True
                break
        for iid in self.insts:
            self._close(iid)
        for rid, req in ({} if stopped else self.controller.requests).items():
            # the event queue ran dry with the request unfinished: the cluster deadlocked
            self._errors.setdefault(rid, f"simulation stalled with the request in stage "
                                         f"{req.stage!r} on {req.instance}")
        records = [
            SimRecord(rid, len(r.prompt_token_ids), len(r.output_token_ids), r.timeline,
                      r.finish_reason, self._errors.get(rid), r.num_cached_tokens,
                      r.prefill_instance or r.instance)
            for rid, r in self.controller.history.items()
        ]
        stats = {iid: i.worker.stats() for iid, i in self.insts.items()}
        return SimResult(records, now, n_events, stats,
                         self._batch_log if self.record_batches else None, stopped, self._busy)

    def _add_busy(self, iid: str, start: float, elapsed: float) -> None:
        """Count a step's ``elapsed`` seconds from ``start`` into its instance's seconds."""
        busy = self._busy.get(iid)
        if busy is None:
            busy = self._busy[iid] = {}
        sec = int(start)
        end = start + elapsed
        while end > sec + 1:  # a step across a second's end
            busy[sec] = busy.get(sec, 0.0) + (sec + 1 - start)
            sec += 1
            start = float(sec)
        busy[sec] = busy.get(sec, 0.0) + (end - start)

    def _quiet_step_end(self, iid: str, rep: StepReport, now: float,
                        data: tuple[str, StepReport]) -> bool:
        """The end of a step whose report says nothing but its time and stats (and a temporal
        instance's phase and decode progress), on an instance whose next step is pure decode
        with no request finishing in it, nothing queued for it and no request held by the
        router: what :meth:`DriverCore.step_done` would do — take the next step at once
        (:meth:`DecodeShortcut.quiet_step`), then set the controller's stats (and temporal
        report) from ``rep``, all that :meth:`Controller.on_report` does with such a report —
        without building commands or effects (``rep`` becomes the next step's report, but for
        a temporal instance's, which the controller keeps). ``False``: nothing was done, the
        caller takes the general path. Exact: the same heap order, stats and state
        (``tests/sim/test_fast_forward.py``)."""
        if (not rep.has_work or rep.deltas or rep.pulls or rep.imported or rep.errors
                or rep.transfer_failures or rep.kv_events or not rep.stepped):
            return False
        inst = self.insts[iid]
        sc, w = inst.shortcut, inst.worker
        ctl, core = self.controller, self.core
        if (sc is None or w.role == "prefill" or core.queues[iid]
                or ctl.queued or ctl.flips is not None or self._removing
                or (w.role == "decode" and w.engine.scheduler.pending_kv)):
            return False
        inst.executor.now = now
        elapsed = sc.quiet_step(now)
        if elapsed is None:
            return False
        core.sent[iid] += 1  # (DriverCore._start; the instance stays busy)
        view, eng = ctl.instances[iid], w.engine
        view.stats = rep.stats
        if w.role == "temporal":  # the controller keeps its report for the macro router
            view.report = rep
            rep = StepReport(iid, w.role, now, elapsed, stepped=True, stats=eng.stats(),
                             has_work=True, has_unfinished=True)
            rep.phase, rep.phase_switch_time, rep.progress = eng.temporal_state()
            data = (iid, rep)
        else:
            rep.now, rep.elapsed, rep.stats = now, elapsed, eng.stats()
        self.num_quiet_ends += 1
        self._push(now + elapsed, STEP_END, data)
        self._add_busy(iid, now, elapsed)
        return True

    def _handle(self, inst: _Inst, commands: list[Command], now: float) -> StepReport:
        """:meth:`InstanceWorker.handle`, with the exact decode fast path
        (:class:`DecodeShortcut`) taking the steps it can where nothing else needs the batch."""
        w = inst.worker
        eng = w.engine
        if (w.role == "prefill" or self.record_batches or w.record_events
                or w.stream_tokens or eng.tokenizer is not None or eng.config.step_log is not None
                or not inst.executor.can_price or self.controller.flips is not None):
            self._close(inst.spec.instance_id)
            return w.handle(commands, now)
        if inst.shortcut is None:
            inst.shortcut = DecodeShortcut(eng, inst.executor)
        return w.handle(commands, now, shortcut=inst.shortcut)

    def _close(self, iid: str) -> None:
        self.insts[iid].worker.engine.scheduler.close_run()

    def _start_step(self, iid: str, commands: list[Command], now: float) -> None:
        """A :class:`StartStep`: the instance applies ``commands`` and takes its next step."""
        inst = self.insts[iid]
        inst.executor.now = now
        rep = (self._handle(inst, commands, now) if self.fast_forward
               else inst.worker.handle(commands, now))
        if rep.stepped:
            if self.record_batches:
                self._batch_log.append((iid, now, rep.batch))
            self._push(now + rep.elapsed, STEP_END, (iid, rep))
            self._add_busy(iid, now, rep.elapsed)
        else:  # nothing to compute: the report takes effect now
            self.core.step_done(iid, rep, lambda effects: self._run(effects, now))

    def _run(self, effects: list[Effect], now: float) -> None:
        """Carry out the driver core's effects at virtual time ``now``."""
        for e in effects:
            if isinstance(e, StartStep):
                self._start_step(e.instance_id, e.commands, now)
            elif isinstance(e, Transfer):
                src, dst = self.insts[e.src], self.insts[e.dst]
                self._close(e.src)
                payload = src.worker.export_kv(e.request_id, e.first_block)
                nbytes = (payload.num_blocks * dst.spec.engine.cache.block_size
                          * self.model.kv_bytes_per_token(self.kv_dtype))
                link = self.intra if src.spec.node == dst.spec.node else self.inter
                nbytes /= min(src.pp, dst.pp)  # one segment per inter-op stage, at once
                self._push(now + link.min_time(nbytes), TRANSFER_END,
                           (e.request_id, e.dst, payload))
            elif isinstance(e, Fail):
                self._errors[e.request_id] = e.message
