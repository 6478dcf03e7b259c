"""The length predictors (TetriInfer §3.3.2), one small registered class each.

- ``oracle``: the true bucket with probability ``accuracy``, else a neighbouring bucket — for
  simulations, where the output length is known (``max_tokens`` with forced lengths) and the
  paper's accuracy (74.9 % at granularity 200) or an ideal 100 % is to be dialled in.
- ``majority``: the training set's most frequent bucket (no information).
- ``prompt-length``: the most frequent bucket among training prompts of the same length class
  (log2 bins) — what the prompt length alone tells.
- ``classifier``: :class:`pdserve.predict.classifier.SoftmaxClassifier`, a learned classifier
  over cheap prompt features.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from pdserve.config import check_granularity
from pdserve.predict.base import (
    LengthPrediction,
    LengthPredictor,
    bucket_of,
    register,
)


@register
class Oracle(LengthPredictor):
    """The true bucket (from ``max_tokens``) with probability ``accuracy``; otherwise the bucket
    above or below it (at random; above for bucket 0), as a classifier's typical error.
    Seeded, so a simulation is reproducible."""

    name = "oracle"

    def __init__(self, granularity: int = 200, accuracy: float = 1.0, seed: int = 0) -> None:
        self.granularity = check_granularity(granularity)
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"oracle accuracy must be in [0, 1], got {accuracy!r}")
        self.accuracy = accuracy
        self.rng = random.Random(seed)

    def predict(self, prompt_token_ids: Sequence[int], max_tokens: int) -> LengthPrediction:
        b = bucket_of(max_tokens, self.granularity)
        if self.rng.random() >= self.accuracy:
            b = b + 1 if b == 0 or self.rng.random() < 0.5 else b - 1
        return LengthPrediction(b, self.granularity)


def length_bin(n: int) -> int:
    """Log2 class of a prompt length: 0 for 0-1 tokens, then 2-3, 4-7, ... (capped at 15)."""
    return min(max(int(n), 1).bit_length() - 1, 15)


class _Fitted(LengthPredictor):
    """A predictor fitted on (prompt length, output length) pairs."""

    def __init__(self, granularity: int = 200, num_buckets: int = 10) -> None:
        self.granularity = check_granularity(granularity)
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.num_buckets = num_buckets
        self.default = 0

    def labels(self, output_lens: Sequence[int]) -> np.ndarray:
        return np.array([bucket_of(o, self.granularity, self.num_buckets) for o in output_lens])


@register
class Majority(_Fitted):
    """The most frequent training bucket for every request."""

    name = "majority"

    def fit(self, prompt_lens: Sequence[int], output_lens: Sequence[int], **_: object) -> Majority:
        self.default = int(np.bincount(self.labels(output_lens)).argmax())
        return self

    def predict(self, prompt_token_ids: Sequence[int], max_tokens: int) -> LengthPrediction:
        return LengthPrediction(self.default, self.granularity)


@register
class PromptLength(_Fitted):
    """The most frequent training bucket among prompts of the same log2 length class (the
    global majority for a class the training set lacks)."""

    name = "prompt-length"

    def fit(self, prompt_lens: Sequence[int], output_lens: Sequence[int],
            **_: object) -> PromptLength:
        y = self.labels(output_lens)
        self.default = int(np.bincount(y).argmax())
        bins = np.array([length_bin(n) for n in prompt_lens])
        self.table = {int(b): int(np.bincount(y[bins == b]).argmax()) for b in np.unique(bins)}
        return self

    def predict(self, prompt_token_ids: Sequence[int], max_tokens: int) -> LengthPrediction:
        b = self.table.get(length_bin(len(prompt_token_ids)), self.default)
        return LengthPrediction(b, self.granularity)


def default_num_buckets(granularity: int, max_len: int = 2048) -> int:
    return max(math.ceil(max_len / granularity), 1)
