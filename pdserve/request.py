"""Requests, sampling parameters, per-request timelines and outputs (torch-free)."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# ---- chained block hashes: a full block of tokens is named by its whole prefix (the KV pool's
# prefix reuse and the cluster's prefix index share them)
NO_PARENT = -1


def hash_block(parent_hash: int, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))


def hash_blocks(token_ids: Sequence[int], block_size: int,
                hashes: list[int] | None = None) -> list[int]:
    """The chained :func:`hash_block` of every full block of ``token_ids``: ``hashes`` (the
    chain of its first ``len(hashes)`` blocks, extended in place) or a new list."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out = [] if hashes is None else hashes
    n = len(token_ids) // block_size
    if len(out) >= n:
        return out
    start = len(out) * block_size
    toks = tuple(token_ids[start:n * block_size])  # only the new blocks' tokens, once
    parent = out[-1] if out else NO_PARENT
    for i in range(0, len(toks), block_size):
        parent = hash((parent, toks[i:i + block_size]))  # = hash_block, inlined
        out.append(parent)
    return out


def _bad(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{name} {rule}, got {value!r}")


@dataclass
class SamplingParams:
    """How to sample one request's output (names follow vLLM/OpenAI).

    ``temperature=0`` is greedy. ``top_k=0`` or ``-1`` disables top-k; ``top_p=1`` and ``min_p=0``
    disable theirs. ``seed`` makes this request's sampling reproducible regardless of batching.
    ``logprobs=N`` returns the sampled token's log-probability and the ``N`` most likely
    alternatives at each step (``0`` = the sampled token only; at most ``MAX_LOGPROBS``).

    Logit processing (per sequence, before temperature): ``logit_bias`` ``{token: bias}`` is
    added (OpenAI, bias in [-100, 100]); ``repetition_penalty`` divides positive logits and
    multiplies negative ones of every token in the prompt or the output (CTRL/transformers;
    ``1`` = off); ``frequency_penalty`` subtracts ``count`` and ``presence_penalty`` ``1`` per
    token already in the output, each in [-2, 2] (OpenAI). ``guided_regex`` constrains the
    output to a full match of a regular expression (structured output; JSON schemas are
    compiled to one by the server).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    guided_regex: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):
                raise _bad(name, v, "must be a list" + (" or a string" if name == "stop" else ""))
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise _bad("max_tokens", self.max_tokens, "must be an integer")
        if self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "must be >= 1")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= 1e6:
            raise _bad("temperature", self.temperature, "must be >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be -1, 0 (disabled) or a positive integer")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "must be >= 0")
        if self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise _bad("logprobs", self.logprobs, "must be a non-negative integer")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise _bad("logprobs", self.logprobs, f"must be <= {MAX_LOGPROBS}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise _bad(name, v, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be in (0, 100]")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.guided_regex is not None and (not isinstance(self.guided_regex, str)
                                              or not self.guided_regex):
            raise _bad("guided_regex", self.guided_regex, "must be a non-empty string")
        if self.seed is not None and not isinstance(self.seed, int):
            raise _bad("seed", self.seed, "must be an integer")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", s, "entries must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise _bad("stop_token_ids", t, "entries must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries; OpenAI's limit


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """``{token id: bias}`` with int keys (JSON's string keys are converted)."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", bias, "must be a map of token id to bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"{len(bias)} entries", f"must have <= {MAX_LOGIT_BIAS} entries")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tok = int(k) if not isinstance(k, bool) else -1
        except (TypeError, ValueError):
            tok = -1
        if tok < 0:
            raise _bad("logit_bias", k, "keys must be non-negative token ids")
        if not _is_real(v) or not -100.0 <= v <= 100.0:
            raise _bad("logit_bias", v, "values must be in [-100, 100]")
        out[tok] = float(v)
    return out


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request with ``n`` samples and ``seed`` (sample 0 keeps
    the request's seed, so ``n=1`` is unchanged)."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1)
    return x ^ (x >> 29)


def validate_prompt(prompt_token_ids: list[int], max_model_len: int,
                    vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` naming the problem if a prompt cannot be served."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty (0 tokens); give at least one token")
    if n >= max_model_len:
        raise ValueError(f"prompt has {n} tokens, which leaves no room to generate within "
                         f"max_model_len={max_model_len}")
    if vocab_size is not None:
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary "
                                 f"[0, {vocab_size})")


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued for (re)computation
    RUNNING = 1
    WAITING_KV = 2  # decode role: accepted, KV not imported yet
    HELD = 3  # prefill role: first token done, KV kept until a decode instance pulls it
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass
class Timeline:
    """Every moment of a request's life (seconds, same clock as the driver's ``now``).

    Filled by the engine (queued, prefill start/end, decode admitted, tokens, finish) and by the
    controller (arrival, routed, transfer start/end). ``None`` = did not happen (e.g. colocated
    requests have no transfer).
    """

    arrival: float | None = None
    routed: float | None = None
    prefill_queued: float | None = None
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_start: float | None = None
    transfer_end: float | None = None
    decode_queued: float | None = None
    decode_admitted: float | None = None
    decode_start: float | None = None  # the first step that decodes it (after its first token)
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        if self.arrival is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """(last − first token) / (n − 1); ``None`` for one-token outputs (DESIGN.md)."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    def merge(self, other: Timeline) -> None:
        """Take every timestamp ``other`` has set and this one has not (token times are not
        merged: the controller records them as tokens arrive)."""
        for name in ("arrival", "routed", "prefill_queued", "prefill_start", "prefill_end",
                     "transfer_start", "transfer_end", "decode_queued", "decode_admitted",
                     "decode_start", "finish"):
            if getattr(self, name) is None and getattr(other, name) is not None:
                setattr(self, name, getattr(other, name))

    @property
    def switch_wait(self) -> float | None:
        """EcoServe's phase-switching wait (§4.2.2): from the first token until the request's
        decoding starts — other requests' prefills (colocated, temporal) or the KV transfer and
        the decode queue (disaggregated). ``None`` before it decodes."""
        st = self.stages()
        if st is None or self.decode_start is None and self.transfer_end is None:
            return None
        return st["transfer"] + st["decode_queue"]

    def stages(self) -> dict[str, float] | None:
        """The request's five latency stages (DistServe §6.3), or ``None`` without prefill
        timestamps; the benchmark breakdown and the server's /metrics histograms both use
        this one definition.

        ``arrival → prefill_start`` prefill queue; ``prefill_start → prefill_end`` prefill;
        ``transfer_end − transfer_start`` transfer; decode starts at the latest of
        ``transfer_end``, ``decode_admitted`` and ``decode_start`` (the first step that decodes
        the request; ``prefill_end`` without any) and the time from ``prefill_end`` to it, less
        the transfer, is decode queue — on a colocated or temporal instance the prefills of
        others that run first, EcoServe's phase-switching wait (§4.2.2); decode runs until
        ``finish`` (else last token). The five add up to ``end − arrival``.
        """
        first = self.first_token
        p_end = self.prefill_end if self.prefill_end is not None else first
        if self.arrival is None or self.prefill_start is None or p_end is None:
            return None
        end = self.finish if self.finish is not None else (self.token_times or [p_end])[-1]
        transfer = 0.0
        if self.transfer_start is not None and self.transfer_end is not None:
            transfer = max(self.transfer_end - self.transfer_start, 0.0)
        d_start = max([t for t in (self.transfer_end, self.decode_admitted, self.decode_start)
                       if t is not None], default=p_end)
        d_start = min(max(d_start, p_end), max(end, p_end))
        return {
            "prefill_queue": max(self.prefill_start - self.arrival, 0.0),
            "prefill": max(p_end - self.prefill_start, 0.0),
            "transfer": transfer,
            "decode_queue": max(d_start - p_end - transfer, 0.0),
            "decode": max(end - d_start, 0.0),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "arrival": self.arrival, "routed": self.routed,
            "prefill_queued": self.prefill_queued, "prefill_start": self.prefill_start,
            "prefill_end": self.prefill_end, "transfer_start": self.transfer_start,
            "transfer_end": self.transfer_end, "decode_queued": self.decode_queued,
            "decode_admitted": self.decode_admitted, "decode_start": self.decode_start,
            "token_times": list(self.token_times),
            "finish": self.finish,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Timeline:
        return cls(**{k: (list(v) if k == "token_times" else v) for k, v in d.items()})


class Prompt(list):
    """A prompt's token ids that remember their chained block hashes
    (:func:`hash_blocks`), so that a prompt is hashed once in a cluster:
    the controller makes each prompt one of these, the prefix-aware router's index lookup and
    the engine's block pool (:class:`Request` keeps a reference) share the chain. A prompt is
    not changed once made (the chain is computed for the first block size asked for and
    extended, never recomputed); it pickles with its chain."""

    __slots__ = ("_bs", "_chain")

    def __init__(self, token_ids: Iterable[int] = ()) -> None:
        super().__init__(token_ids)
        self._bs = 0
        self._chain: list[int] = []

    def block_hashes(self, block_size: int) -> list[int]:
        """The chained hashes of the prompt's full blocks (shared: do not change the list)."""
        if block_size != self._bs:
            if self._bs:  # another block size (rare): not kept
                return hash_blocks(self, block_size)
            self._bs = block_size
        return hash_blocks(self, block_size, self._chain)


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids``: a :class:`Prompt`'s own (do not
    change the list), else computed now."""
    if isinstance(token_ids, Prompt):
        return token_ids.block_hashes(block_size)
    return hash_blocks(token_ids, block_size)


class Request:
    """One request inside an engine.

    ``num_computed_tokens`` chases ``num_tokens`` (prompt + generated so far): a prefill chunk and
    a decode step are both "compute these many tokens". ``block_ids`` is the request's block
    table; ``block_hashes`` the chained hashes of its full blocks (filled lazily, starting from
    the prompt's own chain when it came as a :class:`Prompt`: ``shared_prompt``).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "params",
        "status", "num_computed_tokens", "num_cached_tokens", "block_ids", "block_hashes",
        "timeline", "logprobs", "num_preemptions", "stop_reason", "detok", "grammar",
        "predicted", "shared_prompt",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = request_id
        shared = prompt_token_ids if isinstance(prompt_token_ids, Prompt) else None
        # a Prompt is never changed: shared, not copied (a plain list is copied)
        self.prompt_token_ids = shared if shared is not None else list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set at first scheduling (prefix-cache hit length)
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.shared_prompt = shared
        self.timeline = Timeline(arrival=arrival_time)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.detok: Any = None  # incremental detokenizer state (engine-owned)
        self.grammar: Any = None  # structured-output matcher state (executor-owned)
        self.predicted: Any = None  # predicted output length range (pdserve.predict), if any

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")


@dataclass
class RequestOutput:
    """The result (or a streamed delta) of one request.

    ``token_ids`` and ``text`` are the generated output so far (cumulative); ``new_token_ids`` and
    ``new_text`` what this step added. ``finish_reason`` is ``'stop'`` or ``'length'`` once
    finished (``'abort'``/``'error'`` for requests that were cancelled or failed), else ``None``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    prompt: str | None = None
    timeline: Timeline = field(default_factory=Timeline)
    error: str | None = None
    instance_id: str | None = None  # the instance that produced this delta

    @property
    def token_times(self) -> list[float]:
        return self.timeline.token_times

    @property
    def arrival_time(self) -> float | None:
        return self.timeline.arrival

    @property
    def first_token_time(self) -> float | None:
        return self.timeline.first_token
