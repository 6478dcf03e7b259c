"""Structured output cost (docs/benchmarks.md, "Serving API: structured output cost").

For each vocabulary (the random tiny llama's 512-token byte-level BPE, and a 32k byte-level BPE
trained here on the Python standard library's sources, since no real model can be downloaded)
and each constraint (a choice, a regex, a JSON schema, ``json_object``), reports:

- **compile**: building the token-level index once (cached afterwards per expression);
- **mask per token**: what the engine adds to each sampled token of a constrained request:
  advancing the guide by the sampled token, writing the allowed-token bitmask
  (``GrammarState.bitmask``), expanding it and masking one row of float32 logits (the
  sampler's ``process_logits``); measured along random valid outputs.

    python benchmarks/grammar_mask.py [--tokens 2000] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import sysconfig
import tempfile
import time
from typing import Any

import numpy as np
import torch

from pdserve.grammar import (
    GrammarCompiler,
    GrammarState,
    json_object_regex,
    regex_for_choice,
    regex_for_schema,
)
from pdserve.model.sampler import SampleRow, process_logits
from pdserve.request import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                         "kind": {"enum": ["cat", "dog", "fish"]}},
          "required": ["name", "age", "kind"]}
CONSTRAINTS = {
    "choice (3)": lambda: regex_for_choice(["positive", "negative", "neutral"]),
    "regex (phone)": lambda: r"\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}",
    "json_schema (4 fields)": lambda: regex_for_schema(SCHEMA),
    "json_object": json_object_regex,
}


def big_tokenizer(vocab: int) -> Any:
    """A byte-level BPE of ``vocab`` tokens trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    path = os.path.join(tempfile.mkdtemp(), "tokenizer.json")
    tok.save(path)
    fast = PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<eos>")
    fast.name_or_path = f"stdlib-bpe-{vocab}"
    return fast


def tiny_tokenizer() -> Any:
    from pdserve.model.tiny import make_tiny_model
    from pdserve.tokenizer import load_tokenizer

    return load_tokenizer(make_tiny_model(tempfile.mkdtemp() + "/llama"))


def measure(tok: Any, tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    eos = tok.eos_token_id
    vocab = len(tok)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, eos)
    vocab_s = time.perf_counter() - t0
    rows = []
    for name, make in CONSTRAINTS.items():
        regex = make()
        t0 = time.perf_counter()
        index = compiler.compile(regex)
        compile_s = time.perf_counter() - t0
        logits = torch.zeros(1, vocab)
        params = SamplingParams(guided_regex=regex)
        steps, spent = 0, 0.0
        while steps < tokens:
            state = GrammarState(index, eos)
            out: list[int] = []
            while steps < tokens:
                t0 = time.perf_counter()
                words = state.bitmask(out, vocab)
                process_logits(logits.clone(), [SampleRow(params, len(out), allowed=words)])
                spent += time.perf_counter() - t0
                steps += 1
                bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
                nxt = int(rng.choice(np.flatnonzero(bits).tolist()))
                if nxt == eos or len(out) > 200:
                    break
                out.append(nxt)
        rows.append({"vocab": vocab, "constraint": name, "vocab_build_ms": 1e3 * vocab_s,
                     "compile_ms": 1e3 * compile_s, "mask_us_per_token": 1e6 * spent / steps})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="masked tokens per constraint")
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    rows = measure(tiny_tokenizer(), args.tokens, rng)
    rows += measure(big_tokenizer(args.vocab), args.tokens, rng)
    print("| vocabulary | constraint | index compile ms | mask + advance µs/token |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab']} | {r['constraint']} | {r['compile_ms']:.1f} | "
              f"{r['mask_us_per_token']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
