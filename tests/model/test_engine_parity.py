"""Parity with transformers through the real Engine (scheduler + block pool + executor).

For each architecture, 16 prompts (1 to 300 tokens; half of them share long prefixes) arrive in
waves and are served greedily under four configurations: chunked prefill on (small token
budget) and off, each with an ample KV pool (prefix-cache hits must happen) and with a scarce
one (preemption by recompute must happen). Every request's tokens must equal transformers'
``generate`` on the same weights, and the float32 logits that chose each token must be within
1e-4 relative error of the reference's.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.batch import ExecuteResult, ScheduledBatch
from pdserve.engine.engine import Engine
from pdserve.engine.model_executor import ModelExecutor
from pdserve.request import SamplingParams
from tests.model.conftest import ARCHS
from tests.model.helpers import NEW_TOKENS, hf_reference, make_prompts, rel_err

TOL = 1e-4
BLOCK = 16
MAX_LEN = 320
MIXED_LENS = (1, 5, 16, 17, 40, 97, 150, 230, 300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def shared_prefix_prompts(vocab: int = 512) -> list[list[int]]:
    """Seven prompts over one 200-token trunk: suffixes, an exact duplicate, a prompt that is a
    prefix of another, a fork in mid-block and one ending exactly on a block boundary."""
    g = torch.Generator().manual_seed(11)
    trunk = torch.randint(4, vocab, (200,), generator=g).tolist()

    def tail(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=g).tolist()

    first = trunk + tail(9)
    return [first, trunk[:120] + tail(30), list(first), trunk[:150], trunk + tail(40),
            trunk[:37] + tail(3), trunk[:160]]


PROMPTS = make_prompts(MIXED_LENS, seed=4) + shared_prefix_prompts()
SHARED = range(len(MIXED_LENS), len(PROMPTS))


class RecordingExecutor(ModelExecutor):
    """Keeps, per request, the float32 logits of every row it sampled."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.capture_logits = True
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        res = super().execute(batch)
        rows = [s.request_id for s in batch.seqs if s.sample]
        assert len(rows) == len(res.sampled)
        if rows:
            assert self.last_logits is not None
            for rid, row in zip(rows, self.last_logits):
                self.logits[rid].append(row.clone())
        return res


@pytest.fixture(scope="module")
def refs(hf_models):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = hf_reference(hf_models(arch), PROMPTS)
        return cache[arch]

    return get


def serve(model_dir: str, chunked: bool, num_blocks: int, seed: int = 0):
    """Serve PROMPTS in seeded waves; check integrity after every step."""
    cfg = EngineConfig(
        model=model_dir,
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64 if chunked else MAX_LEN,
                                  max_num_seqs=6, max_model_len=MAX_LEN,
                                  enable_chunked_prefill=chunked),
    )
    ex = RecordingExecutor(cfg)
    engine = Engine(cfg, executor=ex)
    rng = random.Random(seed)
    order = list(range(len(PROMPTS)))
    rng.shuffle(order)
    order.remove(SHARED[0])
    order.insert(0, SHARED[0])  # the trunk's first user arrives first
    outs, kinds, now, wave = {}, set(), 0.0, 2
    while order or engine.has_unfinished():
        for _ in range(min(len(order), wave)):
            i = order.pop(0)
            engine.add_request(f"p{i}", PROMPTS[i], GREEDY, now=now)
        wave = rng.randrange(0, 4)
        res = engine.step(now)
        now += res.elapsed
        if not res.batch.empty:
            kinds.add(res.batch.kind)
        engine.check_integrity()
        for o in res.outputs:
            if o.finished:
                outs[o.request_id] = o
    assert engine.scheduler.pool.num_used_blocks == 0
    return engine, ex, outs, kinds


def check_against(ex: RecordingExecutor, outs, refs) -> None:
    assert len(outs) == len(PROMPTS)
    for i, ref in enumerate(refs):
        rid = f"p{i}"
        assert outs[rid].token_ids == ref.tokens, f"{rid} ({len(PROMPTS[i])} prompt tokens)"
        got = ex.logits[rid]
        assert len(got) == NEW_TOKENS
        for j, row in enumerate(got):
            err = rel_err(row, ref.logits[j])
            assert err <= TOL, f"{rid} token {j}: relative logit error {err:.2e}"


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_parity_with_prefix_hits(arch, chunked, tiny_dirs, refs):
    engine, ex, outs, kinds = serve(tiny_dirs[arch], chunked, num_blocks=256)
    check_against(ex, outs, refs(arch))
    cached = {i: outs[f"p{i}"].num_cached_tokens for i in SHARED}
    assert sum(cached.values()) > 0, cached
    assert all(c % BLOCK == 0 for c in cached.values())
    assert engine.stats().prefix_hits > 0
    assert engine.stats().num_preemptions == 0
    if chunked:
        assert "mixed" in kinds


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_parity_under_preemption(arch, chunked, tiny_dirs, refs):
    # 24 blocks of 16 = 384 slots: the longest request (308 tokens) fits, six at once do not
    engine, ex, outs, _ = serve(tiny_dirs[arch], chunked, num_blocks=24, seed=1)
    assert engine.stats().num_preemptions > 0
    check_against(ex, outs, refs(arch))
