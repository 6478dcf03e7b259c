"""Named workloads: what each one samples, from which trace, with which filter.

A preset picks request lengths (and, where the source has them, timestamps, block hashes or
prompt text) for ``num_requests`` requests; :mod:`pdserve.bench.workloads` turns them into
prompts, scales them to a model's context and gives them arrival times. Prompts are described
as *segments* ``(key, length)``: a segment is the first ``length`` tokens of a deterministic
token stream named by ``key``, so two prompts that share a key share those tokens exactly.

| preset | source | selection |
|---|---|---|
| ``chatbot`` | ShareGPT (DistServe §6.1, Table 1) | uniform sample |
| ``code`` | HumanEval prompt text (DistServe §6.1) | problems in seeded order, repeated |
| ``summarization`` | arXiv summarization (LongBench stand-in, DistServe §6.1) | output ≤ input |
| ``lpld`` ... ``hphd`` | ShareGPT (TetriInfer §5.1) | heavy: prompt > 512, output > 128 |
| ``mixed`` | ShareGPT (TetriInfer §5.1) | uniform sample (all classes) |
| ``alpaca`` | log-normal fit of EcoServe Table 4 Alpaca-gpt4 | short in, long out |
| ``prefix`` | Preble-style generator (``papers/preble-notes.md``) | Zipf over shared prefixes |
| ``fixed`` | fixed lengths | ``input=``, ``output=`` |
| trace names | each file in ``shared/traces`` (``traces.TRACE_NAMES``) | see below |

Timestamped traces take a contiguous window of rows starting at ``start=`` (default 0) so their
real arrival pattern survives; length-only sources are sampled without replacement (with
replacement when more requests than rows are asked for).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.bench.metrics import SLO
from pdserve.bench.traces import TRACE_NAMES, Trace, load_trace
from pdserve.config import cdiv

# Segment key namespaces (see module docstring).
NS_PROMPT, NS_BLOCK, NS_PREFIX = 1, 2, 3


def segment_key(namespace: int, ident: int) -> int:
    return (namespace << 48) ^ int(ident)


@dataclass
class Selection:
    """Chosen requests before scaling. ``segments[i]`` describes request i's prompt (``None``:
    one private segment per request); ``hash_ids`` are the source's block ids per request."""

    input_lens: np.ndarray
    output_lens: np.ndarray
    arrivals: np.ndarray | None = None
    segments: list[list[tuple[int, int]]] | None = None
    hash_ids: list[list[int]] | None = None
    prompts: list[str] | None = None
    block_size: int | None = None  # tokens per block of hash_ids / of derived block ids
    chain_block_ids: bool = False  # derive prefix-block ids from the prompt tokens


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[int, np.random.Generator, dict[str, float], str | None], Selection]
    params: dict[str, float] = field(default_factory=dict)
    default_arrival: str = "poisson"
    default_slo: SLO | None = None


