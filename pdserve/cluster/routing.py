"""Routers: which instance gets a request. One small class each, registered by name."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from pdserve.engine.engine import EngineStats
from pdserve.engine.kv_cache import KVEvent
from pdserve.registry import Registry

if TYPE_CHECKING:
    from pdserve.cluster.cluster_request import ClusterRequest
    from pdserve.config import ClusterConfig


@dataclass
class InstanceView:
    """The controller's picture of one instance.

    ``queued`` counts requests dispatched to it whose first token has not come back;
    ``active`` requests assigned and unfinished; ``pending_tokens`` the KV tokens of requests
    assigned to it that its block pool has not reserved yet (a decode instance reserves when it
    pulls). ``stats`` is the instance's last report.
    """

    instance_id: str
    role: str
    num_kv_blocks: int
    block_size: int
    alive: bool = True
    stats: EngineStats | None = None
    queued: int = 0
    active: int = 0
    pending_tokens: int = 0
    # TetriInfer (cluster/decode_dispatch.py): decodes routed here by predicted length, their
    # predicted KV tokens; ``draining``: being emptied for a role flip (routers do not see it)
    num_heavy: int = 0
    num_light: int = 0
    predicted_tokens: int = 0
    draining: bool = False
    report: Any = None  # a temporal instance's last StepReport (phase, progress: EcoServe)

    @property
    def queue_len(self) -> int:
        """DistServe's prefill "queue": requests not yet past prefill; on a colocated instance
        every unfinished request competes for the same steps, so all count."""
        return self.active if self.role in ("colocated", "temporal") else self.queued

    @property
    def kv_load(self) -> float:
        """Share of the KV capacity used or promised: reserved blocks (last report) plus
        requests routed here and not reserved yet."""
        used = self.stats.num_used_blocks if self.stats is not None else 0
        return (used * self.block_size + self.pending_tokens) / (
            self.num_kv_blocks * self.block_size)


class Router:
    """Picks one of ``candidates`` (live instances of the right role, in a fixed order).

    A router that sets ``wants_kv_events`` gets every instance's KV events (blocks stored /
    evicted, :mod:`pdserve.engine.kv_cache`) through :meth:`on_kv_events`; drivers must then
    build the workers with ``record_events=True``. Every router hears of a dead instance through
    :meth:`on_instance_removed`. A router may return ``None`` from :meth:`select` to hold the
    request: the controller keeps it queued (in arrival order) and asks again after the next
    instance report; :meth:`on_time` tells a router the time before it is asked."""

    name = ""
    wants_kv_events = False

    def select(self, request: ClusterRequest,
               candidates: list[InstanceView]) -> InstanceView | None:
        raise NotImplementedError

    def on_kv_events(self, instance_id: str, events: list[KVEvent]) -> None:
        """KV events of one instance, in emission order."""

    def on_instance_removed(self, instance_id: str) -> None:
        """``instance_id`` died or is being removed: forget what it cached."""

    def on_instance_added(self, view: InstanceView) -> None:
        """A new instance joined (live scaling); it is among the candidates from now on."""

    def on_time(self, now: float) -> None:
        """The controller's current time, before a routing decision or after a report."""


ROUTERS: Registry[Router] = Registry("router")
register = ROUTERS.register
make_router = ROUTERS.make  # the router registered as ``name``, built with its keywords


def require(cond: bool, msg: str) -> None:
    """A router parameter check: ``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


@cache
def _parameters(name: str) -> frozenset[str]:
    """The names the constructor of router ``name`` takes (once per router: ``inspect.signature``
    of a class without ``__init__`` builds a throwaway class each call)."""
    return frozenset(inspect.signature(ROUTERS[name]).parameters)


def make_routers(prefill: str | Router, decode: str | Router,
                 prefill_time: Any = None, **options: Any) -> tuple[Router, Router]:
    """A deployment's prefill (or colocated) and decode routers. A router that prices prefills
    (Preble's E2, EcoServe's macro_rolling) gets ``prefill_time`` (tokens → seconds: the
    deployment's latency model) when one is given, and each of ``options``
    (:meth:`ClusterConfig.router_options`) its constructor names; a built router is used as
    it is."""
    given = {**options, **({"prefill_time": prefill_time} if prefill_time is not None else {})}

    def one(r: str | Router) -> Router:
        if not isinstance(r, str):
            return r
        takes = _parameters(r) if r in ROUTERS else frozenset()
        return make_router(r, **{k: v for k, v in given.items() if k in takes})

    return one(prefill), one(decode)


def routers_for(config: ClusterConfig, prefill_time: Any = None,
                **extra: Any) -> tuple[Router, Router]:
    """The routers a deployment names, with its router options (the one way both drivers build
    them; the simulator adds its latency model's ``prefill_time`` and ``extra`` settings)."""
    return make_routers(config.prefill_router, config.decode_router, prefill_time,
                        **extra, **config.router_options())


def role_router(role: str, prefill: Router, decode: Router) -> Router:
    """The router whose decisions depend on instances of ``role`` (and so their KV events)."""
    return decode if role == "decode" else prefill


@register
class RoundRobin(Router):
    """Cycle through the candidates in order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        inst = candidates[self._next % len(candidates)]
        self._next += 1
        return inst


@register
class ShortestQueue(Router):
    """DistServe §4.3: dispatch to the prefill instance with the shortest queue (ties: the
    earliest in order)."""

    name = "shortest_queue"

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        return min(candidates, key=lambda i: i.queue_len)


@register
class LeastLoad(Router):
    """DistServe §4.3: the least loaded decoding instance, load = share of its KV blocks used or
    promised to requests routed to it (:attr:`InstanceView.kv_load`); ties: fewer active
    requests, then the earliest in order."""

    name = "least_load"

    def select(self, request: ClusterRequest, candidates: list[InstanceView]) -> InstanceView:
        return min(candidates, key=lambda i: (i.kv_load, i.active))

