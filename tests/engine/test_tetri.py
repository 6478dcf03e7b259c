"""TetriInfer's instance-local policies: fixed-size prefill chunks with padding (§3.3.3), SJF/LJF
within scheduling batches (§3.3.1), decode admission greedy / reserve-static / reserve-dynamic
(§3.4), role change in place (§3.5) — each against a hand-worked schedule."""

from collections import deque

import pytest

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.prefill_order import LongestJobFirst, ShortestJobFirst
from pdserve.predict import LengthPrediction
from pdserve.request import Request, SamplingParams
from tests.engine.fakes import FakeExecutor, reference_generate


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def prefill_engine(chunk=8, policy="fcfs", sched_batch=16, num_blocks=32, block_size=4):
    cfg = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=64, enable_chunked_prefill=False,
                                  role="prefill", prefill_chunk_size=chunk, policy=policy,
                                  prefill_sched_batch=sched_batch))
    ex = FakeExecutor(num_blocks, block_size)
    return Engine(cfg, executor=ex), ex


def steps(eng, ex):
    """Run to the end; the (batch, padding) of every step."""
    out = []
    while eng.has_work():
        res = eng.step(0.0)
        out.append((ex.batches[-1], res.batch.num_pad_tokens))
        eng.check_integrity()
    return out


# ------------------------------------------------------------------ chunked prefill (§3.3.3)
def test_prompts_are_sliced_merged_and_the_last_chunk_padded():
    """ChunkSize 8, prompts A=5, B=7, C=2 in arrival order:
    chunk 1: A[0:5] B[0:3]          = 8 tokens
    chunk 2: B[3:7] C[0:2]          = 6 tokens + 2 padding"""
    eng, ex = prefill_engine(chunk=8)
    for rid, n in (("A", 5), ("B", 7), ("C", 2)):
        eng.add_request(rid, list(range(1, n + 1)), greedy(4))
    assert steps(eng, ex) == [([("A", 0, 5), ("B", 0, 3)], 0),
                              ([("B", 3, 4), ("C", 0, 2)], 2)]
    held = eng.scheduler.held
    assert sorted(held) == ["A", "B", "C"]  # prefill-only: each stops after its first token
    assert held["B"].output_token_ids == reference_generate(list(range(1, 8)), 1)


def test_a_long_prompt_spans_chunks_exactly():
    """ChunkSize 4, one prompt of 10: 4 + 4 + 2 (+ 2 padding)."""
    eng, ex = prefill_engine(chunk=4)
    eng.add_request("L", list(range(1, 11)), greedy(2))
    assert steps(eng, ex) == [([("L", 0, 4)], 0), ([("L", 4, 4)], 0), ([("L", 8, 2)], 2)]


def test_padding_is_priced_as_a_prefill_entry():
    eng, _ = prefill_engine(chunk=8)
    eng.add_request("A", [1, 2, 3], greedy(2))
    batch = eng.scheduler.schedule(0.0)
    assert batch.num_pad_tokens == 5
    assert batch.shape() == ([(0, 3), (0, 5)], [])


def test_chunk_size_only_applies_to_prefill_instances():
    cfg = SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=4)
    eng = Engine(EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=16),
                              scheduler=cfg), executor=FakeExecutor(16, 4))
    eng.add_request("A", list(range(1, 11)), greedy(2))
    batch = eng.scheduler.schedule(0.0)
    assert batch.num_batched_tokens == 10 and batch.num_pad_tokens == 0


# ------------------------------------------------------------------ SJF / LJF (§3.3.1)
def req(rid, n):
    return Request(rid, list(range(n)), greedy(1))


def order(policy, waiting):
    policy.arrange(waiting, lambda r: 0)
    return [r.request_id for r in waiting]


def test_sjf_and_ljf_sort_within_batches_of_sched_batch():
    """PrefillSchedBatch 4, prompt lengths in arrival order 9 5 1 7 | 3 8:
    SJF 1 5 7 9 | 3 8, LJF 9 7 5 1 | 8 3 — the second group never overtakes the first."""
    lens = {"a": 9, "b": 5, "c": 1, "d": 7, "e": 3, "f": 8}
    assert order(ShortestJobFirst(4), deque(req(r, n) for r, n in lens.items())) == \
        ["c", "b", "d", "a", "e", "f"]
    assert order(LongestJobFirst(4), deque(req(r, n) for r, n in lens.items())) == \
        ["a", "d", "b", "c", "f", "e"]


