"""TetriInfer's inter-decode dispatch (§3.3.4) and its comparison policies (§5.2.3), as routers.

The controller counts, per decode instance, the requests routed there as heavy or light decodes
and their predicted KV tokens (:class:`~pdserve.cluster.routing.InstanceView` ``num_heavy``,
``num_light``, ``predicted_tokens``), from each request's predicted output length range
(:mod:`pdserve.predict`; without a prediction, ``max_tokens``). A decode is *heavy* when its
predicted length (range midpoint) exceeds 128 tokens, the paper's split (§5.1: ShareGPT's median
answer). A request's predicted usage is its prompt plus the range's upper end, in KV tokens.

Registered decode routers (``--decode-router``):

- ``power_of_two_length`` — TetriInfer §3.3.4: split the instances into α (room for the
  request's predicted usage next to what is already predicted there) and β; pick two of α at
  random (seeded) and send the request to the one whose heavy share (heavy : light ratio) stays
  lowest with it; with α empty, the least predicted load of all.
- ``random`` — §5.2.3's random dispatch (seeded).
- ``imbalanced`` — §5.2.3's worst case: every heavy decode to the first instance, light ones
  round robin over the others.
- ``least_load`` (routing.py) — DistServe's KV-load balance, the third baseline.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from pdserve.cluster.routing import InstanceView, Router, register

if TYPE_CHECKING:
    from pdserve.cluster.cluster_request import ClusterRequest

HEAVY_DECODE_TOKENS = 128  # TetriInfer §5.1: decodes longer than ShareGPT's median are heavy


def decode_demand(req: ClusterRequest) -> tuple[bool, int]:
    """``(heavy, predicted KV tokens at the end)`` of a request about to decode."""
    pred, cap = req.predicted, req.params.max_tokens
    mid = cap if pred is None else min(pred.mid, cap)
    hi = cap if pred is None else min(pred.hi, cap)
    return mid > HEAVY_DECODE_TOKENS, len(req.prompt_token_ids) + hi


def capacity(inst: InstanceView) -> int:
    return inst.num_kv_blocks * inst.block_size


def heavy_share(inst: InstanceView, heavy: bool) -> float:
    """Share of heavy decodes on ``inst`` with one more (heavy or light) request: ordering by
    it is ordering by the heavy : light ratio, without dividing by zero."""
    h = inst.num_heavy + heavy
    return h / (h + inst.num_light + (not heavy))


@register
class PowerOfTwoLength(Router):
    """TetriInfer §3.3.4 decentralized load balancing (module docstring); ``seed`` fixes the
    random pairs."""

    name = "power_of_two_length"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        heavy, need = decode_demand(request)
        alpha = [i for i in candidates if i.predicted_tokens + need <= capacity(i)]
        if not alpha:  # no instance has room: the least predicted load
            return min(candidates, key=lambda i: (i.predicted_tokens / capacity(i), i.active))
        pair = alpha if len(alpha) <= 2 else self.rng.sample(alpha, 2)
        return min(pair, key=lambda i: (heavy_share(i, heavy), i.active))


@register
class RandomDispatch(Router):
    """TetriInfer §5.2.3 random: a uniformly random instance (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        return self.rng.choice(candidates)


@register
class Imbalanced(Router):
    """TetriInfer §5.2.3 imbalance, the worst case: heavy decodes all go to the first
    instance, light ones round robin over the rest (over all when there is one)."""

    name = "imbalanced"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        heavy, _ = decode_demand(request)
        if heavy or len(candidates) == 1:
            return candidates[0]
        rest = candidates[1:]
        self._next += 1
        return rest[(self._next - 1) % len(rest)]
