"""Loaders for the request traces in ``shared/traces`` (see that folder's README for sources).

Every loader returns a :class:`Trace`: per-request input and output token counts, plus what the
file has beyond lengths — arrival timestamps (Azure, Splitwise, Mooncake, APEX), Mooncake's
prefix-chained 512-token block hashes, HumanEval's prompt text. Rows keep the file's order
(timestamped traces are sorted by arrival). Files are read once per process and cached.

The folder is found from ``$PDSERVE_TRACES``, else by walking up from the current directory and
from this package's directory looking for ``shared/traces`` (the development layout keeps it at
``../shared/traces`` beside the repository). Without it, ``sharegpt`` (and so the ``chatbot`` and
TetriInfer presets) falls back to ``pdserve/data/sharegpt_lengths_sample.csv``: 4,000 rows of the
ShareGPT length table drawn without replacement (numpy ``default_rng(0)``), in file order.
"""

from __future__ import annotations

import csv
import functools
import gzip
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

TRACES_ENV = "PDSERVE_TRACES"
# HumanEval ships text only; code runs at about 3.5 characters per token (traces/README.md).
CHARS_PER_TOKEN = 3.5
MOONCAKE_BLOCK_SIZE = 512


class TraceNotFoundError(FileNotFoundError):
    """The traces folder or one of its files is missing."""


@dataclass(frozen=True)
class Trace:
    """One trace file as arrays. ``arrivals`` are seconds from the first request (or ``None``);
    ``hash_ids[i]`` are request i's prefix-chained block hashes of ``hash_block_size`` tokens;
    ``prompts`` real prompt text where the file has it."""

    name: str
    file: str
    input_lens: np.ndarray
    output_lens: np.ndarray
    tokenizer: str
    arrivals: np.ndarray | None = None
    hash_ids: list[list[int]] | None = None
    hash_block_size: int | None = None
    prompts: list[str] | None = None

    def __len__(self) -> int:
        return len(self.input_lens)


