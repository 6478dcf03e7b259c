"""Training data, fitting and the accuracy report of the length predictors (TetriInfer §3.3.2).

Training data are logged pairs (prompt, generated length) of the target model: a JSONL file
with ``output_len`` and ``prompt_token_ids`` (or only ``prompt_len``), or a length trace of
``shared/traces`` by name (length-only: the features are the prompt length alone). The paper
splits its pairs into a training and an evaluation part; :func:`split` does the same, seeded.
:class:`PairLog` writes that JSONL (``pdserve serve --log-length-pairs FILE``), so the served
model's own answers become the next predictor's training data (the paper's Figure 8 loop).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.logfile import AppendLog
from pdserve.predict.base import PREDICTORS, LengthPredictor, bucket_of, check_granularity
from pdserve.predict.classifier import SoftmaxClassifier
from pdserve.predict.models import Oracle, default_num_buckets


@dataclass
class Pairs:
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    prompts: list[list[int] | None]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def take(self, idx: np.ndarray) -> Pairs:
        return Pairs(self.prompt_lens[idx], self.output_lens[idx],
                     [self.prompts[i] for i in idx])


class PairLog:
    """Appends one logged pair per finished request to a JSONL file:
    ``{"prompt_token_ids": [...], "output_len": n}`` (what :func:`load_pairs` reads). Each line
    is flushed as it is written, so a server that is killed loses at most the line in flight;
    an existing file is appended to. A bad path is a ``ValueError`` here; a line that cannot be
    written later (a full disk) is logged and counted in :attr:`errors`, never raised; a file
    rotated away is reopened (:class:`~pdserve.engine.logfile.AppendLog`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._log = AppendLog(self.path, "length-pair log")

    @property
    def count(self) -> int:
        return self._log.lines

    @property
    def errors(self) -> int:
        return self._log.errors

    def write(self, prompt_token_ids: Sequence[int], output_len: int) -> bool:
        return self._log.write(json.dumps({"prompt_token_ids": [int(t) for t in prompt_token_ids],
                                           "output_len": int(output_len)}))

    @property
    def closed(self) -> bool:
        return self._log.closed

    def close(self) -> None:
        self._log.close()


def load_pairs(source: str, traces_dir: str | None = None) -> Pairs:
    """A JSONL file of logged pairs, or a trace's (input, output) lengths (and prompt text's
    bytes where the trace has text)."""
    p = Path(source)
    if p.suffix in (".jsonl", ".json") or p.is_file():
        if not p.is_file():
            raise ValueError(f"training data {source!r} does not exist")
        prompts, plens, olens = [], [], []
        for i, line in enumerate(p.read_text().splitlines()):
            if not line.strip():
                continue
            d = json.loads(line)
            if "output_len" not in d:
                raise ValueError(f"{source}:{i + 1}: a logged pair needs output_len")
            ids = d.get("prompt_token_ids")
            prompts.append(list(ids) if ids is not None else None)
            plens.append(len(ids) if ids is not None else int(d["prompt_len"]))
            olens.append(int(d["output_len"]))
        return Pairs(np.array(plens), np.array(olens), prompts)
    from pdserve.bench.traces import load_trace

    t = load_trace(source, traces_dir)
    # a trace with prompt text (HumanEval): its UTF-8 bytes stand in for token ids
    prompts = ([list(p.encode("utf-8")) for p in t.prompts] if t.prompts is not None
               else [None] * len(t))
    return Pairs(t.input_lens.astype(np.int64), t.output_lens.astype(np.int64), prompts)


def split(pairs: Pairs, eval_share: float = 0.2, seed: int = 0) -> tuple[Pairs, Pairs]:
    idx = np.random.default_rng(seed).permutation(len(pairs))
    n_eval = max(int(len(pairs) * eval_share), 1)
    return pairs.take(idx[n_eval:]), pairs.take(idx[:n_eval])


def fit_predictor(name: str, granularity: int, train: Pairs | None,
                  num_buckets: int | None = None, accuracy: float = 1.0,
                  seed: int = 0) -> LengthPredictor:
    """A predictor by name, fitted on ``train`` (the oracle needs no data)."""
    granularity = check_granularity(granularity)
    if name not in PREDICTORS:
        raise ValueError(f"unknown length predictor {name!r}; available: {sorted(PREDICTORS)}")
    if name == "oracle":
        return Oracle(granularity, accuracy, seed)
    if train is None or not len(train):
        raise ValueError(f"length predictor {name!r} needs training data")
    k = num_buckets or default_num_buckets(granularity)
    pred: Any = PREDICTORS[name](granularity, k)
    return pred.fit(train.prompt_lens, train.output_lens, prompts=train.prompts)


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
