"""Length predictors (TetriInfer §3.3.2): buckets, the baselines and the classifier trained and
evaluated on small fixed data sets, the oracle's accuracy, files, bad input."""

import json

import numpy as np
import pytest

from pdserve.config import ClusterConfig, PredictorConfig
from pdserve.predict import (
    LengthPrediction,
    Oracle,
    PromptLength,
    SoftmaxClassifier,
    bucket_of,
    make_predictor,
)
from pdserve.predict.data import Pairs, fit_predictor, load_pairs
from pdserve.predict.train import evaluate, split


def test_buckets():
    assert [bucket_of(n, 200) for n in (0, 199, 200, 401)] == [0, 0, 1, 2]
    assert bucket_of(5000, 200, num_buckets=10) == 9  # the last bucket takes the tail
    p = LengthPrediction(2, 100)
    assert (p.lo, p.hi, p.mid) == (200, 300, 250.0)


def test_prompt_length_baseline_hand_worked():
    """g = 200. Prompts of 2-3 tokens (log2 class 1) answered 10, 20, 30, 250 -> buckets
    0 0 0 1 -> 0; prompts of 100-120 tokens (class 6) answered 450, 460, 300 -> 2 2 1 -> 2;
    an unseen class gets the global majority (0: 3 times)."""
    pl = PromptLength(200, 10).fit([2, 3, 2, 3, 100, 120, 100], [10, 20, 30, 250, 450, 460, 300])
    assert pl.predict([0] * 2, 1).bucket == 0
    assert pl.predict([0] * 110, 1).bucket == 2
    assert pl.predict([0] * 1000, 1).bucket == 0
    ev = evaluate(pl, Pairs(np.array([2, 3, 100, 100]), np.array([50, 210, 420, 220]),
                            [None] * 4))
    # truth 0 1 2 1, predicted 0 0 2 2
    assert ev["accuracy"] == 0.5
    assert ev["per_bucket"] == {0: {"n": 1, "accuracy": 1.0}, 1: {"n": 2, "accuracy": 0.0},
                                2: {"n": 1, "accuracy": 1.0}}
    assert ev["within_one"] == 1.0


def _token_signal_pairs(n=200, seed=0):
    """Prompts of equal length; token 7 marks a long answer (~500), token 3 a short one (~50):
    only the prompt's content tells the buckets apart."""
    rng = np.random.default_rng(seed)
    prompts, outs = [], []
    for i in range(n):
        long = i % 2 == 0
        body = list(rng.integers(20, 250, size=30))  # no hash collision with 3 or 7
        body[int(rng.integers(0, 30))] = 7 if long else 3
        prompts.append([int(t) for t in body])
        outs.append(int(rng.integers(450, 550) if long else rng.integers(10, 90)))
    return Pairs(np.full(n, 30), np.array(outs), prompts)


def test_classifier_learns_from_prompt_tokens_where_length_cannot():
    train, test = split(_token_signal_pairs(600), eval_share=0.25, seed=1)
    clf = fit_predictor("classifier", 200, train)
    base = fit_predictor("prompt-length", 200, train)
    got, ref = evaluate(clf, test), evaluate(base, test)
    assert got["accuracy"] == 1.0
    assert ref["accuracy"] < 0.7  # one length class: it can only guess the majority
    assert set(got["per_bucket"]) == {0, 2}


def test_classifier_save_load_round_trip(tmp_path):
    pairs = _token_signal_pairs(60)
    clf = SoftmaxClassifier(200, 10, epochs=100).fit(pairs.prompt_lens, pairs.output_lens,
                                                     prompts=pairs.prompts)
    clf.save(tmp_path / "m.npz")
    back = make_predictor("classifier", 200, data=str(tmp_path / "m.npz"))
    for p in pairs.prompts[:10]:
        assert back.predict(p, 1) == clf.predict(p, 1)


def test_oracle_accuracy_is_dialled_in():
    exact = Oracle(100, 1.0)
    assert [exact.predict([], n).bucket for n in (5, 150, 999)] == [0, 1, 9]
    never = Oracle(100, 0.0, seed=3)
    got = [never.predict([], 150).bucket for _ in range(50)]
    assert set(got) == {0, 2}  # always a neighbouring bucket
    assert never.predict([], 50).bucket == 1  # bucket 0's only neighbour
    o = Oracle(200, 0.749, seed=0)
    acc = np.mean([o.predict([], 300).bucket == 1 for _ in range(4000)])
    assert abs(acc - 0.749) < 0.03


def test_logged_pairs_file(tmp_path):
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in (
        {"prompt_token_ids": [1, 2, 3], "output_len": 40},
        {"prompt_len": 700, "output_len": 900})))
    p = load_pairs(str(f))
    assert list(p.prompt_lens) == [3, 700] and list(p.output_lens) == [40, 900]
    assert p.prompts == [[1, 2, 3], None]
    pred = make_predictor("prompt-length", 400, data=str(f))
    assert pred.predict([0] * 700, 1).bucket == 2


@pytest.mark.parametrize("call, msg", [
    (lambda: Oracle(0), "granularity must be an integer >= 1"),
    (lambda: make_predictor("oracle", granularity=0), "granularity must be an integer >= 1"),
    (lambda: make_predictor("psychic"), "unknown length predictor 'psychic'"),
    (lambda: make_predictor("classifier"), "needs training data"),
    (lambda: Oracle(100, accuracy=1.5), "accuracy must be in"),
    (lambda: SoftmaxClassifier().predict([1], 1), "not trained"),
    (lambda: ClusterConfig(predictor=PredictorConfig(granularity=0)),
     "granularity must be an integer >= 1"),
    (lambda: ClusterConfig(predictor=PredictorConfig(name="gpt")),
     "unknown length predictor 'gpt'"),
    (lambda: ClusterConfig(flip="sometimes"), "unknown flip policy 'sometimes'"),
    (lambda: ClusterConfig(flip="idle:0"), "must be > 0"),
    (lambda: ClusterConfig(flip="load:x"), "bad flip policy"),
])
def test_bad_input(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()
