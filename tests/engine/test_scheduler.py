"""Scheduler: hand-computed schedules (exact batches and block ids), roles, randomized runs."""

import random

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.request import RequestStatus, SamplingParams
from tests.engine.fakes import FakeExecutor, reference_generate


def make_engine(num_blocks=16, block_size=4, budget=8, chunked=True, max_seqs=8, max_len=64,
                role="colocated", caching=True, target=None):
    cfg = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                  max_model_len=max_len, enable_chunked_prefill=chunked,
                                  role=role, prefill_token_target=target),
    )
    ex = FakeExecutor(num_blocks, block_size)
    return Engine(cfg, executor=ex), ex


def run(engine, now=0.0, check=True):
    outs = {}
    while engine.has_unfinished():
        res = engine.step(now)
        now += res.elapsed
        for o in res.outputs:
            if o.finished:
                outs[o.request_id] = o
        if check:
            engine.check_integrity()
    return outs


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_chunked_prefill_schedule_is_exact():
    eng, ex = make_engine()
    a = eng.add_request("A", list(range(1, 11)), greedy(3))
    b = eng.add_request("B", [7, 8, 9], greedy(2))
    eng.step(0.0)
    assert ex.batches[-1] == [("A", 0, 8)]  # budget 8: A's first chunk, B waits
    assert a.block_ids == [0, 1] and a.num_computed_tokens == 8
    eng.step(1.0)
    assert ex.batches[-1] == [("A", 8, 2), ("B", 0, 3)]  # A's last chunk rides with B's prompt
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    eng.step(2.0)
    assert ex.batches[-1] == [("A", 10, 1), ("B", 3, 1)]  # both decode, no new blocks needed
    assert b.status == RequestStatus.FINISHED_LENGTH and b.block_ids == []
    eng.step(3.0)
    assert ex.batches[-1] == [("A", 11, 1)]
    assert a.is_finished
    assert a.output_token_ids == reference_generate(list(range(1, 11)), 3)
    # token times are step start + executor time
    assert a.timeline.token_times == pytest.approx([1.01, 2.01, 3.01])
    assert a.timeline.prefill_start == 0.0 and a.timeline.prefill_end == pytest.approx(1.01)
    eng.check_integrity()
    assert eng.scheduler.pool.num_used_blocks == 0


def test_prefill_first_schedule_without_chunking():
    eng, ex = make_engine(budget=64, chunked=False, max_len=64)
    eng.add_request("A", list(range(1, 11)), greedy(3))
    eng.step(0.0)
    eng.add_request("B", [7, 8, 9], greedy(2))
    eng.step(1.0)  # B's whole prompt runs alone: prefill-only step (vLLM v0 priority)
    eng.step(2.0)
    eng.step(3.0)
    assert ex.batches == [[("A", 0, 10)], [("B", 0, 3)], [("A", 10, 1), ("B", 3, 1)],
                          [("A", 11, 1)]]


def test_preemption_by_recompute_is_exact():
    eng, ex = make_engine(num_blocks=4, block_size=2, budget=16)
    a = eng.add_request("A", [1, 2, 3], greedy(4))
    b = eng.add_request("B", [4, 5, 6], greedy(4))
    eng.step(0)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    eng.step(1)
    res = eng.step(2)  # A needs a third block: B (last admitted) is preempted
    assert res.batch.preempted == ["B"] and ex.batches[-1] == [("A", 4, 1)]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert a.block_ids == [0, 1, 3]  # block 3 = B's tail block, freed first and reused first
    eng.check_integrity()
    eng.step(3)  # B's first block is still cached but 3 blocks do not fit yet
    assert ex.batches[-1] == [("A", 5, 1)] and a.is_finished
    eng.step(4)  # B resumes: its first block (block 2) is a prefix hit, it recomputes the rest
    assert ex.batches[-1] == [("B", 2, 3)] and b.block_ids == [2, 3, 1]
    eng.step(5)
    assert b.is_finished and b.num_preemptions == 1
    assert b.output_token_ids == reference_generate([4, 5, 6], 4)
    assert a.output_token_ids == reference_generate([1, 2, 3], 4)
    assert eng.scheduler.pool.num_used_blocks == 0
    eng.check_integrity()


