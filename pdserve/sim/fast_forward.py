"""The simulator's exact decode fast path: pure decode steps of one instance advanced without
building batches, identical to the step-by-step path (``tests/sim/test_fast_forward.py``).

It lives here, outside the engine: the scheduler knows it only through one hook,
:attr:`pdserve.engine.scheduler.Scheduler.open_run` (an :class:`~pdserve.engine.scheduler.OpenRun`
that the scheduler closes before it reads its running requests). What it saves is measured by
``benchmarks/sim_speed.py [--step-by-step]`` (docs/benchmarks.md, "Simulator speed").
"""

from __future__ import annotations

from pdserve.engine.scheduler import Scheduler
from pdserve.request import Request, RequestStatus

S = RequestStatus


def open_decode_run(sched: Scheduler, token_id: int) -> DecodeRun | None:
    """A :class:`DecodeRun` over ``sched``'s running requests, opened as its
    :attr:`~pdserve.engine.scheduler.Scheduler.open_run`, if the next steps are pure decode with
    an unchanged batch as long as no command arrives (nothing waiting, every running request
    decoding, no stop token that ``token_id`` could hit), else ``None``. The simulator's
    executor samples ``token_id`` every step; the simulator runs the worker's
    :meth:`~pdserve.engine.scheduler.Scheduler.reserve_pulls` around each step itself, as the
    worker does."""
    if (sched.role == "prefill" or sched.waiting or not sched.running
            or token_id in sched.eos_token_ids):
        return None
    run = DecodeRun(sched, token_id)
    if not run.sync():
        return None
    sched.open_run = run
    return run


class DecodeRun:
    """The next decode steps of a :class:`Scheduler`, advanced one at a time without building
    batches: the simulator's exact fast path (:func:`open_decode_run`).

    A step of an unchanged decode batch does, per request, what :meth:`Scheduler.schedule` and
    :meth:`Scheduler.update` do: a block when the request crosses into a new one, one computed
    token, a cached block when one fills, the sampled token and its time. Here a step costs the
    block events due that step (one request in ``block_size``, by phase) plus O(1); each request's
    tokens, times and counts are caught up lazily, before it caches a block (prefix caching on;
    a new block needs no catch-up) and at :meth:`close`, in the order the step-by-step path
    would apply them, so the block pool sees the same calls in the same order and every
    request ends in the same state. A step is
    :meth:`safe` when nothing waits and its blocks fit in the free pool (no preemption);
    requests that reach their length finish in it as in :meth:`Scheduler.update`. The caller
    runs any other step through the scheduler, which catches the run up (:meth:`close`)
    before it reads the running requests (``Scheduler.open_run``, the scheduler's one hook);
    requests appended to the running list meanwhile (a KV import, a prefill-only step) join the
    run (:meth:`sync`).
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
        self.ctx_total = 0  # sum(ctx)
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
        self._due_at: tuple[int, list[int]] = (-1, [])  # (step, its new blocks' requests)

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
        ctx = [c + 1 - j for c in cs]
        self.ctx += ctx
        self.ctx_total += sum(ctx)
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
        self._due_at = (-1, [])
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

    def total_context(self) -> int:
        """``sum(contexts())``, without the list."""
        return self.ctx_total + self.j * len(self.ctx)

    def _due(self) -> list[int]:
        j = self.j
        if self._due_at[0] != j:
            first = self.first
            self._due_at = (j, [i for i in self.alloc[j % self.bs] if j >= first[i]])
        return self._due_at[1]

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
        r, d = self.reqs[i], self.done[i]
        if upto != d:
            r.num_computed_tokens += upto - d
            toks = [self.tok] * (upto - d)
            r.output_token_ids += toks
            r.all_token_ids += toks
            r.timeline.token_times += self.times[d:upto]
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
            blocks = sched.pool.allocate(len(due))
            if self.cache is None:  # no reader of the tokens: they catch up at close()
                reqs = self.reqs
                for i, b in zip(due, blocks, strict=True):
                    reqs[i].block_ids.append(b.block_id)
            else:
                for i, b in zip(due, blocks, strict=True):
                    self._catch_up(i, j).block_ids.append(b.block_id)
        self.times.append(end)
        if self.cache is not None:
            cache = sched.kv.cache_computed
            for i in self.cache[j % self.bs]:
                r = self._catch_up(i, j + 1)  # this step's token, then cache its block
                cache(r, r.num_computed_tokens - 1, r.num_computed_tokens)
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
            self.ctx_total -= self.ctx[pos]
            del self.live[pos], self.ctx[pos], self.ids[pos], self.firsts[pos], self.outs[pos]
            self.alloc[self.first[i] % self.bs].remove(i)
            if self.cache is not None:
                self.cache[self.cphase[i]].remove(i)
            lims[i] = self.first[i] = self.done[i] = never
        self.limit = min([lims[i] for i in self.live], default=never)  # (finished: never)
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
