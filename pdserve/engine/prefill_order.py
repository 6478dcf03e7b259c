"""TetriInfer's prefill scheduler policies (§3.3.1): FCFS, SJF and LJF by prompt length, sorted
within scheduling batches of ``PrefillSchedBatch`` requests (torch-free).

The paper keeps a raw queue (arrival order) and a scheduled queue: the scheduler moves up to
``PrefillSchedBatch`` raw requests at a time into the scheduled queue, sorted. Here the waiting
deque is both: requests the policy has not seen yet are cut, in arrival order, into groups of
``sched_batch`` (the last group may be smaller: fewer were waiting); each group keeps its place
behind the groups formed before it and is sorted inside. A request never waits behind a group
formed after its own, so neither policy starves anyone::

    arrivals 9 5 1 7 | 3 8     sched_batch = 4, SJF
    groups   [9 5 1 7] [3 8]   ->  1 5 7 9  3 8

Resumed requests (preempted, or part-computed) stay first in their order, as for every policy.
FCFS is the registry's ``fcfs``.
"""

from __future__ import annotations

import itertools
from collections import deque

from pdserve.engine.policies import CachedTokens, WaitingPolicy, _resumed, register
from pdserve.request import Request


class _SortedBatches(WaitingPolicy):
    """Sort by :meth:`key` within groups of ``sched_batch`` (TetriInfer's default 16)."""

    sched_batch_policy = True  # built with SchedulerConfig.prefill_sched_batch (policy_for)

    def __init__(self, sched_batch: int = 16) -> None:
        if sched_batch < 1:
            raise ValueError(f"prefill_sched_batch must be >= 1, got {sched_batch}")
        self.sched_batch = sched_batch
        self._group: dict[str, int] = {}  # request id -> its scheduling batch
        self._next = itertools.count()

    def key(self, req: Request) -> int:
        raise NotImplementedError

    def arrange(self, waiting: deque[Request], cached_tokens: CachedTokens) -> int | None:
        group, fresh, head = self._group, [], []
        for r in waiting:
            if _resumed(r):
                head.append(r)
            else:
                fresh.append(r)
        new = [r for r in fresh if r.request_id not in group]
        for i in range(0, len(new), self.sched_batch):
            g = next(self._next)
            for r in new[i:i + self.sched_batch]:
                group[r.request_id] = g
        fresh.sort(key=lambda r: (group[r.request_id], self.key(r)))  # stable: ties by arrival
        waiting.clear()
        waiting.extend(head)
        waiting.extend(fresh)
        if len(group) > len(fresh):  # forget admitted requests
            live = {r.request_id for r in fresh}
            for rid in [k for k in group if k not in live]:
                del group[rid]
        return None


@register
class ShortestJobFirst(_SortedBatches):
    """TetriInfer §3.3.1 SJF: shortest prompt first within each scheduling batch."""

    name = "sjf"

    def key(self, req: Request) -> int:
        return req.num_prompt_tokens


@register
class LongestJobFirst(_SortedBatches):
    """TetriInfer §3.3.1 LJF: longest prompt first within each scheduling batch."""

    name = "ljf"

    def key(self, req: Request) -> int:
        return -req.num_prompt_tokens
