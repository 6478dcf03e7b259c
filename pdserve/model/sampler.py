"""Token sampling from a batch of logits, vectorised over rows.

Order of operations (vLLM's): ``min_tokens`` masking → the structured-output mask →
``logit_bias`` → repetition, frequency and presence penalties → greedy argmax for
``temperature=0`` rows; for the others temperature → top-k → top-p → min-p → one draw.

Penalties (per row, over that request's tokens):

* ``repetition_penalty`` ``r`` (CTRL, as transformers' ``RepetitionPenaltyLogitsProcessor``):
  a token of the prompt or the output has its logit ``l`` replaced by ``l / r`` if ``l > 0``
  else ``l * r``.
* ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI): a token that occurs
  ``c > 0`` times in the output has ``c * f + p`` subtracted.

Boundaries:

* top-k keeps the ``k`` highest-ranked tokens (ties broken by the sort).
* top-p keeps the smallest prefix of the descending-probability order whose mass reaches
  ``top_p``: a token stays iff the mass of the tokens ranked before it is ``< top_p - 1e-6``
  (the tolerance absorbs float rounding). With ``[0.5, 0.3, 0.15, 0.05]`` and ``top_p=0.8`` two
  tokens stay.
* min-p keeps tokens whose probability is ``>= min_p * max probability``.

A draw is an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per token, which
picks token ``i`` with probability ``p_i``. For a request with a ``seed`` the noise comes from a
CPU generator seeded by ``mix(seed, index of the output token)``, so the draw depends on nothing
but the request itself: batching, preemption or the instance that samples cannot change it.
Unseeded rows share the executor's generator.

Log-probabilities are the log-softmax of the raw logits (before temperature and filtering).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.request import SamplingParams

_MASK64 = (1 << 64) - 1
TOP_P_EPS = 1e-6


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(seed: int, output_index: int) -> int:
    """The generator seed of the draw for output token ``output_index`` of a seeded request."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_index) >> 1


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs about one row: its parameters, how many output tokens the request
    already has (the index of the token being drawn), the ids to ban while ``min_tokens``
    is unmet (EOS unless ``ignore_eos``, plus ``stop_token_ids``), the request's tokens (for
    penalties) and the structured-output mask."""

    params: SamplingParams
    output_index: int
    stop_ids: tuple[int, ...] = ()
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    allowed: np.ndarray | None = None  # int32 words; bit t set = token t allowed (grammar)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None


def _allowed_mask(words: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[: bits.size] = torch.from_numpy(bits.astype(np.bool_))
    return mask.to(device)


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Apply each row's grammar mask, ``logit_bias`` and penalties to ``logits`` (in place;
    float32 ``[n, vocab]``) and return it."""
    n, vocab = logits.shape
    dev = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if r.allowed is not None:
            logits[i].masked_fill_(~_allowed_mask(r.allowed, vocab, dev), -torch.inf)
        if p.logit_bias:
            items = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
            if items:
                ids = torch.tensor([t for t, _ in items], device=dev)
                logits[i, ids] += torch.tensor([b for _, b in items], device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor([*r.prompt_ids, *r.output_ids], dtype=torch.long, device=dev)
            seen = seen[(seen >= 0) & (seen < vocab)].unique()
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            out = torch.tensor(list(r.output_ids), dtype=torch.long, device=dev)
            counts = torch.bincount(out[(out >= 0) & (out < vocab)], minlength=vocab).float()
            logits[i] -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
    return logits


class Sampler:
    """Samples one token per row of ``logits`` ``[n, vocab]``."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        n, vocab = logits.shape
        if n != len(rows):
            raise ValueError(f"{n} rows of logits for {len(rows)} sampling rows")
        dev = logits.device
        logits = logits.float()
        want_lp = [r.params.logprobs for r in rows]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(k is not None for k in want_lp) else None)

        ban_r: list[int] = []
        ban_c: list[int] = []
        for i, r in enumerate(rows):
            if r.output_index < r.params.min_tokens:
                ids = [t for t in r.stop_ids if 0 <= t < vocab]
                ban_r += [i] * len(ids)
                ban_c += ids
        if ban_r:
            logits = logits.clone()
            logits[torch.tensor(ban_r, device=dev), torch.tensor(ban_c, device=dev)] = -torch.inf
        if any(r.allowed is not None or r.params.logit_bias or r.params.has_penalties
               for r in rows):
            logits = process_logits(logits if ban_r else logits.clone(), rows)

        chosen = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand, device=dev)
            chosen[idx] = self._sample(logits.index_select(0, idx), [rows[i] for i in rand])
        token_ids = chosen.tolist()

        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._logprobs(raw_logprobs, chosen, want_lp)
        return SampleOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        m, vocab = logits.shape
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in rows], device=dev)
        logits = logits / temp[:, None]
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        top_p = [float(r.params.top_p) for r in rows]
        min_p = [float(r.params.min_p) for r in rows]
        if min(top_k) < vocab or min(top_p) < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=dev)
            drop = rank[None, :] >= torch.tensor(top_k, device=dev)[:, None]
            if min(top_p) < 1.0:
                probs = sorted_logits.masked_fill(drop, -torch.inf).softmax(dim=-1)
                before = probs.cumsum(dim=-1) - probs
                limit = torch.tensor([p - TOP_P_EPS if p < 1.0 else torch.inf for p in top_p],
                                     device=dev)[:, None]
                drop |= before >= limit
                drop[:, 0] = False
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, -torch.inf))
        probs = logits.softmax(dim=-1)
        if max(min_p) > 0.0:
            thresh = torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True)[0]
            probs = probs.masked_fill(probs < thresh, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            e = torch.empty(len(unseeded), vocab, device=dev).exponential_(
                generator=self.generator)
            noise[torch.tensor(unseeded, device=dev)] = e
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator().manual_seed(request_seed(r.params.seed, r.output_index))
                noise[i] = torch.empty(vocab).exponential_(generator=g).to(dev)
        return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)

    @staticmethod
    def _logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                  want: list[int | None]) -> list[dict[int, float] | None]:
        k = min(max(w for w in want if w is not None), logprobs.shape[1])
        picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        top_v, top_i = (logprobs.topk(k, dim=-1) if k > 0 else (None, None))
        top_v = top_v.tolist() if top_v is not None else None
        top_i = top_i.tolist() if top_i is not None else None
        ids = chosen.tolist()
        out: list[dict[int, float] | None] = []
        for i, w in enumerate(want):
            if w is None:
                out.append(None)
                continue
            d = {ids[i]: picked[i]}
            if w and top_i is not None and top_v is not None:
                for t, v in zip(top_i[i][:w], top_v[i][:w]):
                    d.setdefault(t, v)
            out.append(d)
        return out
