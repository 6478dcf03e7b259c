"""Torch-free iteration-level scheduler of one instance.

There are no hard-coded phases: each request's ``num_computed_tokens`` chases ``num_tokens``
(prompt + generated). One token-budget loop produces prefill chunks, decodes, prefix-cache hits and
recomputation after preemption alike. Two modes:

* **chunked** (``enable_chunked_prefill``, Sarathi-Serve / vLLM v1): running requests first
  (decodes and unfinished chunks, in order), then waiting ones, each taking
  ``min(remaining, budget)`` tokens — prefill chunks ride along with decodes.
* **prefill-first** (vLLM v0, the colocated baseline in DistServe §6): if any waiting prompt fits,
  the step is prefill-only (whole prompts up to the budget); otherwise it decodes every running
  request.

Roles (DESIGN.md "Engine step"): a ``prefill`` instance holds each request after its first token
(its blocks stay allocated until a decode instance pulls them, DistServe §4.3) and batches whole
prompts up to the token target ``L_m`` (a longer prompt runs alone); a ``decode`` instance reserves
blocks for a request's prompt KV (matching its own prefix cache first), lets the driver pull the
missing blocks, then continues it like any running request. A ``temporal`` instance (EcoServe
§4.2.1, temporal disaggregation) runs prefill-first without chunking — a prefill-only phase
while prompts wait (its router hands it new prompts only when the decodes can afford the
pause), a decode-only phase otherwise, never a mixed batch — and records its phase and the time
of the last switch (``phase``, ``phase_switch_time``) for its macro instance's router.

TetriInfer (§3.3.3): with ``prefill_chunk_size`` a prefill instance slices and merges the
(policy-ordered) prompts into prefill-only chunks of exactly ``ChunkSize`` tokens, in order; the
last chunk is padded (``ScheduledBatch.num_pad_tokens``), so every step runs at the
accelerator's saturation point. Decode admission is a policy (:mod:`pdserve.engine.admission`).

Preemption is by recompute: the victim (the most recently admitted running request) frees its
blocks and returns to the head of the waiting queue with ``num_computed_tokens = 0``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.engine.admission import make_admission
from pdserve.engine.batch import ExecuteResult, ScheduledBatch, ScheduledSeq
from pdserve.engine.kv_cache import BlockPool
from pdserve.engine.kv_manager import NO_HIT, KVCacheManager
from pdserve.engine.policies import policy_for
from pdserve.request import Request, RequestStatus

S = RequestStatus


class OpenRun(Protocol):
    """The one hook for steps taken outside the scheduler: a driver (the simulator's exact
    decode fast path, :mod:`pdserve.sim.fast_forward`) may advance pure decode steps itself and
    leave the running requests behind; the scheduler calls :meth:`close` to catch them up
    before it reads them (:meth:`Scheduler.close_run`), and reports :meth:`progress` without
    catching up (:meth:`Scheduler.decode_progress`)."""

    def close(self) -> None: ...

    def progress(self) -> list[tuple[str, float, int]]: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 eos_token_ids: Iterable[int] = (), record_events: bool = False) -> None:
        self.config = config
        self._configure(config)
        self.block_size = cache_config.block_size
        self.pool = BlockPool(num_blocks, cache_config.block_size,
                              cache_config.enable_prefix_caching, record_events)
        self.kv = KVCacheManager(self.pool)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # prefill role: KV kept for a decode instance
        self.pending_kv: deque[Request] = deque()  # decode role: waiting for blocks to pull into
        self.pulling: dict[str, Request] = {}  # decode role: blocks reserved, transfer in flight
        self.step_id = 0
        self.num_preemptions = 0
        self.phase = "idle"  # prefill | decode: what the last batch did (EcoServe §4.2.1)
        self.phase_switch_time = 0.0
        # steps a driver advanced without this scheduler (the simulator's decode fast path,
        # pdserve.sim.fast_forward); caught up (closed) before the running requests are read
        self.open_run: OpenRun | None = None

    def _configure(self, config: SchedulerConfig) -> None:
        """Role-dependent settings (also applied by :meth:`reconfigure` on an instance flip)."""
        self.config = config
        self.role = config.role
        self.policy = policy_for(config)  # orders the waiting queue (policies.py)
        self.admission = make_admission(config.admission)  # decode admission (admission.py)
        # TetriInfer §3.3.3: a prefill instance computes fixed chunks of ChunkSize tokens
        self.chunk_size = config.prefill_chunk_size if self.role == "prefill" else None
        if self.chunk_size is not None:
            self.budget = self.chunk_size
        elif self.role == "prefill":
            self.budget = config.prefill_token_target or config.token_budget
        else:
            self.budget = config.token_budget
        # A decode instance always runs its admitted requests alongside the running ones.
        self.chunked = (config.enable_chunked_prefill or self.role == "decode"
                        or self.chunk_size is not None)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Take another role's scheduler settings (TetriInfer §3.5 instance flip: "changing an
        internal variable"). Only an empty (drained) scheduler may flip; the block pool stays."""
        if self.requests:
            raise ValueError(f"cannot change role with {len(self.requests)} requests on the "
                             f"instance; drain it first")
        self.close_run()
        self._configure(config)

    # ------------------------------------------------------------------ admission
    def add_request(self, req: Request, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        need = self.kv.blocks_for(min(req.num_prompt_tokens + req.params.max_tokens,
                                      self.config.max_model_len))
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {req.request_id!r} may need {need} KV blocks but the pool has only "
                f"{self.pool.num_blocks}; raise num_kv_blocks or lower max_model_len")
        self.requests[req.request_id] = req
        if self.role == "decode":
            req.status = S.WAITING_KV
            req.timeline.decode_queued = now
            self.pending_kv.append(req)
        else:
            req.status = S.WAITING
            req.timeline.prefill_queued = now
            self.waiting.append(req)

    # ------------------------------------------------------------------ schedule
    def schedule(self, now: float) -> ScheduledBatch:
        self.step_id += 1
        batch = ScheduledBatch(self.step_id)
        limit = (self.policy.arrange(self.waiting, self.kv.cached_prefix_tokens)
                 if self.waiting else None)
        if self.chunked:
            budget = self._schedule_running(batch, self.budget)
            if not batch.preempted:
                self._schedule_waiting(batch, budget, now, limit)
        else:
            self._schedule_waiting(batch, self.budget, now, limit)
            phase = "prefill"
            if batch.empty:
                self._schedule_running(batch, self.budget)
                phase = "decode"
            if phase != self.phase and not batch.empty:
                self.phase, self.phase_switch_time = phase, now
        if self.chunk_size is not None and not batch.empty:  # pad the last chunk (§3.3.3)
            batch.num_pad_tokens = self.chunk_size - batch.num_batched_tokens
        for s in batch.seqs:  # the first decode step: the end of the phase-switch wait
            req = s.request
            if req.output_token_ids and req.timeline.decode_start is None:
                req.timeline.decode_start = now
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        self.close_run()  # the running requests are read: catch them up
        running, bs, seqs = self.running, self.block_size, batch.seqs
        append, seq = seqs.append, ScheduledSeq
        # hot loop; preemption pops only from the tail, which list iteration tolerates
        for req in running:
            if budget <= 0:
                break
            computed = req.num_computed_tokens
            total = len(req.all_token_ids)
            n = total - computed
            if n > budget:
                n = budget
            if computed + n > len(req.block_ids) * bs:  # needs a new block
                while not self.kv.allocate(req, n):
                    victim = running.pop()
                    self._preempt(victim)
                    batch.preempted.append(victim.request_id)
                    if victim is req:
                        return budget
            append(seq(req, computed, n, computed + n == total))
            budget -= n
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int, now: float,
                          limit: int | None = None) -> int:
        """Admit from the head of the waiting queue (at most ``limit`` requests, the policy's
        quota) while the budget, ``max_num_seqs`` and the free blocks allow."""
        waiting, kv = self.waiting, self.kv
        while waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if limit is not None:
                if limit <= 0:
                    break
                limit -= 1
            req = waiting[0]
            fresh = req.num_computed_tokens == 0 and not req.block_ids
            hit = kv.match_prefix(req) if fresh else NO_HIT
            start = req.num_computed_tokens + hit.num_tokens
            n = req.num_tokens - start
            if self.chunked:
                n = min(n, budget)
            elif n > budget and not (self.role == "prefill" and batch.empty):
                break  # whole prompts only; on a prefill instance a long prompt runs alone
            if not kv.allocate(req, n, hit):
                break
            waiting.popleft()
            if fresh:
                kv.record_admission(req, hit)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = start
            req.num_computed_tokens = start
            req.status = S.RUNNING
            tl = req.timeline
            if self.role == "decode":
                if tl.decode_admitted is None:
                    tl.decode_admitted = now
            elif tl.prefill_start is None:
                tl.prefill_start = now
            self.running.append(req)
            batch.seqs.append(ScheduledSeq(req, start, n, start + n == req.num_tokens))
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = S.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update
    def update(self, batch: ScheduledBatch, result: ExecuteResult,
               now: float) -> tuple[list[Request], list[Request]]:
        """Advance computed counts, append sampled tokens (timestamped ``now``), apply the
        token-level stop rules. Returns (requests that got a token, requests that finished)."""
        got: list[Request] = []
        done: list[Request] = []
        sampled, lps, k = result.sampled, result.logprobs, 0
        bs, running_status = self.block_size, S.RUNNING
        eos, max_len = self.eos_token_ids, self.config.max_model_len
        not_decode, is_prefill = self.role != "decode", self.role == "prefill"
        cache_computed, got_append = self.kv.cache_computed, got.append
        for seq in batch.seqs:  # hot loop: one pass per scheduled request per step
            req = seq.request
            sample = seq.sample
            if sample:
                tok = sampled[k]
                lp = lps[k] if lps is not None else None
                k += 1
            if req.status != running_status:
                continue  # aborted while the step ran
            old = req.num_computed_tokens
            new = req.num_computed_tokens = old + seq.num_tokens
            if old // bs != new // bs:
                cache_computed(req, old, new)
            if not sample:
                continue
            outs, toks = req.output_token_ids, req.all_token_ids
            outs.append(tok)
            toks.append(tok)
            if lp is not None and req.logprobs is not None:
                req.logprobs.append(lp)
            tl = req.timeline
            tl.token_times.append(now)
            n_out = len(outs)
            if not_decode and n_out == 1:
                tl.prefill_end = now
            got_append(req)
            p = req.params
            if (n_out < p.max_tokens and tok not in eos and
                    not p.stop_token_ids and len(toks) < max_len):
                status = None  # fast path: nothing can stop this request now
            else:
                status = self._stop_status(req, tok)
            if status is not None:
                self.finish(req, status, now)
                done.append(req)
            elif is_prefill:
                self.running.remove(req)
                req.status = S.HELD
                self.held[req.request_id] = req
        return got, done

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        p, n = req.params, len(req.output_token_ids)
        if n >= p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                return S.FINISHED_STOPPED
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.stop_reason = tok
                return S.FINISHED_STOPPED
        if n >= p.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            return S.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ finish / abort
    def finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """End ``req`` wherever it is (running, waiting, held, pending or pulling) and free its
        blocks. Idempotent for finished requests."""
        if req.is_finished:
            return
        rid = req.request_id
        if req.status == S.RUNNING:
            self.running.remove(req)
        elif req.status == S.WAITING:
            self.waiting.remove(req)
        elif req.status == S.HELD:
            del self.held[rid]
        elif req.status == S.WAITING_KV:
            if rid in self.pulling:
                del self.pulling[rid]
            else:
                self.pending_kv.remove(req)
        self.kv.free(req)
        req.status = status
        req.timeline.finish = now
        self.requests.pop(rid, None)

    def abort(self, request_id: str, now: float, discard_kv: bool = False) -> Request | None:
        """End the request. ``discard_kv``: the blocks it imported (those past its local
        prefix-cache hit) leave the prefix cache as they are freed — their content came from a
        pull the source may not have held to the end."""
        self.close_run()
        req = self.requests.get(request_id)
        if req is not None:
            if discard_kv:
                self.kv.uncache(req, req.num_cached_tokens)
            self.finish(req, S.FINISHED_ABORTED, now)
        return req

    # ------------------------------------------------------------------ prefill role
    def release(self, request_id: str, now: float) -> Request:
        """A decode instance has the KV of this held request: free the prefill copy."""
        self.close_run()
        req = self.held.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not held on this instance")
        self.finish(req, S.FINISHED_STOPPED, now)
        return req

    # ------------------------------------------------------------------ decode role
    def reserve_pulls(self, now: float, limit: int | None = None) -> list[tuple[Request, int]]:
        """Reserve blocks for pending requests in FIFO order while they fit (head-of-line
        blocking keeps arrival order). Returns ``(request, first block index to pull)``: blocks
        before that index were found in this instance's own prefix cache.

        Admission keeps the instance live under memory pressure: nothing is admitted while a
        preempted request waits to be recomputed (new arrivals would take the blocks it needs),
        admitted requests stay under ``max_num_seqs``, and one free block per running request
        is kept back for its next tokens (vLLM's watermark, so that an admission does not
        immediately preempt a running request) — the ``greedy`` admission policy; the
        ``reserve-*`` policies (TetriInfer §3.4, :mod:`pdserve.engine.admission`) replace that
        test with the request's predicted usage."""
        out: list[tuple[Request, int]] = []
        if self.admission.reads_running:  # the running requests' lengths: catch them up
            self.close_run()
        if self.waiting:
            return out
        kv, max_seqs = self.kv, self.config.max_num_seqs
        while self.pending_kv and (limit is None or len(out) < limit):
            if len(self.running) + len(self.pulling) >= max_seqs:
                break
            req = self.pending_kv[0]
            hit = kv.match_prefix(req)
            need = kv.blocks_for(req.num_tokens) - len(hit.blocks) + hit.num_revived
            if not self.admission.admit(self, req, need):
                break
            n = req.num_tokens - 1 - hit.num_tokens
            if not kv.allocate(req, n, hit):
                break
            self.pending_kv.popleft()
            kv.record_admission(req, hit)
            req.num_cached_tokens = hit.num_tokens
            self.pulling[req.request_id] = req
            out.append((req, len(hit.blocks)))
        return out

    def complete_pull(self, request_id: str, now: float) -> Request:
        """The KV of a reserved request is in place: it joins the running requests (so that it
        can be preempted like any other) with everything but its last token computed, and its
        imported blocks become prefix-cacheable here."""
        req = self.pulling.pop(request_id)
        cached = req.num_cached_tokens
        req.num_computed_tokens = req.num_tokens - 1
        self.kv.cache_computed(req, cached, req.num_computed_tokens)
        req.status = S.RUNNING
        if req.timeline.decode_admitted is None:
            req.timeline.decode_admitted = now
        self.running.append(req)
        return req

    # ------------------------------------------------------------------ steps taken outside
    def decode_progress(self) -> list[tuple[str, float, int]]:
        """Every running request past its first token: ``(id, first token time, tokens
        generated)``, in running order (a temporal instance's report to its macro router),
        counting the steps of :attr:`open_run` without catching it up."""
        if self.open_run is not None:
            return self.open_run.progress()
        return [(r.request_id, r.timeline.token_times[0], len(r.output_token_ids))
                for r in self.running if r.output_token_ids]

    def close_run(self) -> None:
        """Catch up the requests of :attr:`open_run`, if any, and close it."""
        if self.open_run is not None:
            self.open_run.close()

    # ------------------------------------------------------------------ introspection
    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def check_integrity(self) -> None:
        """Block pool invariants plus: every live request's blocks are referenced exactly as often
        as tables name them, and tables cover the computed tokens."""
        self.close_run()
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for req in self.requests.values():
            for b in req.block_ids:
                refs[b] = refs.get(b, 0) + 1
            assert len(req.block_ids) * self.block_size >= req.num_computed_tokens, req
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block} referenced {refs.get(block.block_id, 0)} times by request tables")
        queued = len(self.waiting) + len(self.running) + len(self.held) + len(
            self.pending_kv) + len(self.pulling)
        assert queued == len(self.requests), "request table and queues disagree"
