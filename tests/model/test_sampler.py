"""Sampler: greedy, filter supports, seeded reproducibility, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.model.sampler import Sampler, SampleRow, request_seed
from pdserve.request import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs, n: int = 1, vocab: int | None = None) -> torch.Tensor:
    row = torch.full((vocab or len(probs),), -math.inf)
    row[: len(probs)] = torch.tensor(probs).log()
    return row.repeat(n, 1)


def support(sampler: Sampler, n: int = 4000, **kw) -> dict[int, int]:
    p = SamplingParams(**kw)
    out = sampler(logits_of(PROBS, n), [SampleRow(p, 0)] * n).token_ids
    return {t: out.count(t) for t in sorted(set(out))}


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(torch.Generator().manual_seed(0))


def test_greedy_is_argmax(sampler):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = sampler(logits, [SampleRow(SamplingParams(temperature=0.0), 0)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs is None


def test_filter_supports(sampler):
    assert set(support(sampler)) == {0, 1, 2, 3}
    assert set(support(sampler, top_p=0.8)) == {0, 1}  # mass before token 2 is 0.8: dropped
    assert set(support(sampler, top_p=0.81)) == {0, 1, 2}
    assert set(support(sampler, top_p=0.5)) == {0}
    assert set(support(sampler, top_k=3)) == {0, 1, 2}
    assert set(support(sampler, top_k=1, temperature=5.0)) == {0}
    assert set(support(sampler, min_p=0.2)) == {0, 1, 2}  # threshold 0.1
    assert set(support(sampler, min_p=0.7)) == {0}  # threshold 0.35
    # top-k renormalises before top-p: the mass before token 2 becomes 0.8 / 0.95 = 0.842
    assert set(support(sampler, top_p=0.84)) == {0, 1, 2}
    assert set(support(sampler, top_k=3, top_p=0.84)) == {0, 1}
    assert set(support(sampler, top_k=-1, top_p=1.0, min_p=0.0)) == {0, 1, 2, 3}


def test_frequencies_follow_the_distribution(sampler):
    counts = support(sampler, n=20000)
    for t, p in enumerate(PROBS):
        assert abs(counts[t] / 20000 - p) < 0.015
    counts = support(sampler, n=20000, temperature=2.0)  # flatter: p ** 0.5, renormalised
    flat = [p**0.5 for p in PROBS]
    for t, p in enumerate(flat):
        assert abs(counts[t] / 20000 - p / sum(flat)) < 0.015


def test_mixed_rows_get_their_own_filters(sampler):
    rows = [SampleRow(SamplingParams(top_k=1), 0), SampleRow(SamplingParams(temperature=0), 0),
            SampleRow(SamplingParams(min_p=0.2), 0)] * 500
    out = sampler(logits_of(PROBS, len(rows)), rows).token_ids
    assert set(out[0::3]) == {0} and set(out[1::3]) == {0} and set(out[2::3]) == {0, 1, 2}


def test_seed_reproducible_regardless_of_batch():
    vocab = 64
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(seed=1234, temperature=1.0)
    alone = [Sampler(torch.Generator().manual_seed(0))(logits[i : i + 1], [SampleRow(seeded, i)])
             .token_ids[0] for i in range(8)]
    # the same rows inside batches with other (seeded and unseeded) requests, another generator
    other = SamplingParams(temperature=0.7, top_p=0.9)
    rows, sub = [], []
    for i in range(8):
        rows += [SampleRow(other, 0), SampleRow(seeded, i), SampleRow(SamplingParams(seed=9), i)]
        sub += [logits[(i + 3) % 8], logits[i], logits[i]]
    out = Sampler(torch.Generator().manual_seed(99))(torch.stack(sub), rows).token_ids
    assert out[1::3] == alone
    assert len(set(alone)) > 1
    # the draw depends on the output index
    assert request_seed(1234, 0) != request_seed(1234, 1)


def test_unseeded_follows_the_executor_generator():
    logits = torch.zeros(20, 100)
    rows = [SampleRow(SamplingParams(), 0)] * 20
    a = Sampler(torch.Generator().manual_seed(5))(logits, rows).token_ids
    b = Sampler(torch.Generator().manual_seed(5))(logits, rows).token_ids
    c = Sampler(torch.Generator().manual_seed(6))(logits, rows).token_ids
    assert a == b and a != c


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids(sampler, temperature):
    logits = logits_of([0.01, 0.01, 0.9, 0.03, 0.05], 3)  # EOS = 2 dominates
    p = SamplingParams(temperature=temperature, min_tokens=2, top_k=1, stop_token_ids=[4])
    rows = [SampleRow(p, 0, (2, 4)), SampleRow(p, 1, (2, 4)), SampleRow(p, 2)]
    assert sampler(logits, rows).token_ids == [3, 3, 2]


def test_logprobs_are_raw_log_softmax(sampler):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 3
    rows = [SampleRow(SamplingParams(temperature=0.5, top_k=5, logprobs=3), 0),
            SampleRow(SamplingParams(temperature=0.0), 0),
            SampleRow(SamplingParams(temperature=0.0, logprobs=0), 0)]
    out = sampler(logits, rows)
    ref = torch.log_softmax(logits, -1)
    lp0 = out.logprobs[0]
    top3 = ref[0].topk(3).indices.tolist()
    assert set(lp0) == set(top3) | {out.token_ids[0]}
    for t, v in lp0.items():
        assert v == pytest.approx(ref[0, t].item(), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2] == {out.token_ids[2]: pytest.approx(ref[2].max().item(), abs=1e-6)}
