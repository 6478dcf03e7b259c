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

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.engine.admission import make_admission
from pdserve.engine.batch import ExecuteResult, ScheduledBatch, ScheduledSeq
from pdserve.engine.kv_cache import BlockPool
from pdserve.engine.kv_manager import NO_HIT, KVCacheManager
from pdserve.engine.policies import policy_for
from pdserve.request import Request, RequestStatus

S = RequestStatus


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
        self.open_run: DecodeRun | None = None  # the simulator's fast path (decode_run)

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

    def abort(self, request_id: str, now: float) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, S.FINISHED_ABORTED, now)
        return req

    # ------------------------------------------------------------------ prefill role
    def release(self, request_id: str, now: float) -> Request:
        """A decode instance has the KV of this held request: free the prefill copy."""
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

    # ------------------------------------------------------------------ simulator fast path
    def decode_run(self, token_id: int) -> DecodeRun | None:
        """A :class:`DecodeRun` over the running requests if the next steps are pure decode with
        an unchanged batch as long as no command arrives (nothing waiting, every running
        request decoding, no stop token that ``token_id`` could hit), else ``None``. Only the
        simulator uses it (its executor samples ``token_id`` every step); it runs the worker's
        :meth:`reserve_pulls` around each step itself, as the worker does."""
        if (self.role == "prefill" or self.waiting or not self.running
                or token_id in self.eos_token_ids):
            return None
        run = DecodeRun(self, token_id)
        if not run.sync():
            return None
        self.open_run = run
        return run

    def decode_progress(self) -> list[tuple[str, float, int]]:
        """Every running request past its first token: ``(id, first token time, tokens
        generated)``, in running order (a temporal instance's report to its macro router),
        counting the open :class:`DecodeRun`'s steps without catching it up."""
        if self.open_run is not None:
            return self.open_run.progress()
        return [(r.request_id, r.timeline.token_times[0], len(r.output_token_ids))
                for r in self.running if r.output_token_ids]

    def close_run(self) -> None:
        """Catch up the requests of the open :class:`DecodeRun`, if any, and close it."""
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


