"""Global prefix index: which instance caches which prompt prefix, fed only by KV events.

Preble §4 ("Global scheduler data structures") keeps a radix tree of prompts whose nodes record
the GPUs holding their KV. Here the tree is built over the engines' chained block hashes
(:func:`pdserve.engine.kv_cache.hash_block`): a block's hash names its whole prefix, so one dict
``hash -> node`` finds any block in O(1), and ``parent`` links give the tree::

    root ─ h0 ─ h1 ─ h2 ─ h3        a node = one full block (block_size tokens)
                   └ h2' ─ h3'      h1 has two children: a branch point

Preble's (compressed) radix nodes are the maximal non-branching chains of blocks; a match
computes them on the fly (:attr:`PrefixMatch.segments`), so no split/merge bookkeeping is needed
when prompts diverge. Each node carries a bitmask of the instances whose block pool holds the
block: set by ``BlockStored`` events, cleared by ``BlockRemoved`` events and instance loss, so the
index knows what is really cached rather than what was routed. A node lives while some instance
holds it or a descendant needs it as a parent, so memory is bounded by the blocks cached across
the cluster (:meth:`PrefixIndex.memory_bytes` reports it). A lookup hashes the prompt block by
block and stops at the first block no instance holds: O(matched blocks + 1).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.kv_cache import NO_PARENT, BlockRemoved, BlockStored, KVEvent, hash_block


class Node:
    """One cached block. ``mask``: bit ``b`` set when instance ``b`` holds the block;
    ``nchild``: children in the index (> 1 = a branch point)."""

    __slots__ = ("key", "parent", "nchild", "mask")

    def __init__(self, key: int, parent: Node | None) -> None:
        self.key = key
        self.parent = parent
        self.nchild = 0
        self.mask = 0


@dataclass(slots=True)
class PrefixMatch:
    """A prompt matched against the index.

    ``nodes``: the leading prompt blocks some instance holds *contiguously from the start*;
    ``lengths``: instance -> number of leading blocks it holds (instances holding none absent);
    ``segments``: ``(start, end)`` block ranges of Preble's radix nodes along ``nodes`` (a new
    segment starts after a branch point); ``num_tokens``: the prompt's length.
    """

    nodes: list[Node]
    lengths: dict[str, int]
    segments: list[tuple[int, int]]
    num_tokens: int
    block_size: int

    @property
    def hashes(self) -> list[int]:
        """The chained block hashes of ``nodes``."""
        return [n.key for n in self.nodes]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of the longest prefix held by any one instance."""
        return max(self.lengths.values(), default=0) * self.block_size

    def cached_tokens(self, instance_id: str) -> int:
        return self.lengths.get(instance_id, 0) * self.block_size

    def key_portion(self) -> tuple[int, int] | None:
        """Preble's *key portion* (its workload study; "E2 Global Scheduler"): the deepest radix
        node on the matched path with more tokens than all its predecessors together (the first
        node always qualifies); ``None`` without a match."""
        best = None
        for start, end in self.segments:
            if end - start > start:
                best = (start, end)
        return best


