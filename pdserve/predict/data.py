"""Training data of the length predictors (TetriInfer §3.3.2) and fitting one: what a deployment
needs to build its predictor at start (``ClusterConfig.predictor.data``). The accuracy report
(split, evaluate) is :mod:`pdserve.predict.train`.

Training data are logged pairs (prompt, generated length) of the target model: a JSONL file
with ``output_len`` and ``prompt_token_ids`` (or only ``prompt_len``), or a length trace of
``shared/traces`` by name (length-only: the features are the prompt length alone).
:class:`PairLog` writes that JSONL (``pdserve serve --log-length-pairs FILE``), so the served
model's own answers become the next predictor's training data (the paper's Figure 8 loop).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.config import check_granularity
from pdserve.engine.logfile import AppendLog
from pdserve.predict.base import PREDICTORS, LengthPredictor
from pdserve.predict.predictors import Oracle, default_num_buckets


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
    # a deployment may name a trace as its predictor's training data: the one core -> harness
    # edge (allowed in tests/test_import_contract.py)
    from pdserve.bench.traces import load_trace  # lazy: the harness's trace loader

    t = load_trace(source, traces_dir)
    # a trace with prompt text (HumanEval): its UTF-8 bytes stand in for token ids
    prompts = ([list(p.encode("utf-8")) for p in t.prompts] if t.prompts is not None
               else [None] * len(t))
    return Pairs(t.input_lens.astype(np.int64), t.output_lens.astype(np.int64), prompts)


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
