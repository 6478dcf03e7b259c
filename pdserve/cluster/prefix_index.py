"""Global prefix index: which instance caches which prompt prefix, fed only by KV events.

Preble §4 ("Global scheduler data structures") keeps a radix tree of prompts whose nodes record
the GPUs holding their KV. Here the tree is built over the engines' chained block hashes
(:func:`pdserve.request.hash_block`): a block's hash names its whole prefix, so one dict
``hash -> node`` finds any block in O(1), and ``parent`` links give the tree::

    root ─ h0 ─ h1 ─ h2 ─ h3        a node = one full block (block_size tokens)
                   └ h2' ─ h3'      h1 has two children: a branch point

Preble's (compressed) radix nodes are the maximal non-branching chains of blocks; a match
computes them on the fly (:attr:`PrefixMatch.segments`), so no split/merge bookkeeping is needed
when prompts diverge. Each node carries a bitmask of the instances whose block pool holds the
block: set by ``BlockStored`` events, cleared by ``BlockRemoved`` events and instance loss, so the
index knows what is really cached rather than what was routed. A node lives while some instance
holds it or a descendant needs it as a parent, so memory is bounded by the blocks cached across
the cluster (:meth:`PrefixIndex.memory_bytes` reports it). A lookup takes the prompt's chained
block hashes (a :class:`~pdserve.request.Prompt` carries them, computed once for the router and
the engines alike) and stops at the first block no instance holds. So that it need not visit
every matched block, each node also keeps a summary of its stride-aligned
window (the AND of the holder masks from the window's first block down to it, and whether one
of them is a branch point), which the events keep current by touching at most one window below
the changed node (children links); a matched stride whose summary shows no instance's prefix
ending inside it costs O(1) (:meth:`PrefixIndex.match_hashes`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from pdserve.engine.kv_cache import BlockRemoved, BlockStored, KVEvent
from pdserve.request import NO_PARENT, block_hashes


class Node:
    """One cached block. ``mask``: bit ``b`` set when instance ``b`` holds the block;
    ``nchild``: children in the index (> 1 = a branch point), ``kids`` them (``None``, one
    node, or a list); ``depth``: blocks above it (-1: unknown, below a placeholder).

    The *window summary* serves lookups by whole strides: the index cuts every path into
    windows of ``stride`` blocks (depths ``k·stride`` to ``k·stride + stride − 1``), and
    ``wand`` is the AND of the masks from the window's first block down to this one, ``wor``
    their OR, ``wbr`` whether any of them is a branch point."""

    __slots__ = ("key", "parent", "nchild", "mask", "depth", "kids", "wand", "wor", "wbr")

    def __init__(self, key: int, parent: Node | None, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.nchild = 0
        self.mask = 0
        self.depth = depth
        self.kids: Node | list[Node] | None = None
        self.wand = 0
        self.wor = 0
        self.wbr = False

    def children(self) -> list[Node]:
        k = self.kids
        return [] if k is None else [k] if isinstance(k, Node) else list(k)


class PrefixMatch:
    """A prompt matched against the index.

    ``nodes``: the leading prompt blocks some instance holds *contiguously from the start*;
    ``lengths``: instance -> number of leading blocks it holds (instances holding none absent);
    ``segments``: ``(start, end)`` block ranges of Preble's radix nodes along ``nodes`` (a new
    segment starts after a branch point) and ``segment_ends`` the node ending each;
    ``num_tokens``: the prompt's length.

    A lookup does not list the matched nodes (that is per-block work a routing decision does not
    need): ``nodes`` is built on first use from the stretches the lookup kept — a node standing
    for the blocks of its window (``stride`` blocks from a multiple of ``stride``) down to it,
    or a list of nodes.
    """

    __slots__ = ("lengths", "segments", "segment_ends", "num_tokens", "block_size",
                 "num_nodes", "_parts", "_stride", "_nodes")

    def __init__(self, parts: list[Node | list[Node]], stride: int, num_nodes: int,
                 lengths: dict[str, int], segments: list[tuple[int, int]],
                 segment_ends: list[Node], num_tokens: int, block_size: int) -> None:
        self._parts, self._stride, self.num_nodes = parts, stride, num_nodes
        self.lengths, self.segments, self.segment_ends = lengths, segments, segment_ends
        self.num_tokens, self.block_size = num_tokens, block_size
        self._nodes: list[Node] | None = None

    @property
    def first(self) -> Node | None:
        """The prompt's first block (``None`` without a match)."""
        if not self.num_nodes:
            return None
        part = self._parts[0]
        return part[0] if isinstance(part, list) else _up(part, part.depth % self._stride)

    @property
    def nodes(self) -> list[Node]:
        if self._nodes is None:
            out: list[Node] = []
            for part in self._parts:
                if isinstance(part, Node):  # a window's blocks down to it: walk up
                    chain, node = [part], part
                    for _ in range(part.depth % self._stride):
                        node = node.parent  # type: ignore[assignment]
                        chain.append(node)
                    out += reversed(chain)
                else:
                    out += part
            self._nodes = out[:self.num_nodes]
        return self._nodes

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

    def key_segment(self) -> int | None:
        """Index in ``segments`` of Preble's *key portion* (its workload study; "E2 Global
        Scheduler"): the deepest radix node on the matched path with more tokens than all its
        predecessors together (the first node always qualifies); ``None`` without a match."""
        best = None
        for j, (start, end) in enumerate(self.segments):
            if end - start > start:
                best = j
        return best

    def key_portion(self) -> tuple[int, int] | None:
        """The key portion's block range (:meth:`key_segment`)."""
        j = self.key_segment()
        return None if j is None else self.segments[j]


