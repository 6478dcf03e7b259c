"""pdserve.grammar: vocabulary bytes, compiled guides, and states that follow output tokens."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.grammar import GrammarCompiler, GrammarState, regex_for_choice, token_bytes
from pdserve.tokenizer import load_tokenizer
from tests.cluster.realstack import tiny_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(tiny_model(tmp_path_factory))


def allowed(words: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_byte_level_tokens_are_their_bytes(tok) -> None:
    table = token_bytes(tok)
    for text in (" the", "\n", "é"):
        for i in tok.encode(text, add_special_tokens=False):
            assert i in table
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode()
    assert tok.eos_token_id not in table  # special tokens are not text


def test_state_follows_the_output_wherever_it_was_sampled(tok) -> None:
    vocab, eos = len(tok), tok.eos_token_id
    index = GrammarCompiler.for_tokenizer(tok, eos).compile(regex_for_choice(["yes", "no"]))
    table = token_bytes(tok)
    state = GrammarState(index, eos)
    first = allowed(state.bitmask([], vocab), vocab)
    assert first and eos not in first
    assert all(b"yes".startswith(table[t]) or b"no".startswith(table[t]) for t in first)
    out = tok.encode("yes", add_special_tokens=False)
    assert allowed(state.bitmask(out, vocab), vocab) == {eos}  # complete: only EOS
    # a state created later (a decode instance after the hand-off) catches up the same way
    late = GrammarState(index, eos)
    assert allowed(late.bitmask(out[:1], vocab), vocab) == allowed(
        GrammarState(index, eos).bitmask(out[:1], vocab), vocab)
    assert allowed(late.bitmask(out, vocab), vocab) == {eos}


def test_bad_expressions(tok) -> None:
    compiler = GrammarCompiler.for_tokenizer(tok, tok.eos_token_id)
    with pytest.raises(ValueError, match="cannot compile"):
        compiler.compile("a(")
    failed = GrammarState(None, tok.eos_token_id)
    assert allowed(failed.bitmask([5], len(tok)), len(tok)) == {tok.eos_token_id}