def test_prefix_cache_hit_counts():
    eng, ex = make_engine(num_blocks=32, block_size=4, budget=64)
    shared = list(range(20, 32))  # 12 tokens = 3 blocks
    eng.add_request("A", shared + [1, 2], greedy(2))
    run(eng)
    b = eng.add_request("B", shared + [3, 4, 5], greedy(2))
    eng.step(0)
    assert ex.batches[-1] == [("B", 12, 3)] and b.num_cached_tokens == 12
    outs = run(eng)
    assert outs["B"].num_cached_tokens == 12
    assert outs["B"].token_ids == reference_generate(shared + [3, 4, 5], 2)
    st = eng.stats()
    assert st.prefix_hits == 12 and st.prefix_queries == 14 + 15


def test_prefix_cache_counters_count_each_admission_once():
    """A prefix-cache query is one admission (vLLM's record_prefix_cache_stats), not every
    scheduling attempt: a request that waits for memory is not counted again each step. 5
    blocks of 4: A (12 prompt tokens, 3 + 1 blocks) runs; B (the same 8 first tokens + 9,
    a 2-block hit and 3 new blocks) does not fit until A has finished."""
    eng, ex = make_engine(num_blocks=5, block_size=4, budget=64, max_len=32)
    shared = list(range(40, 48))
    eng.add_request("A", shared + [1, 2, 3, 4], greedy(4))
    eng.add_request("B", shared + list(range(60, 69)), greedy(2))
    outs = run(eng)
    assert [b for b in ex.batches if any(r == "B" for r, _, _ in b)][0] == [("B", 8, 9)]
    assert len(ex.batches) == 6  # B waited on 3 steps (A's prefill and decodes) before it fit
    assert outs["B"].num_cached_tokens == 8
    st = eng.stats()
    assert st.prefix_queries == 12 + 17  # one query per admitted request, in prompt tokens
    assert st.prefix_hits == 8


def test_full_prompt_hit_still_computes_last_token():
    eng, ex = make_engine(block_size=4, budget=64)
    p = list(range(8))  # exactly 2 blocks
    eng.add_request("A", p, greedy(1))
    run(eng)
    eng.add_request("B", p, greedy(1))
    eng.step(0)
    assert ex.batches[-1] == [("B", 4, 4)]  # at most num_tokens - 1 cached: one block recomputed


def test_request_larger_than_pool_is_rejected():
    eng, _ = make_engine(num_blocks=2, block_size=4, max_len=64)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("A", list(range(10)), greedy(5))


def test_bad_prompts_rejected():
    eng, _ = make_engine(max_len=16)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("A", [], greedy(1))
    with pytest.raises(ValueError, match="max_model_len=16"):
        eng.add_request("A", list(range(16)), greedy(1))
    eng.add_request("A", [1], greedy(1))
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("A", [1], greedy(1))


def test_abort_everywhere_frees_blocks():
    eng, _ = make_engine(num_blocks=8, block_size=2, budget=4)
    eng.add_request("A", list(range(1, 8)), greedy(5))
    eng.add_request("B", [1, 2], greedy(5))
    eng.step(0)  # A mid-prefill (running), B waiting
    out = eng.abort("A")
    assert out.finish_reason == "abort" and out.finished
    eng.abort("B")
    assert eng.abort("nope") is None
    eng.check_integrity()
    assert eng.scheduler.pool.num_used_blocks == 0 and not eng.has_unfinished()