class PrefixIndex:
    """Which instances cache which prompt blocks (see the module docstring)."""

    def __init__(self, block_size: int, stride: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.block_size, self.stride = block_size, stride
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
        held = []
        for n in self.nodes.values():
            n.wand &= ~m  # the bit leaves every mask, so every window AND and OR
            n.wor &= ~m
            if n.mask & m:
                n.mask &= ~m  # all masks first: pruning refreshes summaries from them
                held.append(n)
        for node in held:
            if self.nodes.get(node.key) is node:  # (not pruned with a descendant already)
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
        parent = None if parent_hash == NO_PARENT else self._node(parent_hash)
        for h in block_hashes:
            node = nodes.get(h)
            if node is None:
                if parent is None:
                    node = nodes[h] = Node(h, None, 0)
                else:
                    node = nodes[h] = Node(h, parent, parent.depth + 1 if parent.depth >= 0
                                           else -1)
                    self._adopt(parent, node)
            elif node.parent is None and node.depth < 0:  # a placeholder learns its place
                if parent is not None:
                    node.parent = parent
                    self._adopt(parent, node)
                depth = 0 if parent is None else parent.depth + 1 if parent.depth >= 0 else -1
                if depth >= 0:
                    self._set_depths(node, depth)
            if not node.mask & m:
                node.mask |= m
                self._blocks[instance_id] += 1
                self._refresh(node)
            parent = node

    def _node(self, h: int) -> Node:
        """The node for ``h``, created as a placeholder (held by nobody, depth unknown) when
        unknown: a parent the events never stored, or one already removed while a child is
        still cached."""
        node = self.nodes.get(h)
        if node is None:
            node = self.nodes[h] = Node(h, None, -1)
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
                self._refresh(node)
                self._prune(node)

    def _prune(self, node: Node | None) -> None:
        while node is not None and node.mask == 0 and node.nchild == 0:
            del self.nodes[node.key]
            parent = node.parent
            if parent is not None:
                _disown(parent, node)
                self._refresh(parent)
            node = parent

    # ------------------------------------------------------------------ window summaries
    def _adopt(self, parent: Node, child: Node) -> None:
        k = parent.kids
        if k is None:
            parent.kids = child
        elif isinstance(k, Node):
            parent.kids = [k, child]
        else:
            k.append(child)
        parent.nchild += 1
        if parent.nchild == 2:
            self._refresh(parent)  # it became a branch point

    def _refresh(self, node: Node) -> None:
        """Recompute ``node``'s window summary from its parent's, and its descendants' in the
        same window while theirs change (each event touches at most one window's worth)."""
        sb = self.stride
        stack = [node]
        while stack:
            x = stack.pop()
            p, d = x.parent, x.depth
            if d % sb == 0 or p is None or d < 0:
                wand, wor, wbr = x.mask, x.mask, x.nchild > 1
            else:
                wand, wor, wbr = p.wand & x.mask, p.wor | x.mask, p.wbr or x.nchild > 1
            if wand == x.wand and wor == x.wor and wbr == x.wbr:
                continue
            x.wand, x.wor, x.wbr = wand, wor, wbr
            k = x.kids
            if k is not None and (d + 1) % sb:
                stack += [k] if isinstance(k, Node) else k

    def _set_depths(self, top: Node, depth: int) -> None:
        """``top`` learned its place (``depth``): give it and its subtree their depths and
        summaries (O(subtree); placeholders are rare)."""
        top.depth = depth
        stack = [top]
        while stack:
            x = stack.pop()
            if x is not top:
                x.depth = x.parent.depth + 1  # type: ignore[union-attr]
            x.wand, x.wor, x.wbr = -1, -1, True  # force the recomputation below
            self._refresh(x)
            stack += x.children()

    # ------------------------------------------------------------------ lookups
    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Match a prompt (:meth:`match_hashes` on its chained block hashes: a
        :class:`~pdserve.request.Prompt`'s own, else computed now, O(prompt tokens))."""
        return self.match_hashes(block_hashes(token_ids, self.block_size), len(token_ids))

    def match_hashes(self, hashes: Sequence[int], num_tokens: int) -> PrefixMatch:
        """Match a prompt of ``num_tokens`` tokens given the chained hashes of its full blocks
        (:func:`~pdserve.request.block_hashes`): the leading blocks some instance holds, each
        instance's share of them, and the radix nodes along them. Costs O(matched strides +
        blocks near where an instance's prefix ends), not O(prompt).

        The prompt is taken a window (``stride`` blocks, :class:`Node`) at a time: its deepest
        block in the index is the window's last one or, where the match ends inside the window,
        found by a binary search (O(log stride) look-ups). When that node's window AND says
        that every instance that held the blocks before the window holds all of the window's
        blocks down to it, or none of them, they are taken in O(1) (with a walk up them when
        the window has branch points, which end radix nodes); otherwise they are looked up one
        by one."""
        if len(hashes) != num_tokens // self.block_size:
            raise ValueError(f"{len(hashes)} block hashes for a prompt of {num_tokens} tokens "
                             f"in blocks of {self.block_size}")
        bs, sb, nodes, ids = self.block_size, self.stride, self.nodes, self._ids
        nb = len(hashes)
        parts: list[Node | list[Node]] = []
        lengths: dict[str, int] = {}
        segments: list[tuple[int, int]] = []
        seg_ends: list[Node] = []
        live = -1  # instances holding every block so far (-1: before the first block)
        i = start = 0  # blocks matched; where the current radix node starts
        while i < nb:
            n_to = i + sb if i + sb < nb else nb  # this window's blocks: [i, n_to)
            stop = False
            if sb > 1:
                # the deepest block of the window on the prompt's path: the last one, or (the
                # match ends inside) a binary search — a node at its depth has every block
                # above it on the path in the index, so such blocks form a prefix
                p = n_to - 1
                end = nodes.get(hashes[p])
                if end is None or end.depth != p:
                    end, lo, hi = None, i, p
                    while lo < hi:
                        mid = (lo + hi) // 2
                        x = nodes.get(hashes[mid])
                        if x is not None and x.depth == mid:
                            end, p, lo = x, mid, mid + 1
                        else:
                            hi = mid
                if end is not None:
                    # its window summary says who holds every block from i to it
                    # nobody's prefix ends inside [i, p]: at the start, every block has
                    # the same holders; later, each of the holders so far holds every block
                    # of it (kept) or none (its prefix ends at i)
                    keep = end.wand & live
                    if keep and end.wor & live == keep:
                        if i and keep != live:
                            _record(lengths, ids, live & ~keep, i)
                        live = keep
                        if end.wbr:  # branch points inside: each ends a radix node; walk
                            # up only while some remain above (wbr counts down to the node)
                            node, k = end, p + 1
                            ends = []
                            while k > i and node.wbr:
                                if node.nchild > 1:
                                    ends.append((k, node))
                                node, k = node.parent, k - 1  # type: ignore[assignment]
                            for k, node in reversed(ends):
                                segments.append((start, k))
                                seg_ends.append(node)
                                start = k
                        parts.append(end)
                        i = p + 1
                        if i < n_to:
                            break  # the match ends inside the window
                        continue
                    if p + 1 < n_to:  # no block after p is on the path: the match ends
                        n_to, stop = p + 1, True
            chain = []  # block by block
            for j in range(i, n_to):
                found = nodes.get(hashes[j])
                if found is None:
                    break
                chain.append(found)
            whole = len(chain) == n_to - i
            taken = 0
            for node in chain:  # block by block: most blocks change nothing
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
                    seg_ends.append(node)
                    start = i + 1
                i += 1
                taken += 1
            if taken:
                parts.append(chain[:taken])
            if not whole or live == 0 or stop:
                break
        if i:
            _record(lengths, ids, live, i)
            if start < i:
                segments.append((start, i))
                seg_ends.append(_last(parts))
        return PrefixMatch(parts, sb, i, lengths, segments, seg_ends, num_tokens, bs)

    def holders(self, block_hash: int) -> list[str]:
        """Instances holding the block ``block_hash``."""
        node = self.nodes.get(block_hash)
        if node is None:
            return []
        return [iid for iid, bit in self._bit.items() if node.mask >> bit & 1]

    # ------------------------------------------------------------------ size
    def memory_bytes(self) -> int:
        """Bytes held by the index's nodes and hash table (object sizes, shallow; an int shared
        with another field or CPython's small-int cache counted once or not at all)."""
        per_node = sys.getsizeof(Node(0, None, 0))
        size = sys.getsizeof
        total = sys.getsizeof(self.nodes) + per_node * len(self.nodes)
        for n in self.nodes.values():
            total += size(n.key) + size(n.mask)
            for v in (n.wand, n.wor):
                if v is not n.mask and not -5 <= v <= 256:
                    total += size(v)
            if n.depth > 256:
                total += size(n.depth)
            if isinstance(n.kids, list):
                total += size(n.kids)
        return total


def block_size_of(events: Sequence[KVEvent]) -> int | None:
    """The block size of the first stored block in ``events`` (``None``: only removals)."""
    return next((e.block_size for e in events if isinstance(e, BlockStored)), None)


def _disown(parent: Node, child: Node) -> None:
    k = parent.kids
    if k is child:
        parent.kids = None
    else:
        assert isinstance(k, list)
        k.remove(child)
        if len(k) == 1:
            parent.kids = k[0]
    parent.nchild -= 1


def _up(node: Node, k: int) -> Node:
    """The ``k``-th ancestor of ``node`` (the caller knows it exists)."""
    for _ in range(k):
        node = node.parent  # type: ignore[assignment]
    return node


def _last(parts: list[Node | list[Node]]) -> Node:
    part = parts[-1]
    return part if isinstance(part, Node) else part[-1]


def _record(lengths: dict[str, int], ids: Sequence[str | None], mask: int, n: int) -> None:
    """``lengths[iid] = n`` for every instance whose bit is set in ``mask``."""
    while mask:
        low = mask & -mask
        iid = ids[low.bit_length() - 1]
        if iid is not None:
            lengths[iid] = n
        mask ^= low
