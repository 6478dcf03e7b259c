"""Plain data passed between scheduler, executor and engine (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    """Compute positions ``[start, start + num_tokens)`` of ``request`` this step.

    ``sample`` is true when the chunk ends at the request's last known token, i.e. the step yields
    one new token for it. The KV of the computed positions is written to ``request.block_ids``::

        block_size = 4, block_ids = [7, 2, 9], start = 5, num_tokens = 3
        position:   0 1 2 3 | 4 5 6 7 | 8 ...
        block:      7       | 2       | 9
        slots:                 2*4+1, 2*4+2, 2*4+3   (positions 5, 6, 7)
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]

    @property
    def context_len(self) -> int:
        """Tokens of context attended to by the last computed position (itself included)."""
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        """One new token after the prompt was fully computed (not a prefill or a recompute)."""
        return self.num_tokens == 1 and self.start >= self.request.num_prompt_tokens


@dataclass
class ScheduledBatch:
    """What one engine step computes; the executor's only input.

    ``seqs`` are in execution order. ``preempted`` lists requests evicted (KV freed, to be
    recomputed) while building this batch; they are not in ``seqs``. ``num_pad_tokens``: zero
    tokens that pad a fixed-size prefill chunk (TetriInfer §3.3.3); a latency model prices them
    as one more prefill entry, the torch executor skips them (a CPU gains nothing from fixed
    shapes).
    """

    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_pad_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def prefill_lens(self) -> list[int]:
        """Tokens computed per prefill (or chunk, or recompute) entry."""
        return [s.num_tokens for s in self.seqs if not s.is_decode]

    @property
    def prefill_contexts(self) -> list[tuple[int, int]]:
        """(start, num_tokens) of each prefill entry (attention covers start + num_tokens)."""
        return [(s.start, s.num_tokens) for s in self.seqs if not s.is_decode]

    @property
    def decode_context_lens(self) -> list[int]:
        return [s.context_len for s in self.seqs if s.is_decode]

    def shape(self) -> tuple[list[tuple[int, int]], list[int]]:
        """``(prefill_contexts, decode_context_lens)`` in one pass (latency models' input)."""
        prefills, decodes, _ = self.shape_and_samples()
        return prefills, decodes

    def shape_and_samples(self) -> tuple[list[tuple[int, int]], list[int], int]:
        """:meth:`shape` plus the number of sampled sequences, in the same single pass (the
        simulated executor's hot path)."""
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        n = 0
        for s in self.seqs:  # is_decode inlined: one pass per sequence per simulated step
            if s.sample:
                n += 1
            start, k = s.start, s.num_tokens
            if k == 1 and start >= len(s.request.prompt_token_ids):
                decodes.append(start + 1)
            else:
                prefills.append((start, k))
        if self.num_pad_tokens:
            prefills.append((0, self.num_pad_tokens))
        return prefills, decodes, n

    @property
    def kind(self) -> str:
        """``'prefill'``, ``'decode'``, ``'mixed'`` or ``'empty'``."""
        has_p = any(not s.is_decode for s in self.seqs)
        has_d = any(s.is_decode for s in self.seqs)
        if has_p and has_d:
            return "mixed"
        return "prefill" if has_p else ("decode" if has_d else "empty")


@dataclass
class ExecuteResult:
    """What the executor returns for a batch.

    ``sampled`` has one token id per ``seq.sample`` entry, in batch order; ``logprobs`` (when any
    request asked) aligns with it: ``{token_id: logprob}`` holding the sampled token and the top
    alternatives, or ``None`` for requests that did not ask. ``elapsed`` is the step's duration in
    seconds (measured wall time for a real executor, modelled time for a simulated one).
    """

    sampled: list[int]
    elapsed: float
    logprobs: list[dict[int, float] | None] | None = None