def test_prefill_decode_handoff_matches_colocated():
    pre, pex = make_engine(num_blocks=16, block_size=4, budget=8, chunked=False, role="prefill",
                           target=8)
    dec, dex = make_engine(num_blocks=16, block_size=4, budget=8, role="decode")
    prompts = {"A": list(range(1, 11)), "B": [5, 6, 7], "C": [9, 9, 9, 9, 9]}
    for rid, p in prompts.items():
        pre.add_request(rid, p, greedy(4))
    res = pre.step(0)
    # L_m = 8: A (10 tokens) is longer than the target and runs alone
    assert pex.batches[-1] == [("A", 0, 10)] and res.held == ["A"]
    res = pre.step(1)
    assert pex.batches[-1] == [("B", 0, 3), ("C", 0, 5)] and sorted(res.held) == ["B", "C"]
    assert pre.scheduler.pool.num_used_blocks == 3 + 1 + 2  # held blocks are the queue buffer
    for rid, p in prompts.items():
        first = pre.scheduler.held[rid].output_token_ids[0]
        dec.add_transfer_request(rid, p, [first], greedy(4))
    for rid, k in dec.reserve_pulls():
        assert k == 0  # nothing cached on the decode side yet
        dec.import_kv(pre.export_kv(rid, k))
        pre.release(rid)
    pre.check_integrity()
    assert pre.scheduler.pool.num_used_blocks == 0 and not pre.has_unfinished()
    outs = run(dec)
    for rid, p in prompts.items():
        assert outs[rid].token_ids == reference_generate(p, 4), rid
    # a later request sharing A's prompt prefix pulls only the blocks the decode side lacks
    p2 = list(range(1, 11)) + [42]
    pre.add_request("D", p2, greedy(2))
    pre.step(2)
    dec.add_transfer_request("D", p2, pre.scheduler.held["D"].output_token_ids[:1], greedy(2))
    [(rid, k)] = dec.reserve_pulls()
    assert k == 2  # blocks 0-1 (8 tokens) found in the decode instance's own prefix cache
    payload = pre.export_kv(rid, k)
    assert payload.num_blocks == 1
    dec.import_kv(payload)
    pre.release(rid)
    assert run(dec)["D"].token_ids == reference_generate(p2, 2)


def test_decode_admission_waits_for_blocks():
    dec, _ = make_engine(num_blocks=4, block_size=4, role="decode")
    dec.add_transfer_request("A", list(range(12)), [1], greedy(2))
    dec.add_transfer_request("B", list(range(8)), [1], greedy(2))
    assert [r for r, _ in dec.reserve_pulls()] == ["A"]  # B must wait: A holds 3 of 4 blocks
    assert dec.reserve_pulls() == []
    dec.abort("A")
    assert [r for r, _ in dec.reserve_pulls()] == ["B"]
    dec.check_integrity()


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_runs_never_leak(chunked, seed):
    rng = random.Random(seed)
    bs = 4
    eng, _ = make_engine(num_blocks=12, block_size=bs, budget=64 if not chunked else 12,
                         chunked=chunked, max_len=64, max_seqs=6)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    expected, aborted, done = {}, set(), {}
    now, n = 0.0, 0
    for _ in range(400):
        if n < 40 and rng.random() < 0.3:
            p = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            m = rng.randrange(1, 12)
            rid = f"r{n}"
            eng.add_request(rid, p, greedy(m), now=now)
            expected[rid] = reference_generate(p, m)
            n += 1
        if expected and rng.random() < 0.05:
            victim = rng.choice(sorted(expected))
            if victim not in done and eng.abort(victim, now) is not None:
                aborted.add(victim)
        res = eng.step(now)
        now += res.elapsed + 0.001
        for o in res.outputs:
            if o.finished:
                done[o.request_id] = o
        eng.check_integrity()
    done.update(run(eng, now))
    assert eng.scheduler.pool.num_used_blocks == 0
    assert eng.scheduler.num_preemptions > 0  # the pool is small enough to force preemption
    for rid, toks in expected.items():
        if rid in aborted:
            continue
        assert done[rid].token_ids == toks, rid
        assert done[rid].finish_reason == "length"


def test_resume_with_generated_tokens_continues_identically():
    """A request moved to another instance after generating tokens recomputes them (no
    re-sampling) and continues exactly as if it had never moved."""
    full = reference_generate([3, 1, 4, 1, 5], 6)
    eng, ex = make_engine()
    r = eng.add_request("A", [3, 1, 4, 1, 5], greedy(6), output_token_ids=full[:2])
    eng.step(0)
    assert ex.batches[-1] == [("A", 0, 7)]  # prompt + 2 earlier outputs recomputed in one chunk
    assert run(eng)["A"].token_ids == full and r.num_output_tokens == 6