def _pick(n_rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if n_rows == 0:
        raise ValueError("the source has no rows left after filtering")
    return rng.choice(n_rows, size=n, replace=n > n_rows)


def _window(trace: Trace, n: int, start: int) -> np.ndarray:
    if not 0 <= start < len(trace):
        raise ValueError(f"start={start} is outside {trace.name} (0..{len(trace) - 1})")
    if start + n > len(trace):
        raise ValueError(f"{trace.name} has {len(trace) - start} requests from start={start}; "
                         f"{n} requested (lower --num-requests or start=)")
    return np.arange(start, start + n)


def _from_trace(trace: Trace, idx: np.ndarray) -> Selection:
    sel = Selection(trace.input_lens[idx].copy(), trace.output_lens[idx].copy())
    if trace.arrivals is not None:
        t = trace.arrivals[idx]
        sel.arrivals = t - t[0]
    if trace.prompts is not None:
        sel.prompts = [trace.prompts[i] for i in idx]
    if trace.hash_ids is not None:
        bs = sel.block_size = trace.hash_block_size or 512
        sel.hash_ids = [trace.hash_ids[i] for i in idx]
        sel.segments = [_block_segments(h, int(n), bs)
                        for h, n in zip(sel.hash_ids, sel.input_lens)]
    return sel


def _block_segments(hash_ids: list[int], n_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Block ``h`` ↦ segment ``(key(h), block_size)``; the last block holds the remainder."""
    segs = []
    for j, h in enumerate(hash_ids):
        left = n_tokens - j * block_size
        if left <= 0:
            break
        segs.append((segment_key(NS_BLOCK, h), min(block_size, left)))
    return segs


def _trace_preset(name: str) -> Preset:
    def build(n: int, rng: np.random.Generator, p: dict[str, float],
              d: str | None) -> Selection:
        trace = load_trace(name, d)
        if trace.arrivals is not None:
            return _from_trace(trace, _window(trace, n, int(p.get("start", 0))))
        if trace.prompts is not None:
            return _from_trace(trace, _cycle(len(trace), n, rng))
        return _from_trace(trace, _pick(len(trace), n, rng))

    timed = name.startswith(("azure", "splitwise", "mooncake", "apex"))
    desc = {"mooncake": "Mooncake conversation trace; 512-token hash_ids become shared token "
                        "blocks (exact prefix sharing)",
            "humaneval": "HumanEval prompt text; output = canonical solution length"}
    return Preset(name, desc.get(name, f"trace {name}"), build,
                  params={"start": 0} if timed else {},
                  default_arrival="trace" if timed else "poisson")


def _cycle(n_rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Every row once in a seeded order, then again in a new order, ... (no row twice before
    all rows were used)."""
    reps = cdiv(n, n_rows)
    return np.concatenate([rng.permutation(n_rows) for _ in range(reps)])[:n]


def _sharegpt_class(heavy_in: bool | None, heavy_out: bool | None) -> Callable[..., Selection]:
    def build(n: int, rng: np.random.Generator, p: dict[str, float],
              d: str | None) -> Selection:
        t = load_trace("sharegpt", d)
        mask = np.ones(len(t), dtype=bool)
        if heavy_in is not None:
            mask &= (t.input_lens > p["heavy_prompt"]) == heavy_in
        if heavy_out is not None:
            mask &= (t.output_lens > p["heavy_output"]) == heavy_out
        rows = np.flatnonzero(mask)
        return _from_trace(t, rows[_pick(len(rows), n, rng)])

    return build


DISTSERVE_MAX_LEN = 2048  # OPT's context: DistServe drops prompt + output >= 2048
DISTSERVE_MIN_LEN = 4  # and pairs whose prompt and output are both shorter than this


def distserve_filter(input_lens: np.ndarray, output_lens: np.ndarray) -> np.ndarray:
    """DistServe's ShareGPT pruning (§6.1 and its released data preparation): drop pairs with
    prompt and output both < 4 tokens and pairs with prompt + output >= 2048 tokens."""
    too_short = (input_lens < DISTSERVE_MIN_LEN) & (output_lens < DISTSERVE_MIN_LEN)
    too_long = input_lens + output_lens >= DISTSERVE_MAX_LEN
    return ~too_short & ~too_long


def _distserve_chatbot(n: int, rng: np.random.Generator, p: dict[str, float],
                       d: str | None) -> Selection:
    """DistServe's chatbot recipe on the ShareGPT length table: its two filters, then a uniform
    sample without replacement; ``output_scale`` (sensitivity studies; 1 = the recipe)
    multiplies every output length (``max(1, round(o * s))``). More requests than rows (the
    bundled sample of the length table has 1,871 after the filters): every row once before any
    twice, with a warning."""
    t = load_trace("sharegpt", d)
    keep = np.flatnonzero(distserve_filter(t.input_lens, t.output_lens))
    if n > len(keep):
        # one text per table, so that a process says it once, not once per probe
        warnings.warn(f"only {len(keep)} ShareGPT rows pass DistServe's filters: past that many "
                      "requests every row is used once before any twice (the full ShareGPT "
                      "length table in the traces folder has more)", stacklevel=2)
        rows = keep[_cycle(len(keep), n, rng)]
    else:
        rows = keep[rng.choice(len(keep), size=n, replace=False)]
    sel = _from_trace(t, rows)
    if p["output_scale"] != 1.0:
        sel.output_lens = np.maximum(1, np.rint(sel.output_lens * p["output_scale"])).astype(
            np.int64)
    return sel


def _summarization(n: int, rng: np.random.Generator, p: dict[str, float],
                   d: str | None) -> Selection:
    t = load_trace("arxiv", d)
    rows = np.flatnonzero(t.output_lens <= t.input_lens)
    return _from_trace(t, rows[_pick(len(rows), n, rng)])


def _code(n: int, rng: np.random.Generator, p: dict[str, float], d: str | None) -> Selection:
    t = load_trace("humaneval", d)
    return _from_trace(t, _cycle(len(t), n, rng))


def _lognormal(median: float, mean: float, n: int, rng: np.random.Generator,
               lo: int, hi: int) -> np.ndarray:
    sigma = math.sqrt(2.0 * math.log(mean / median))
    x = rng.lognormal(math.log(median), sigma, n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _alpaca(n: int, rng: np.random.Generator, p: dict[str, float], d: str | None) -> Selection:
    # EcoServe Table 4, Alpaca-gpt4: input mean 20.63 / median 17; output mean 163.8 / median 119.
    return Selection(_lognormal(17.0, 20.63, n, rng, 1, 4096),
                     _lognormal(119.0, 163.8, n, rng, 1, 4096))


def _fixed(n: int, rng: np.random.Generator, p: dict[str, float], d: str | None) -> Selection:
    return Selection(np.full(n, int(p["input"]), dtype=np.int64),
                     np.full(n, int(p["output"]), dtype=np.int64))


def _prefix(n: int, rng: np.random.Generator, p: dict[str, float], d: str | None) -> Selection:
    """Preble-style prompt sharing: request i uses shared prefix k with probability
    ∝ 1 / (k + 1)^zipf, then ``unique_len`` private tokens."""
    k = int(p["num_prefixes"])
    weights = 1.0 / np.arange(1, k + 1) ** p["zipf"]
    choice = rng.choice(k, size=n, p=weights / weights.sum())
    shared, unique = int(p["shared_len"]), int(p["unique_len"])
    segments = []
    for i, c in enumerate(choice):
        segs = [(segment_key(NS_PREFIX, int(c)), shared)] if shared else []
        if unique:
            segs.append((segment_key(NS_PROMPT, i), unique))
        segments.append(segs)
    return Selection(np.full(n, shared + unique, dtype=np.int64),
                     np.full(n, int(p["output_len"]), dtype=np.int64),
                     segments=segments, block_size=int(p["block_size"]), chain_block_ids=True)


_HEAVY = {"heavy_prompt": 512, "heavy_output": 128}
_CHAT_SLO = SLO(0.25, 0.1)  # DistServe Table 1, chatbot OPT-13B
_TETRI = "TetriInfer §5.1 class {} from ShareGPT (heavy prompt > 512, heavy output > 128)"

PRESETS: dict[str, Preset] = {
    "chatbot": Preset("chatbot", "DistServe §6.1 chatbot: ShareGPT lengths, Poisson arrivals",
                      _sharegpt_class(None, None), dict(_HEAVY), default_slo=_CHAT_SLO),
    "distserve-chatbot": Preset(
        "distserve-chatbot", "DistServe §6.1 chatbot recipe: ShareGPT pairs filtered as "
        "DistServe does (prompt + output < 2048, not both < 4), sampled without replacement",
        _distserve_chatbot, {"output_scale": 1.0}, default_slo=_CHAT_SLO),
    "code": Preset("code", "DistServe §6.1 code completion: HumanEval prompt text, output = "
                           "canonical solution length", _code, default_slo=SLO(0.125, 0.2)),
    "summarization": Preset("summarization", "DistServe §6.1 summarization: arXiv summarization "
                                             "lengths (LongBench stand-in), output <= input",
                            _summarization, default_slo=SLO(15.0, 0.15)),
    "lpld": Preset("lpld", _TETRI.format("LPLD"), _sharegpt_class(False, False), dict(_HEAVY),
                   default_slo=_CHAT_SLO),
    "lphd": Preset("lphd", _TETRI.format("LPHD"), _sharegpt_class(False, True), dict(_HEAVY),
                   default_slo=_CHAT_SLO),
    "hpld": Preset("hpld", _TETRI.format("HPLD"), _sharegpt_class(True, False), dict(_HEAVY),
                   default_slo=_CHAT_SLO),
    "hphd": Preset("hphd", _TETRI.format("HPHD"), _sharegpt_class(True, True), dict(_HEAVY),
                   default_slo=_CHAT_SLO),
    "mixed": Preset("mixed", "TetriInfer §5.1 Mixed: uniform ShareGPT sample (all classes)",
                    _sharegpt_class(None, None), dict(_HEAVY), default_slo=_CHAT_SLO),
    "alpaca": Preset("alpaca", "Alpaca-like short prompt, long output (log-normal fit of "
                               "EcoServe Table 4 Alpaca-gpt4)", _alpaca,
                     default_slo=SLO(1.0, 0.1)),
    "prefix": Preset("prefix", "Preble-style prefix sharing: Zipf popularity over shared "
                               "prefixes plus a private suffix", _prefix,
                     params={"num_prefixes": 8, "zipf": 1.1, "shared_len": 1024,
                             "unique_len": 128, "output_len": 64, "block_size": 512}),
    "fixed": Preset("fixed", "fixed input and output lengths", _fixed,
                    params={"input": 128, "output": 64}),
    **{name: _trace_preset(name) for name in TRACE_NAMES},
}
PRESETS["apex-lmsys"] = PRESETS["apex-lmsys-llama"]
PRESETS["apex-creation"] = PRESETS["apex-creation-llama"]
PRESETS["apex-summarization"] = PRESETS["apex-summarization-llama"]


def parse_workload_spec(spec: str) -> tuple[Preset, dict[str, float]]:
    """``NAME[:key=value,...]`` → the preset and its parameters (defaults filled in)."""
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name not in PRESETS:
        raise ValueError(f"unknown workload {spec!r}; choose one of {', '.join(PRESETS)} "
                         "(or a .jsonl file)")
    preset = PRESETS[name]
    params: dict[str, Any] = dict(preset.params)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in preset.params:
            known = ", ".join(preset.params) or "none"
            raise ValueError(f"workload {name!r} has no parameter {item!r} (parameters: {known})")
        try:
            params[key] = float(val)
        except ValueError:
            raise ValueError(f"workload parameter {key}={val!r} is not a number") from None
    _check_params(name, params)
    return preset, params


def _check_params(name: str, p: dict[str, float]) -> None:
    positive = {"num_prefixes", "input", "output", "output_len", "block_size"}
    for key, val in p.items():
        if not math.isfinite(val) or val < 0 or (key in positive and val < 1):
            raise ValueError(f"workload {name!r}: {key}={val:g} is out of range")
    if name == "distserve-chatbot" and not p["output_scale"] > 0:
        raise ValueError(f"workload {name!r}: output_scale must be > 0")
    if name == "prefix" and p["shared_len"] + p["unique_len"] < 1:
        raise ValueError("workload 'prefix' needs shared_len + unique_len >= 1")

