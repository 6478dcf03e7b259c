"""A deterministic torch-free executor for scheduler/engine tests."""

from __future__ import annotations

import time

from pdserve.engine.batch import ExecuteResult, ScheduledBatch


def next_token(context: list[int], vocab: int) -> int:
    """The 'model': a fixed function of the whole context, so recomputation is invisible."""
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % vocab


class FakeExecutor:
    """Checks that every step computes exactly the positions the KV says are missing, tracks
    which token each KV slot holds, and 'samples' :func:`next_token` of the context.

    ``step_time`` is the elapsed time each step reports; with ``sleep`` a step also takes that
    long, so a live test can watch requests in flight (unpaced, a request finishes in
    microseconds, before a poll sees it)."""

    def __init__(self, num_kv_blocks: int, block_size: int, vocab: int = 50,
                 step_time: float = 0.01, sleep: bool = False) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab = vocab
        self.step_time = step_time
        self.sleep = sleep
        self.slots: dict[int, int] = {}  # slot -> token id whose KV it holds
        self.batches: list[list[tuple[str, int, int]]] = []
        self.eos_token_ids = ()

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        if self.sleep:
            time.sleep(self.step_time)
        self.batches.append([(s.request_id, s.start, s.num_tokens) for s in batch.seqs])
        sampled = []
        for s in batch.seqs:
            req = s.request
            toks = req.all_token_ids
            for pos in range(s.start, s.start + s.num_tokens):
                self.slots[self._slot(req.block_ids, pos)] = toks[pos]
            # attention reads every earlier position from the cache: it must hold the right token
            for pos in range(s.start + s.num_tokens):
                got = self.slots.get(self._slot(req.block_ids, pos))
                assert got == toks[pos], (f"{req.request_id}: KV slot for position {pos} holds "
                                          f"{got}, expected {toks[pos]}")
            if s.sample:
                sampled.append(next_token(toks[: s.start + s.num_tokens], self.vocab))
        return ExecuteResult(sampled=sampled, elapsed=self.step_time)

    def export_kv(self, block_ids: list[int]) -> list[list[int | None]]:
        bs = self.block_size
        return [[self.slots.get(b * bs + i) for i in range(bs)] for b in block_ids]

    def import_kv(self, block_ids: list[int], payload: list[list[int | None]]) -> None:
        bs = self.block_size
        for b, vals in zip(block_ids, payload):
            for i, v in enumerate(vals):
                if v is not None:
                    self.slots[b * bs + i] = v


def reference_generate(prompt: list[int], max_tokens: int, vocab: int = 50) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(ctx, vocab)
        out.append(t)
        ctx.append(t)
    return out