def find_traces_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The traces folder: ``path`` if given, else ``$PDSERVE_TRACES``, else the first
    ``shared/traces`` found walking up from the current directory or from this package."""
    if path is None:
        path = os.environ.get(TRACES_ENV) or None
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise TraceNotFoundError(f"traces folder {str(p)!r} does not exist")
        return p
    starts = [Path.cwd().resolve(), Path(__file__).resolve().parent]
    for start in starts:
        for d in (start, *start.parents):
            for cand in (d / "shared" / "traces", d / "traces"):
                if (cand / "README.md").is_file() and any(cand.glob("*.csv")):
                    return cand
    raise TraceNotFoundError(
        "cannot find the traces folder: set $PDSERVE_TRACES to the folder holding the trace "
        "files (in development it is ../shared/traces beside the repository)")


def _file(traces_dir: Path, name: str) -> Path:
    p = traces_dir / name
    if not p.is_file():
        raise TraceNotFoundError(f"trace file {name!r} is missing from {str(traces_dir)!r}")
    return p


def _read_csv(path: Path) -> dict[str, list[str]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    return {h: [r[i] for r in body] for i, h in enumerate(header)}


def _ints(values: list[str]) -> np.ndarray:
    return np.asarray([int(float(v)) for v in values], dtype=np.int64)


def _sorted_by_arrival(trace: Trace) -> Trace:
    assert trace.arrivals is not None
    order = np.argsort(trace.arrivals, kind="stable")
    pick = lambda xs: None if xs is None else [xs[i] for i in order]
    return replace(
        trace, input_lens=trace.input_lens[order], output_lens=trace.output_lens[order],
        arrivals=trace.arrivals[order] - trace.arrivals[order[0]],
        hash_ids=pick(trace.hash_ids), prompts=pick(trace.prompts))


def _azure(d: Path, kind: str) -> Trace:
    fname = f"AzureLLMInferenceTrace_{kind}.csv"
    cols = _read_csv(_file(d, fname))
    stamps = np.array(cols["TIMESTAMP"], dtype="datetime64[ns]")
    secs = (stamps - stamps.min()).astype(np.int64) / 1e9
    return _sorted_by_arrival(Trace(
        f"azure-{kind}", fname, _ints(cols["ContextTokens"]), _ints(cols["GeneratedTokens"]),
        "production GPT tokenizer", arrivals=secs))


def _splitwise(d: Path, kind: str) -> Trace:
    fname = f"vidur_splitwise_{kind}.csv"
    cols = _read_csv(_file(d, fname))
    return _sorted_by_arrival(Trace(
        f"splitwise-{kind}", fname, _ints(cols["num_prefill_tokens"]),
        _ints(cols["num_decode_tokens"]), "production GPT tokenizer",
        arrivals=np.asarray(cols["arrived_at"], dtype=float)))


def _mooncake(d: Path) -> Trace:
    fname = "mooncake_conversation_trace.jsonl"
    ts, inp, out, hashes = [], [], [], []
    with open(_file(d, fname)) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            ts.append(r["timestamp"] / 1000.0)
            inp.append(r["input_length"])
            out.append(r["output_length"])
            hashes.append([int(h) for h in r["hash_ids"]])
    return _sorted_by_arrival(Trace(
        "mooncake", fname, np.asarray(inp, dtype=np.int64), np.asarray(out, dtype=np.int64),
        "Kimi tokenizer", arrivals=np.asarray(ts, dtype=float), hash_ids=hashes,
        hash_block_size=MOONCAKE_BLOCK_SIZE))


_LENGTH_TABLES = {
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "bwb": "bwb_stats_llama2_tokenizer_filtered_v2.csv",
}


def _length_table(d: Path, name: str) -> Trace:
    fname = _LENGTH_TABLES[name]
    cols = _read_csv(_file(d, fname))
    return Trace(name, fname, _ints(cols["num_prefill_tokens"]),
                 _ints(cols["num_decode_tokens"]), "Llama-2 tokenizer")


def _apex(d: Path, task: str, tok: str) -> Trace:
    fname = f"apex_{task}_05_{tok}_tokenizer.csv"
    cols = _read_csv(_file(d, fname))
    return _sorted_by_arrival(Trace(
        f"apex-{task}-{tok}", fname, _ints(cols["input_tokens"]), _ints(cols["output_tokens"]),
        "Llama-3 tokenizer" if tok == "llama" else "Mistral tokenizer",
        arrivals=np.asarray(cols["arrival_s"], dtype=float)))


def estimate_tokens(text: str) -> int:
    """Token count estimate for code text without a tokenizer (``ceil(chars / 3.5)``, >= 1)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _humaneval(d: Path) -> Trace:
    fname = "HumanEval.jsonl.gz"
    with gzip.open(_file(d, fname), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [r["prompt"] for r in rows]
    return Trace(
        "humaneval", fname, np.asarray([estimate_tokens(p) for p in prompts], dtype=np.int64),
        np.asarray([estimate_tokens(r["canonical_solution"]) for r in rows], dtype=np.int64),
        f"estimated: characters / {CHARS_PER_TOKEN}", prompts=prompts)


_LOADERS: dict[str, Callable[[Path], Trace]] = {
    "azure-code": lambda d: _azure(d, "code"),
    "azure-conv": lambda d: _azure(d, "conv"),
    "splitwise-code": lambda d: _splitwise(d, "code"),
    "splitwise-conv": lambda d: _splitwise(d, "conv"),
    "mooncake": _mooncake,
    "humaneval": _humaneval,
    **{name: functools.partial(_length_table, name=name) for name in _LENGTH_TABLES},
    **{f"apex-{task}-{tok}": functools.partial(_apex, task=task, tok=tok)
       for task in ("lmsys", "creation", "summarization") for tok in ("llama", "mistral")},
}
TRACE_NAMES: tuple[str, ...] = tuple(_LOADERS)


BUNDLED_SHAREGPT = Path(__file__).resolve().parent.parent / "data" / "sharegpt_lengths_sample.csv"


@functools.lru_cache(maxsize=32)
def _load_cached(name: str, traces_dir: str) -> Trace:
    if traces_dir == str(BUNDLED_SHAREGPT):
        cols = _read_csv(BUNDLED_SHAREGPT)
        return Trace("sharegpt", "pdserve/data/sharegpt_lengths_sample.csv",
                     _ints(cols["num_prefill_tokens"]), _ints(cols["num_decode_tokens"]),
                     "Llama-2 tokenizer")
    return _LOADERS[name](Path(traces_dir))


def load_trace(name: str, traces_dir: str | os.PathLike[str] | None = None) -> Trace:
    """Load trace ``name`` (one of :data:`TRACE_NAMES`; ``apex-TASK`` means the Llama file)."""
    if name in ("apex-lmsys", "apex-creation", "apex-summarization"):
        name = f"{name}-llama"
    if name not in _LOADERS:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACE_NAMES)}")
    try:
        d = str(find_traces_dir(traces_dir).resolve())
    except TraceNotFoundError:
        if name != "sharegpt" or traces_dir is not None or not BUNDLED_SHAREGPT.is_file():
            raise
        warnings.warn("trace folder not found: using the bundled 4,000-request sample of the "
                      "ShareGPT length table", stacklevel=2)
        d = str(BUNDLED_SHAREGPT)
    return _load_cached(name, d)
