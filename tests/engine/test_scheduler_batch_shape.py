"""``ScheduledBatch.shape_and_samples`` (the simulator's hot path, one pass) against the
per-field properties it replaces (``prefill_contexts``, ``decode_context_lens``, ``sample``)."""

from __future__ import annotations

import random

from pdserve.engine.batch import ScheduledBatch, ScheduledSeq
from pdserve.request import Request, SamplingParams


def _req(i: int, prompt: int, out: int) -> Request:
    r = Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=64))
    for t in range(out):
        r.append_token(7 + t)
    return r


def test_shape_and_samples_matches_the_properties():
    rng = random.Random(0)
    for trial in range(200):
        seqs = []
        for i in range(rng.randint(0, 12)):
            prompt, out = rng.randint(1, 40), rng.randint(0, 5)
            r = _req(i, prompt, out)
            total = prompt + out
            kind = rng.choice(("decode", "chunk", "recompute1", "prompt_last1"))
            if kind == "decode" and out > 0:
                start, n = total - 1, 1          # a decode: one token after the prompt
            elif kind == "recompute1":
                start, n = 0, 1                  # one token inside the prompt: not a decode
            elif kind == "prompt_last1":
                start, n = prompt - 1, 1         # the prompt's last token: a prefill chunk
            else:
                start = rng.randint(0, total - 1)
                n = rng.randint(1, total - start)
            seqs.append(ScheduledSeq(r, start, n, start + n == total))
        b = ScheduledBatch(trial, seqs, num_pad_tokens=rng.choice((0, 0, 3)))
        prefills, decodes, n = b.shape_and_samples()
        want_p = b.prefill_contexts + ([(0, b.num_pad_tokens)] if b.num_pad_tokens else [])
        assert prefills == want_p
        assert decodes == b.decode_context_lens
        assert n == sum(1 for s in seqs if s.sample)
        assert b.shape() == (prefills, decodes)