def test_groups_are_fixed_once_formed_so_late_short_requests_do_not_starve_others():
    """A group formed from the requests waiting then keeps its place: a later, shorter
    arrival joins a new group behind it."""
    pol = ShortestJobFirst(2)
    waiting = deque([req("a", 9), req("b", 5)])
    assert order(pol, waiting) == ["b", "a"]
    waiting.popleft()  # b admitted
    waiting.append(req("c", 1))
    waiting.append(req("d", 2))
    assert order(pol, waiting) == ["a", "c", "d"]  # c is shortest but a's group came first
    pre = req("p", 50)
    pre.num_preemptions = 1
    waiting.appendleft(pre)
    assert order(pol, waiting)[0] == "p"  # resumed requests stay first


def test_sjf_with_chunks_end_to_end():
    """SJF, batch 16, ChunkSize 8, prompts A=5, B=7, C=2 -> order C A B:
    chunk 1: C[0:2] A[0:5] B[0:1];  chunk 2: B[1:7] + 2 padding."""
    eng, ex = prefill_engine(chunk=8, policy="sjf")
    for rid, n in (("A", 5), ("B", 7), ("C", 2)):
        eng.add_request(rid, list(range(1, n + 1)), greedy(4))
    assert steps(eng, ex) == [([("C", 0, 2), ("A", 0, 5), ("B", 0, 1)], 0),
                              ([("B", 1, 6)], 2)]


def test_sched_batch_comes_from_the_config():
    eng, _ = prefill_engine(policy="ljf", sched_batch=3)
    assert isinstance(eng.scheduler.policy, LongestJobFirst)
    assert eng.scheduler.policy.sched_batch == 3


# ------------------------------------------------------------------ admission (§3.4)
def decode_engine(admission, num_blocks=10, block_size=4):
    cfg = EngineConfig(cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                         enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_model_len=64, role="decode",
                                                 admission=admission))
    return Engine(cfg, executor=FakeExecutor(num_blocks, block_size))


def transfer(eng, rid, prompt_len, predicted_lo, max_tokens=25):
    pred = LengthPrediction(predicted_lo // 2, 2) if predicted_lo is not None else None
    eng.add_transfer_request(rid, list(range(1, prompt_len + 1)), [99], greedy(max_tokens),
                             predicted=pred)


def admitted(eng):
    got = [rid for rid, _ in eng.reserve_pulls(0.0)]
    for rid in got:
        eng.scheduler.complete_pull(rid, 0.0)
    eng.check_integrity()
    return got


@pytest.mark.parametrize("admission, r1_lo, expect", [
    # 10 blocks of 4. R1: prompt 7 + 1 token = 8 tokens (2 blocks). R2: 15 + 1 = 16 (4 blocks),
    # predicted output >= 20 -> 35 tokens, 9 blocks at the end; 8 blocks free after R1.
    ("greedy", 12, ["R2"]),  # 4 blocks + 1 watermark <= 8 free
    ("reserve-static", 12, []),  # R2 alone needs 9 blocks at the end > 8 free
    ("reserve-static", 2, []),
    # R1 predicted total 7 + 12 = 19 tokens -> 11 to go; m = 11: R1 grows to 19 tokens
    # (5 blocks, +3), R2 to 27 (7 blocks, +3): 4 + 3 + 3 = 10 > 8 free
    ("reserve-dynamic", 12, []),
    # R1 predicted total 7 + 2 = 9 -> 1 to go; m = 1: R1 -> 9 tokens (3 blocks, +1),
    # R2 -> 17 tokens (5 blocks, +1): 4 + 1 + 1 = 6 <= 8 free
    ("reserve-dynamic", 2, ["R2"]),
])
def test_admission_hand_worked(admission, r1_lo, expect):
    eng = decode_engine(admission)
    transfer(eng, "R1", 7, r1_lo)
    assert admitted(eng) == ["R1"]  # R1 alone: 2 + its growth fits 10 blocks for everyone
    assert eng.scheduler.pool.num_free_blocks == 8
    transfer(eng, "R2", 15, 20)
    assert admitted(eng) == expect


def test_reserve_static_admits_when_predicted_usage_fits():
    """R: prompt 7 (+1), predicted output >= 12: 19 tokens = 5 blocks <= 10 free."""
    eng = decode_engine("reserve-static")
    transfer(eng, "R", 7, 12)
    assert admitted(eng) == ["R"]
    transfer(eng, "S", 7, 28, max_tokens=33)  # 35 tokens = 9 blocks at the end, 8 free
    assert admitted(eng) == []


def test_without_a_prediction_admission_expects_max_tokens():
    """No prediction: the request runs to max_tokens."""
    eng = decode_engine("reserve-static")
    transfer(eng, "A", 3, None, max_tokens=2)
    assert admitted(eng) == ["A"]  # 3 + 1 tokens: 1 block held, 9 free
    transfer(eng, "B", 3, None, max_tokens=34)
    assert admitted(eng) == []  # 3 + 34 = 37 tokens: 10 blocks > 9 free
    eng2 = decode_engine("reserve-static")
    transfer(eng2, "A", 3, None, max_tokens=2)
    transfer(eng2, "B", 3, None, max_tokens=33)
    assert admitted(eng2) == ["A", "B"]  # 36 tokens: 9 blocks <= 9 free


# ------------------------------------------------------------------ role change (§3.5)
def test_reconfigure_changes_role_in_place_only_when_empty():
    eng, ex = prefill_engine(chunk=8)
    eng.add_request("A", [1, 2, 3], greedy(2))
    dec = SchedulerConfig(max_model_len=64, role="decode")
    with pytest.raises(ValueError, match="drain it first"):
        eng.scheduler.reconfigure(dec)
    steps(eng, ex)
    eng.release("A")
    pool = eng.scheduler.pool
    eng.scheduler.reconfigure(dec)
    assert eng.scheduler.role == "decode" and eng.scheduler.chunk_size is None
    assert eng.scheduler.pool is pool and pool.num_free_blocks == pool.num_blocks


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kw, msg", [
    ({"policy": "shortest"}, "unknown scheduling policy 'shortest'"),
    ({"admission": "reserve"}, "unknown admission policy 'reserve'"),
    ({"prefill_chunk_size": 0}, "prefill_chunk_size must be >= 1"),
    ({"prefill_sched_batch": 0}, "prefill_sched_batch must be >= 1"),
])
def test_bad_scheduler_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SchedulerConfig(**kw)


