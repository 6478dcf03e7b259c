"""Structured output: regular-expression guides over a tokenizer's vocabulary (torch-free).

The server turns ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``guided_json``/``guided_regex``/``guided_choice`` into one regular expression
(:func:`regex_for_schema`, :func:`regex_for_choice`); the engine keeps a :class:`GrammarState`
per request (on ``Request.grammar``) and the executor masks every sampled row with the tokens
the state allows. The automaton over tokens comes from ``outlines-core`` (a Rust library with no
Python dependencies): :class:`GrammarCompiler` builds its vocabulary once per tokenizer and
compiles (and caches) one index per regular expression.

A state follows the request's output tokens, wherever they were sampled: a decode instance that
imports a request whose first token came from a prefill instance, or a request recomputed
after preemption, replays the tokens it has not seen (:meth:`GrammarState.sync`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from pdserve.schema_regex import BOOLEAN, NULL, STRING, schema_regex

# Whitespace allowed between JSON tokens: a single optional space, which keeps small models
# from looping on whitespace (outlines-core's default allows any run of it).
JSON_WHITESPACE = r"[ ]?"


def json_object_regex() -> str:
    """``response_format: json_object``: a JSON object whose values are scalars or arrays of
    scalars. One level only: a regular expression for nested objects grows exponentially with
    the depth (outlines-core's own ``{"type": "object"}`` takes seconds to compile on a 512-token
    vocabulary); give a ``json_schema`` for nested documents."""
    ws = JSON_WHITESPACE
    number = schema_regex({"type": "number"}, ws)  # bounded digits, no exponent
    scalar = f"({STRING}|{number}|{BOOLEAN}|{NULL})"
    array = rf"\[{ws}({scalar}({ws},{ws}{scalar})*)?{ws}\]"
    value = f"({scalar}|{array})"
    member = f"{STRING}{ws}:{ws}{value}"
    return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"


def regex_for_schema(schema: str | dict[str, Any]) -> str:
    """The regular expression of (bounded) JSON documents valid under ``schema`` (a JSON Schema
    as text or a dict; :mod:`pdserve.schema_regex`). Raises ``ValueError`` naming a keyword
    that cannot be enforced."""
    try:
        return schema_regex(schema, JSON_WHITESPACE)
    except ValueError as e:
        raise ValueError(f"unsupported JSON schema: {e}") from e


MAX_REGEX_CHARS = 100_000
MAX_REPEAT = 2000  # a counted repetition {m,n} unrolls into up to n automaton states
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def check_regex(regex: str) -> None:
    """Refuse expressions whose automaton would take seconds to minutes to build: over
    ``MAX_REGEX_CHARS`` characters, or a counted repetition over ``MAX_REPEAT`` (``x{5000}``
    takes over a second on a 512-token vocabulary). Raises ``ValueError``."""
    if len(regex) > MAX_REGEX_CHARS:
        raise ValueError(f"the output constraint is too large ({len(regex)} characters as a "
                         f"regular expression, at most {MAX_REGEX_CHARS})")
    for m in _REPEAT.finditer(regex):
        bound = max(int(m.group(1)), int(m.group(2) or 0))
        if bound > MAX_REPEAT:
            raise ValueError(f"the output constraint repeats up to {bound} times "
                             f"({m.group(0)}); at most {MAX_REPEAT} is supported")


def regex_for_choice(choices: list[str]) -> str:
    """One of ``choices`` exactly."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted (byte-level BPE token strings)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_SPIECE_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """The bytes each ordinary (non-special) token of a Hugging Face tokenizer stands for."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        decoder = json.dumps(decoder)
    out: dict[int, bytes] = {}
    if "ByteLevel" in decoder:
        table = _byte_decoder()
        for tok, i in vocab.items():
            if i in special:
                continue
            try:
                out[i] = bytes(table[c] for c in tok)
            except KeyError:  # an added token written as plain text
                out[i] = tok.encode("utf-8")
        return out
    for tok, i in vocab.items():
        if i in special:
            continue
        m = _SPIECE_BYTE.match(tok)
        out[i] = bytes([int(m.group(1), 16)]) if m else tok.replace("\u2581", " ").encode()
    return out


class GrammarCompiler:
    """Compiles regular expressions into token-level indexes for one tokenizer (thread-safe,
    LRU-cached). Build with :meth:`for_tokenizer` to share one per tokenizer and process."""

    _shared: dict[tuple[str, int, int], GrammarCompiler] = {}
    _shared_lock = threading.Lock()

    def __init__(self, tokenizer: Any, eos_token_id: int, cache_size: int = 64) -> None:
        from outlines_core import Vocabulary

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in token_bytes(tokenizer).items():
            if i != eos_token_id and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = Vocabulary(eos_token_id, by_bytes)
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, eos_token_id: int) -> GrammarCompiler:
        key = (str(getattr(tokenizer, "name_or_path", id(tokenizer))), len(tokenizer),
               eos_token_id)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(tokenizer, eos_token_id)
            return cls._shared[key]

    def compile(self, regex: str) -> Any:
        """The ``outlines_core.Index`` of ``regex``. Raises ``ValueError`` when the expression
        is invalid or unsupported."""
        from outlines_core import Index

        check_regex(regex)
        with self._lock:
            if regex in self._cache:
                self._cache.move_to_end(regex)
                return self._cache[regex]
        try:
            index = Index(regex, self.vocabulary)
        except Exception as e:  # the Rust side raises its own error types
            raise ValueError(f"cannot compile the output constraint: {e}") from e
        with self._lock:
            self._cache[regex] = index
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return index


class GrammarState:
    """A request's position in its guide.

    :meth:`bitmask` gives the allowed next tokens as int32 words: bit ``t % 32`` of word
    ``t // 32`` set = token ``t`` allowed. In a final state with no continuation only EOS is
    allowed, so the request stops there."""

    __slots__ = ("guide", "consumed", "eos_token_id", "failed")

    def __init__(self, index: Any, eos_token_id: int) -> None:
        """``index=None`` (an expression that did not compile) allows only EOS."""
        from outlines_core import Guide

        self.guide = Guide(index) if index is not None else None
        self.consumed = 0
        self.eos_token_id = eos_token_id
        self.failed = index is None

    def sync(self, output_ids: list[int]) -> None:
        """Advance over the output tokens not seen yet."""
        for t in output_ids[self.consumed:]:
            if self.guide is None or self.failed:
                break
            try:
                self.guide.advance(t, return_tokens=False)
            except Exception:  # a token outside the guide (only if sampled unmasked): stop
                self.failed = True
        self.consumed = len(output_ids)

    def bitmask(self, output_ids: list[int], vocab: int) -> np.ndarray:
        """The allowed next tokens after ``output_ids``, as ``ceil(vocab / 32)`` int32 words."""
        self.sync(output_ids)
        words = np.zeros((vocab + 31) // 32, dtype=np.int32)
        if self.guide is None or self.failed:
            words.view(np.uint8)[self.eos_token_id // 8] |= 1 << (self.eos_token_id % 8)
            return words
        self.guide.write_mask_into(words.ctypes.data, words.size, 4)
        return words
