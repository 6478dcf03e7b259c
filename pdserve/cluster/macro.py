"""EcoServe's macro-instance router: rolling activation, adaptive scheduling, mitosis scaling.

The instances are ``temporal`` (:mod:`pdserve.engine.scheduler`): each runs prefill-only and
decode-only phases. This router is the macro-instance scheduler of §4.2.1–§4.2.4 (and the
overall scheduler above it, which tries the macro instances in turn).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.cluster.routing import InstanceView, Router, register, require
from pdserve.cluster.scaling import InstanceHandle, Mitosis, Move, migrate

if TYPE_CHECKING:
    from pdserve.cluster.cluster_request import ClusterRequest


@register
class MacroRolling(Router):
    """EcoServe §4.2.3 (Algorithms 1 and 2) over macro instances (§4.2.1), with mitosis
    scaling (§4.2.4).

    **Rolling activation / Algorithm 1.** Within a macro instance a new prompt goes to the
    instance that took the last one while :meth:`check` holds, else to the next ones in cyclic
    order (the first that passes becomes the new "last"): one instance at a time takes the
    prefills while the others decode. Macro instances are tried round robin. A request that no
    instance can take is held (``None``): the controller queues it and asks again after the next
    report — nothing is admitted into a certain SLO violation, and the runtime's waiting bound
    (HTTP 429) caps the queue.

    **Algorithm 2** (:meth:`check`), for instance ``i`` at time ``now``:
    (1) TTFT: ``t_total`` = the predicted prefill time of the prompts of ``i``'s current prefill
    phase — routed there and not decoding yet (one token at most in its last report) — plus the
    new one, must be ≤ ``slo_ttft`` (this bounds the phase's prefill work, so the requests it
    prefilled first do not wait without end to decode). The paper sums per-prompt predictions
    (``prefill_time``: tokens → seconds, the deployment's latency model); a temporal instance
    runs those prompts as one prefill-only batch, so with ``prefill_batch_time``
    (prompt lengths → seconds of one batch) we predict that batch instead — the sum counts the
    per-step weight read once per prompt, which for short prompts overestimates many times;
    (2) TPOT: the mean saved TPOT of ``i``'s decodes (past their first decode step),
    ``L × slo_tpot − (now − first token time)`` with ``L`` tokens generated (from the
    instance's last report), must be ≥ ``t_total``; (3) KV: the new prompt's blocks must fit in
    the free blocks less those of the prompts not prefilled yet and one per running request. An idle
    instance (no pending prompt, no decode) takes any request that fits (waiting cannot help).

    **Mitosis** (``mitosis=True``): start with ``mitosis_initial`` (default N_l) instances in
    one macro instance, the rest parked. Every ``mitosis_interval`` s: scale out (one parked
    instance, :meth:`Mitosis.expand`) when the window's mean TTFT exceeds ``slo_ttft`` or a
    request was held; scale in (:meth:`Mitosis.contract`; the instance drains its requests and
    parks) after three windows in a row with mean TTFT under half the SLO, nothing held and a
    mean saved TPOT over ``slo_ttft`` (the decodes could absorb a whole TTFT budget of prefill).
    ``scale_log`` keeps ``(time, instances in macro instances, removed ones still draining)``
    per decision; ``moves`` every migration (with its handle's serialization time). A driver
    sets ``handle_of`` (instance id → :class:`InstanceHandle`, the live runtime's with the
    instance's Ray actor handle) and ``on_migrated`` (gets the rebuilt handle) to move real
    handles; without them a plain handle (id, pool size) is moved. Instances added while
    serving (:meth:`on_instance_added`) are parked under mitosis, else join the last macro
    instance with room (or a new one).

    Without ``prefill_time`` (a live deployment without a latency model) prefill time is
    estimated online: the mean seconds per prompt token of finished prefills.
    """

    name = "macro_rolling"
    SCALE_IN_PATIENCE = 3

    def __init__(self, slo_ttft: float = 5.0, slo_tpot: float = 0.1,
                 macro_instance_size: int = 4,
                 prefill_time: Callable[[int], float] | None = None,
                 prefill_batch_time: Callable[[list[int]], float] | None = None,
                 mitosis: bool = False,
                 mitosis_lower: int = 2, mitosis_upper: int = 4,
                 mitosis_initial: int | None = None, mitosis_interval: float = 10.0) -> None:
        require(slo_ttft > 0, f"macro_rolling: slo_ttft must be > 0, got {slo_ttft}")
        require(slo_tpot > 0, f"macro_rolling: slo_tpot must be > 0, got {slo_tpot}")
        require(macro_instance_size >= 1,
                f"macro_rolling: macro_instance_size must be >= 1, got {macro_instance_size}")
        require(mitosis_interval > 0,
                f"macro_rolling: mitosis_interval must be > 0, got {mitosis_interval}")
        self.slo_ttft, self.slo_tpot = float(slo_ttft), float(slo_tpot)
        self.macro_size = macro_instance_size
        self.prefill_time = prefill_time
        self.prefill_batch_time = prefill_batch_time
        self.mitosis = Mitosis(mitosis_lower, mitosis_upper)  # validates N_l / N_u
        self.scaling = mitosis
        self.initial = mitosis_initial or mitosis_lower
        self.interval = float(mitosis_interval)
        self.now = 0.0
        self._ready = False
        self.views: dict[str, InstanceView] = {}
        self.parked: list[str] = []
        self.last: dict[int, int] = {}  # macro index -> position of its last instance
        self._rr = 0
        # routed and not decoding yet (Algorithm 2's pending prefills, since the phase switch)
        self.pending: dict[str, dict[str, ClusterRequest]] = {}
        self._noted: set[str] = set()  # pending requests whose TTFT mitosis has seen
        # online estimate without a latency model: prompt tokens and seconds of prefills seen
        self._seen = [0, 0.0]
        # mitosis state
        self._next_tick: float | None = None
        self._window_ttfts: list[float] = []
        self._held_in_window = False
        self._calm = 0
        self.scale_log: list[tuple[float, int, int]] = []
        self.moves: list[tuple[float, Move]] = []
        self.handle_of: Callable[[str], InstanceHandle] | None = None
        self.on_migrated: Callable[[InstanceHandle], None] | None = None

    # ------------------------------------------------------------------ membership
    @property
    def macros(self) -> list[list[str]]:
        return self.mitosis.groups

    def _setup(self, candidates: list[InstanceView]) -> None:
        ids = [c.instance_id for c in candidates]
        self.views.update((c.instance_id, c) for c in candidates)
        if self.scaling:
            for iid in ids[:self.initial]:
                self.mitosis.expand(iid)
            self.parked = ids[self.initial:]
        else:
            self.mitosis.groups = [ids[k:k + self.macro_size]
                                   for k in range(0, len(ids), self.macro_size)]
        self._ready = True
        self.scale_log.append((self.now, len(self.mitosis.members), 0))

    def on_instance_removed(self, instance_id: str) -> None:
        for g in self.macros:
            if instance_id in g:
                g.remove(instance_id)
        self.mitosis.groups = [g for g in self.macros if g]
        self.last.clear()
        if instance_id in self.parked:
            self.parked.remove(instance_id)
        self.pending.pop(instance_id, None)

    def on_instance_added(self, view: InstanceView) -> None:
        self.views[view.instance_id] = view
        if not self._ready:
            return  # set up with the candidates of the first routing decision
        if self.scaling:
            self.parked.append(view.instance_id)
        elif self.macros and len(self.macros[-1]) < self.macro_size:
            self.macros[-1].append(view.instance_id)
        else:
            self.macros.append([view.instance_id])

    def _record(self, moves: list[Move]) -> None:
        """Hand each moved instance's handle to its new macro-instance scheduler: serialize it
        and rebuild it (timed), then the driver reaches the instance through the rebuilt one."""
        for m in moves:
            v = self.views.get(m.instance_id)
            handle = (self.handle_of(m.instance_id) if self.handle_of is not None
                      else InstanceHandle(m.instance_id, v.num_kv_blocks if v else 0,
                                          v.block_size if v else 16))
            rebuilt, seconds = migrate(handle)
            if self.on_migrated is not None:
                self.on_migrated(rebuilt)
            self.moves.append((self.now, Move(m.instance_id, m.src, m.dst, seconds)))
        if moves:
            self.last.clear()

    # ------------------------------------------------------------------ Algorithm 2
    def _predict(self, tokens: int) -> float:
        if self.prefill_time is not None:
            return float(self.prefill_time(tokens))
        n, secs = self._seen
        return tokens * secs / n if n else 0.0

    def _pending(self, view: InstanceView) -> tuple[list[ClusterRequest], list[ClusterRequest]]:
        """Algorithm 2's pending prefills on ``view``'s instance, split: the prompts routed there
        without a first token yet, and those prefilled since the phase switch but not decoding
        yet (one token in the instance's last report). The rest leave (decoding, finished or
        moved), their TTFT noted for mitosis."""
        iid = view.instance_id
        pend = self.pending.setdefault(iid, {})
        rep = view.report
        fresh = {rid for rid, _, n in rep.progress if n == 1} if rep is not None else set()
        waiting, prefilled = [], []
        for rid, r in list(pend.items()):
            if r.instance == iid and r.stage == "prefill":
                waiting.append(r)
                continue
            if rid not in self._noted:
                self._noted.add(rid)
                self._note_ttft(r)
            if r.instance == iid and r.stage == "decode" and rid in fresh:
                prefilled.append(r)
            else:
                del pend[rid]
                self._noted.discard(rid)
        return waiting, prefilled

    def _note_ttft(self, r: ClusterRequest) -> None:
        tl = r.timeline
        if tl.token_times and tl.arrival is not None:
            self._window_ttfts.append(tl.token_times[0] - tl.arrival)
            if tl.prefill_start is not None and tl.prefill_end is not None:
                self._seen[0] += len(r.prompt_token_ids)
                self._seen[1] += tl.prefill_end - tl.prefill_start

    def _saved_tpots(self, view: InstanceView, now: float) -> list[float]:
        """Saved TPOT of the instance's decodes (those past their first decode step)."""
        rep = view.report
        if rep is None:
            return []
        return [n * self.slo_tpot - (now - first) for _, first, n in rep.progress if n > 1]

    def check(self, view: InstanceView, request: ClusterRequest, now: float) -> bool:
        """Algorithm 2: may ``request`` go to ``view``'s instance now?"""
        waiting, prefilled = self._pending(view)
        pend = waiting + prefilled
        saved = self._saved_tpots(view, now)
        bs = view.block_size
        need = -(-request.num_tokens // bs)
        free = (view.stats.num_free_blocks if view.stats is not None else view.num_kv_blocks)
        free -= sum(-(-r.num_tokens // bs) for r in waiting) + len(saved) + len(prefilled)
        if not pend and not saved:  # idle: nothing to protect, waiting cannot help
            return need <= free
        lens = [r.num_tokens for r in pend] + [request.num_tokens]
        if self.prefill_batch_time is not None:
            t_total = float(self.prefill_batch_time(lens))
        else:
            t_total = sum(self._predict(n) for n in lens)
        if t_total > self.slo_ttft:  # (1) TTFT
            return False
        if saved and sum(saved) / len(saved) < t_total:  # (2) saved TPOT
            return False
        return need <= free  # (3) KV capacity

    # ------------------------------------------------------------------ Algorithm 1
    def select(self, request: ClusterRequest,
               candidates: list[InstanceView]) -> InstanceView | None:
        if not self._ready:
            self._setup(candidates)
        live = {c.instance_id: c for c in candidates}
        self.views.update(live)
        macros = self.macros
        for k in range(len(macros)):
            m = (self._rr + k) % len(macros)
            group = macros[m]
            start = self.last.get(m, 0)
            for j in range(len(group)):
                pos = (start + j) % len(group)
                view = live.get(group[pos])
                if view is not None and self.check(view, request, self.now):
                    self.last[m] = pos
                    self._rr = (m + 1) % len(macros)
                    self.pending.setdefault(view.instance_id, {})[request.request_id] = request
                    return view
        self._held_in_window = True
        return None

    # ------------------------------------------------------------------ mitosis
    def on_time(self, now: float) -> None:
        self.now = now
        if not self.scaling or not self._ready:
            return
        if self._next_tick is None:
            self._next_tick = now + self.interval
        while now >= self._next_tick:
            self._next_tick += self.interval
            self._scale(now)

    def _draining(self) -> int:
        members = set(self.mitosis.members)
        return sum(1 for iid in self.parked
                   if iid not in members and (v := self.views.get(iid)) is not None
                   and v.active > 0)

    def _scale(self, now: float) -> None:
        for iid in list(self.pending):
            if iid in self.views:
                self._pending(self.views[iid])
        ttfts, held = self._window_ttfts, self._held_in_window
        self._window_ttfts, self._held_in_window = [], False
        mean_ttft = sum(ttfts) / len(ttfts) if ttfts else 0.0
        if (held or mean_ttft > self.slo_ttft) and self.parked:
            self._calm = 0
            iid = self.parked.pop(0)
            self._record(self.mitosis.expand(iid))
        else:
            saved = [s for iid in self.mitosis.members if iid in self.views
                     for s in self._saved_tpots(self.views[iid], now)]
            slack = sum(saved) / len(saved) if saved else float("inf")
            calm = not held and mean_ttft <= 0.5 * self.slo_ttft and slack >= self.slo_ttft
            self._calm = self._calm + 1 if calm else 0
            if self._calm >= self.SCALE_IN_PATIENCE:
                self._calm = 0
                moves = self.mitosis.contract(self._least_busy)
                if moves:
                    self.parked.append(moves[0].instance_id)
                    self._record(moves)
        self.scale_log.append((now, len(self.mitosis.members), self._draining()))

    def _least_busy(self, group: list[str]) -> str:
        return min(reversed(group), key=lambda i: self.views[i].active
                   if i in self.views else 0)
