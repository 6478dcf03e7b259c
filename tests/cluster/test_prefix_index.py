"""Global prefix index against a brute-force reference (sets of block hashes per instance)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.prefix_index import PrefixIndex, prompt_hashes
from pdserve.engine.kv_cache import NO_PARENT, BlockPool, BlockRemoved, BlockStored

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
HASHES = [prompt_hashes(p, BS) for p in PROMPTS]
INSTANCES = ["a", "b", "c"]


def ref_lengths(ref, prompt_idx):
    """Blocks of the prompt each instance holds contiguously from the start (brute force)."""
    out = {}
    for iid, held in ref.items():
        n = 0
        for h in HASHES[prompt_idx]:
            if h not in held:
                break
            n += 1
        if n:
            out[iid] = n
    return out


def check(index, ref):
    for iid in INSTANCES:
        assert index.num_blocks(iid) == len(ref.get(iid, ()))
    for k, prompt in enumerate(PROMPTS):
        m = index.match(prompt + [0])  # a partial trailing block never matches
        assert m.lengths == ref_lengths(ref, k), (k, m.lengths)
        assert m.hashes == HASHES[k][:len(m.nodes)]
        assert len(m.nodes) == max(m.lengths.values(), default=0)
        assert sum(e - s for s, e in m.segments) == len(m.nodes)
    union = set().union(*ref.values()) if ref else set()
    for h in union:
        assert sorted(index.holders(h)) == sorted(i for i, s in ref.items() if h in s)
    children = {}
    for node in index.nodes.values():
        if node.parent is not None:
            assert index.nodes[node.parent.key] is node.parent
            children[node.parent.key] = children.get(node.parent.key, 0) + 1
    for h, node in index.nodes.items():
        assert node.nchild == children.get(h, 0)
        # bounded memory: a node nobody holds lives only as some held node's ancestor
        assert node.mask or node.nchild, "an unreferenced node was not pruned"
        if node.mask:
            assert h in union


op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(INSTANCES), st.integers(0, len(PROMPTS) - 1),
              st.integers(0, 5), st.integers(1, 3)),
    st.tuples(st.just("evict"), st.sampled_from(INSTANCES), st.integers(0, len(PROMPTS) - 1),
              st.integers(0, 5), st.integers(1, 3)),
    st.tuples(st.just("lose"), st.sampled_from(INSTANCES), st.just(0), st.just(0), st.just(0)),
)


@pytest.mark.parametrize("stride, max_memo", [(1, 1), (2, 1 << 10), (3, 2)])
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40))
def test_index_matches_brute_force(stride, max_memo, ops):
    """Block-by-block lookups (stride 1) and stride lookups through the memo (a tiny memo is
    cleared as it goes) agree with the reference after every event."""
    index, ref = PrefixIndex(BS, stride=stride, max_memo=max_memo), {}
    for kind, iid, k, first, n in ops:
        hs = HASHES[k][first:first + n]
        if kind == "store" and hs:
            parent = HASHES[k][first - 1] if first else NO_PARENT
            toks = PROMPTS[k][first * BS:(first + len(hs)) * BS]
            index.apply(iid, [BlockStored(hs, parent, toks, BS)])
            ref.setdefault(iid, set()).update(hs)
        elif kind == "evict" and hs:
            index.apply(iid, [BlockRemoved(hs)])
            ref.setdefault(iid, set()).difference_update(hs)
        elif kind == "lose":
            index.remove_instance(iid)
            ref.pop(iid, None)
        check(index, ref)
    for iid in INSTANCES:
        index.remove_instance(iid)
    assert index.nodes == {}  # everything leaves with the instances


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
    index.store("b", prompt_hashes([1, 1] + [9] * 20, BS), NO_PARENT)
    m = index.match([1, 1] + [9] * 20)
    assert m.segments == [(0, 1), (1, 11)]
    assert m.key_portion() == (1, 11)  # 10 blocks after a 1-block shared root


def test_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex(0)
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        PrefixIndex(BS).apply("a", [BlockStored([1], NO_PARENT, [1, 2, 3, 4], 4)])


def test_memory_is_reported():
    index = PrefixIndex(BS)
    index.store("a", HASHES[0], NO_PARENT)
    assert 4 * 50 < index.memory_bytes() < 4 * 400
