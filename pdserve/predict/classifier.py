"""A learned output-length classifier that fits a CPU (TetriInfer §3.3.2's predict model).

TetriInfer fine-tunes OPT-125M as a sequence classifier and runs it beside the prefill on the
GPU. Without an accelerator, fine-tuning 125M parameters over thousands of prompts takes hours
and one forward pass costs tens of milliseconds per prompt — as much as the main model's
prefill on the tiny models served live on a CPU. So the predict model here
is multinomial logistic regression (softmax) in numpy over cheap prompt features:

- the prompt length: ``log1p(n)``, its square and a one-hot of its log2 class;
- the prompt's tokens: a hashed bag of token ids (``hash_dims`` buckets, counts / n), which
  lets it learn what a prompt asks for ("write an essay" vs "yes or no") when the training
  pairs carry token ids. Length-only traces leave these features at zero.

Trained full-batch with Adam and L2 regularisation on standardised features (seconds for 10⁴
pairs); prediction is a dot product (tens of microseconds). No torch, so it runs inside the
controller, beside the prefill, and in the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.predict.base import LengthPrediction, bucket_of, register
from pdserve.predict.predictors import _Fitted, length_bin

NUM_LEN_BINS = 16


def features(prompts: Sequence[Sequence[int] | None], prompt_lens: Sequence[int],
             hash_dims: int) -> np.ndarray:
    """One row per prompt (``None``: length only)."""
    x = np.zeros((len(prompt_lens), 2 + NUM_LEN_BINS + hash_dims))
    for i, (p, n) in enumerate(zip(prompts, prompt_lens)):
        ln = np.log1p(n)
        x[i, 0], x[i, 1] = ln, ln * ln
        x[i, 2 + length_bin(n)] = 1.0
        if p is not None and hash_dims and len(p):
            ids = np.asarray(p, dtype=np.int64) % hash_dims
            x[i, 2 + NUM_LEN_BINS:] = np.bincount(ids, minlength=hash_dims) / len(p)
    return x


@register
class SoftmaxClassifier(_Fitted):
    """Multinomial logistic regression over :func:`features` (module docstring)."""

    name = "classifier"

    def __init__(self, granularity: int = 200, num_buckets: int = 10, hash_dims: int = 256,
                 l2: float = 1e-2, epochs: int = 300, lr: float = 0.05, seed: int = 0) -> None:
        super().__init__(granularity, num_buckets)
        self.hash_dims, self.l2, self.epochs, self.lr, self.seed = hash_dims, l2, epochs, lr, seed
        self.w: np.ndarray | None = None

    def fit(self, prompt_lens: Sequence[int], output_lens: Sequence[int],
            prompts: Sequence[Sequence[int] | None] | None = None) -> SoftmaxClassifier:
        prompts = prompts if prompts is not None else [None] * len(prompt_lens)
        if all(p is None for p in prompts):
            self.hash_dims = 0  # length-only pairs: no token features to learn from
        x = features(prompts, prompt_lens, self.hash_dims)
        y = self.labels(output_lens)
        self.mean = x.mean(0)
        self.std = x.std(0) + 1e-6
        x = np.hstack([(x - self.mean) / self.std, np.ones((len(x), 1))])
        k = self.num_buckets
        onehot = np.eye(k)[y]
        rng = np.random.default_rng(self.seed)
        w = rng.normal(0, 0.01, (x.shape[1], k))
        m, v = np.zeros_like(w), np.zeros_like(w)
        b1, b2 = 0.9, 0.999
        for t in range(1, self.epochs + 1):  # full-batch Adam on the cross-entropy
            p = _softmax(x @ w)
            g = x.T @ (p - onehot) / len(x) + self.l2 * w
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            w -= self.lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + 1e-8)
        self.w = w
        return self

    def predict_buckets(self, prompts: Sequence[Sequence[int] | None],
                        prompt_lens: Sequence[int]) -> np.ndarray:
        if self.w is None:
            raise ValueError("the classifier is not trained (fit it or load a saved one)")
        x = (features(prompts, prompt_lens, self.hash_dims) - self.mean) / self.std
        return (x @ self.w[:-1] + self.w[-1]).argmax(1)

    def predict(self, prompt_token_ids: Sequence[int], max_tokens: int) -> LengthPrediction:
        b = int(self.predict_buckets([prompt_token_ids], [len(prompt_token_ids)])[0])
        return LengthPrediction(b, self.granularity)

    # ---- files ----
    def save(self, path: str | Path) -> None:
        if self.w is None:
            raise ValueError("nothing to save: the classifier is not trained")
        np.savez(path, w=self.w, mean=self.mean, std=self.std,
                 meta=np.array([self.granularity, self.num_buckets, self.hash_dims]))

    @classmethod
    def load(cls, path: str | Path) -> SoftmaxClassifier:
        try:
            d = np.load(path)
            g, k, h = (int(v) for v in d["meta"])
        except OSError as e:
            raise ValueError(f"cannot read length predictor {str(path)!r}: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError):  # (an .npy, pickled data)
            raise ValueError(f"{str(path)!r} is not a length classifier saved by `pdserve "
                             f"predictor train`") from None
        c = cls(g, k, h)
        c.w, c.mean, c.std = d["w"], d["mean"], d["std"]
        return c


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def true_buckets(output_lens: Sequence[int], granularity: int, num_buckets: int) -> np.ndarray:
    return np.array([bucket_of(o, granularity, num_buckets) for o in output_lens])