class PrefixIndex:
    """Which instances cache which prompt blocks (see the module docstring)."""

    def __init__(self, block_size: int, stride: int = 16, max_memo: int = 1 << 18) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if stride < 1 or max_memo < 1:
            raise ValueError(f"stride and max_memo must be >= 1, got {stride}, {max_memo}")
        self.block_size, self.stride, self.max_memo = block_size, stride, max_memo
        self._memo: dict[int, int] = {}  # stride-chain hash of tokens -> engine block hash
        self.nodes: dict[int, Node] = {}
        self._bit: dict[str, int] = {}
        self._ids: list[str | None] = []  # bit -> instance id (None: a freed bit)
        self._blocks: dict[str, int] = {}  # instance -> blocks it holds

    # ------------------------------------------------------------------ instances
    def _bit_of(self, instance_id: str) -> int:
        bit = self._bit.get(instance_id)
        if bit is None:
            try:
                bit = self._ids.index(None)
                self._ids[bit] = instance_id
            except ValueError:
                bit = len(self._ids)
                self._ids.append(instance_id)
            self._bit[instance_id] = bit
            self._blocks[instance_id] = 0
        return bit

    @property
    def instances(self) -> list[str]:
        return list(self._bit)

    def num_blocks(self, instance_id: str) -> int:
        """Blocks the index believes ``instance_id`` caches."""
        return self._blocks.get(instance_id, 0)

    def remove_instance(self, instance_id: str) -> None:
        """The instance is gone: its blocks leave the index (O(index size); a rare event)."""
        bit = self._bit.pop(instance_id, None)
        if bit is None:
            return
        self._ids[bit] = None
        del self._blocks[instance_id]
        m = 1 << bit
        for node in [n for n in self.nodes.values() if n.mask & m]:
            node.mask &= ~m
            self._prune(node)

    # ------------------------------------------------------------------ events
    def apply(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one instance's KV events, in the order its block pool emitted them."""
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size != self.block_size:
                    raise ValueError(f"instance {instance_id!r} stores blocks of {ev.block_size} "
                                     f"tokens; the index uses {self.block_size}")
                self.store(instance_id, ev.block_hashes, ev.parent_hash)
            elif isinstance(ev, BlockRemoved):
                self.remove(instance_id, ev.block_hashes)
            else:
                raise TypeError(f"unknown KV event {ev!r}")

    def store(self, instance_id: str, block_hashes: Sequence[int], parent_hash: int) -> None:
        """``instance_id`` now holds these chained blocks (the first one's parent given)."""
        m = 1 << self._bit_of(instance_id)
        nodes = self.nodes
        parent = None if parent_hash == NO_PARENT else self._node(parent_hash, None)
        for h in block_hashes:
            node = nodes.get(h)
            if node is None:
                node = nodes[h] = Node(h, parent)
                if parent is not None:
                    parent.nchild += 1
            elif node.parent is None and parent is not None:  # a placeholder learns its parent
                node.parent = parent
                parent.nchild += 1
            if not node.mask & m:
                node.mask |= m
                self._blocks[instance_id] += 1
            parent = node

    def _node(self, h: int, parent: Node | None) -> Node:
        """The node for ``h``, created as a placeholder (held by nobody) when unknown: a parent
        the events never stored, or one already removed while a child is still cached."""
        node = self.nodes.get(h)
        if node is None:
            node = self.nodes[h] = Node(h, parent)
        return node

    def remove(self, instance_id: str, block_hashes: Sequence[int]) -> None:
        """``instance_id`` evicted these blocks (unknown ones are ignored)."""
        bit = self._bit.get(instance_id)
        if bit is None:
            return
        m = 1 << bit
        for h in block_hashes:
            node = self.nodes.get(h)
            if node is not None and node.mask & m:
                node.mask &= ~m
                self._blocks[instance_id] -= 1
                self._prune(node)

    def _prune(self, node: Node | None) -> None:
        while node is not None and node.mask == 0 and node.nchild == 0:
            del self.nodes[node.key]
            parent = node.parent
            if parent is not None:
                parent.nchild -= 1
            node = parent

    # ------------------------------------------------------------------ lookups
    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Match a prompt: the leading blocks some instance holds, each instance's share of
        them, and the radix nodes along them. Costs O(matched blocks + 1)."""
        bs, ids = self.block_size, self._ids
        found = self._walk(token_ids if isinstance(token_ids, tuple) else tuple(token_ids))
        lengths: dict[str, int] = {}
        segments: list[tuple[int, int]] = []
        live = -1  # instances holding every block so far
        i = start = 0
        for node in found:  # hot loop: most blocks change nothing
            if live & node.mask != live:
                held = live & node.mask
                if i:  # the instances that held every block so far but not this one
                    _record(lengths, ids, live & ~held, i)
                if not held:
                    live = 0
                    break
                live = held
            if node.nchild > 1:  # a branch point ends Preble's radix node here
                segments.append((start, i + 1))
                start = i + 1
            i += 1
        path = found[:i]
        n = len(path)
        if n:
            _record(lengths, ids, live, n)
            if start < n:
                segments.append((start, n))
        return PrefixMatch(path, lengths, segments, len(token_ids), bs)

    def _walk(self, toks: tuple[int, ...]) -> list[Node]:
        """The index's nodes for the prompt's leading blocks, up to the first block it lacks.

        Hashing block by block is the cost of a lookup, so whole strides of ``stride`` blocks
        are looked up at once: a stride's tokens hash (chained over strides, in C) to a memo of
        the engine's chained hash of its last block; when that node exists, its parent links
        give the stride's other nodes. A stride seen for the first time, one where the match
        ends, and the tail are hashed block by block (the memo then learns the stride). The
        memo maps token content to hashes, so it never goes stale; it is cleared when full."""
        bs, sb, nodes, memo = self.block_size, self.stride, self.nodes, self._memo
        nb = len(toks) // bs
        out: list[Node] = []
        i, sh = 0, NO_PARENT
        while i < nb:
            if sb > 1 and i + sb <= nb:
                sh = hash((sh, toks[i * bs:(i + sb) * bs]))
                end = nodes.get(memo.get(sh, NO_PARENT))
                if end is not None:
                    chain, node = [end], end
                    for _ in range(sb - 1):
                        node = node.parent
                        if node is None:
                            break
                        chain.append(node)
                    if node is not None:
                        chain.reverse()
                        out += chain
                        i += sb
                        continue
                n_to = i + sb
            else:
                n_to = nb
            parent = out[-1].key if out else NO_PARENT
            for j in range(i, n_to):
                parent = hash((parent, toks[j * bs:(j + 1) * bs]))  # = hash_block (hot loop)
                node = nodes.get(parent)
                if node is None:
                    return out
                out.append(node)
            if n_to - i == sb > 1:
                if len(memo) >= self.max_memo:
                    memo.clear()
                memo[sh] = parent
            i = n_to
        return out

    def holders(self, block_hash: int) -> list[str]:
        """Instances holding the block ``block_hash``."""
        node = self.nodes.get(block_hash)
        if node is None:
            return []
        return [iid for iid, bit in self._bit.items() if node.mask >> bit & 1]

    # ------------------------------------------------------------------ size
    def memory_bytes(self) -> int:
        """Bytes held by the index's nodes and hash table (object sizes, shallow)."""
        per_node = sys.getsizeof(Node(0, None))
        ints = sum(sys.getsizeof(n.key) + sys.getsizeof(n.mask) for n in self.nodes.values())
        return sys.getsizeof(self.nodes) + per_node * len(self.nodes) + ints


def prompt_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The engines' chained hashes of every full block of ``token_ids``."""
    out, parent = [], NO_PARENT
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


def block_size_of(events: Sequence[KVEvent]) -> int | None:
    """The block size of the first stored block in ``events`` (``None``: only removals)."""
    return next((e.block_size for e in events if isinstance(e, BlockStored)), None)


def _record(lengths: dict[str, int], ids: Sequence[str | None], mask: int, n: int) -> None:
    """``lengths[iid] = n`` for every instance whose bit is set in ``mask``."""
    while mask:
        low = mask & -mask
        iid = ids[low.bit_length() - 1]
        if iid is not None:
            lengths[iid] = n
        mask ^= low
