"""Per-request view of the block pool: prefix matching, slot allocation, caching, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import cdiv
from pdserve.engine.kv_cache import Block, BlockPool
from pdserve.request import NO_PARENT, Request, hash_blocks


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What :meth:`KVCacheManager.match_prefix` found for a request: the cached ``blocks`` that
    prefix its tokens (in order), the ``num_tokens`` they hold, and ``num_revived`` — how many
    of them are cached but unreferenced, so that taking them uses up free blocks."""

    blocks: tuple[Block, ...]
    num_tokens: int
    num_revived: int


NO_HIT = PrefixHit((), 0, 0)


class KVCacheManager:
    """Keeps ``request.block_ids`` and ``request.block_hashes`` in step with the pool.

    Counters ``prefix_queries``/``prefix_hits`` count prompt tokens looked up / found in the prefix
    cache (vLLM's ``prefix_cache_queries``/``hits``), once per admitted request
    (:meth:`record_admission`), not per scheduling attempt: a request that waits for memory is
    one query.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.prefix_queries = 0
        self.prefix_hits = 0

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _hashes(self, req: Request) -> list[int]:
        """Chained hashes of every full block of ``req.all_token_ids`` (extended lazily; a
        :class:`~pdserve.request.Prompt`'s chain is taken, not recomputed)."""
        hashes = req.block_hashes
        if not hashes and req.shared_prompt is not None:
            hashes += req.shared_prompt.block_hashes(self.block_size)
        return hash_blocks(req.all_token_ids, self.block_size, hashes)

    def match_prefix(self, req: Request) -> PrefixHit:
        """Longest run of cached blocks that prefixes ``req``'s tokens, leaving at least the last
        token to compute (its logits are needed). Takes no references and counts nothing."""
        if not self.pool.enable_caching:
            return NO_HIT
        hits = self._longest_prefix(req)
        return PrefixHit(tuple(hits), len(hits) * self.block_size,
                         sum(1 for b in hits if b.ref_cnt == 0))

    def record_admission(self, req: Request, hit: PrefixHit) -> None:
        """``req`` was admitted with ``hit``: one prefix-cache query of its tokens."""
        if self.pool.enable_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += hit.num_tokens

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens :meth:`match_prefix` would find now (without counting a query)."""
        if not self.pool.enable_caching:
            return 0
        return len(self._longest_prefix(req)) * self.block_size

    def _longest_prefix(self, req: Request) -> list[Block]:
        n_max = (req.num_tokens - 1) // self.block_size
        if n_max == 0:
            return []
        hashes = self._hashes(req)
        bs, toks, hits, cached = self.block_size, req.all_token_ids, [], self.pool.cached
        for i in range(n_max):
            if hashes[i] not in cached:  # the common miss, without building the token tuple
                break
            b = self.pool.lookup(hashes[i], tuple(toks[i * bs : (i + 1) * bs]))
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Give ``req`` slots for ``num_new_tokens`` more tokens after its computed ones (plus the
        prefix ``hit``, which must come from :meth:`match_prefix` on a request with no blocks).
        Returns ``False`` and changes nothing when the pool is too small."""
        hits = hit.blocks
        if not hits:  # the per-step path (a running request crossing a block boundary)
            n_new = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(
                req.block_ids)
            if n_new > self.pool.num_free_blocks:
                return False
            if n_new > 0:
                req.block_ids.extend([b.block_id for b in self.pool.allocate(n_new)])
            return True
        total = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        n_new = self.blocks_for(total) - len(req.block_ids) - len(hits)
        if max(n_new, 0) + hit.num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(hits)
        req.block_ids.extend(b.block_id for b in hits)
        if n_new > 0:
            req.block_ids.extend(b.block_id for b in self.pool.allocate(n_new))
        return True

    def cache_computed(self, req: Request, old_computed: int, new_computed: int) -> None:
        """Register the blocks that became full and computed between the two counts."""
        pool = self.pool
        if not pool.enable_caching:
            return
        bs = self.block_size
        first, last = old_computed // bs, new_computed // bs
        if last <= first:
            return
        hashes, toks = self._hashes(req), req.all_token_ids
        span = tuple(toks[first * bs : last * bs])  # the blocks' tokens, sliced once
        parts = [span] if last == first + 1 else [span[o : o + bs]
                                                  for o in range(0, len(span), bs)]
        blocks = pool.blocks
        pool.cache_blocks([blocks[b] for b in req.block_ids[first:last]], hashes[first:last],
                          parts, hashes[first - 1] if first else NO_PARENT)

    def uncache(self, req: Request, num_trusted_tokens: int) -> None:
        """Take ``req``'s blocks past its first ``num_trusted_tokens`` tokens out of the prefix
        cache (their content is not to be trusted); the request keeps them until freed."""
        pool = self.pool
        for i in req.block_ids[max(num_trusted_tokens, 0) // self.block_size:]:
            b = pool.blocks[i]
            if b.block_hash is not None:
                pool.uncache(b)

    def free(self, req: Request) -> None:
        """Release all of ``req``'s blocks, tail first (so its last blocks are evicted first)."""
        blocks = self.pool.blocks
        self.pool.free([blocks[i] for i in reversed(req.block_ids)])
        req.block_ids = []