class DecodeRun:
    """The next decode steps of a :class:`Scheduler`, advanced one at a time without building
    batches: the simulator's exact fast path (:meth:`Scheduler.decode_run`).

    A step of an unchanged decode batch does, per request, what :meth:`Scheduler.schedule` and
    :meth:`Scheduler.update` do: a block when the request crosses into a new one, one computed
    token, a cached block when one fills, the sampled token and its time. Here a step costs the
    block events due that step (one request in ``block_size``, by phase) plus O(1); each request's
    tokens, times and counts are caught up lazily, before its next block event and at
    :meth:`close`, in the order the step-by-step path would apply them, so the block pool sees
    the same calls in the same order and every request ends in the same state. A step is
    :meth:`safe` when nothing waits and its blocks fit in the free pool (no preemption);
    requests that reach their length finish in it as in :meth:`Scheduler.update`. The caller
    runs any other step through the scheduler, which catches the run up (:meth:`close`)
    before it reads the running requests (``Scheduler.open_run``); requests appended to the
    running list meanwhile (a KV import, a prefill-only step) join the run (:meth:`sync`).
    """

    def __init__(self, sched: Scheduler, token_id: int) -> None:
        self.sched, self.tok = sched, token_id
        self.bs = bs = sched.block_size
        self.j = 0  # steps advanced
        self.reqs: list[Request] = []  # the batch, in running order
        self.done: list[int] = []  # steps applied to each request so far
        self.times: list[float] = []  # end of each step (its tokens' time)
        self.live: list[int] = []  # the running (unfinished) requests' indices, in order
        self.ctx: list[int] = []  # their context lens at step 0 (shifted by their joins)
        # their ids, first token times and tokens generated at step 0 (for progress())
        self.ids: list[str] = []
        self.firsts: list[float] = []
        self.outs: list[int] = []
        self.starting: list[Request] = []  # joined since the last step
        self.lims: list[int] = []  # the step in which each request finishes
        self.limit = 1 << 62  # the first of them
        # block events by step phase (j mod block_size), in running order: a new block at steps
        # j >= first with computed + j == a multiple of bs; a full block to cache when computed
        # + j + 1 is one
        self.alloc: list[list[int]] = [[] for _ in range(bs)]
        self.first: list[int] = []
        self.cache: list[list[int]] | None = (
            [[] for _ in range(bs)] if sched.pool.enable_caching else None)
        self.cphase: list[int] = []

    def sync(self) -> bool:
        """Take the requests appended to the running list since the last step (a KV import
        on a decode instance); ``False`` if the batch changed any other way or is not pure
        decode (the run must then be closed)."""
        sched, reqs, j, live = self.sched, self.reqs, self.j, self.live
        running, n, m = sched.running, len(reqs), len(live)
        if (len(running) < m or len(running) > sched.budget
                or (m and running[m - 1] is not reqs[live[-1]])):
            return False
        if len(running) == m:
            return True
        new = running[m:]
        for r in new:
            c = r.num_computed_tokens
            if (c != len(r.all_token_ids) - 1 or c < len(r.prompt_token_ids)
                    or r.params.stop_token_ids or r.detok is not None):
                return False
        bs, max_len = self.bs, sched.config.max_model_len
        self.starting += new
        reqs += new
        cs = [r.num_computed_tokens for r in new]
        self.done += [j] * len(new)
        live += range(n, n + len(new))
        self.ctx += [c + 1 - j for c in cs]
        self.ids += [r.request_id for r in new]
        # (an imported request's timeline may not hold its first token: only read on temporal)
        self.firsts += [(r.timeline.token_times or (0.0,))[0] for r in new]
        self.outs += [len(r.output_token_ids) - j for r in new]
        firsts = [j + len(r.block_ids) * bs - c for r, c in zip(new, cs)]
        self.first += firsts
        # the step in which each finishes (update's stop rules; all_token_ids holds c + 1)
        lims = [j - 1 + min(r.params.max_tokens - len(r.output_token_ids), max_len - 1 - c)
                for r, c in zip(new, cs)]
        self.lims += lims
        if lims:
            self.limit = min(self.limit, min(lims))
        alloc, cache = self.alloc, self.cache
        for i, f in enumerate(firsts, n):
            alloc[f % bs].append(i)
        cph = [(bs - 1 - c + j) % bs for c in cs]
        self.cphase += cph
        if cache is not None:
            for i, q in enumerate(cph, n):
                cache[q].append(i)
        return True

    def contexts(self) -> list[int]:
        """The decode context lengths of the next step (the latency model's input)."""
        j = self.j
        return [c + j for c in self.ctx]

    def _due(self) -> list[int]:
        j, first = self.j, self.first
        return [i for i in self.alloc[j % self.bs] if j >= first[i]]

    def safe(self) -> bool:
        """Whether the next step is pure decode with every new block fitting the free pool (no
        preemption); requests may finish in it."""
        return (bool(self.live) and not self.sched.waiting and self.j <= self.limit
                and len(self._due()) <= self.sched.pool.num_free_blocks)

    def progress(self) -> list[tuple[str, float, int]]:
        """:meth:`Scheduler.decode_progress` with the run open: the run's requests lead the
        running list (in its order); requests appended since the last step follow."""
        j = self.j
        out = list(zip(self.ids, self.firsts, [n + j for n in self.outs]))
        out += [(r.request_id, r.timeline.token_times[0], len(r.output_token_ids))
                for r in self.sched.running[len(self.live):] if r.output_token_ids]
        return out

    def _catch_up(self, i: int, upto: int) -> Request:
        r, k = self.reqs[i], upto - self.done[i]
        if k:
            r.num_computed_tokens += k
            toks = [self.tok] * k
            r.output_token_ids += toks
            r.all_token_ids += toks
            r.timeline.token_times += self.times[self.done[i]:upto]
            self.done[i] = upto
        return r

    def advance(self, start: float, end: float) -> list[Request]:
        """One step that starts at ``start`` and whose tokens are timed ``end`` (must be
        :meth:`safe`). Returns the requests that finished in it, in update's order; the run
        goes on with the others."""
        sched, j = self.sched, self.j
        sched.step_id += 1
        if not sched.chunked and sched.phase != "decode":  # as schedule() on a decode step
            sched.phase, sched.phase_switch_time = "decode", start
        if self.starting:  # their first decode step
            for r in self.starting:
                if r.timeline.decode_start is None:
                    r.timeline.decode_start = start
            self.starting = []
        due = self._due()
        if due:  # one new block each, taken in order (as one allocate per request would)
            for i, b in zip(due, sched.pool.allocate(len(due)), strict=True):
                self._catch_up(i, j).block_ids.append(b.block_id)
        self.times.append(end)
        if self.cache is not None:
            cache = sched.kv.cache_computed
            for i in self.cache[j % self.bs]:
                old = self._catch_up(i, j).num_computed_tokens
                cache(self._catch_up(i, j + 1), old, old + 1)  # this step's token, then cache
        self.j = j + 1
        if j < self.limit:
            return []
        # update() interleaves these finishes with the other requests' cached blocks; freeing
        # and caching touch disjoint state (ref counts and the free queue; the hash index)
        done, lims, never = [], self.lims, 1 << 62
        for i in [i for i in self.live if lims[i] == j]:
            r = self._catch_up(i, j + 1)
            sched.finish(r, S.FINISHED_LENGTH, end)
            done.append(r)
            pos = self.live.index(i)  # the run goes on without it
            del self.live[pos], self.ctx[pos], self.ids[pos], self.firsts[pos], self.outs[pos]
            self.alloc[self.first[i] % self.bs].remove(i)
            if self.cache is not None:
                self.cache[self.cphase[i]].remove(i)
            lims[i] = self.first[i] = self.done[i] = never
        self.limit = min(lims)
        return done

    def close(self) -> None:
        """Catch every request up with the steps advanced (before anything else reads them);
        the scheduler no longer has an open run."""
        if self.sched.open_run is self:
            self.sched.open_run = None
        j, done = self.j, self.done
        for i in range(len(self.reqs)):
            if done[i] < j:  # (a finished request's is "never")
                self._catch_up(i, j)
