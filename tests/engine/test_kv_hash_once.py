"""Hashing a prompt once: the chain a :class:`Prompt` carries is the engine's, and the engine
takes it instead of hashing the prompt again."""

import pickle

import pytest

import pdserve.engine.kv_manager as kv_manager
from pdserve.request import NO_PARENT, Prompt, block_hashes, hash_block, hash_blocks
from tests.engine.test_scheduler import greedy, make_engine, run


def chain(tokens, bs):
    """Reference: the engine's chained hash, block by block."""
    out, parent = [], NO_PARENT
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]))
        out.append(parent)
    return out


def test_hash_blocks_is_the_chain_and_extends_in_place():
    toks = list(range(100, 123))  # 5 full blocks of 4 and a partial one
    assert hash_blocks(toks, 4) == chain(toks, 4) and len(chain(toks, 4)) == 5
    part = hash_blocks(toks[:9], 4)
    assert len(part) == 2
    same = hash_blocks(toks, 4, part)
    assert same is part and part == chain(toks, 4)
    assert hash_blocks(tuple(toks), 4) == chain(toks, 4)
    assert hash_blocks([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(toks, 0)


def test_prompt_keeps_its_chain():
    p = Prompt(range(10))
    assert p == list(range(10)) and isinstance(p, list)
    h = p.block_hashes(2)
    assert h == chain(list(range(10)), 2) and p.block_hashes(2) is h  # computed once
    assert p.block_hashes(3) == chain(list(range(10)), 3)  # another size: computed, not kept
    assert p.block_hashes(2) is h
    assert block_hashes(p, 2) is h and block_hashes(list(p), 2) == h
    q = pickle.loads(pickle.dumps(p))
    assert q == p and type(q) is Prompt and q.block_hashes(2) == h


def spy(monkeypatch):
    """Count the blocks the engine's KV manager hashes itself."""
    hashed = []

    def counting(token_ids, block_size, hashes=None):
        before = len(hashes) if hashes else 0
        out = hash_blocks(token_ids, block_size, hashes)
        hashed.append(len(out) - before)
        return out

    monkeypatch.setattr(kv_manager, "hash_blocks", counting)
    return hashed


@pytest.mark.parametrize("as_prompt", [False, True])
def test_engine_takes_the_prompts_chain(monkeypatch, as_prompt):
    """Same prefix hits either way; with a Prompt whose chain was made (by the router) the
    engine hashes only the blocks its outputs fill."""
    hashed = spy(monkeypatch)
    eng, _ = make_engine(num_blocks=32, block_size=4, budget=64)
    shared = list(range(1, 13))
    prompts = [shared + [20, 21, 22, 23, 24], shared + [30, 31, 32, 33, 34]]
    if as_prompt:
        prompts = [Prompt(p) for p in prompts]
        for p in prompts:
            p.block_hashes(4)
    eng.add_request("A", prompts[0], greedy(8))
    outs = run(eng)
    eng.add_request("B", prompts[1], greedy(8))
    outs.update(run(eng))
    assert outs["B"].num_cached_tokens == 12  # the shared three blocks
    # each request: 4 full prompt blocks; 17 + 8 - 1 = 24 computed tokens fill 2 more
    assert sum(hashed) == (2 * 2 if as_prompt else 2 * (4 + 2))
