"""Torch-free paged KV block pool with ref counts, chained-hash prefix reuse and O(1) LRU.

A block holds ``block_size`` tokens of KV. A block is in exactly one of three states::

    used    ref_cnt > 0                      (in some request's block table)
    cached  ref_cnt == 0, has a hash         (in the free queue, revivable by a prefix hit)
    free    ref_cnt == 0, no hash            (in the free queue)

The free queue is ordered by release time (an ``OrderedDict``, a linked list in C): allocation
pops the head (least recently released), so cached blocks are evicted in LRU order, and a prefix
hit takes a cached block from the middle in O(1) (a pool without caching, where nothing is
revived, keeps a list instead: :class:`FifoBlockQueue`). Full blocks are identified by a
chained hash ``hash((parent_hash, tokens))``; every hit also compares the stored tokens, so a
hash collision can never serve wrong KV. Python's hash of int tuples is stable across
processes, so hashes from different instances can be compared by a cluster-wide prefix index
(fed by :attr:`events`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks with these chained hashes now hold KV (in chain order, after ``parent_hash``)."""

    block_hashes: list[int]
    parent_hash: int
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks with these hashes were evicted and no longer hold reusable KV."""

    block_hashes: list[int]


KVEvent = BlockStored | BlockRemoved


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in release order with O(1) append, popleft and remove: an ``OrderedDict``
    by block id (a linked list in C; blocks hold no links, so they form no reference cycles
    and a dropped pool is freed by reference counting alone).

    ``lazy``: the queue starts as every block of ``blocks`` in id order without entering them,
    and ``blocks`` may hold ``None`` for a block not built yet (:class:`BlockPool`): blocks
    ``fresh..n-1`` (never taken) are its head, in order, ahead of the entered ones (blocks
    freed later go to the tail), so ``popleft`` takes them by index, building them. Removing
    one of them (never on the allocation path: only cached blocks are revived) enters them
    first."""

    def __init__(self, blocks: list[Block], lazy: bool = False) -> None:
        self._q: OrderedDict[int, Block] = OrderedDict()
        self.size = 0
        self._blocks, self._fresh, self._n = blocks, 0, 0
        if lazy:
            self._n = self.size = len(blocks)
        else:
            for b in blocks:
                self.append(b)

    def _get(self, i: int) -> Block:
        b = self._blocks[i]
        if b is None:
            b = self._blocks[i] = Block(i)
        return b

    def _enter_fresh(self) -> None:
        """Enter the fresh blocks at the head, in order."""
        q = self._q
        for i in range(self._n - 1, self._fresh - 1, -1):
            q[i] = self._get(i)
            q.move_to_end(i, last=False)
        self._fresh = self._n

    def append(self, block: Block) -> None:
        self._q[block.block_id] = block
        self.size += 1

    def remove(self, block: Block) -> None:
        i = block.block_id
        if self._fresh <= i < self._n:
            self._enter_fresh()
        assert i in self._q, f"{block} is not queued"
        del self._q[i]
        self.size -= 1

    def extend(self, blocks: list[Block]) -> None:
        """Append ``blocks`` at the tail, in order (what ``append`` on each would do)."""
        self._q.update([(b.block_id, b) for b in blocks])
        self.size += len(blocks)

    def popleft(self) -> Block:
        f = self._fresh
        if f < self._n:  # a fresh block
            self._fresh = f + 1
            self.size -= 1
            return self._get(f)
        assert self._q, "free queue is empty"
        self.size -= 1
        return self._q.popitem(last=False)[1]

    def take_fresh(self, n: int) -> list[Block]:
        """Pop up to ``n`` blocks from the fresh head at once (what ``popleft`` would give)."""
        f = self._fresh
        k = min(n, self._n - f)
        if k <= 0:
            return []
        out = self._blocks[f:f + k]
        if None in out:
            for t in range(k):
                if out[t] is None:
                    out[t] = self._blocks[f + t] = Block(f + t)
        self._fresh = f + k
        self.size -= k
        return out

    def take(self, n: int) -> list[Block]:
        """Pop ``n`` blocks from the head (``n`` calls of ``popleft``); ``n`` must be queued."""
        out = self.take_fresh(n)
        k = n - len(out)
        if k > 0:
            assert k <= len(self._q), "free queue is empty"
            pop = self._q.popitem
            out += [pop(False)[1] for _ in range(k)]
            self.size -= k
        return out

    def __iter__(self):
        for i in range(self._fresh, self._n):
            yield self._get(i)
        yield from self._q.values()

    def __len__(self) -> int:
        return self.size


