"""Block pool: exact block ids, ref counts and eviction order in hand-worked cases."""

import pytest

from pdserve.engine.kv_cache import BlockPool, BlockRemoved, BlockStored
from pdserve.request import NO_PARENT, hash_block


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_free_lru_order_and_revival():
    pool = BlockPool(4, block_size=2, record_events=True)
    a = pool.allocate(2)
    assert ids(a) == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    assert ids(pool.free_queue) == [2, 3]
    h0 = hash_block(NO_PARENT, (1, 2))
    h1 = hash_block(h0, (3, 4))
    assert pool.cache(a[0], h0, (1, 2), NO_PARENT)
    assert pool.cache(a[1], h1, (3, 4), h0)
    pool.check_integrity()
    pool.free(list(reversed(a)))  # tail first
    assert ids(pool.free_queue) == [2, 3, 1, 0]
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    pool.check_integrity()
    # plain free blocks go first (LRU), cached ones survive
    assert ids(pool.allocate(1)) == [2]
    assert ids(pool.allocate(1)) == [3]
    # a prefix hit revives block 0 out of the middle of the queue in O(1)
    hit = pool.lookup(h0, (1, 2))
    assert hit is pool.blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and ids(pool.free_queue) == [1]
    pool.check_integrity()
    # the next allocation evicts block 1 (least recently freed cached block)
    assert ids(pool.allocate(1)) == [1]
    assert pool.lookup(h1, (3, 4)) is None
    events = pool.take_events()
    assert events == [BlockStored([h0], NO_PARENT, [1, 2], 2), BlockStored([h1], h0, [3, 4], 2),
                      BlockRemoved([h1])]
    assert pool.take_events() == []
    pool.check_integrity()
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)


def test_token_check_on_hash_hit():
    pool = BlockPool(2, block_size=2)
    b = pool.allocate(1)[0]
    h = hash_block(NO_PARENT, (5, 6))
    pool.cache(b, h, (5, 6), NO_PARENT)
    assert pool.lookup(h, (5, 6)) is b
    assert pool.lookup(h, (5, 7)) is None  # same hash, other tokens: never served


def test_shared_block_ref_counts_and_duplicate_content():
    pool = BlockPool(3, block_size=2)
    b = pool.allocate(1)[0]
    h = hash_block(NO_PARENT, (1, 1))
    pool.cache(b, h, (1, 1), NO_PARENT)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and pool.num_used_blocks == 1
    # another block with the same content is not indexed twice
    other = pool.allocate(1)[0]
    assert not pool.cache(other, h, (1, 1), NO_PARENT)
    assert other.block_hash is None
    pool.free([b, other])
    pool.check_integrity()
    assert ids(pool.free_queue) == [2, 0, 1]
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


def test_integrity_detects_leak_and_corruption():
    pool = BlockPool(2, block_size=2)
    b = pool.allocate(1)[0]
    b.ref_cnt = 0  # lost without going back to the free queue
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity()


def test_reset_prefix_cache():
    pool = BlockPool(2, block_size=1, record_events=True)
    b = pool.allocate(1)[0]
    pool.cache(b, 123, (9,), NO_PARENT)
    pool.free([b])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(123, (9,)) is None
    pool.check_integrity()


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)


