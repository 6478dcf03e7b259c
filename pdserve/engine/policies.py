"""Local waiting-queue policies: which waiting requests an instance admits next (torch-free).

A policy is a small registered class. Before each step the scheduler calls
``policy.arrange(waiting, cached_tokens)``: the policy may reorder the waiting deque in place and
returns how many requests the step may admit from its head (``None``: no limit). The scheduler
then admits from the head as usual, while the token budget and the KV blocks allow.

Requests that already computed tokens or were preempted (their place at the head is how
recompute-on-preemption keeps its promise) always stay first, in their order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pdserve.config import SCHEDULING_POLICIES, SchedulerConfig
from pdserve.registry import Registry
from pdserve.request import Request

CachedTokens = Callable[[Request], int]


class WaitingPolicy:
    name = ""

    def arrange(self, waiting: deque[Request], cached_tokens: CachedTokens) -> int | None:
        raise NotImplementedError


POLICIES: Registry[WaitingPolicy] = Registry("scheduling policy", names=SCHEDULING_POLICIES)
register = POLICIES.register
make_policy = POLICIES.make


@register
class FCFS(WaitingPolicy):
    """Arrival order (preempted requests return to the head)."""

    name = "fcfs"

    def arrange(self, waiting: deque[Request], cached_tokens: CachedTokens) -> int | None:
        return None


def _resumed(req: Request) -> bool:
    return req.num_computed_tokens > 0 or bool(req.block_ids) or req.num_preemptions > 0


@register
class PriorityGroups(WaitingPolicy):
    """Preble's local scheduler (Preble §4, "Local Scheduler": "Waiting queue request ordering").

    Waiting requests fall into ``num_groups`` (P = 10) priority groups by the share of their
    prompt cached on this instance now: group ``ceil(ratio · P) − 1`` (group 0 for no hit), so
    group ``P − 1`` holds the best hits. Each step serves one group, visiting the groups in turn
    from the highest down (empty ones skipped), and admits only from that group, at most
    ``(i + 1) · k`` requests of group ``i`` (k = 10, Preble's implementation), first come first
    served within the group. Over
    a round every backlogged group ``i`` gets a share proportional to ``i + 1``: cache hits go
    first while misses are not starved.

    The paper's other local mechanisms are the scheduler's own: long prompts are chunked by
    chunked prefill (``enable_chunked_prefill``), and cached blocks are evicted in LRU order by
    the block pool.
    """

    name = "preble"

    def __init__(self, num_groups: int = 10, quota: int = 10) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if quota < 1:
            raise ValueError(f"quota must be >= 1, got {quota}")
        self.num_groups, self.quota = num_groups, quota
        self.next_group = num_groups - 1

    def group(self, req: Request, cached_tokens: CachedTokens) -> int:
        n = req.num_prompt_tokens
        hit = min(cached_tokens(req), n)
        if hit <= 0:
            return 0
        return -(-hit * self.num_groups // n) - 1  # ceil(ratio · P) - 1, in integers

    def arrange(self, waiting: deque[Request], cached_tokens: CachedTokens) -> int | None:
        head: list[Request] = []
        groups: list[list[Request]] = [[] for _ in range(self.num_groups)]
        for req in waiting:
            if _resumed(req):
                head.append(req)
            else:
                groups[self.group(req, cached_tokens)].append(req)
        if not any(groups):
            return None
        g = self.next_group
        while not groups[g]:
            g = (g - 1) % self.num_groups
        self.next_group = (g - 1) % self.num_groups
        chosen = groups[g]
        taken = {id(r) for r in chosen}
        rest = [r for r in waiting if not _resumed(r) and id(r) not in taken]
        waiting.clear()
        waiting.extend(head)
        waiting.extend(chosen)
        waiting.extend(rest)
        return len(head) + min(len(chosen), (g + 1) * self.quota)  # only the chosen group


def policy_for(config: SchedulerConfig) -> WaitingPolicy:
    """The waiting policy ``config.policy`` names, with the settings it takes from the config
    (TetriInfer's ``prefill_sched_batch`` for sjf/ljf)."""
    cls = POLICIES.get(config.policy)
    params = {"sched_batch": config.prefill_sched_batch} if cls is not None and hasattr(
        cls, "sched_batch_policy") else {}
    return make_policy(config.policy, **params)

