"""Prompt-sharing-aware routing: Preble's E2 global scheduler (``preble``).

:class:`E2Router` implements Preble's E2 global scheduler (§4, "E2 Global Scheduler":
exploit/explore with a load cost, post-assignment rebalancing and prefix replication,
prefill/decode balancing) over the global :class:`~pdserve.cluster.prefix_index.PrefixIndex`
fed by the engines' KV events. The cache-aware baselines it is compared with live in
:mod:`pdserve.cluster.cache_routing`.

Routers that want KV events set ``wants_kv_events``; the controller hands them each instance's
events (:meth:`Router.on_kv_events`) and instance losses (:meth:`Router.on_instance_removed`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from math import exp
from operator import attrgetter, is_, truediv
from typing import TYPE_CHECKING

from pdserve.cluster.prefix_index import PrefixIndex, PrefixMatch, block_size_of
from pdserve.cluster.routing import InstanceView, Router, register
from pdserve.cluster.routing import require as _check
from pdserve.engine.kv_cache import KVEvent
from pdserve.request import block_hashes

if TYPE_CHECKING:
    from pdserve.cluster.cluster_request import ClusterRequest

PrefillTime = Callable[[int], float]
_ID = attrgetter("instance_id")
_INF = float("inf")
_NEG_INF = float("-inf")


def memo_prefill_time(memo: dict[int, float], prefill_time: PrefillTime,
                      num_tokens: int) -> float:
    """``prefill_time(num_tokens)``, memoised in ``memo`` (a regression: a pure function of the
    count; the memo is emptied past 65,536 entries)."""
    t = memo.get(num_tokens)
    if t is None:
        if len(memo) >= 1 << 16:
            memo.clear()
        t = memo[num_tokens] = prefill_time(num_tokens)
    return t


@dataclass(frozen=True)
class LinearPrefillTime:
    """Default prefill-time regression, ``base + per_token · tokens`` seconds.

    The defaults (10 ms + 0.1 ms/token, i.e. ~10k prefill tokens/s) are the order of a 7B–13B
    model on one A100; pass the deployment's latency model instead where one exists, e.g.
    ``lambda n: latency.prefill_time([n])`` (Preble fits this regression offline per GPU
    and model)."""

    base: float = 0.010
    per_token: float = 1.0e-4

    def __post_init__(self) -> None:
        if self.base < 0 or self.per_token < 0:
            raise ValueError(f"prefill-time coefficients must be >= 0, got base={self.base}, "
                             f"per_token={self.per_token}")

    def __call__(self, num_tokens: int) -> float:
        return self.base + self.per_token * num_tokens if num_tokens > 0 else 0.0


# ====================================================================================== E2
@dataclass(slots=True)
class _Entry:
    """One routed request in the window H."""

    t: float
    instance: str
    key: int | None
    prefill: float  # PT_r: prefill time of its missed tokens
    decode: float  # DT_r: its expected decode time


@register
class E2Router(Router):
    """Preble's E2 global scheduler (Preble §4, "E2 Global Scheduler": "Per-request scheduling
    policy", "Post-assignment load adjustment", "Prefill-decoding balancing").

    For each request the prompt is matched against the global prefix index. If more of it is
    cached (on the best instance) than missing — more than ``exploit_ratio`` of the prompt hits —
    E2 **exploits**: the request goes to the least loaded instance holding its *key portion*
    (the deepest radix node with more tokens than its predecessors; a replica or a rebalancing
    target of that prefix counts as a holder). Otherwise it **explores**: every candidate ``i``
    costs ``L_i + M_i + R_i`` and the cheapest wins:

    * ``L_i = Σ_{r ∈ H} PT(missed_r) + DT_r`` over requests routed to ``i`` in the last
      ``window`` seconds (H = 3 min, Preble's implementation); ``DT_r = max_tokens · tpot``;
    * ``M_i`` — what the request would evict: when the index says ``i`` is full, the least
      recently routed prefixes of ``i`` are evicted virtually until the request's missed blocks
      fit, each costing ``PT(tokens) · N_j`` (``N_j`` its requests on ``i`` in H);
    * ``R_i = PT(prompt tokens not cached on i)``.

    Prefill/decode balancing ("Prefill-decoding balancing"): a request whose missed part is at
    least ``pd_tokens`` long goes straight to the most decode-heavy candidate when that
    candidate's decode share of ``L`` exceeds the others' mean by ``pd_margin`` and its ``L`` is
    not above the mean (the paper gives no numbers or guard; these are ours).

    Post-assignment adjustment ("Post-assignment load adjustment"): once
    ``rebalance_min_per_instance`` requests per instance have been routed (50, Preble's
    implementation), whenever the busiest instance's ``L`` exceeds ``balance_threshold``
    (Th_bal = 1.5) times the least busy one's, the future requests of one prefix subtree of the
    busiest instance move to the least busy one (its window load moves along); the check runs
    at most once per ``rebalance_interval`` (1 s, ours: the load it balances spans a 3-minute
    window). A prefix is **replicated** on the least loaded non-holder when the average TTFT of
    its requests on an instance in the second half of the window is at least
    ``replicate_factor`` (2×) that of the first half. A moved prefix's holder is its target
    (plus its replicas), so a hot prefix that a rebalance sent to one instance can still be
    replicated (otherwise every request of it would go to that one instance for good).

    ``prefill_time`` is the prefill-time regression (tokens → seconds): the deployment's
    latency model when given, else :class:`LinearPrefillTime`; it must be a pure function of
    the token count (E2 memoises it).
    """

    name = "preble-paper"
    wants_kv_events = True

    def __init__(self, prefill_time: PrefillTime | None = None, tpot: float = 0.03,
                 window: float = 180.0, exploit_ratio: float = 0.5,
                 balance_threshold: float = 1.5, rebalance_min_per_instance: int = 50,
                 replicate_factor: float = 2.0, min_ttft_samples: int = 1,
                 pd_tokens: int = 1024, pd_margin: float = 0.2, rebalance_interval: float = 1.0,
                 max_window: int = 100_000, max_evict_scan: int = 32) -> None:
        _check(tpot >= 0, f"tpot must be >= 0, got {tpot}")
        _check(window > 0, f"window must be > 0 seconds, got {window}")
        _check(0 <= exploit_ratio < 1, f"exploit_ratio must be in [0, 1), got {exploit_ratio}")
        _check(balance_threshold >= 1, f"balance_threshold must be >= 1, got {balance_threshold}")
        _check(rebalance_min_per_instance >= 0,
               f"rebalance_min_per_instance must be >= 0, got {rebalance_min_per_instance}")
        _check(replicate_factor > 1, f"replicate_factor must be > 1, got {replicate_factor}")
        _check(min_ttft_samples >= 1, f"min_ttft_samples must be >= 1, got {min_ttft_samples}")
        _check(pd_tokens >= 1, f"pd_tokens must be >= 1, got {pd_tokens}")
        _check(0 <= pd_margin <= 1, f"pd_margin must be in [0, 1], got {pd_margin}")
        _check(max_window >= 1, f"max_window must be >= 1, got {max_window}")
        _check(rebalance_interval >= 0,
               f"rebalance_interval must be >= 0 seconds, got {rebalance_interval}")
        self.rebalance_interval = rebalance_interval
        self._next_rebalance = float("-inf")
        self.prefill_time = prefill_time or LinearPrefillTime()
        self.tpot, self.window, self.exploit_ratio = tpot, window, exploit_ratio
        self.balance_threshold = balance_threshold
        self.rebalance_min_per_instance = rebalance_min_per_instance
        self.replicate_factor, self.min_ttft_samples = replicate_factor, min_ttft_samples
        self.pd_tokens, self.pd_margin = pd_tokens, pd_margin
        self.max_window, self.max_evict_scan = max_window, max_evict_scan
        self.index: PrefixIndex | None = None
        self._win: deque[_Entry] = deque()
        self.load: dict[str, float] = {}  # L_i
        self.decode_load: dict[str, float] = {}  # the Σ DT_r part of L_i
        # key prefix -> instance -> [requests in H, Σ cost in H]
        self.key_stats: dict[int, dict[str, list[float]]] = {}
        self.key_tokens: dict[int, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}  # instance -> keys, oldest first
        self.moved: dict[int, str] = {}  # rebalanced prefix -> instance taking its requests
        self.replicas: dict[int, set[str]] = {}
        # prefix -> instance -> (first-token time, TTFT) of its requests there, in the window
        self._ttft: dict[int, dict[str, deque[tuple[float, float]]]] = {}
        self._pending: deque[tuple[ClusterRequest, int, str]] = deque()
        self.num_routed = 0
        self._now = float("-inf")
        self._pt_memo: dict[int, float] = {}
        self._cands: list[InstanceView] = []
        self._cands_by_id: dict[str, InstanceView] = {}
        self._cand_ids: list[str] = []
        self.decisions: dict[str, int] = {"exploit": 0, "explore": 0, "pd_balance": 0,
                                          "rebalance": 0, "replicate": 0}

    # ------------------------------------------------------------------ events
    def _index(self, block_size: int) -> PrefixIndex:
        if self.index is None:
            self.index = PrefixIndex(block_size)
        return self.index

    def on_kv_events(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        events = list(events)
        bs = block_size_of(events)
        if self.index is None and bs is None:
            return  # only removals before anything was stored: nothing to forget
        self._index(bs or 1).apply(instance_id, events)

    def on_instance_removed(self, instance_id: str) -> None:
        if self.index is not None:
            self.index.remove_instance(instance_id)
        self.load.pop(instance_id, None)
        self.decode_load.pop(instance_id, None)
        self._lru.pop(instance_id, None)
        self.moved = {k: v for k, v in self.moved.items() if v != instance_id}
        for reps in self.replicas.values():
            reps.discard(instance_id)

    # ------------------------------------------------------------------ select
    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        # the window's clock: arrivals (a request re-dispatched after a failure keeps its own)
        now = self._now = max(request.arrival, self._now)
        if self._win and self._win[0].t < now - self.window:
            self._expire(now)
        if self._pending:
            self._observe_ttfts()
        bs = candidates[0].block_size
        hashes = block_hashes(request.prompt_token_ids, bs)
        m = self._index(bs).match_hashes(hashes, len(request.prompt_token_ids))
        by_id = self._by_id(candidates)
        n = m.num_tokens
        lengths = m.lengths
        cached = max((lengths[i] for i in lengths if i in by_id), default=0) * bs
        j = m.key_segment()
        key_hash = m.segment_ends[j].key if j is not None else None
        inst = None
        if j is not None and cached > self.exploit_ratio * n:
            inst = self._exploit(m, j, by_id, now)
            if inst is not None:
                self.decisions["exploit"] += 1
        if inst is None:
            inst = self._explore(m, n, by_id)
            if key_hash is None and hashes:  # a new prefix (the whole prompt is Preble's
                # new leaf node): its first block names it
                key_hash = hashes[0]
                self.key_tokens.setdefault(key_hash, n - n % bs)
        self._record(request, inst.instance_id, m, key_hash, now)
        self._rebalance(by_id)
        return inst

    def _by_id(self, candidates: list[InstanceView]) -> dict[str, InstanceView]:
        """``instance id -> view`` of the candidates, kept while the same views come."""
        last = self._cands
        if len(last) != len(candidates) or not all(map(is_, last, candidates)):
            self._cands = list(candidates)
            self._cands_by_id = dict(zip(map(_ID, candidates), candidates))
            self._cand_ids = list(self._cands_by_id)
        return self._cands_by_id

    def _pt(self, num_tokens: int) -> float:
        return memo_prefill_time(self._pt_memo, self.prefill_time, num_tokens)

    def _exploit(self, m: PrefixMatch, j: int, by_id: dict[str, InstanceView],
                 now: float) -> InstanceView | None:
        start, end = m.segments[j]
        key_hash = m.segment_ends[j].key
        self.key_tokens[key_hash] = (end - start) * m.block_size
        holders = None
        if self.moved:
            # the deepest moved prefix on the path wins; a prefix first seen as new is keyed by
            # its first block (see select), so that one is checked too. Its target is its one
            # holder (with its replicas: a moved hot prefix can still be replicated)
            for node in [*reversed(m.segment_ends), m.first]:
                target = self.moved.get(node.key)  # type: ignore[union-attr]
                if target in by_id:
                    holders = [target]
                    break
        if holders is None:
            holders = [iid for iid, k in m.lengths.items() if k >= end and iid in by_id]
        reps = self.replicas.get(key_hash)
        if reps:
            holders += [iid for iid in reps if iid in by_id and iid not in holders]
        if not holders:
            return None
        load = self.load
        best = holders[0] if len(holders) == 1 else min(holders, key=lambda i: load.get(i, 0.0))
        if key_hash in self._ttft and self._overloaded(key_hash, best, now):
            others = [i for i in by_id if i not in holders]
            if others:
                rep = min(others, key=lambda i: load.get(i, 0.0))
                self.replicas.setdefault(key_hash, set()).add(rep)
                self._ttft.get(key_hash, {}).pop(best, None)
                self.decisions["replicate"] += 1
                return by_id[rep]
        return by_id[best]

    def _explore(self, m: PrefixMatch, n: int, by_id: dict[str, InstanceView]) -> InstanceView:
        missed = n - m.num_cached_tokens
        ids = self._cand_ids if by_id is self._cands_by_id else list(by_id)
        loads = list(map(self.load.get, ids, repeat(0.0)))
        if missed >= self.pd_tokens and len(ids) > 1:
            top = self._decode_heavy(ids, loads)
            if top is not None:
                self.decisions["pd_balance"] += 1
                return by_id[top]
        self.decisions["explore"] += 1
        # cost_i = L_i + R_i + M_i. M_i >= 0 is the costly term: it is computed for the
        # instance with the least L_i + R_i, then only for those whose L_i + R_i is below that
        # instance's total (ties: candidate order)
        lengths, bs = m.lengths, m.block_size
        pt_all = self._pt(n)
        bounds = [li + pt_all for li in loads]
        if lengths:
            for k, i in enumerate(ids):
                if i in lengths:
                    bounds[k] = loads[k] + self._pt(n - lengths[i] * bs)
        j = bounds.index(min(bounds))
        best, best_cost = j, bounds[j] + self._evict_cost(by_id[ids[j]], self._miss(m, ids[j]))
        # only candidates under the first total can win; the check repeats as best_cost falls
        for k in [k for k, bound in enumerate(bounds) if bound < best_cost]:
            bound = bounds[k]
            if bound < best_cost and k != j:
                cost = bound + self._evict_cost(by_id[ids[k]], self._miss(m, ids[k]))
                if cost < best_cost or cost == best_cost and k < best:
                    best, best_cost = k, cost
        return by_id[ids[best]]

    @staticmethod
    def _miss(m: PrefixMatch, instance_id: str) -> int:
        return m.num_tokens - m.cached_tokens(instance_id)

    def _decode_heavy(self, ids: list[str], loads: list[float]) -> str | None:
        """The candidate whose window load is most decode-heavy, when it stands out: its decode
        share of ``L`` exceeds the others' mean by ``pd_margin`` and its ``L`` is at most the
        mean ``L`` (a busy instance is no place for a long prefill, whatever its mix). ``None``
        while some candidate has no load in the window (nothing to balance yet). ``loads``:
        the candidates' ``L``, in the order of ``ids``."""
        dec = self.decode_load
        if min(loads) <= 0:
            return None
        shares = list(map(truediv, map(dec.get, ids, repeat(0.0)), loads))
        top = max(shares)
        k = shares.index(top)
        rest = (sum(shares) - top) / (len(shares) - 1)
        if top - rest >= self.pd_margin and loads[k] <= sum(loads) / len(loads):
            return ids[k]
        return None

    def _evict_cost(self, inst: InstanceView, missed_tokens: int) -> float:
        """M_i: recomputing the prefixes the request's missed blocks would evict (LRU order)."""
        assert self.index is not None
        bs = inst.block_size
        excess = (self.index.num_blocks(inst.instance_id) - inst.num_kv_blocks) * bs \
            + missed_tokens
        lru = self._lru.get(inst.instance_id)
        if excess <= 0 or not lru:
            return 0.0
        cost, pt = 0.0, self._pt
        for k, key in enumerate(lru):
            if excess <= 0 or k >= self.max_evict_scan:
                break
            tokens = self.key_tokens.get(key, bs)
            stats = self.key_stats[key].get(inst.instance_id)
            if stats:
                cost += pt(tokens) * stats[0]
            excess -= tokens
        return cost

    # ------------------------------------------------------------------ window
    def _record(self, req: ClusterRequest, iid: str, m: PrefixMatch, key: int | None,
                now: float) -> None:
        missed = m.num_tokens - m.cached_tokens(iid)
        e = _Entry(now, iid, key, self._pt(missed),
                   req.params.max_tokens * self.tpot)
        self._win.append(e)
        self.load[iid] = self.load.get(iid, 0.0) + e.prefill + e.decode
        self.decode_load[iid] = self.decode_load.get(iid, 0.0) + e.decode
        if key is not None:
            per = self.key_stats.get(key)
            if per is None:
                per = self.key_stats[key] = {}
            st = per.get(iid)
            if st is None:
                st = per[iid] = [0, 0.0]
            st[0] += 1
            st[1] += e.prefill + e.decode
            lru = self._lru.get(iid)
            if lru is None:
                lru = self._lru[iid] = OrderedDict()
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
            self._pending.append((req, key, iid))
            if len(self._pending) > self.max_window:
                self._pending.popleft()
        self.num_routed += 1
        if len(self._win) > self.max_window:
            self._drop(self._win.popleft())

    def _expire(self, now: float) -> None:
        win, start = self._win, now - self.window
        while win and win[0].t < start:
            self._drop(win.popleft())

    def _drop(self, e: _Entry) -> None:
        cost = e.prefill + e.decode
        if e.instance in self.load:
            self.load[e.instance] = max(self.load[e.instance] - cost, 0.0)
            self.decode_load[e.instance] = max(self.decode_load[e.instance] - e.decode, 0.0)
        if e.key is None:
            return
        per = self.key_stats.get(e.key, {})
        st = per.get(e.instance)
        if st is None:
            return
        st[0] -= 1
        st[1] -= cost
        if st[0] <= 0:
            del per[e.instance]
            lru = self._lru.get(e.instance)
            if lru is not None:
                lru.pop(e.key, None)
        if not per:  # the prefix left the window: forget its moves, replicas and size
            self.key_stats.pop(e.key, None)
            self.key_tokens.pop(e.key, None)
            self.moved.pop(e.key, None)
            self.replicas.pop(e.key, None)
            self._ttft.pop(e.key, None)

    # ------------------------------------------------------------------ adjustment
    def _rebalance(self, by_id: dict[str, InstanceView]) -> None:
        """Th_bal check after an assignment (Preble §4, "Post-assignment load adjustment")."""
        if len(by_id) < 2 or self.num_routed < self.rebalance_min_per_instance * len(by_id):
            return
        if self._now < self._next_rebalance:
            return
        self._next_rebalance = self._now + self.rebalance_interval
        loads = [(self.load.get(i, 0.0), i) for i in by_id]
        (l_hi, hi), (l_lo, lo) = max(loads), min(loads)
        if l_hi <= self.balance_threshold * l_lo or l_hi <= 0:
            return
        gap = (l_hi - l_lo) / 2
        stats = self.key_stats
        keys = [(stats[k][hi][1], k) for k in self._lru.get(hi, ())
                if self.moved.get(k, hi) == hi]
        fitting = [kc for kc in keys if kc[0] <= gap]
        if not fitting:
            return
        cost, key = max(fitting)
        self.moved[key] = lo
        self.decisions["rebalance"] += 1
        # the prefix's window load moves along, so the next check sees the new balance
        n_req = self.key_stats[key].pop(hi)[0]
        dst = self.key_stats[key].setdefault(lo, [0, 0.0])
        dst[0] += n_req
        dst[1] += cost
        moved_decode = 0.0
        for e in self._win:
            if e.key == key and e.instance == hi:
                e.instance = lo
                moved_decode += e.decode
        self.load[hi] -= cost
        self.load[lo] = l_lo + cost
        self.decode_load[hi] -= moved_decode
        self.decode_load[lo] = self.decode_load.get(lo, 0.0) + moved_decode
        self._lru.get(hi, OrderedDict()).pop(key, None)
        self._lru.setdefault(lo, OrderedDict())[key] = None

    def _observe_ttfts(self) -> None:
        """Collect TTFTs of routed requests whose first token came back (in routing order)."""
        pend = self._pending
        while pend:
            req, key, iid = pend[0]
            times = req.timeline.token_times
            if times:
                if key in self.key_stats:  # (a prefix that left the window is forgotten)
                    self._ttft.setdefault(key, {}).setdefault(iid, deque()).append(
                        (times[0], times[0] - req.arrival))
            elif req.stage != "done":
                return
            pend.popleft()

    def _overloaded(self, key: int, iid: str, now: float) -> bool:
        """Preble's replication trigger ("Post-assignment load adjustment"; its implementation's
        TTFT overload detector): mean TTFT of the prefix's requests on ``iid`` in the
        second half of the window ≥ ``replicate_factor`` × the first half's."""
        samples = self._ttft.get(key, {}).get(iid)
        if not samples:
            return False
        start, half = now - self.window, now - self.window / 2
        while samples and samples[0][0] < start:
            samples.popleft()
        first = [v for t, v in samples if t < half]
        second = [v for t, v in samples if t >= half]
        if len(first) < self.min_ttft_samples or len(second) < self.min_ttft_samples:
            return False
        mean1, mean2 = sum(first) / len(first), sum(second) / len(second)
        return mean2 >= self.replicate_factor * mean1 and mean2 > 0


# ============================================================================ prefix_aware
@dataclass(frozen=True)
class LinearDecodeTime:
    """Default decode-step model, ``base + per_seq · B + per_token · Σctx`` seconds for a step of
    ``B`` sequences holding ``Σctx`` context tokens (the shape of DistServe's fitted decode
    step). The defaults (20 ms, 0.1 ms per sequence, 20 ns per context token) are the order of a
    7B–13B model on one A100; the simulator derives them from the deployment's latency model
    (:meth:`from_step_time`)."""

    base: float = 0.020
    per_seq: float = 1.0e-4
    per_token: float = 2.0e-8

    def __post_init__(self) -> None:
        if min(self.base, self.per_seq, self.per_token) < 0:
            raise ValueError(f"decode-step coefficients must be >= 0, got {self}")

    @classmethod
    def from_step_time(cls, step_time: Callable[[list[tuple[int, int]], list[int]], float],
                       ctx: int = 1024) -> LinearDecodeTime:
        """The linear model through three decode steps of ``step_time`` (a latency model's
        ``step_time(prefill_chunks, decode_context_lens)``): 8 and 64 sequences of ``ctx``
        tokens, and 64 of ``2·ctx``."""
        t8, t64 = step_time([], [ctx] * 8), step_time([], [ctx] * 64)
        t64x2 = step_time([], [2 * ctx] * 64)
        per_token = max((t64x2 - t64) / (64 * ctx), 0.0)
        per_seq = max((t64 - t8) / 56 - per_token * ctx, 0.0)
        base = max(t8 - 8 * (per_seq + per_token * ctx), 0.0)
        return cls(base, per_seq, per_token)

    def __call__(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.base + self.per_seq * batch + self.per_token * context_tokens


@register
class PrefixAwareRouter(Router):
    """pdserve's prompt-sharing-aware router: each request goes where its *predicted cost* is
    lowest, the prefill it would really compute there priced with the deployment's latency
    model together with the queue in front of it and the decode load it joins. No
    exploit/explore switch, no load window: the cost is read from the instances' state at the
    decision (``docs/routing.md`` explains why Preble's E2, ``preble-paper``, loses and how
    this differs).

    For candidate ``i`` with ``q_i`` requests still before their first token (the controller's
    ``queued``), ``A_i`` unfinished (``active``: decoding now, or soon, beside this one), ``X_i``
    context tokens in its KV (its last report's used blocks), and a prompt of ``n`` tokens with
    ``c_i``
    of them cached on ``i`` — per the KV-event-fed :class:`PrefixIndex`, or promised by a
    request of the same prefix routed to ``i`` whose prefill is still running — and ``o``
    output tokens:

    * ``miss_i = max(n − c_i, 1)``, the prompt tokens ``i`` would compute;
    * ``wait_i = Σ W(miss_r)`` over the ``q_i`` requests in front (each priced when routed),
      ``W(m) = PT(m) − a + a·m/B``: what ``m`` tokens add to the steps that carry them — a
      step's fixed cost ``a = 2·PT(1) − PT(2)`` is shared by the up to ``B = batch_tokens``
      tokens it takes, so ten queued cache hits of 64 tokens cost about one step, not ten —
      less the head's progress: the time since the oldest of them became the head (routed to
      an empty queue, or the one before it reached its first token), at most its own ``W`` (a
      long chunked prefill is partly done when the next request comes; the clock is the
      requests' arrival);
    * ``ttft_i = wait_i + PT(miss_i)``, the predicted first-token time;
    * ``cost_i = ttft_i + o·DT_i⁺ + w·A_i·[o·(DT_i⁺ − DT_i) + S_i(miss_i)]``: its own decode
      (``DT_i⁺``: a decode step of ``i``'s ``A_i`` requests with it, ``DT_i`` without) and,
      weighted by ``w = decode_weight``, what it costs the others: each of its ``o`` steps is
      longer for them, and its prefill stalls them (those in front decode while it prefills;
      a chunked prefill lengthens each step they take). The queued count too: counting only
      those decoding now sent requests to instances whose queue was about to decode (on one
      hot prefix, 12 % above round robin's mean latency);
    * the stall is convex: ``S_i(m) = PT(m)·(1 + κ·(wait_i + PT(m)/2)/D)``, the growth, from
      ``wait_i`` to ``wait_i + PT(m)``, of a decoder's harm ``s + κ·s²/(2D)`` from sitting
      through ``s`` of prefill (``D = o·DT`` of this request alone: a decoder's span;
      ``κ = stall_convexity``). The ``A_i`` requests already sit through ``wait_i``, and one
      more long prefill hurts them more than a first one hurts decoders elsewhere. Linear
      (``κ = 0``), the cheapest place for a long prompt was the instance with the fewest
      decoders however much prefill they already sat through: long prompts piled up there and
      its decoders missed their TPOT (``docs/routing.md``).

    The cheapest ``i`` wins (ties take turns: the first tied candidate after the last tie's
    winner, so that equal instances — an idle cluster, one hot prefix everywhere — share
    the requests instead of the first in order taking every tie; on the agent workload, 4 ×
    H100, that took its P99 E2E from 1.17 to 0.99 s). A hit on a busy holder costs its queue,
    so E2's failure — long prompts piled onto the one holder of their prefix — cannot happen
    while a copy elsewhere is cheaper; it is taken when the copy would cost the requests on
    the other instance more (their stall) than the wait costs this one. ``guard=True`` adds the
    literal rule instead: only candidates that would *start* the request no later than the
    earliest predicted prefill finish anywhere (``start_i ≤ min_j ttft_j``, ``start_i`` the
    steps before the one that takes the last token in front, :meth:`_start`). Off by default:
    measured, each redirect is a recomputed long prompt that stalls the instance it lands on,
    and under load that costs more than it saves (docs/routing.md). ``decisions`` counts
    ``late_start``: choices the rule would have redirected.

    **Balance guard** (SGLang's router balances unfinished requests, ``balance_abs`` 64 /
    ``balance_rel`` 1.5; here the unit is computed prompt tokens): an instance's load ``L_i`` is
    the missed tokens routed to it, decayed with ``τ`` — the running mean decode span ``D`` of
    the last ~100 requests, so about the prefill its decoders sit through — plus this request's
    ``miss_i``. When the cheapest candidate's ``L`` exceeds the least loaded priced candidate's
    ``L_lo`` by more than ``balance_abs`` (4,096) tokens and ``balance_rel`` (1.25) times, the
    cheapest candidate with ``L ≤ max(L_lo + balance_abs, balance_rel · L_lo)`` wins instead
    (``decisions["balanced"]``; ``balance_rel=None``: off). The cost prices the stall a prefill
    causes the decoders there *now*; greedily, the short requests gathered where many decoders
    were and the long prompts went to the others, whose decoders then sat through most of the
    prefill (``docs/routing.md``).

    Replication follows from the cost: once a holder's queue costs more than recomputing the
    prefix, the request (and so the prefix) goes to another instance, at whatever load that
    happens — there is no window or trigger to wait for.

    ``prefill_time`` (tokens → seconds) is the deployment's latency model where known, else
    :class:`LinearPrefillTime`; the decode step is a :class:`LinearDecodeTime` (``decode_time``,
    or fitted to ``step_time``, a latency model's own, as the simulator passes it);
    ``batch_tokens`` the instances' token budget per step (the simulator passes the engine's).

    With more than ``max_priced`` (16; 0: no limit) candidates, a decision prices the instances
    caching or promised part of the prompt and a window of ``max_priced`` others that rotates
    over the candidates from one decision to the next (the power of a few choices, as
    load balancers sample: the decision stays O(``max_priced``) at 64 instances).
    """

    name = "prefix_aware"
    wants_kv_events = True

    def __init__(self, prefill_time: PrefillTime | None = None,
                 decode_time: LinearDecodeTime | None = None,
                 step_time: Callable[[list[tuple[int, int]], list[int]], float] | None = None,
                 decode_weight: float = 1.0, promise_stride: int = 16,
                 batch_tokens: int = 2048, guard: bool = False, max_priced: int = 16,
                 stall_convexity: float = 3.0, balance_abs: int = 4096,
                 balance_rel: float | None = 1.25) -> None:
        _check(decode_weight >= 0, f"decode_weight must be >= 0, got {decode_weight}")
        _check(balance_abs >= 0, f"balance_abs must be >= 0, got {balance_abs}")
        _check(balance_rel is None or balance_rel >= 1,
               f"balance_rel must be >= 1 (or None: no balance guard), got {balance_rel}")
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._span, self._num_spans = 1.0, 0  # τ: the mean decode span D of recent requests
        _check(stall_convexity >= 0, f"stall_convexity must be >= 0, got {stall_convexity}")
        self.stall_convexity = stall_convexity
        self._now = _NEG_INF  # the decisions' clock: the latest arrival
        _check(batch_tokens >= 1, f"batch_tokens must be >= 1, got {batch_tokens}")
        self.batch_tokens = batch_tokens
        self.guard = guard
        _check(max_priced >= 0, f"max_priced must be >= 0, got {max_priced}")
        self.max_priced, self._rot = max_priced, 0
        self._tie = 0  # where a tie starts looking: after the last tie's winner (in turn)
        self._step_base: float | None = None  # a step's fixed cost, from prefill_time
        _check(promise_stride >= 1, f"promise_stride must be >= 1, got {promise_stride}")
        _check(decode_time is None or step_time is None,
               "give decode_time or step_time, not both")
        _check(decode_time is None or isinstance(decode_time, LinearDecodeTime),
               f"decode_time must be a LinearDecodeTime, got {decode_time!r}")
        self.prefill_time = prefill_time or LinearPrefillTime()
        self.decode_time = decode_time or (LinearDecodeTime.from_step_time(step_time)
                                           if step_time is not None else LinearDecodeTime())
        self.decode_weight = decode_weight
        self.promise_stride = promise_stride
        self.index: PrefixIndex | None = None
        self._pt_memo: dict[int, float] = {}
        # per instance: [the requests routed there, oldest first, as (cumulative W, cumulative
        # missed tokens, the block hashes they promise); Σ W routed so far; Σ W of the entries
        # dropped; Σ missed tokens routed; Σ of those dropped; entries; when the oldest entry
        # became the head, i.e. started its prefill; the missed tokens routed there decayed
        # with τ (the balance guard's load), as of the time in the last slot]. The newest
        # ``queued`` of them are the ones in front
        self._queues: dict[str, list] = {}
        self._cands: list[InstanceView] = []
        self._cand_states: list[list] = []
        self._pos: dict[str, int] = {}
        self._cand_ids: list[str] = []
        self._windows: dict[int, list[int]] = {}  # _window's, for _windows_num
        self._windows_num = (0, 0)
        # block hash -> instance -> requests in flight there whose prompt has that block
        self._promised: dict[int, dict[str, int]] = {}
        self.decisions: dict[str, int] = {"hit": 0, "miss": 0, "late_start": 0, "guarded": 0,
                                          "balanced": 0}

    # ------------------------------------------------------------------ events
    def on_kv_events(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        events = list(events)
        bs = block_size_of(events)
        if self.index is None:
            if bs is None:
                return
            self.index = PrefixIndex(bs)
        self.index.apply(instance_id, events)

    def on_instance_removed(self, instance_id: str) -> None:
        if self.index is not None:
            self.index.remove_instance(instance_id)
        st = self._queues.pop(instance_id, None)
        for _, _, keys in st[0] if st else ():
            self._unpromise(instance_id, keys)
        self._cands = []  # (its state is gone: rebuild the candidates' list)

    # ------------------------------------------------------------------ helpers
    def _pt(self, num_tokens: int) -> float:
        return memo_prefill_time(self._pt_memo, self.prefill_time, num_tokens)

    def _unpromise(self, iid: str, keys: tuple[int, ...]) -> None:
        promised = self._promised
        for h in keys:
            per = promised.get(h)
            if per is not None:
                k = per.get(iid, 0)
                if k > 1:
                    per[iid] = k - 1
                elif k:
                    del per[iid]
                    if not per:
                        del promised[h]

    def _trim(self, iid: str, st: list, queued: int) -> None:
        """Drop the entries of ``iid`` older than its ``queued`` newest: they reached their
        first token (about in order), their blocks are cached and the index knows."""
        dq = st[0]
        if len(dq) > queued:
            st[6] = self._now  # (the next one's prefill started by now)
        while len(dq) > queued:
            st[2], st[4], keys = dq.popleft()
            st[5] -= 1
            if keys:
                self._unpromise(iid, keys)

    def _states(self, candidates: list[InstanceView]) -> list[list]:
        """The candidates' queue states, in order (kept while the same views come, or views equal
        field by field: they name the same instances in the same order)."""
        if self._cands != candidates:
            self._cands = list(candidates)
            q = self._queues
            self._cand_states = [q.setdefault(v.instance_id, [deque(), 0.0, 0.0, 0, 0, 0,
                                                                 0.0, 0.0, 0.0])
                                 for v in candidates]
            self._pos = {v.instance_id: k for k, v in enumerate(candidates)}
            self._cand_ids = list(self._pos)
        return self._cand_states

    def _queued_time(self, tokens: int, pt_tokens: float | None = None) -> float:
        """``W(tokens)``: what a prefill of ``tokens`` adds to the steps that carry it (the
        class docstring); ``pt_tokens``: ``PT(tokens)`` when known."""
        if tokens <= 0:
            return 0.0
        a = self._step_base
        if a is None:
            a = self._step_base = max(2 * self._pt(1) - self._pt(2), 0.0)
        p = self._pt(tokens) if pt_tokens is None else pt_tokens
        return max(p - a, 0.0) + a * tokens / self.batch_tokens

    def _start(self, st: list, wait: float) -> float:
        """When a request routed now would start on the instance of state ``st``: the steps
        before the one that takes the last of the ``Q`` tokens in front (FCFS chunked prefill
        fills each step's budget ``B`` in order), ``wait − W(Q mod B)``."""
        tail = (st[3] - st[4]) % self.batch_tokens
        return max(wait - self._queued_time(tail), 0.0)

    def _wait(self, view: InstanceView) -> float:
        """Σ W of the requests in front on ``view`` (the newest ``queued`` routed there), less
        what the oldest of them has computed since it became the head (:meth:`_left`)."""
        st = self._queues.get(view.instance_id)
        if not st:
            return 0.0
        self._trim(view.instance_id, st, view.queued)
        return self._left(st) if st[0] else 0.0

    def _left(self, st: list) -> float:
        """The queue's prefill time left: Σ W in front less the head's progress — the time
        since it became the head (its routing, or the first token of the one before it), at
        most its own W (a long chunked prefill is partly done when the next request comes)."""
        wait = st[1] - st[2]
        if wait > 0:
            wait -= min(self._now - st[6], st[0][0][0] - st[2])
        return wait

    def _promised_blocks(self, keys: list[int], nblocks: int) -> dict[str, int]:
        """Instance -> leading prompt blocks that requests in flight there will have cached
        (``keys``: the prompt's checkpoint hashes, every ``promise_stride``-th block and the
        last one, shallowest first)."""
        out: dict[str, int] = {}
        promised = self._promised
        if not promised or not keys or keys[0] not in promised:
            return out
        stride = self.promise_stride
        last = len(keys) - 1
        for k in range(last, -1, -1):
            per = promised.get(keys[k])
            if per:
                blocks = (k + 1) * stride if k < last else nblocks
                for iid in per:
                    if iid not in out:
                        out[iid] = blocks
        return out

    # ------------------------------------------------------------------ select
    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        pr = self._price(request, candidates)
        waits, costs, best_finish, states = pr[0], pr[1], pr[2], pr[3]
        low = min(costs)
        k = costs.index(low)
        if self.balance_rel is not None:
            k = self._balance(pr, costs, k)
        if costs[k] == low and costs.count(low) > 1:  # ties: the first after the last tie's
            num = len(costs)  # winner
            k = next(j % num for j in range(self._tie, self._tie + num) if costs[j % num] == low)
            self._tie = k + 1
        if waits[k] > best_finish and self._start(states[k], waits[k]) > best_finish:
            # it would start after the request could be done elsewhere
            if not self.guard:
                self.decisions["late_start"] += 1
            else:
                self.decisions["guarded"] += 1
                k = min((j for j, wt in enumerate(waits)
                         if wt <= best_finish or self._start(states[j], wt) <= best_finish),
                        key=costs.__getitem__)
        return self._commit(candidates, k, pr)

    def _balance(self, pr: tuple, costs: list[float], k: int) -> int:
        """The balance guard: ``k`` (the cheapest) unless its load ``L_k`` — the missed tokens
        routed to it, decayed with τ, plus what this request would compute there — exceeds the
        least loaded candidate's ``L_lo`` by more than ``balance_abs`` tokens and
        ``balance_rel`` times; then the cheapest candidate within those bounds of ``L_lo``. The
        candidates compared: all of them, or past ``max_priced`` the rotating window (with
        ``k``)."""
        loads = pr[12]  # the priced candidates' (_price)
        if k not in loads:
            states, n, lengths, bs, ids = pr[3], pr[6], pr[8], pr[9], self._cand_ids
            st = states[k]
            c = lengths.get(ids[k], 0) * bs if lengths else 0
            loads[k] = st[7] * exp((st[8] - self._now) / self._span) + (n - c if c < n else 1)
        lo = min(loads.values())
        hi = max(lo + self.balance_abs, lo * self.balance_rel)  # type: ignore[operator]
        if loads[k] <= hi:
            return k
        self.decisions["balanced"] += 1
        return min((j for j, ld in loads.items() if ld <= hi), key=costs.__getitem__)

    def assess(self, request: ClusterRequest, candidates: list[InstanceView],
               chosen: InstanceView) -> dict[str, float]:
        """Price ``request`` as :meth:`select` would, then record it as routed to ``chosen``
        (another router's decision, shadowed: ``docs/routing.md``'s diagnosis). Returns the
        chosen instance's predicted start and first-token time, the earliest predicted
        first-token time anywhere, and whether the chosen one is the cheapest."""
        pr = self._price(request, candidates)
        waits, costs, best_finish, states = pr[0], pr[1], pr[2], pr[3]
        k = next(j for j, c in enumerate(candidates) if c is chosen)
        start = self._start(states[k], waits[k]) if waits[k] > best_finish else waits[k]
        out = {"start": start, "ttft": waits[k] + pr[4].get(k, pr[5]),
               "best_ttft": best_finish, "cheapest": float(costs[k] == min(costs)),
               "missed": float(pr[4].get(k, pr[5]) == pr[5])}
        self._commit(candidates, k, pr)
        return out

    def _price(self, request: ClusterRequest, candidates: list[InstanceView]) -> tuple:
        """Every candidate's wait and cost (the class docstring), the earliest predicted
        first-token time, and what :meth:`_commit` needs."""
        bs = candidates[0].block_size
        if self.index is None:
            self.index = PrefixIndex(bs)
        arrival = request.arrival  # (a property)
        if arrival > self._now:
            self._now = arrival
        now = self._now
        prompt = request.prompt_token_ids
        n = len(prompt)
        hashes = block_hashes(prompt, bs)
        lengths = self.index.match_hashes(hashes, n).lengths if hashes else {}
        stride = self.promise_stride
        keys = hashes[stride - 1::stride]
        if len(hashes) % stride:
            keys.append(hashes[-1])
        promised = self._promised_blocks(keys, len(hashes))
        if promised:
            for iid, k in lengths.items():
                if promised.get(iid, 0) < k:
                    promised[iid] = k
            lengths = promised
        out = request.params.max_tokens
        pt, w = self._pt, self.decode_weight
        dt = self.decode_time
        # DT_i⁺ = base + per_seq·(A_i + 1) + per_token·(X_i + n + o/2); DT_i⁺ − DT_i = inc
        inc = dt.per_seq + dt.per_token * (n + out // 2)
        per_seq, per_block = dt.per_seq, dt.per_token * bs
        pt_cold = pt(n)
        own0 = out * (dt.base + inc) + pt_cold
        dinc = w * out * inc + out * per_seq
        wp_cold = w * pt_cold
        adinc = wp_cold + dinc
        # the stall's convexity: w·κ/D, D = o·DT of the request alone (a decoder's span)
        d_alone = out * (dt.base + inc)
        kd = w * self.stall_convexity / d_alone if d_alone > 0 else 0.0
        half_cold = pt_cold / 2
        kdp = kd * pt_cold
        states = self._states(candidates)
        trim = self._trim
        xb = out * per_block
        num, m = len(candidates), self.max_priced
        pos = self._pos
        # the balance guard's loads of the priced candidates, as if nothing were cached there
        # (the holders corrected below): E_j·exp(−Δt/τ) + miss_j (_balance)
        loads: dict[int, float] | None = {} if self.balance_rel is not None else None
        tau, n_cold = self._span, (n if n > 0 else 1)
        if m and num > m:  # the holders and a rotating window of m candidates
            off = self._rot % num
            self._rot = off + m
            window = self._window(off, num, m)
            priced: list[int] | None = window  # (the guard's comparison)
            waits, costs = [_INF] * num, [_INF] * num
            for k in window:
                view, st = candidates[k], states[k]
                q = view.queued
                if st[5] > q:
                    trim(view.instance_id, st, q)
                wait = st[1] - st[2]
                if wait > 0:  # less the head's progress (_left)
                    d, h = now - st[6], st[0][0][0] - st[2]
                    wait -= h if h < d else d
                waits[k] = wait
                a = view.active
                stats = view.stats
                costs[k] = (wait + own0 + a * (adinc + kdp * (wait + half_cold))
                            + (xb * stats.num_used_blocks if stats is not None else 0.0))
                if loads is not None:
                    loads[k] = st[7] * exp((st[8] - now) / tau) + n_cold
            for i in lengths:  # the holders outside the window
                k = pos.get(i, -1)
                if k < 0 or costs[k] != _INF:
                    continue
                view, st = candidates[k], states[k]
                q = view.queued
                if st[5] > q:
                    trim(view.instance_id, st, q)
                wait = st[1] - st[2]
                if wait > 0:
                    d, h = now - st[6], st[0][0][0] - st[2]
                    wait -= h if h < d else d
                waits[k] = wait
                a = view.active
                stats = view.stats
                costs[k] = (wait + own0 + a * (adinc + kdp * (wait + half_cold))
                            + (xb * stats.num_used_blocks if stats is not None else 0.0))
        else:
            priced = None  # (all of them)
            waits = []
            costs = []
            add_wait, add_cost = waits.append, costs.append
            # every candidate priced as if nothing were cached there; the holders corrected
            # below
            for k, (view, st) in enumerate(zip(candidates, states)):
                q = view.queued
                if st[5] > q:  # drop what reached its first token
                    trim(view.instance_id, st, q)
                wait = st[1] - st[2]  # (0 once every entry is dropped: the sums meet)
                if wait > 0:  # less the head's progress (_left)
                    d, h = now - st[6], st[0][0][0] - st[2]
                    wait -= h if h < d else d
                a = view.active
                stats = view.stats
                add_wait(wait)
                add_cost(wait + own0 + a * (adinc + kdp * (wait + half_cold))
                         + (xb * stats.num_used_blocks if stats is not None else 0.0))
                if loads is not None:
                    loads[k] = st[7] * exp((st[8] - now) / tau) + n_cold
        best_finish = min(waits) + pt_cold
        ps: dict[int, float] = {}
        if lengths:
            for iid, c in lengths.items():
                at = pos.get(iid)
                if at is None:
                    continue
                p = pt(n - c * bs if c * bs < n else 1)
                ps[at] = p
                a = candidates[at].active
                costs[at] += (p - pt_cold) * (1.0 + a * (w + kd * (waits[at]
                                                                   + (p + pt_cold) / 2)))
                if waits[at] + p < best_finish:
                    best_finish = waits[at] + p
                if loads is not None and at in loads:
                    st, cb = states[at], c * bs
                    loads[at] = st[7] * exp((st[8] - now) / tau) + (n - cb if cb < n else 1)
        return (waits, costs, best_finish, states, ps, pt_cold, n, keys, lengths, bs,
                d_alone, priced, loads)

    def _window(self, off: int, num: int, m: int) -> list[int]:
        """The rotating window of ``m`` of the ``num`` candidates from ``off``, in the order
        the guard compares them (kept: ``off`` takes at most ``num`` values)."""
        memo = self._windows
        if self._windows_num != (num, m):
            memo.clear()
            self._windows_num = (num, m)
        win = memo.get(off)
        if win is None:
            win = memo[off] = list({(off + j) % num for j in range(m)})
        return win

    def _commit(self, candidates: list[InstanceView], k: int, pr: tuple) -> InstanceView:
        """Record the request as routed to ``candidates[k]`` (its queue entry, its promises)."""
        states, ps, pt_cold, n, keys, lengths, bs = pr[3], pr[4], pr[5], pr[6], pr[7], pr[8], \
            pr[9]
        inst = candidates[k]
        iid = inst.instance_id
        p = ps.get(k, pt_cold)
        self.decisions["hit" if p < pt_cold else "miss"] += 1
        st = states[k]
        if not st[0]:  # the head: its prefill starts now
            st[6] = self._now
        # what it adds to the queue: its prefill less the fixed step cost, but for its share
        # of the step's token budget
        miss = max(n - lengths.get(iid, 0) * bs if lengths else n, 1)
        st[1] += self._queued_time(miss, p)
        st[3] += miss
        st[0].append((st[1], st[3], tuple(keys)))
        st[5] += 1
        now = self._now
        st[7] = st[7] * exp((st[8] - now) / self._span) + miss
        st[8] = now
        if pr[10] > 0:  # τ: the running mean of the last ~100 requests' decode spans
            self._num_spans += 1
            self._span += (pr[10] - self._span) / min(self._num_spans, 100)
        pm = self._promised
        for h in keys:
            per = pm.get(h)
            if per is None:
                pm[h] = {iid: 1}
            else:
                per[iid] = per.get(iid, 0) + 1
        return inst
