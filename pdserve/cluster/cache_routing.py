"""Cache-aware baseline routers that Preble's E2 (:mod:`pdserve.cluster.prefix_routing`) is
compared with.

* ``sglang_cache_aware`` — :class:`CacheAwareRouter`, SGLang's router: an approximate prefix tree
  of what it routed, a cache-hit threshold and load-balance thresholds.
* ``kv_overlap`` — :class:`KVOverlapRouter`, Dynamo's KV router cost: prompt blocks to compute
  (prompt blocks minus the cached overlap) plus the instance's decode blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pdserve.cluster.prefix_index import PrefixIndex, block_size_of
from pdserve.cluster.routing import InstanceView, Router, register
from pdserve.cluster.routing import require as _check
from pdserve.engine.kv_cache import KVEvent
from pdserve.request import NO_PARENT, block_hashes

if TYPE_CHECKING:
    from pdserve.cluster.cluster_request import ClusterRequest


# ============================================================================ SGLang router
@register
class CacheAwareRouter(Router):
    """SGLang's cache-aware router (sgl-router ``cache_aware`` policy), as a baseline.

    It keeps an *approximate* prefix tree of what it routed (not what is cached), per instance
    at block granularity (the engines' chained block hashes), bounded to ``max_tree_blocks``
    blocks per instance by evicting the least recently routed prompts. If the load (unfinished
    requests) is imbalanced — ``max - min > balance_abs`` (64) and ``max > balance_rel · min``
    (1.5) — the least loaded instance wins. Otherwise the instance with the longest match wins
    when it covers more than ``cache_threshold`` (0.3) of the prompt, else the instance with the
    smallest tree (the most free cache)."""

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, max_tree_blocks: int = 1 << 20) -> None:
        _check(0 <= cache_threshold <= 1,
               f"cache_threshold must be in [0, 1], got {cache_threshold}")
        _check(balance_abs >= 0, f"balance_abs must be >= 0, got {balance_abs}")
        _check(balance_rel >= 1, f"balance_rel must be >= 1, got {balance_rel}")
        _check(max_tree_blocks >= 1, f"max_tree_blocks must be >= 1, got {max_tree_blocks}")
        self.cache_threshold, self.balance_abs, self.balance_rel = (
            cache_threshold, balance_abs, balance_rel)
        self.max_tree_blocks = max_tree_blocks
        self.tree: PrefixIndex | None = None
        # instance -> block hash -> prompts routed there containing it (LRU order: oldest first)
        self._refs: dict[str, OrderedDict[int, int]] = {}
        self._prompts: dict[str, deque[list[int]]] = {}

    def on_instance_removed(self, instance_id: str) -> None:
        if self.tree is not None:
            self.tree.remove_instance(instance_id)
        self._refs.pop(instance_id, None)
        self._prompts.pop(instance_id, None)

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        if self.tree is None:
            self.tree = PrefixIndex(candidates[0].block_size)
        tree = self.tree
        loads = [c.active for c in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            inst = candidates[loads.index(lo)]
        else:
            m = tree.match(request.prompt_token_ids)
            ids = {c.instance_id: c for c in candidates}
            best = max(ids, key=lambda i: m.cached_tokens(i))
            n = max(m.num_tokens, 1)
            if m.cached_tokens(best) / n > self.cache_threshold:
                inst = ids[best]
            else:
                inst = min(candidates, key=lambda c: tree.num_blocks(c.instance_id))
        self._insert(inst.instance_id, request.prompt_token_ids)
        return inst

    def _insert(self, iid: str, token_ids: Sequence[int]) -> None:
        assert self.tree is not None
        hashes = block_hashes(token_ids, self.tree.block_size)
        refs = self._refs.setdefault(iid, OrderedDict())
        new = [h for h in hashes if h not in refs]
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
            refs.move_to_end(h)
        if new:
            self.tree.store(iid, hashes, NO_PARENT)
        prompts = self._prompts.setdefault(iid, deque())
        prompts.append(hashes)
        while len(refs) > self.max_tree_blocks and len(prompts) > 1:
            gone = []
            for h in prompts.popleft():
                refs[h] -= 1
                if refs[h] == 0:
                    del refs[h]
                    gone.append(h)
            self.tree.remove(iid, gone)


# ======================================================================== Dynamo KV router
@register
class KVOverlapRouter(Router):
    """Dynamo's KV-aware router cost as a baseline: for instance ``i``,
    ``overlap_weight · (prompt blocks − blocks of the prompt cached on i) + decode blocks_i``
    (blocks in use on ``i`` plus blocks promised to requests routed there), lowest wins (ties:
    fewer unfinished requests, then order). The overlap comes from the KV-event-fed
    :class:`PrefixIndex`."""

    name = "kv_overlap"
    wants_kv_events = True

    def __init__(self, overlap_weight: float = 1.0) -> None:
        _check(overlap_weight >= 0, f"overlap_weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight
        self.index: PrefixIndex | None = None

    def on_kv_events(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        events = list(events)
        bs = block_size_of(events)
        if self.index is None and bs is None:
            return
        if self.index is None:
            self.index = PrefixIndex(bs or 1)
        self.index.apply(instance_id, events)

    def on_instance_removed(self, instance_id: str) -> None:
        if self.index is not None:
            self.index.remove_instance(instance_id)

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        bs = candidates[0].block_size
        if self.index is None:
            self.index = PrefixIndex(bs)
        m = self.index.match(request.prompt_token_ids)
        prompt_blocks = -(-m.num_tokens // bs)

        def cost(c: InstanceView) -> tuple[float, int]:
            used = c.stats.num_used_blocks if c.stats is not None else 0
            decode = used + -(-c.pending_tokens // bs)
            prefill = prompt_blocks - m.lengths.get(c.instance_id, 0)
            return self.overlap_weight * prefill + decode, c.active

        return min(candidates, key=cost)