def test_handoff_after_several_tokens():
    """A prefill instance that resumes a request holds it after one more token; the decode
    side pulls the KV of every computed token (prompt + earlier outputs)."""
    full = reference_generate(list(range(1, 8)), 5)
    pre, _ = make_engine(role="prefill", chunked=False)
    dec, _ = make_engine(role="decode")
    pre.add_request("A", list(range(1, 8)), greedy(5), output_token_ids=full[:2])
    assert pre.step(0).held == ["A"]
    held = pre.scheduler.held["A"]
    assert held.output_token_ids == full[:3]
    dec.add_transfer_request("A", list(range(1, 8)), held.output_token_ids, greedy(5))
    [(rid, k)] = dec.reserve_pulls()
    payload = pre.export_kv(rid, k)
    assert payload.num_blocks == 3  # 9 computed tokens in blocks of 4
    dec.import_kv(payload)
    pre.release(rid)
    assert run(dec)["A"].token_ids == full


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_instance_under_memory_pressure_finishes_everything(seed):
    """Imported requests are running (preemptable) at once, and no pull is admitted while a
    preempted request waits: a decode instance whose pool is far too small for its load
    preempts and recomputes, but never stalls with every block held by unscheduled requests."""
    rng = random.Random(seed)
    bs = 4
    pre, _ = make_engine(num_blocks=256, block_size=bs, budget=64, chunked=False,
                         role="prefill", max_len=64)
    dec, _ = make_engine(num_blocks=10, block_size=bs, budget=16, role="decode", max_len=64)
    prompts = {f"r{i}": [rng.randrange(1, 50) for _ in range(rng.randrange(5, 14))]
               for i in range(10)}
    lens = {rid: rng.randrange(8, 20) for rid in prompts}
    for rid, p in prompts.items():
        pre.add_request(rid, p, greedy(lens[rid]))
    while pre.has_work():
        pre.step(0)
    for rid, p in prompts.items():
        dec.add_transfer_request(rid, p, pre.scheduler.held[rid].output_token_ids[:1],
                                 greedy(lens[rid]))
    outs, now, idle = {}, 0.0, 0
    for _ in range(2000):
        for rid, k in dec.reserve_pulls(now):
            dec.import_kv(pre.export_kv(rid, k), now)
            pre.release(rid)
        if not dec.has_unfinished():
            break
        res = dec.step(now)
        idle = idle + 1 if not res.batch.seqs else 0  # a step may only preempt; not two
        assert idle < 2, "decode instance stalled with unfinished requests"
        now += res.elapsed
        outs.update({o.request_id: o for o in res.outputs if o.finished})
        dec.check_integrity()
    assert dec.scheduler.num_preemptions > 0  # the pool is small enough to force preemption
    assert sorted(outs) == sorted(prompts)
    for rid, p in prompts.items():
        assert outs[rid].token_ids == reference_generate(p, lens[rid]), rid
    assert dec.scheduler.pool.num_used_blocks == 0 and pre.scheduler.pool.num_used_blocks == 0


@pytest.mark.parametrize("discard", [False, True])
def test_abort_discarding_pulled_kv_keeps_it_out_of_the_prefix_cache(discard):
    """A client going away while its KV moved here (``Abort(discard_kv=True)``): the blocks it
    pulled were maybe read after the source freed them, so they must not serve a later prefix
    hit; the decode side's own earlier hit stays trusted. A plain abort keeps them cached."""
    pre, _ = make_engine(num_blocks=16, block_size=4, budget=16, chunked=False, role="prefill")
    dec, _ = make_engine(num_blocks=16, block_size=4, budget=16, role="decode")
    base = list(range(1, 9))  # 2 blocks, cached on the decode side by request A
    for rid, prompt in (("A", base + [40]), ("B", base + list(range(50, 58)) + [60])):
        pre.add_request(rid, prompt, greedy(3))
        pre.step(0)
        dec.add_transfer_request(rid, prompt, pre.scheduler.held[rid].output_token_ids[:1],
                                 greedy(3))
        [(_, k)] = dec.reserve_pulls()
        dec.import_kv(pre.export_kv(rid, k))
        pre.release(rid)
        if rid == "A":
            run(dec)
    assert k == 2  # B pulled blocks 2-3 only
    dec.abort("B", 1.0, discard_kv=discard)
    dec.check_integrity()
    dec.add_transfer_request("C", base + list(range(50, 58)) + [61], [7], greedy(1))
    [(_, k)] = dec.reserve_pulls()
    assert k == (2 if discard else 4)  # blocks found in the decode side's own prefix cache