class FifoBlockQueue(FreeBlockQueue):
    """:class:`FreeBlockQueue` for a pool without prefix caching, where no block leaves the
    queue but from its head (nothing is revived): a list and a head index, so that taking and
    returning a request's blocks are slices (an ``OrderedDict`` pops one entry per call). The
    same blocks in the same order; :meth:`remove` still works, in O(n)."""

    def __init__(self, blocks: list[Block], lazy: bool = False) -> None:
        self._l: list[Block] = []
        self._h = 0  # the queue is _l[_h:]
        super().__init__(blocks, lazy)

    def _enter_fresh(self) -> None:
        self._l[self._h:self._h] = [self._get(i) for i in range(self._fresh, self._n)]
        self._fresh = self._n

    def append(self, block: Block) -> None:
        self._l.append(block)
        self.size += 1

    def remove(self, block: Block) -> None:
        if self._fresh <= block.block_id < self._n:
            self._enter_fresh()
        ids = [b.block_id for b in self._l[self._h:]]
        assert block.block_id in ids, f"{block} is not queued"
        del self._l[self._h + ids.index(block.block_id)]
        self.size -= 1

    def extend(self, blocks: list[Block]) -> None:
        self._l += blocks
        self.size += len(blocks)

    def popleft(self) -> Block:
        return self.take(1)[0]

    def take(self, n: int) -> list[Block]:
        out = self.take_fresh(n)
        k = n - len(out)
        if k > 0:
            h, q = self._h, self._l
            assert k <= len(q) - h, "free queue is empty"
            out += q[h:h + k]
            h += k
            if h > 1024 and 2 * h > len(q):  # drop the taken prefix (amortized O(1))
                del q[:h]
                h = 0
            self._h = h
            self.size -= k
        return out

    def __iter__(self):
        for i in range(self._fresh, self._n):
            yield self._get(i)
        yield from self._l[self._h:]


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.record_events = record_events
        # blocks are built on first use (None until then; the simulator builds hundreds of
        # pools of up to ~20k blocks, most never touched): :meth:`materialize` builds them all
        self.blocks: list[Block] = [None] * num_blocks  # type: ignore[list-item]
        self.free_queue = (FreeBlockQueue if enable_caching else FifoBlockQueue)(
            self.blocks, lazy=True)
        self.cached: dict[int, Block] = {}
        self.events: list[KVEvent] = []

    def materialize(self) -> list[Block]:
        """Build every block not built yet; returns :attr:`blocks`."""
        blocks = self.blocks
        if None in blocks:
            for i, b in enumerate(blocks):
                if b is None:
                    blocks[i] = Block(i)
        return blocks

    # ---- queries ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached)."""
        return self.free_queue.size

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.size

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> Block | None:
        """The cached block with this hash *and* these tokens, or ``None``."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tokens:
            return None
        return block

    # ---- transitions ----
    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found by :meth:`lookup` (reviving cached free ones)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached KV."""
        if n > self.free_queue.size:
            raise ValueError(f"cannot allocate {n} blocks, only {self.free_queue.size} free")
        out = self.free_queue.take(n)
        cached = self.cached
        for b in out:  # hot loop: the never-used head has no hash, a reused block may have one
            if b.block_hash is not None:
                if self.record_events:
                    self.events.append(BlockRemoved([b.block_hash]))
                del cached[b.block_hash]
                b.block_hash = b.token_ids = None
            b.ref_cnt = 1
        return out

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block. Pass a request's table **tail first** so that its
        last blocks (least likely to be shared) are evicted first."""
        released = []
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                released.append(b)
        self.free_queue.extend(released)

    def cache(self, block: Block, block_hash: int, tokens: tuple[int, ...],
              parent_hash: int) -> bool:
        """Register a used, fully computed block under ``block_hash``. Returns ``False`` (and
        leaves the block uncached) when another block already holds this content."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash, block.token_ids = block_hash, tokens
        self.cached[block_hash] = block
        if self.record_events:
            self.events.append(BlockStored([block_hash], parent_hash, list(tokens),
                                           self.block_size))
        return True

    def cache_blocks(self, blocks: list[Block], block_hashes: list[int],
                     tokens: list[tuple[int, ...]], parent_hash: int) -> None:
        """:meth:`cache` each of a run of consecutive blocks of one chain (``parent_hash``
        precedes the first; each block's hash is the next one's parent)."""
        if not self.enable_caching:
            return
        cached = self.cached
        for b, h, t in zip(blocks, block_hashes, tokens, strict=True):
            if b.block_hash is None and h not in cached:
                b.block_hash, b.token_ids = h, t
                cached[h] = b
                if self.record_events:
                    self.events.append(BlockStored([h], parent_hash, list(t), self.block_size))
            parent_hash = h

    def uncache(self, block: Block) -> None:
        """Drop a cached block's hash (it stays allocated): no lookup finds it again."""
        self._evict(block)

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        if self.record_events:
            self.events.append(BlockRemoved([block.block_hash]))
        block.block_hash = block.token_ids = None

    def reset_prefix_cache(self) -> int:
        """Evict every cached free block; returns how many were evicted."""
        victims = [b for b in self.free_queue if b.block_hash is not None]
        for b in victims:
            self._evict(b)
        return len(victims)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    # ---- invariants ----
    def check_integrity(self) -> None:
        """Assert ``free + cached + used == total``, ref counts >= 0, every block in one place."""
        self.materialize()
        queued = list(self.free_queue)
        ids = [b.block_id for b in queued]
        assert len(ids) == len(set(ids)) == self.free_queue.size, "free queue corrupt"
        queued_set = set(ids)
        n_free = n_cached = n_used = 0
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"{b} has negative ref count"
            if b.ref_cnt > 0:
                assert b.block_id not in queued_set, f"{b} is used but in the free queue"
                n_used += 1
            else:
                assert b.block_id in queued_set, f"{b} leaked: unreferenced and not free"
                if b.block_hash is None:
                    n_free += 1
                else:
                    n_cached += 1
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"{b} hash not indexed"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        assert n_free + n_cached + n_used == self.num_blocks