def test_bad_settings_through_the_deployment_spec():
    with pytest.raises(ValueError, match="unknown admission policy"):
        ClusterConfig.from_dict({"strategy": "disaggregated", "admission": "lazy"})
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        ClusterConfig.from_dict({"roles": [{"role": "prefill", "engine": {"policy": "x"}},
                                           {"role": "decode"}]}).instance_specs()


def test_reserve_dynamic_grows_everyone_only_until_the_shortest_job_ends():
    """12 blocks of 4. R1: 3 + 1 tokens, predicted >= 2 (1 to go); R2: 3 + 1, predicted >= 24
    (23 to go); both admitted (1 block each, 10 free). R3: 15 + 1 tokens (4 blocks), predicted
    >= 20. Shortest remaining m = 1: R1 and R2 grow to 5 tokens (+1 block each), R3 to 17
    (+1 block): 4 + 1 + 1 + 1 = 7 <= 10 -> admitted. (Growing R2 by all its 23 tokens would
    take 6 blocks: 12 > 10.)"""
    eng = decode_engine("reserve-dynamic", num_blocks=12)
    transfer(eng, "R1", 3, 2)
    transfer(eng, "R2", 3, 24)
    assert admitted(eng) == ["R1", "R2"]
    assert eng.scheduler.pool.num_free_blocks == 10
    transfer(eng, "R3", 15, 20)
    assert admitted(eng) == ["R3"]


def test_chunk_size_is_where_prefill_throughput_saturates():
    """Step time 0.1 + 0.001·L s: throughput L / (0.1 + 0.001 L) peaks at 4096 (976 tok/s);
    90 % of it is 879: 512 gives 837, 1024 gives 911 -> ChunkSize 1024."""
    from pdserve.sim.profiler import saturation_chunk_size

    class Lin:
        def prefill_time(self, lens):
            return 0.1 + 0.001 * sum(lens)

    chunk, curve = saturation_chunk_size(Lin())
    assert chunk == 1024
    assert [n for n, _ in curve] == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def test_reserve_dynamic_counts_at_least_one_more_token_per_running_request():
    """3 blocks of 4; every request 3 + 1 tokens (1 block), predicted output in [0, 2), so
    expected to be done already — but a running request makes at least one more token.
    R2: its block + R1 growing to 5 tokens (+1 block) = 2 <= 2 free -> admitted.
    R3: its block + R1 and R2 growing (+1 each) = 3 > 1 free -> waits."""
    eng = decode_engine("reserve-dynamic", num_blocks=3)
    transfer(eng, "R1", 3, 0, max_tokens=4)
    assert admitted(eng) == ["R1"]
    transfer(eng, "R2", 3, 0, max_tokens=4)
    transfer(eng, "R3", 3, 0, max_tokens=4)
    assert admitted(eng) == ["R2"]
