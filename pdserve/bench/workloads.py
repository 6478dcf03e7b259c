"""Benchmark workloads: requests with arrival times, prompts and forced output lengths.

``make_workload('chatbot', 500, rate=4.0, seed=0)`` samples a preset (:mod:`.presets`), turns
lengths into prompts, scales them to a model's context and assigns arrival times
(:mod:`.arrivals`). Everything is deterministic given ``seed``; the request sample does not depend
on the rate, so a goodput search probes the same requests at every rate (``Workload.retimed``).

**Prompts.** Length-only sources get synthetic token ids in ``[token_low, vocab_size)`` (set
``vocab_size`` to the served model's; tiny CPU models have ~512). A prompt is a list of
segments ``(key, length)``, each the first ``length`` tokens of a token stream determined by
``(seed, key)``; equal keys give equal tokens, so a Mooncake block hash ``h`` becomes the same
block of tokens in every request that has it and prefix sharing is exact. Text sources
(HumanEval) keep their text: an HTTP target sends the text, and ``prompt_token_ids`` holds a
stand-in of ``prompt_len`` synthetic ids for token-level targets (the simulator) — or the real
ids when a ``tokenizer`` is given.

**Scaling rule** (replaying a long-context trace on a small model with the same shape):

1. Every segment length ``l`` becomes ``max(1, round(l · s))`` for the length scale ``s``; the
   output length likewise. Full Mooncake blocks therefore all become ``round(512 · s)`` tokens,
   the token-mapping block size scales with the lengths, and block sharing is unchanged.
   ``s = 'fit'`` picks ``s = min(1, max_model_len / P99(input + output))``.
2. A request with ``input + output > max_model_len`` is clipped keeping its input:output
   ratio: both are multiplied by ``max_model_len / (input + output)`` and floored (each ≥ 1);
   the prompt loses its tail, so a clipped prompt is still a prefix of the unclipped one.
   ``Workload.scaling.num_clipped`` counts them.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.arrivals import ArrivalProcess, TraceReplay, parse_arrival
from pdserve.bench.metrics import SLO
from pdserve.bench.presets import NS_PROMPT, PRESETS, Selection, parse_workload_spec, segment_key
from pdserve.bench.traces import estimate_tokens
from pdserve.config import cdiv

_MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                            0x94D049BB133111EB))
# Independent random streams derived from the seed.
_STREAM_SELECT, _STREAM_ARRIVAL = 1, 2


@dataclass
class WorkloadRequest:
    """One request. ``arrival_time`` is seconds from the start of the run. ``prefix_block_ids``
    names the prompt's consecutive blocks (equal id ⇒ equal tokens up to and including that
    block) when the workload shares prefixes."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    prefix_block_ids: list[int] | None = None


@dataclass
class Scaling:
    scale: float = 1.0
    max_model_len: int | None = None
    num_clipped: int = 0
    block_size: int | None = None  # token-mapping block size after scaling (block workloads)


