"""Decode admission: whether a decode instance reserves blocks for the next pending transfer
(torch-free). TetriInfer §3.4 ("intra-decode instance scheduling").

The decode scheduler asks ``admission.admit(scheduler, request, need)`` for the request at the
head of its pending queue, where ``need`` is the number of free blocks its prompt KV takes now;
``False`` stops admission for this step (arrival order is kept). Each policy is a small
registered class. A request's expected output length is its predicted length range's lower end
(TetriInfer §5.2.3: "our policies estimate resource usage using the predicted length range's
lower end"), at least one token; a request with no prediction is expected to run to
``max_tokens`` (exact when outputs are forced, as in the simulator).

Every policy admits a request into an empty instance when its prompt fits, so that a wrong
prediction can never stall an instance.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.config import ADMISSION_POLICIES, SchedulerConfig
from pdserve.engine.kv_cache import BlockPool
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.registry import Registry
from pdserve.request import Request


class SchedulerView(Protocol):
    """What an admission policy reads of the decode scheduler
    (:class:`pdserve.engine.scheduler.Scheduler`)."""

    running: list[Request]
    pulling: dict[str, Request]
    pool: BlockPool
    kv: KVCacheManager
    config: SchedulerConfig


def expected_total_tokens(req: Request, max_model_len: int) -> int:
    """Prompt + expected output tokens of ``req`` (its predicted range's lower end, or
    ``max_tokens`` without a prediction), never below what it already holds."""
    pred = getattr(req, "predicted", None)
    out = req.params.max_tokens if pred is None else min(max(pred.lo, 1), req.params.max_tokens)
    return max(min(req.num_prompt_tokens + out, max_model_len), req.num_tokens)


class AdmissionPolicy:
    name = ""
    reads_running = False  # reads the running requests' lengths (not only counts and the pool)

    def admit(self, sched: SchedulerView, req: Request, need: int) -> bool:
        raise NotImplementedError


ADMISSIONS: Registry[AdmissionPolicy] = Registry("admission policy", names=ADMISSION_POLICIES)
register = ADMISSIONS.register
make_admission = ADMISSIONS.make


def _busy(sched: SchedulerView) -> bool:
    return bool(sched.running or sched.pulling)


@register
class Greedy(AdmissionPolicy):
    """vLLM's greedy admission (TetriInfer §3.4's baseline): admit while the prompt KV fits the
    free blocks, keeping one free block per running or pulling request for its next token
    (vLLM's watermark). Oblivious to the working set: it may preempt later."""

    name = "greedy"

    def admit(self, sched: SchedulerView, req: Request, need: int) -> bool:
        reserve = len(sched.running) + len(sched.pulling)
        return need + reserve <= sched.pool.num_free_blocks or not _busy(sched)


@register
class ReserveStatic(AdmissionPolicy):
    """TetriInfer §3.4 reserve-static: admit a request only if its predicted memory usage
    (prompt + expected output, in blocks) fits the memory free now."""

    name = "reserve-static"

    def admit(self, sched: SchedulerView, req: Request, need: int) -> bool:
        kv = sched.kv
        growth = (kv.blocks_for(expected_total_tokens(req, sched.config.max_model_len))
                  - kv.blocks_for(req.num_tokens))
        free = sched.pool.num_free_blocks
        return need + growth <= free or (not _busy(sched) and need <= free)


@register
class ReserveDynamic(AdmissionPolicy):
    """TetriInfer §3.4 reserve-dynamic: admit a request only if memory is still left when the
    shortest remaining job finishes. With ``m`` the fewest expected remaining tokens among the
    running and pulling requests, every such request ``j`` grows by ``min(m, rem_j)`` tokens and
    the new one by ``min(m, rem_new)``; the blocks that growth takes, plus the new request's
    prompt KV, must fit the blocks free now. With nothing running it admits as reserve-static."""

    name = "reserve-dynamic"
    reads_running = True

    def admit(self, sched: SchedulerView, req: Request, need: int) -> bool:
        kv, max_len = sched.kv, sched.config.max_model_len
        free = sched.pool.num_free_blocks
        others = list(sched.running) + list(sched.pulling.values())
        if not others:
            return ReserveStatic().admit(sched, req, need)
        # a running request still makes at least one token, whatever its prediction said
        rem = [max(expected_total_tokens(r, max_len) - r.num_tokens, 1) for r in others]
        m = min(rem)
        grow = sum(kv.blocks_for(r.num_tokens + min(m, k)) - len(r.block_ids)
                   for r, k in zip(others, rem))
        rem_new = expected_total_tokens(req, max_len) - req.num_tokens
        grow_new = kv.blocks_for(req.num_tokens + min(m, rem_new)) - kv.blocks_for(req.num_tokens)
        return need + grow_new + max(grow, 0) <= free