@pytest.mark.parametrize("seed", range(4))
def test_randomized_pool_matches_a_reference_model(seed):
    """Random allocate / cache / hit / free sequences against a plain-list model of the pool:
    the free queue order (= eviction order), ref counts and hash index agree after every
    operation, integrity holds throughout, and releasing every reference leaks nothing."""
    import random

    rng = random.Random(seed)
    n, bs = 12, 2
    pool = BlockPool(n, block_size=bs)
    queue = list(range(n))  # model of the free queue, head first
    ref = [0] * n
    cached: dict[int, int] = {}  # hash -> block id
    content: dict[int, tuple[int, ...]] = {}  # block id -> tokens of its hash
    held: list[int] = []  # one entry per reference taken
    for _ in range(600):
        op = rng.random()
        if op < 0.3:
            k = rng.randrange(0, 5)
            if k > len(queue):
                with pytest.raises(ValueError):
                    pool.allocate(k)
                continue
            got = ids(pool.allocate(k))
            want, queue = queue[:k], queue[k:]
            assert got == want
            for b in want:
                for h in [h for h, x in cached.items() if x == b]:
                    del cached[h]
                    content.pop(b)
                ref[b] = 1
            held += want
        elif op < 0.5 and held:
            b = rng.choice(held)
            toks = (rng.randrange(3), rng.randrange(3))
            h = hash_block(NO_PARENT, toks)
            ok = pool.cache(pool.blocks[b], h, toks, NO_PARENT)
            assert ok == (h not in cached and b not in content)
            if ok:
                cached[h], content[b] = b, toks
        elif op < 0.7 and cached:
            h = rng.choice(sorted(cached))
            b = cached[h]
            assert pool.lookup(h, content[b]) is pool.blocks[b]
            assert pool.lookup(h, (9, 9)) is None
            pool.touch([pool.blocks[b]])
            if ref[b] == 0:
                queue.remove(b)
            ref[b] += 1
            held.append(b)
        elif held:
            picked = rng.sample(held, rng.randrange(1, min(4, len(held)) + 1))
            pool.free([pool.blocks[b] for b in picked])
            for b in picked:
                held.remove(b)
                ref[b] -= 1
                if ref[b] == 0:
                    queue.append(b)
        pool.check_integrity()
        assert ids(pool.free_queue) == queue
        assert [b.ref_cnt for b in pool.blocks] == ref
        assert {h: b.block_id for h, b in pool.cached.items()} == cached
    pool.free([pool.blocks[b] for b in held])
    pool.check_integrity()
    assert pool.num_free_blocks == n and pool.num_used_blocks == 0


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_fifo_queue_matches_the_ordered_queue(lazy, seed):
    """The list queue of pools without caching against the ``OrderedDict`` one: the same blocks
    in the same order after every take, return and (rare) removal, past its compaction."""
    import random

    from pdserve.engine.kv_cache import Block, FifoBlockQueue, FreeBlockQueue

    rng = random.Random(seed)
    n = 3000
    made = [[None] * n if lazy else [Block(i) for i in range(n)] for _ in range(2)]
    ref, fifo = FreeBlockQueue(made[0], lazy), FifoBlockQueue(made[1], lazy)
    out: list[list[Block]] = [[], []]
    taken = 0
    for step in range(4000):
        op = rng.random()
        if op < 0.45 and len(ref):
            k = rng.randrange(1, min(len(ref), 60) + 1)
            got = [ref.take(k), fifo.take(k)]
        elif op < 0.5 and len(ref):
            got = [[ref.popleft()], [fifo.popleft()]]
        elif op < 0.95 and out[0]:
            k = rng.randrange(1, min(len(out[0]), 60) + 1)
            idx = sorted(rng.sample(range(len(out[0])), k))
            back = [[out[q][i] for i in idx] for q in (0, 1)]
            for q in (0, 1):
                for i in reversed(idx):
                    del out[q][i]
            ref.extend(back[0])
            fifo.extend(back[1])
            continue
        elif len(ref):  # a removal from the middle
            i = rng.randrange(len(ref))
            ref.remove(list(ref)[i])
            fifo.remove(list(fifo)[i])
            continue
        else:
            continue
        assert ids(got[0]) == ids(got[1])
        taken += len(got[0])
        out[0] += got[0]
        out[1] += got[1]
        if step % 97 == 0:
            assert ids(ref) == ids(fifo) and len(ref) == len(fifo)
    assert ids(ref) == ids(fifo) and len(ref) == len(fifo)
    assert taken > 2 * n  # the taken head was dropped on the way:
    assert fifo._h <= 1024 or 2 * fifo._h <= len(fifo._l)