@dataclass
class Workload:
    name: str
    description: str
    requests: list[WorkloadRequest]
    arrival: str  # the process that timed the requests, e.g. "poisson"
    rate: float | None  # requested mean rate (None: a trace's own timing)
    seed: int
    default_slo: SLO | None = None
    scaling: Scaling = field(default_factory=Scaling)
    native_arrivals: np.ndarray | None = None  # the trace's own timestamps, if any

    def __len__(self) -> int:
        return len(self.requests)

    def retimed(self, rate: float | None, arrival: str | ArrivalProcess | None = None,
                cv: float | None = None) -> Workload:
        """The same requests with arrival times for ``rate`` (prompts are shared, not copied)."""
        process = self._process(arrival, cv)
        rng = np.random.default_rng([self.seed, _STREAM_ARRIVAL])
        times = process.times(len(self.requests), rate, rng)
        reqs = [replace(r, arrival_time=float(t)) for r, t in zip(self.requests, times)]
        return replace(self, requests=reqs, arrival=process.name, rate=rate)

    def _process(self, arrival: str | ArrivalProcess | None, cv: float | None) -> ArrivalProcess:
        if arrival is None:
            arrival = self.arrival
        if isinstance(arrival, str):
            return parse_arrival(arrival, self.native_arrivals, cv)
        return arrival

    def describe(self) -> dict[str, Any]:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        t = np.array([r.arrival_time for r in self.requests])
        stat = lambda a: {"mean": float(a.mean()), "median": float(np.median(a)),
                          "p90": float(np.percentile(a, 90)), "max": int(a.max())}
        return {
            "name": self.name, "description": self.description, "num_requests": len(self),
            "seed": self.seed, "arrival": self.arrival, "rate": self.rate,
            "measured_rate": TraceReplay.native_rate(t) if len(t) else None,
            "prompt_len": stat(p) if len(p) else None, "output_len": stat(o) if len(o) else None,
            "scale": self.scaling.scale, "max_model_len": self.scaling.max_model_len,
            "num_clipped": self.scaling.num_clipped, "block_size": self.scaling.block_size,
            "default_slo": (None if self.default_slo is None
                            else {"ttft": self.default_slo.ttft, "tpot": self.default_slo.tpot}),
        }


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def segment_tokens(seed: int, key: int, length: int, vocab_size: int,
                   low: int = 4) -> np.ndarray:
    """The first ``length`` tokens of stream ``(seed, key)``, uniform in ``[low, vocab_size)``."""
    return segments_tokens(seed, [(key, length)], vocab_size, low)


def segments_tokens(seed: int, segments: Sequence[tuple[int, int]], vocab_size: int,
                    low: int = 4) -> np.ndarray:
    """:func:`segment_tokens` of each ``(key, length)``, concatenated, in one pass."""
    keys = np.array([k & _MASK for k, _ in segments], dtype=np.uint64)
    lens = np.array([n for _, n in segments], dtype=np.int64)
    base = _mix(np.array([seed & _MASK], dtype=np.uint64) ^ _mix(keys))
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    with np.errstate(over="ignore"):
        pos = (np.arange(int(lens.sum()), dtype=np.int64) - starts).astype(np.uint64)
        x = _mix(np.repeat(base, lens) + pos)
    return (x % np.uint64(vocab_size - low)).astype(np.int64) + low


def chained_block_ids(token_ids: Sequence[int], block_size: int,
                      table: dict[tuple[int, tuple[int, ...]], int]) -> list[int]:
    """Dense ids for the prompt's blocks, chained on the previous block (equal id ⇔ equal
    prefix up to that block). ``table`` is shared by all prompts of a workload."""
    ids, parent = [], -1
    for i in range(0, len(token_ids), block_size):
        parent = table.setdefault((parent, tuple(token_ids[i:i + block_size])), len(table))
        ids.append(parent)
    return ids


def _scale_len(n: int, s: float) -> int:
    return max(1, int(round(n * s)))


def _clip(inp: int, out: int, limit: int) -> tuple[int, int]:
    f = limit / (inp + out)
    new_in, new_out = max(1, math.floor(inp * f)), max(1, math.floor(out * f))
    if new_in + new_out > limit:
        new_in = limit - new_out
    return new_in, new_out


