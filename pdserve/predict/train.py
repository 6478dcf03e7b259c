"""The accuracy report of the length predictors (TetriInfer §3.3.2): the paper splits its pairs
into a training and an evaluation part; :func:`split` does the same, seeded, and
:func:`evaluate` scores a predictor. Training data and fitting: :mod:`pdserve.predict.data`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.predict.base import LengthPredictor, bucket_of
from pdserve.predict.classifier import SoftmaxClassifier
from pdserve.predict.data import Pairs


def split(pairs: Pairs, eval_share: float = 0.2, seed: int = 0) -> tuple[Pairs, Pairs]:
    idx = np.random.default_rng(seed).permutation(len(pairs))
    n_eval = max(int(len(pairs) * eval_share), 1)
    return pairs.take(idx[n_eval:]), pairs.take(idx[:n_eval])


def _predict_all(pred: LengthPredictor, pairs: Pairs) -> np.ndarray:
    if isinstance(pred, SoftmaxClassifier):
        return pred.predict_buckets(pairs.prompts, pairs.prompt_lens)
    return np.array([pred.predict(p if p is not None else [0] * int(n), int(o)).bucket
                     for p, n, o in zip(pairs.prompts, pairs.prompt_lens, pairs.output_lens)])


def evaluate(pred: LengthPredictor, pairs: Pairs, timing_samples: int = 200) -> dict[str, Any]:
    """Accuracy (exact bucket), accuracy within one bucket, per true bucket, and the cost of
    one prediction (mean seconds per request, one request at a time as served)."""
    g = pred.granularity
    k = getattr(pred, "num_buckets", None)
    y = np.array([bucket_of(o, g, k) for o in pairs.output_lens])
    yhat = _predict_all(pred, pairs)
    per = {}
    for b in np.unique(y):
        m = y == b
        per[int(b)] = {"n": int(m.sum()), "accuracy": float((yhat[m] == b).mean())}
    n = min(timing_samples, len(pairs))
    t0 = time.perf_counter()
    for i in range(n):
        ids = pairs.prompts[i] if pairs.prompts[i] is not None else [0] * int(pairs.prompt_lens[i])
        pred.predict(ids, int(pairs.output_lens[i]))
    cost = (time.perf_counter() - t0) / max(n, 1)
    return {"predictor": pred.name, "granularity": g, "n": len(pairs),
            "accuracy": float((yhat == y).mean()),
            "within_one": float((np.abs(yhat - y) <= 1).mean()),
            "per_bucket": per, "seconds_per_request": cost}


def accuracy_table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per (predictor, granularity)."""
    rows = ["| predictor | granularity | accuracy | within 1 bucket | per bucket (n: acc) "
            "| µs / request |", "|---|---|---|---|---|---|"]
    for r in results:
        per = ", ".join(f"{b}: {v['accuracy']:.0%} (n={v['n']})"
                        for b, v in sorted(r["per_bucket"].items()) if v["n"] >= 1)
        rows.append(f"| {r['predictor']} | {r['granularity']} | {r['accuracy']:.1%} | "
                    f"{r['within_one']:.1%} | {per} | {1e6 * r['seconds_per_request']:.0f} |")
    return "\n".join(rows)
