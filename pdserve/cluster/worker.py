"""InstanceWorker: one engine behind a command/report interface (sans-IO).

Every driver talks to an instance the same way: ``handle(commands, now)`` applies the commands
(add, transfer, import, release, abort), reserves KV pulls on a decode instance, runs at most one
engine step and returns a :class:`StepReport`. A pipeline-parallel instance's engine is
:class:`~pdserve.engine.pipeline.PipelinedEngine` (its virtual engines behind the instance's one
id): its step completes one micro-batch and starts the next, or only starts one. Live, the
instance's own loop calls it (:class:`pdserve.cluster.instances.StepLoop`, in a thread of the
driver's process or inside a Ray actor); the simulator calls it directly at virtual times.
Messages are small serializable dataclasses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import EngineStats, KVPayload, StepResult
from pdserve.engine.executor import Executor, KVPullError
from pdserve.engine.kv_cache import KVEvent
from pdserve.engine.pipeline import make_engine
from pdserve.request import RequestStatus, SamplingParams, Timeline

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- commands
@dataclass(slots=True)
class AddRequest:
    """Compute a request (colocated/prefill). ``output_token_ids`` resumes it after these."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class AddTransfer:
    """Decode role: continue a request whose KV (all but the last token) is on another instance."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    predicted: Any = None  # LengthPrediction of the output (TetriInfer §3.3.2), if any


@dataclass(slots=True)
class ImportKV:
    """The KV of a request, pulled from its prefill instance by the instance client (a
    :class:`KVPayload`), or why the pull failed (a :class:`PullFailed`)."""

    request_id: str
    payload: Any  # KVPayload | PullFailed; the Ray client resolves an ObjectRef before handle()


@dataclass(slots=True)
class PullFailed:
    """The source died or no longer holds the request."""

    message: str


@dataclass(slots=True)
class Release:
    request_id: str


@dataclass(slots=True)
class Abort:
    """End the request here. ``discard_kv``: the client went away while the request's KV was
    moving here, so its source may have freed (and reused) the blocks a direct pull read from:
    what was pulled is freed without entering the prefix cache."""

    request_id: str
    discard_kv: bool = False


@dataclass(slots=True)
class SetRole:
    """TetriInfer §3.5 instance flip: take ``scheduler`` (another role's settings) without a
    restart or reload. The controller sends it only once the instance is drained."""

    role: str
    scheduler: SchedulerConfig
    request_id: str = ""  # (errors are reported per command's request id)


Command = AddRequest | AddTransfer | ImportKV | Release | Abort | SetRole


# ---------------------------------------------------------------------------------- report
@dataclass(slots=True)
class TokenDelta:
    """New tokens of one request from one step (``token_times`` aligned with ``token_ids``).

    ``timeline`` (the instance-side timeline) is attached to a request's first token and when it
    finishes or is held, so the controller can merge queue/prefill/decode times."""

    request_id: str
    token_ids: list[int]
    text: str
    token_times: list[float]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    held: bool = False
    timeline: Timeline | None = None


@dataclass(slots=True)
class StepReport:
    instance_id: str
    role: str
    now: float
    elapsed: float = 0.0
    deltas: list[TokenDelta] = field(default_factory=list)
    pulls: list[tuple[str, int]] = field(default_factory=list)  # decode: (request, first block)
    imported: list[str] = field(default_factory=list)  # decode: KV in place, prefill may release
    errors: list[tuple[str, str]] = field(default_factory=list)  # (request, message)
    # decode: pulls that failed (source gone or no longer holding the KV): (request, message)
    transfer_failures: list[tuple[str, str]] = field(default_factory=list)
    stepped: bool = False  # a batch was computed
    batch: list[tuple[str, int, int]] = field(default_factory=list)  # (request, start, tokens)
    stats: EngineStats | None = None
    # blocks stored / evicted since the last report (only when built with record_events=True)
    kv_events: list[KVEvent] = field(default_factory=list)
    has_work: bool = False
    has_unfinished: bool = False
    # temporal role (EcoServe §4.2.1): the phase of the last batch, when it began, and every
    # decoding request's (id, first token time, tokens generated) for the macro router
    phase: str = ""
    phase_switch_time: float = 0.0
    progress: list[tuple[str, float, int]] = field(default_factory=list)
    # the instance's own loop (:class:`pdserve.cluster.instances.StepLoop`): how many command
    # batches it had applied, counting from its session's start, when this step began
    applied: int = 0


class StepShortcut(Protocol):
    """Takes an instance's step without the scheduler building a batch — the simulator's exact
    decode fast path (:class:`pdserve.sim.simulator.DecodeShortcut`; the scheduler catches up
    the requests it advanced before reading them, ``Scheduler.open_run``).
    :meth:`InstanceWorker.handle` asks it first for each step: ``(elapsed, result)`` when it
    took the step (``result`` carrying the requests that finished in it, or ``None``), or
    ``None`` to let the engine step."""

    def step(self, now: float) -> tuple[float, StepResult | None] | None: ...


class InstanceWorker:
    """An :class:`Engine` plus the command protocol; sans-IO (no network, no clock)."""

    def __init__(self, instance_id: str, config: EngineConfig, executor: Executor,
                 tokenizer: Any = None, record_events: bool = False, stream_tokens: bool = True,
                 log_batches: bool = True) -> None:
        self.instance_id = instance_id
        self.role: str = config.scheduler.role
        # False: report a request only at its first token, when held and when finished (each
        # delta carrying every token since the last), which is all the controller needs; the
        # simulator uses this, the live runtime streams every token.
        self.stream_tokens = stream_tokens
        self.log_batches = log_batches  # fill StepReport.batch (tests, parity checks)
        self._reported: dict[str, int] = {}
        self.record_events = record_events  # forward the block pool's KV events in reports
        # a pipeline-parallel executor gets pp virtual engines (pdserve.engine.pipeline)
        self.engine = make_engine(config, executor, tokenizer, record_events, instance_id)

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.num_kv_blocks

    def handle(self, commands: list[Command], now: float, step: bool = True,
               shortcut: StepShortcut | None = None) -> StepReport:
        """Apply ``commands``, reserve KV pulls, take one engine step (``step``), reserve
        again, and report. ``shortcut`` may take the step instead of the engine (see
        :class:`StepShortcut`)."""
        eng = self.engine
        rep = StepReport(self.instance_id, self.role, now)
        for cmd in commands:
            self._apply(cmd, now, rep)
        rep.role = self.role  # a SetRole took effect
        if self.role == "decode":
            rep.pulls = eng.reserve_pulls(now)
        taken = shortcut.step(now) if shortcut is not None and step else None
        if taken is not None:
            rep.elapsed, res = taken
            rep.stepped = True
            if res is not None:
                self._deltas(res, rep)
        elif step and eng.has_work():
            res = eng.step(now)
            rep.elapsed = res.elapsed
            rep.stepped = not res.batch.empty or res.started is not None
            if self.log_batches:
                rep.batch = [(s.request_id, s.start, s.num_tokens) for s in res.batch.seqs]
            self._deltas(res, rep)
        if self.role == "decode":  # blocks freed by this step may admit pending transfers
            rep.pulls += eng.reserve_pulls(now + rep.elapsed)
        rep.stats = eng.stats()
        if self.record_events:
            rep.kv_events = eng.take_kv_events()
        rep.has_work = eng.has_work()
        rep.has_unfinished = eng.has_unfinished()
        if self.role == "temporal":
            rep.phase, rep.phase_switch_time, rep.progress = eng.temporal_state()
        return rep

    def _apply(self, cmd: Command, now: float, rep: StepReport) -> None:
        eng = self.engine
        log.debug("%s %s on %s at %.6f", type(cmd).__name__, cmd.request_id, self.instance_id,
                  now)
        try:
            if isinstance(cmd, AddRequest):
                eng.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, now,
                                cmd.arrival_time, cmd.output_token_ids)
                self._reported[cmd.request_id] = len(cmd.output_token_ids)
            elif isinstance(cmd, AddTransfer):
                eng.add_transfer_request(cmd.request_id, cmd.prompt_token_ids,
                                         cmd.output_token_ids, cmd.params, now, cmd.arrival_time,
                                         cmd.predicted)
                self._reported[cmd.request_id] = len(cmd.output_token_ids)
            elif isinstance(cmd, ImportKV):
                self._import(cmd, now, rep)
            elif isinstance(cmd, Release):
                if eng.holds(cmd.request_id):
                    eng.release(cmd.request_id, now)
            elif isinstance(cmd, Abort):
                eng.abort(cmd.request_id, now, discard_kv=cmd.discard_kv)
                self._reported.pop(cmd.request_id, None)
            elif isinstance(cmd, SetRole):
                eng.reconfigure(cmd.scheduler)
                self.role = cmd.role
            else:
                raise TypeError(f"unknown command {cmd!r}")
        except (ValueError, KeyError) as e:
            log.debug("%s on %s refused: %s", type(cmd).__name__, self.instance_id, e)
            rep.errors.append((cmd.request_id, str(e)))

    def _deltas(self, res: StepResult, rep: StepReport) -> None:
        held, stream, reported = set(res.held), self.stream_tokens, self._reported
        not_decode = self.role != "decode"
        fin = RequestStatus.FINISHED_STOPPED
        debug = log.isEnabledFor(logging.DEBUG)
        for req, text in zip(res.requests, res.new_texts):  # hot loop
            outs = req.output_token_ids
            first = not_decode and len(outs) == 1
            finished = req.status >= fin
            rid = req.request_id
            is_held = rid in held
            if debug and (first or finished or is_held):
                log.debug("%s on %s: %s after %d tokens", rid, self.instance_id,
                          "finished" if finished else "held for transfer" if is_held
                          else "first token", len(outs))
            if not (stream or first or finished or is_held):
                continue  # the simulator's common case: a decode token nobody waits for
            since = reported[rid]
            if finished or is_held:
                reported.pop(rid, None)
            else:
                reported[rid] = len(outs)
            tl = req.timeline
            n = len(outs) - since  # unreported tokens, all sampled here: the last n times
            rep.deltas.append(TokenDelta(
                request_id=rid, token_ids=outs[since:], text=text if stream else "",
                token_times=tl.token_times[-n:] if n else [], finished=finished,
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                logprobs=req.logprobs[-n:] if req.logprobs is not None and n else None,
                held=is_held, timeline=tl if (first or finished or is_held) else None))

    def _import(self, cmd: ImportKV, now: float, rep: StepReport) -> None:
        payload, rid = cmd.payload, cmd.request_id
        if not self.engine.is_pulling(rid):
            return  # aborted while the transfer was in flight
        if not isinstance(payload, PullFailed):
            try:
                self.engine.import_kv(payload, now)
            except KVPullError as e:  # a direct pull: a source rank died mid-pull
                payload = PullFailed(str(e))
            else:
                rep.imported.append(rid)
                return
        self.engine.abort(rid, now)
        self._reported.pop(rid, None)  # the driver recomputes it elsewhere: forget it here
        rep.transfer_failures.append((rid, f"KV transfer failed: {payload.message}"))

    def export_kv(self, request_id: str, first_block: int) -> KVPayload:
        return self.engine.export_kv(request_id, first_block)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_integrity(self) -> dict[str, int]:
        """Run the block-pool invariants; returns used/total blocks and live requests."""
        return self.engine.integrity()
