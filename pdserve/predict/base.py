"""Output-length prediction (TetriInfer §3.3.2): the interface, buckets and the registry.

A predictor classifies a request's output length into fixed-size buckets of ``granularity``
tokens for one target model: bucket ``k`` is ``[k·g, (k+1)·g)``, and lengths past the last
bucket fall into it (``num_buckets`` caps the classes). Predicting a range instead of a number
is the paper's choice: the range bounds the request's memory, and sampling makes the exact
length unpredictable anyway. Torch-free; a prediction is a small picklable value that travels
with the request to its decode instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import LENGTH_PREDICTORS
from pdserve.registry import Registry


@dataclass(frozen=True, slots=True)
class LengthPrediction:
    """Output length in ``[lo, hi)`` tokens: bucket ``bucket`` of ``granularity``."""

    bucket: int
    granularity: int

    @property
    def lo(self) -> int:
        return self.bucket * self.granularity

    @property
    def hi(self) -> int:
        return (self.bucket + 1) * self.granularity

    @property
    def mid(self) -> float:
        return (self.bucket + 0.5) * self.granularity


def bucket_of(length: int, granularity: int, num_buckets: int | None = None) -> int:
    b = max(int(length), 0) // granularity
    return b if num_buckets is None else min(b, num_buckets - 1)


class LengthPredictor:
    """Predicts the bucket of a request's output length from its prompt.

    ``predict(prompt_token_ids, max_tokens)`` → :class:`LengthPrediction`. ``max_tokens`` is
    the request's cap; the oracle (simulations, forced lengths) reads the true length from it.
    """

    name = ""
    granularity: int

    def predict(self, prompt_token_ids: Sequence[int], max_tokens: int) -> LengthPrediction:
        raise NotImplementedError


PREDICTORS: Registry[LengthPredictor] = Registry("length predictor", names=LENGTH_PREDICTORS)
register = PREDICTORS.register
