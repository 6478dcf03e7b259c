"""Sampler: greedy, filter supports, seeded reproducibility, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.model.sampler import Sampler, SampleRow, process_logits, request_seed
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


# --------------------------------------------------------------- logit processing
def _rows(params: SamplingParams, prompt: list[list[int]], output: list[list[int]]):
    return [SampleRow(params, len(o), (), p, o) for p, o in zip(prompt, output)]


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=g) * 3
    prompts = [[1, 2, 3, 3], [39, 0], [5]]
    outputs = [[7, 2], [], [5, 5, 6]]
    for penalty in (1.3, 0.7):
        params = SamplingParams(repetition_penalty=penalty)
        ours = process_logits(logits.clone(), _rows(params, prompts, outputs))
        ref = torch.stack([
            RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([p + o]), logits[i:i + 1])[0]
            for i, (p, o) in enumerate(zip(prompts, outputs))])
        torch.testing.assert_close(ours, ref)
        assert not torch.equal(ours, logits)


def test_logit_bias_matches_transformers_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor

    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    bias = {3: 5.0, 17: -100.0, 29: 0.5}
    ours = process_logits(logits.clone(), _rows(SamplingParams(logit_bias=bias), [[1]] * 2,
                                                [[], [2]]))
    proc = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    ref = proc(torch.tensor([[1, 5], [1, 2]]), logits.clone())  # one-token sequences: any input
    torch.testing.assert_close(ours, ref)
    # by hand
    want = logits.clone()
    want[:, 3] += 5.0
    want[:, 17] -= 100.0
    want[:, 29] += 0.5
    torch.testing.assert_close(ours, want)


def test_frequency_and_presence_penalties_by_hand():
    logits = torch.zeros(1, 6)
    logits[0] = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5, 0.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    # output: token 1 twice, token 3 once; prompt tokens (4) are not penalised
    out = process_logits(logits.clone(), _rows(params, [[4, 4]], [[1, 3, 1]]))
    assert out[0].tolist() == [1.0, 2.0 - 2 * 0.5 - 1.0, 3.0, -1.0 - 0.5 - 1.0, 0.5, 0.0]


def test_penalties_steer_greedy_choice(sampler):
    logits = torch.tensor([[0.0, 5.0, 4.9, 0.0]])
    row = SampleRow(SamplingParams(temperature=0.0, presence_penalty=0.5), 1, (), [0], [1])
    assert sampler(logits, [row]).token_ids == [2]
    row = SampleRow(SamplingParams(temperature=0.0), 1, (), [0], [1])
    assert sampler(logits, [row]).token_ids == [1]
    # logprobs stay those of the raw logits
    row = SampleRow(SamplingParams(temperature=0.0, logit_bias={3: 100}, logprobs=0), 0)
    out = sampler(logits, [row])
    assert out.token_ids == [3]
    assert out.logprobs[0][3] == pytest.approx(torch.log_softmax(logits, -1)[0, 3].item())


def test_allowed_mask_restricts_sampling(sampler):
    import numpy as np

    words = np.zeros(2, dtype=np.int32)
    words.view(np.uint8)[4] = 0b00000101  # tokens 32 and 34
    logits = torch.randn(200, 40, generator=torch.Generator().manual_seed(5))
    rows = [SampleRow(SamplingParams(temperature=1.0), 0, allowed=words)] * 200
    assert set(sampler(logits, rows).token_ids) == {32, 34}


@pytest.mark.parametrize(("kw", "msg"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
    ({"logit_bias": {"5": 101}}, "values must be in [-100, 100]"),
    ({"logit_bias": {"x": 1}}, "keys must be non-negative token ids"),
    ({"logprobs": 21}, "logprobs must be <= 20"),
    ({"temperature": float("inf")}, "temperature"),
])
def test_processing_params_are_validated(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kw)
    assert SamplingParams(logit_bias={"5": -3}).logit_bias == {5: -3.0}