def _truncate_segments(segs: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out, left = [], n
    for key, length in segs:
        if left <= 0:
            break
        out.append((key, min(length, left)))
        left -= length
    return out


def _fit_scale(sel: Selection, max_model_len: int | None) -> float:
    if max_model_len is None:
        raise ValueError("length_scale='fit' needs max_model_len")
    total = sel.input_lens + sel.output_lens
    return min(1.0, max_model_len / float(np.percentile(total, 99)))


def make_workload(
    spec: str,
    num_requests: int,
    *,
    seed: int = 0,
    rate: float | None = None,
    arrival: str | None = None,
    cv: float | None = None,
    vocab_size: int = 32000,
    token_low: int = 4,
    max_model_len: int | None = None,
    length_scale: float | str = 1.0,
    prompt_mode: str = "auto",
    tokenizer: Callable[[str], list[int]] | None = None,
    traces_dir: str | None = None,
) -> Workload:
    """Build workload ``spec`` (``NAME[:key=value,...]`` or a ``.jsonl`` file).

    ``arrival`` defaults to the preset's (``trace`` for timestamped traces, else ``poisson``);
    ``rate=None`` with trace replay keeps the trace's own timing. ``prompt_mode``: ``auto``
    (text where the source has text, else ids) or ``ids`` (always token ids).
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not 0 <= token_low < vocab_size:
        raise ValueError(f"need 0 <= token_low < vocab_size, got {token_low} and {vocab_size}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if prompt_mode not in ("auto", "ids"):
        raise ValueError(f"prompt_mode must be 'auto' or 'ids', got {prompt_mode!r}")
    if spec.endswith((".jsonl", ".json")) or "/" in spec:
        w = load_workload_file(spec, num_requests, seed, vocab_size, token_low)
        return w if rate is None and arrival is None else w.retimed(rate, arrival, cv)

    preset, params = parse_workload_spec(spec)
    sel = preset.build(num_requests, np.random.default_rng([seed, _STREAM_SELECT]), params,
                       traces_dir)
    texts = sel.prompts if prompt_mode == "auto" or tokenizer is not None else None
    real_ids = [list(tokenizer(t)) for t in sel.prompts] if tokenizer and sel.prompts else None
    if real_ids is not None:
        sel.input_lens = np.array([len(x) for x in real_ids], dtype=np.int64)
        texts = None if prompt_mode == "ids" else texts

    s = _fit_scale(sel, max_model_len) if length_scale == "fit" else float(length_scale)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"length scale must be a positive number or 'fit', got {length_scale!r}")
    scaling = Scaling(scale=s, max_model_len=max_model_len)
    table: dict[tuple[int, tuple[int, ...]], int] = {}
    block_size = scaling.block_size = None if sel.block_size is None else _scale_len(
        sel.block_size, s)

    shapes, all_segs = [], []  # (input, output) per request; its segments, in order
    for i in range(num_requests):
        orig_in = int(sel.input_lens[i])
        segs = (sel.segments[i] if sel.segments is not None
                else [(segment_key(NS_PROMPT, i), orig_in)])
        segs = [(k, _scale_len(n, s)) for k, n in segs]
        inp = sum(n for _, n in segs)
        out = _scale_len(int(sel.output_lens[i]), s)
        if max_model_len is not None and inp + out > max_model_len:
            inp, out = _clip(inp, out, max_model_len)
            scaling.num_clipped += 1
        shapes.append((inp, out))
        if real_ids is None:
            all_segs += _truncate_segments(segs, inp)
    # every synthetic prompt's tokens at once (a request's ids are its segments' streams)
    tokens = ([] if real_ids is not None or not all_segs
              else segments_tokens(seed, all_segs, vocab_size, token_low).tolist())
    requests, at = [], 0
    for i, (inp, out) in enumerate(shapes):
        orig_in = int(sel.input_lens[i])
        if real_ids is not None:
            ids = real_ids[i][:inp]
        else:
            ids, at = tokens[at:at + inp], at + inp
        text = None
        if texts is not None:
            text = texts[i]
            if inp < orig_in:  # keep the same share of characters as of tokens
                text = text[:max(1, round(len(text) * inp / orig_in))]
        blocks = None
        if sel.hash_ids is not None and block_size:
            blocks = list(sel.hash_ids[i][:cdiv(inp, block_size)])
        elif sel.chain_block_ids and block_size:
            blocks = chained_block_ids(ids, block_size, table)
        requests.append(WorkloadRequest(f"{preset.name}-{i}", 0.0, inp, out, ids, text, blocks))

    w = Workload(name=spec, description=preset.description, requests=requests,
                 arrival=arrival or preset.default_arrival, rate=rate, seed=seed,
                 default_slo=preset.default_slo, scaling=scaling,
                 native_arrivals=sel.arrivals)
    if w.arrival != "trace" and rate is None:
        raise ValueError(f"workload {spec!r} with {w.arrival} arrivals needs a rate "
                         "(requests/s)")
    return w.retimed(rate, w.arrival, cv)


_FILE_KEYS = {"prompt_token_ids", "prompt", "prompt_len", "output_len", "arrival_time",
              "prefix_block_ids", "request_id"}  # one request per line (load_workload_file)


def load_workload_file(path: str, num_requests: int | None = None, seed: int = 0,
                       vocab_size: int = 32000, token_low: int = 4) -> Workload:
    """A JSON-lines workload: one object per request with ``output_len`` and one of
    ``prompt_token_ids``, ``prompt`` (text; ``prompt_len`` estimated unless given) or
    ``prompt_len`` (synthetic ids); optional ``arrival_time`` (seconds; replayed as a trace),
    ``prefix_block_ids`` and ``request_id``; other keys are ignored with a warning that names
    them. A line that is not such an object is an error naming the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"workload file {path!r} does not exist")
    reqs, times = [], []
    ignored: set[str] = set()
    with open(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError(f"a JSON object was expected, got {type(d).__name__}")
                unknown = set(d) - _FILE_KEYS - ignored
                if unknown:  # (a misspelt arrival_time would pass unseen)
                    ignored |= unknown
                    warnings.warn(f"{path}:{lineno}: ignoring key(s) {sorted(unknown)} (a "
                                  f"workload line reads {sorted(_FILE_KEYS)})", stacklevel=2)
                ids, text = d.get("prompt_token_ids"), d.get("prompt")
                if ids is not None and not (isinstance(ids, list) and all(
                        isinstance(t, int) and not isinstance(t, bool) and t >= 0
                        for t in ids)):
                    raise ValueError("prompt_token_ids must be a list of token ids (integers "
                                     ">= 0)")
                plen = int(d.get("prompt_len") or (len(ids) if ids else 0))
                if plen < 1 and text:
                    plen = estimate_tokens(text)
                if plen < 1:
                    raise ValueError("needs prompt_token_ids, prompt or prompt_len")
                if ids is None:
                    ids = segment_tokens(seed, segment_key(NS_PROMPT, len(reqs)), plen,
                                         vocab_size, token_low).tolist()
                out = int(d["output_len"])
                if out < 1:
                    raise ValueError(f"output_len must be >= 1, got {out}")
                at = float(d.get("arrival_time", len(times)))
                if not (math.isfinite(at) and at >= 0):
                    raise ValueError(f"arrival_time must be a finite number >= 0, got {at}")
                reqs.append(WorkloadRequest(
                    str(d.get("request_id", f"{p.stem}-{len(reqs)}")), 0.0, plen,
                    out, ids, text, d.get("prefix_block_ids")))
                times.append(at)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad workload line ({e})") from None
            if num_requests is not None and len(reqs) >= num_requests:
                break
    if not reqs:
        raise ValueError(f"workload file {path!r} has no requests")
    t = np.asarray(times)
    w = Workload(p.name, f"requests from {path}", reqs, "trace", None, seed,
                 native_arrivals=t - t.min())
    return w.retimed(None, "trace")


def workload_names() -> list[str]:
    return list(PRESETS)


def workload_help() -> str:
    """Every workload with its parameters and their defaults, for ``--help``."""
    parts = []
    for name, p in PRESETS.items():
        if p.name != name:
            continue  # an alias
        params = ",".join(f"{k}={v:g}" for k, v in p.params.items())
        parts.append(f"{name}[:{params}]" if params else name)
    return ("NAME[:key=value,...] with NAME one of " + ", ".join(parts)
            + "; or a JSON-lines file (docs/benchmarks.md, Workloads)")
