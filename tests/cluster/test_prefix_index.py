"""Global prefix index against a brute-force reference (sets of block hashes per instance)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.prefix_index import Node, PrefixIndex
from pdserve.engine.kv_cache import BlockPool, BlockRemoved, BlockStored
from pdserve.request import NO_PARENT, block_hashes

BS = 2
# prompts sharing prefixes: a small tree of token blocks
PROMPTS = [
    [1, 1, 2, 2, 3, 3, 4, 4],
    [1, 1, 2, 2, 3, 3, 5, 5],
    [1, 1, 2, 2, 6, 6],
    [1, 1, 7, 7, 8, 8, 9, 9, 1, 1],
    [2, 2, 3, 3],
    [1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4],
]
HASHES = [block_hashes(p, BS) for p in PROMPTS]
INSTANCES = ["a", "b", "c"]


def ref_lengths(ref, hashes):
    """Blocks of the prompt each instance holds contiguously from the start (brute force)."""
    out = {}
    for iid, held in ref.items():
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        if n:
            out[iid] = n
    return out


def ref_segments(hashes, n, children):
    """Preble's radix nodes along the first ``n`` blocks: a new one after each block with two
    or more children (``children`` counted from the index's parent links)."""
    out, start = [], 0
    for i, h in enumerate(hashes[:n]):
        if children.get(h, 0) > 1:
            out.append((start, i + 1))
            start = i + 1
    if start < n:
        out.append((start, n))
    return out


def check(index, ref, prompts=PROMPTS, hashes=HASHES):
    for iid in INSTANCES:
        assert index.num_blocks(iid) == len(ref.get(iid, ()))
    children = {}
    for node in index.nodes.values():
        if node.parent is not None:
            children[node.parent.key] = children.get(node.parent.key, 0) + 1
    for k, prompt in enumerate(prompts):
        m = index.match(prompt + [0])  # a partial trailing block never matches
        lengths = ref_lengths(ref, hashes[k])
        n = max(lengths.values(), default=0)
        assert m.lengths == lengths, (k, m.lengths)
        assert m.hashes == hashes[k][:n]
        assert len(m.nodes) == n
        assert m.segments == ref_segments(hashes[k], n, children)
        assert [e.key for e in m.segment_ends] == [hashes[k][e - 1] for _, e in m.segments]
        assert m.first is None if n == 0 else m.first.key == hashes[k][0]
    check_summaries(index)
    union = set().union(*ref.values()) if ref else set()
    for h in union:
        assert sorted(index.holders(h)) == sorted(i for i, s in ref.items() if h in s)
    for node in index.nodes.values():
        if node.parent is not None:
            assert index.nodes[node.parent.key] is node.parent
    for h, node in index.nodes.items():
        assert node.nchild == children.get(h, 0)
        # bounded memory: a node nobody holds lives only as some held node's ancestor
        assert node.mask or node.nchild, "an unreferenced node was not pruned"
        if node.mask:
            assert h in union


def check_summaries(index):
    """Depths and window summaries recomputed from scratch by walking up the parent links."""
    sb = index.stride
    for node in index.nodes.values():
        assert sorted(c.key for c in node.children()) == sorted(
            n.key for n in index.nodes.values() if n.parent is node)
        path, x = [], node
        while x is not None:
            path.append(x)
            x = x.parent
        # a chain ending at a placeholder (never stored as anybody's child) has no known depth
        rooted = path[-1].depth == 0
        assert node.depth == (len(path) - 1 if rooted else -1)
        if node.depth < 0:
            continue
        window = path[:node.depth % sb + 1]
        want_and, want_or = -1, 0
        for x in window:
            want_and &= x.mask
            want_or |= x.mask
        assert node.wand == want_and and node.wor == want_or
        assert node.wbr == any(x.nchild > 1 for x in window)


op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(INSTANCES), st.integers(0, len(PROMPTS) - 1),
              st.integers(0, 5), st.integers(1, 3)),
    st.tuples(st.just("evict"), st.sampled_from(INSTANCES), st.integers(0, len(PROMPTS) - 1),
              st.integers(0, 5), st.integers(1, 3)),
    st.tuples(st.just("lose"), st.sampled_from(INSTANCES), st.just(0), st.just(0), st.just(0)),
)


