"""Engine: one model instance as a synchronous state machine.

``step(now)`` = ``scheduler.schedule(now)`` → ``executor.execute(batch)`` →
``scheduler.update(batch, result, now + result.elapsed)``. The engine never reads a clock or
sleeps: the driver passes ``now`` in, and token times are ``now`` plus the executor's reported
duration (measured by a real executor, modelled by the simulator's).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.engine.executor import Executor
from pdserve.engine.kv_cache import KVEvent
from pdserve.engine.logfile import AppendLog
from pdserve.engine.scheduler import Scheduler
from pdserve.request import (
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    validate_prompt,
)
from pdserve.tokenizer import IncrementalDetokenizer


@dataclass
class StepResult:
    """What one step did: the batch, its duration, the requests that got a token (with the text
    each token added) and the prefill-role requests now held for a KV pull."""

    batch: ScheduledBatch
    elapsed: float
    requests: list[Request] = field(default_factory=list)
    new_texts: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    # a pipelined engine: the micro-batch this step started (it completes in a later step)
    started: ScheduledBatch | None = None

    @property
    def outputs(self) -> list[RequestOutput]:
        """One :class:`RequestOutput` delta per request that got a token or finished."""
        return [request_output(r, [r.output_token_ids[-1]], t)
                for r, t in zip(self.requests, self.new_texts)]


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_held: int
    num_pending_kv: int
    num_kv_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    num_steps: int
    busy_time: float = 0.0  # seconds spent computing steps (TetriInfer's resource usage time)
    step_log_errors: int = 0  # step-log lines that could not be written (full disk, ...)


@dataclass
class KVPayload:
    """The KV of blocks ``[first_block, first_block + num_blocks)`` of a request (all layers)."""

    request_id: str
    first_block: int
    num_blocks: int
    data: Any


class Engine:
    """One model instance: a scheduler and the executor it is given (the torch
    :class:`~pdserve.engine.model_executor.ModelExecutor`, or the simulator's)."""

    def __init__(self, config: EngineConfig, executor: Executor,
                 tokenizer: Any = None, eos_token_ids: tuple[int, ...] | None = None,
                 record_events: bool = False, name: str = "engine") -> None:
        self.config = config
        self.name = name  # the step log's instance_id
        self.executor = executor
        if eos_token_ids is None:
            eos_token_ids = tuple(getattr(executor, "eos_token_ids", ()))
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config.scheduler, config.cache, executor.num_kv_blocks,
                                   eos_token_ids, record_events)
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = getattr(getattr(executor, "model_config", None), "vocab_size", None)
        self.num_steps = 0
        self.busy_time = 0.0
        self._step_log: AppendLog | None = None  # ``config.step_log``, opened at the first step

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the bad value if this request cannot be served."""
        validate_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    now: float = 0.0, arrival_time: float | None = None,
                    output_token_ids: list[int] | None = None) -> Request:
        """Queue a request (colocated/prefill roles). ``output_token_ids`` resumes a request that
        already generated these tokens elsewhere: they are recomputed, not re-sampled, and
        generation continues after them. Raises ``ValueError`` on bad input."""
        req = self._new_request(request_id, prompt_token_ids, params, now, arrival_time,
                                output_token_ids or [])
        self.scheduler.add_request(req, now)
        return req

    def add_transfer_request(self, request_id: str, prompt_token_ids: list[int],
                             output_token_ids: list[int], params: SamplingParams,
                             now: float = 0.0, arrival_time: float | None = None,
                             predicted: Any = None) -> Request:
        """Decode role: accept a request whose KV up to its last token was computed elsewhere
        (``output_token_ids`` holds at least the first token). The KV is pulled once
        :meth:`reserve_pulls` finds room for it. ``predicted``: its predicted output length
        range (:class:`pdserve.predict.LengthPrediction`), for the admission policy."""
        if not output_token_ids:
            raise ValueError("a transferred request needs its first output token")
        req = self._new_request(request_id, prompt_token_ids, params, now, arrival_time,
                                output_token_ids)
        req.predicted = predicted
        self.scheduler.add_request(req, now)
        return req

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     now: float, arrival_time: float | None, outputs: list[int]) -> Request:
        self.validate(prompt_token_ids, params)
        req = Request(request_id, prompt_token_ids, params,
                      now if arrival_time is None else arrival_time)
        self._attach_detokenizer(req)
        for tok in outputs:
            req.append_token(tok)
            if req.detok is not None:
                req.detok.add(tok)
        return req

    def _attach_detokenizer(self, req: Request) -> None:
        if self.tokenizer is not None:
            p = req.params
            stop = cast(list[str], p.stop)  # SamplingParams made it a list
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                               p.skip_special_tokens, stop,
                                               p.include_stop_str_in_output)

    def abort(self, request_id: str, now: float = 0.0, discard_kv: bool = False
              ) -> RequestOutput | None:
        """End the request; ``discard_kv``: keep the KV it imported out of the prefix cache
        (:meth:`Scheduler.abort`)."""
        req = self.scheduler.abort(request_id, now, discard_kv)
        return None if req is None else request_output(req, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Whether :meth:`step` would compute anything now."""
        s = self.scheduler
        return bool(s.running or s.waiting)

    # ------------------------------------------------------------------ stepping
    def step(self, now: float = 0.0) -> StepResult:
        sched = self.scheduler
        batch = sched.schedule(now)
        if batch.empty:
            return StepResult(batch, 0.0)
        return self.finish_step(batch, self.executor.execute(batch), now)

    def begin_step(self, now: float, submit: Callable[[ScheduledBatch], Any]
                   ) -> tuple[ScheduledBatch, Any] | None:
        """The first half of :meth:`step` for a pipelined executor: schedule and hand the batch
        to ``submit`` (which starts it and returns a handle); ``None`` when nothing is
        scheduled. No other step of this engine may begin before :meth:`finish_step`."""
        batch = self.scheduler.schedule(now)
        if batch.empty:
            return None
        return batch, submit(batch)

    def finish_step(self, batch: ScheduledBatch, result: ExecuteResult,
                    now: float) -> StepResult:
        """The second half of :meth:`step`: ``batch``, scheduled at ``now``, computed
        ``result``; the scheduler takes its tokens."""
        sched = self.scheduler
        self.num_steps += 1
        self.busy_time += result.elapsed
        if self.config.step_log is not None:
            self._log_step(batch, now, result.elapsed)
        end = now + result.elapsed
        got, _ = sched.update(batch, result, end)
        out = StepResult(batch, result.elapsed, got)
        if self.tokenizer is None and sched.role != "prefill":  # nothing to detokenize or hold
            out.new_texts = [""] * len(got)
            return out
        texts = out.new_texts
        for req in got:
            text = ""
            if req.detok is not None:
                text, stop = req.detok.add(req.output_token_ids[-1])
                if stop is not None and not req.is_finished:
                    req.stop_reason = stop
                    sched.finish(req, RequestStatus.FINISHED_STOPPED, end)
            texts.append(text)
            if req.status == RequestStatus.HELD:
                out.held.append(req.request_id)
        return out



    def _log_step(self, batch: ScheduledBatch, now: float, elapsed: float) -> None:
        """One JSON line per step: what :func:`pdserve.sim.measurements.from_step_log` reads.
        Flushed per line and opened for appending, so the instances of a deployment (threads or
        Ray actors on one machine) can share one file. A line that cannot be written (a full
        disk) is counted in ``stats().step_log_errors``, never raised into the step."""
        if self._step_log is None:
            assert self.config.step_log is not None
            self._step_log = AppendLog(self.config.step_log, "step log", check=False)
        prefills, decodes = batch.shape()
        self._step_log.write(json.dumps(
            {"instance_id": self.name, "now": round(now, 6), "elapsed": elapsed,
             "prefill_chunks": prefills, "decode_context_lens": decodes}))

    # ------------------------------------------------------------------ KV hand-off
    def export_kv(self, request_id: str, first_block: int = 0) -> KVPayload:
        """Prefill role: the KV of a held request (every token but the last, which has not been
        computed) from block ``first_block`` on."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not held on this instance")
        n_blocks = self.scheduler.kv.blocks_for(req.num_computed_tokens)
        ids = req.block_ids[first_block:n_blocks]
        return KVPayload(request_id, first_block, len(ids),
                         self.executor.export_kv(ids) if ids else None)

    def release(self, request_id: str, now: float = 0.0) -> None:
        """Prefill role: the decode side confirmed the transfer; free this copy."""
        self.scheduler.release(request_id, now)

    def reserve_pulls(self, now: float = 0.0,
                      limit: int | None = None) -> list[tuple[str, int]]:
        """Decode role: reserve blocks for pending requests; ``(request_id, first block to
        pull)`` for each that now has room."""
        return [(r.request_id, k) for r, k in self.scheduler.reserve_pulls(now, limit)]

    def import_kv(self, payload: KVPayload, now: float = 0.0) -> None:
        """Decode role: write a pulled payload into the reserved blocks; the request becomes
        runnable."""
        req = self.scheduler.pulling.get(payload.request_id)
        if req is None:
            raise KeyError(f"request {payload.request_id!r} has no reserved blocks here")
        ids = req.block_ids[payload.first_block : payload.first_block + payload.num_blocks]
        if len(ids) != payload.num_blocks:
            raise ValueError(f"payload of {payload.num_blocks} blocks does not fit the "
                             f"{len(ids)} reserved from block {payload.first_block}")
        if ids:
            self.executor.import_kv(ids, payload.data)
        self.scheduler.complete_pull(payload.request_id, now)

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        s, pool = self.scheduler, self.scheduler.pool
        n, free = pool.num_blocks, pool.num_free_blocks  # (every step: one pass, positional)
        return EngineStats(
            len(s.running), len(s.waiting), len(s.held), len(s.pending_kv) + len(s.pulling),
            n, free, n - free, (n - free) / n, s.kv.prefix_queries, s.kv.prefix_hits,
            s.num_preemptions, self.num_steps, self.busy_time,
            self._step_log.errors if self._step_log is not None else 0)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def integrity(self) -> dict[str, int]:
        """Run :meth:`check_integrity`; used/total blocks and live requests."""
        self.check_integrity()
        s = self.scheduler
        return {"used_blocks": s.pool.num_used_blocks, "num_blocks": s.pool.num_blocks,
                "num_requests": s.num_unfinished}

    # ------------------------------------------------------------------ what a worker asks
    def holds(self, request_id: str) -> bool:
        """Whether a prefill-role request is held here for a KV pull."""
        return request_id in self.scheduler.held

    def is_pulling(self, request_id: str) -> bool:
        """Whether a decode-role request has blocks reserved for its pull."""
        return request_id in self.scheduler.pulling

    def reconfigure(self, scheduler: SchedulerConfig) -> None:
        """Take another role's scheduler settings (the engine must be empty)."""
        self.scheduler.reconfigure(scheduler)

    def take_kv_events(self) -> list[KVEvent]:
        return self.scheduler.pool.take_events()

    def temporal_state(self) -> tuple[str, float, list[tuple[str, float, int]]]:
        """A temporal instance's phase, when it began, and its decodes' progress."""
        s = self.scheduler
        return s.phase, s.phase_switch_time, s.decode_progress()

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.pool.num_blocks


def request_output(req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
    """A :class:`RequestOutput` delta for ``req`` (cumulative fields are snapshots)."""
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        text=req.detok.text if req.detok is not None else "",
        new_token_ids=new_ids,
        new_text=new_text,
        finished=req.is_finished,
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        logprobs=list(req.logprobs) if req.logprobs is not None else None,
        timeline=req.timeline,
    )
