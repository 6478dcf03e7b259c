"""Tokenizer loading, chat templates and incremental detokenization (no torch)."""

from __future__ import annotations

import os
from typing import Any

# Prompt tokens kept as left context when decoding output incrementally, so that tokenizers which
# render a leading space from context (SentencePiece) produce the same text as a full decode.
_CONTEXT_TOKENS = 5


def load_tokenizer(model_dir: str) -> Any:
    """The Hugging Face fast tokenizer saved in ``model_dir`` (tokenizer.json + config)."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist")
    if not any(os.path.isfile(os.path.join(model_dir, f))
               for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"model directory {model_dir!r} has no tokenizer files")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template plus the assistant
    generation prompt. Raises ``ValueError`` when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Decodes the window ``ids[prefix:]`` and emits what extends beyond the text of
    ``ids[prefix:read]``; text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until
    the next token completes it. Stop strings are matched here because they are a property of text.
    """

    __slots__ = ("tokenizer", "ids", "prefix", "read", "text", "skip_special", "stop",
                 "include_stop", "_stop_scan")

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self.skip_special = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop
        self._stop_scan = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one token; return (new text, the stop string that matched or ``None``).

        When a stop string matches, the text is truncated at it (kept when ``include_stop``) and
        the returned delta is what remains to be emitted."""
        self.ids.append(token_id)
        prev = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if len(full) <= len(prev) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prev):]
        self.prefix, self.read = self.read, len(self.ids)
        before = len(self.text)
        self.text += delta
        if not self.stop:
            return delta, None
        longest = max(len(s) for s in self.stop)
        scan_from = max(self._stop_scan - longest + 1, 0)
        for s in self.stop:
            at = self.text.find(s, scan_from)
            if at >= 0:
                end = at + len(s) if self.include_stop else at
                self.text = self.text[:end]
                return self.text[before:], s
        self._stop_scan = len(self.text)
        return delta, None