@pytest.mark.parametrize("stride", [1, 2, 3])
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40))
def test_index_matches_brute_force(stride, ops):
    """Block-by-block lookups (stride 1) and stride lookups agree with the reference after
    every event."""
    index, ref = PrefixIndex(BS, stride=stride), {}
    for op in ops:
        apply_op(index, ref, op, PROMPTS, HASHES)
        check(index, ref)
    for iid in INSTANCES:
        index.remove_instance(iid)
    assert index.nodes == {}  # everything leaves with the instances


def apply_op(index, ref, op, prompts, hashes) -> None:
    """One random event — ``(kind, instance, prompt, first block, blocks)`` — applied to the
    index and to the reference (instance → set of block hashes)."""
    kind, iid, k, first, n = op
    hs = hashes[k][first:first + n]
    if kind == "store" and hs:
        parent = hashes[k][first - 1] if first else NO_PARENT
        toks = prompts[k][first * BS:(first + len(hs)) * BS]
        index.apply(iid, [BlockStored(hs, parent, toks, BS)])
        ref.setdefault(iid, set()).update(hs)
    elif kind == "evict" and hs:
        index.apply(iid, [BlockRemoved(hs)])
        ref.setdefault(iid, set()).difference_update(hs)
    elif kind == "lose":
        index.remove_instance(iid)
        ref.pop(iid, None)


def long_prompts(draw_tree):
    """Prompts (and their hashes) along random root-to-leaf paths of a tree of token blocks."""
    prompts = []
    for path in draw_tree:
        prompts.append([t for b in path for t in (b, b)])
    return prompts, [block_hashes(p, BS) for p in prompts]


@st.composite
def tree_paths(draw):
    """Up to 5 paths of 1–24 blocks, each branching off an earlier one at a random block."""
    paths = []
    for _ in range(draw(st.integers(1, 5))):
        fork = draw(st.integers(0, 24))
        base = draw(st.sampled_from(paths))[:fork] if paths else []
        tail = draw(st.lists(st.integers(1, 4), min_size=1, max_size=24 - len(base)
                             if len(base) < 24 else 1))
        paths.append(base + tail)
    return paths


@pytest.mark.parametrize("stride", [4, 16])
@settings(max_examples=150, deadline=None)
@given(paths=tree_paths(), data=st.data())
def test_long_prompts_match_brute_force_through_window_summaries(stride, paths, data):
    """Prompts of up to 24 blocks with branch points and instances' prefixes ending anywhere,
    including inside a stride: lookups by whole strides (window summaries) agree with the
    reference after every store, eviction and instance loss."""
    prompts, hashes = long_prompts(paths)
    index, ref = PrefixIndex(BS, stride=stride), {}
    ops = data.draw(st.lists(st.tuples(
        st.sampled_from(["store", "store", "evict", "lose"]), st.sampled_from(INSTANCES),
        st.integers(0, len(prompts) - 1), st.integers(0, 23), st.integers(1, 24)), max_size=25))
    for op in ops:
        apply_op(index, ref, op, prompts, hashes)
        check(index, ref, prompts, hashes)


def test_losing_an_instance_refreshes_summaries_below_a_former_branch():
    """Hand-made case hypothesis found: b holds [1 1]-[1 1] and [1 1]-[2 2], a holds
    [1 1]-[2 2]; when b is lost, [1 1] stops being a branch point and [2 2]'s window summary is
    recomputed — from masks that must already have lost b's bit."""
    prompts, hashes = long_prompts([[1, 1], [1, 2]])
    index = PrefixIndex(BS, stride=16)
    for iid, k in (("b", 0), ("a", 1), ("b", 1)):
        index.apply(iid, [BlockStored(hashes[k], NO_PARENT, prompts[k], BS)])
    index.remove_instance("b")
    node = index.nodes[hashes[1][1]]
    assert (node.mask, node.wand, node.wor, node.wbr) == (2, 2, 2, False)  # a: bit 1
    check(index, {"a": set(hashes[1])}, prompts, hashes)


def test_index_follows_a_real_block_pool():
    """Events from the engine's block pool (stores, LRU evictions) keep the index exact."""
    pool = BlockPool(num_blocks=4, block_size=BS, record_events=True)
    index = PrefixIndex(BS)

    def run(prompt):
        blocks = pool.allocate(len(prompt) // BS)
        parent = NO_PARENT
        for i, b in enumerate(blocks):
            h = HASHES[PROMPTS.index(prompt)][i]
            pool.cache(b, h, tuple(prompt[i * BS:(i + 1) * BS]), parent)
            parent = h
        pool.free(list(reversed(blocks)))
        index.apply("a", pool.take_events())

    run(PROMPTS[0])  # 4 blocks cached
    assert index.match(PROMPTS[0]).lengths == {"a": 4}
    run(PROMPTS[4])  # 2 blocks: evicts the LRU head = prompt 0's last two blocks
    assert index.match(PROMPTS[0]).lengths == {"a": 2}
    assert index.match(PROMPTS[4]).lengths == {"a": 2}
    assert index.num_blocks("a") == len(pool.cached) == 4


def test_key_portion_and_segments():
    index = PrefixIndex(BS)
    for k in (0, 1, 2):
        index.store("a", HASHES[k], NO_PARENT)
    # tree: [1 1]-[2 2] branches into [3 3]-... and [6 6]; [3 3] branches into [4 4] / [5 5]
    m = index.match(PROMPTS[0])
    assert m.segments == [(0, 2), (2, 3), (3, 4)]
    assert m.key_portion() == (0, 2)  # later radix nodes are not longer than their prefix
    index.store("b", block_hashes([1, 1] + [9] * 20, BS), NO_PARENT)
    m = index.match([1, 1] + [9] * 20)
    assert m.segments == [(0, 1), (1, 11)]
    assert m.key_portion() == (1, 11)  # 10 blocks after a 1-block shared root


def test_a_stride_where_some_holders_end_is_taken_whole():
    """Stride 2: a holds blocks 0-3, b blocks 0-1, c blocks 0-2. The stride of blocks 2-3 is
    held whole by a, not at all by b (b's prefix ends where it starts: one lookup takes it),
    and in part by c (block by block)."""
    prompt = list(range(1, 11))  # 5 blocks of 2
    hs = block_hashes(prompt, BS)
    index = PrefixIndex(BS, stride=2)
    index.store("a", hs[:4], NO_PARENT)
    index.store("b", hs[:2], NO_PARENT)
    m = index.match(prompt)
    assert m.lengths == {"a": 4, "b": 2} and m.num_nodes == 4
    assert all(isinstance(p, Node) for p in m._parts)  # two whole strides
    assert [n.key for n in m.nodes] == hs[:4]
    index.store("c", hs[:3], NO_PARENT)
    m = index.match(prompt)
    assert m.lengths == {"a": 4, "b": 2, "c": 3}
    assert isinstance(m._parts[0], Node) and isinstance(m._parts[1], list)
    assert [n.key for n in m.nodes] == hs[:4]


def test_a_match_ending_inside_a_window_is_found_by_binary_search():
    """Stride 4, a 10-block prompt; a holds blocks 0-5: the window of blocks 4-7 ends the
    match at block 5, found without looking up every block, and taken whole (a Node part
    standing for blocks 4-5). Then b holds blocks 0-4: b's prefix ends inside that window, so
    its blocks are looked up one by one."""
    prompt = list(range(1, 21))  # 10 blocks of 2
    hs = block_hashes(prompt, BS)
    index = PrefixIndex(BS, stride=4)
    index.store("a", hs[:6], NO_PARENT)
    m = index.match(prompt)
    assert m.lengths == {"a": 6} and m.num_nodes == 6 and m.segments == [(0, 6)]
    assert [type(p) for p in m._parts] == [Node, Node]
    assert [n.key for n in m.nodes] == hs[:6] and m.first.key == hs[0]
    index.store("b", hs[:5], NO_PARENT)
    m = index.match(prompt)
    assert m.lengths == {"a": 6, "b": 5}
    assert [type(p) for p in m._parts] == [Node, list]
    assert [n.key for n in m.nodes] == hs[:6]


def test_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex(0)
    with pytest.raises(ValueError, match="block hashes for a prompt of 5 tokens"):
        PrefixIndex(BS).match_hashes([1], 5)
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        PrefixIndex(BS).apply("a", [BlockStored([1], NO_PARENT, [1, 2, 3, 4], 4)])


def test_memory_is_reported():
    index = PrefixIndex(BS)
    index.store("a", HASHES[0], NO_PARENT)
    assert 4 * 50 < index.memory_bytes() < 4 * 400
