"""Sans-IO global scheduler: takes cluster events, returns actions.

The controller owns the request table (with each request's canonical timeline) and the picture
of every instance; it decides where requests go. Drivers (the asyncio runtime, the simulator)
feed it events — arrivals, instance reports, KV pulls and imports, failures, aborts — and carry
out the actions it returns: :class:`Send` a command to an instance, :class:`Transfer` KV between
two instances, :class:`Fail` a request. It never does I/O or reads a clock.

Disaggregated flow (DistServe §4.3): arrival → prefill router → prefill instance computes the
prompt and the first token, then holds the KV → decode router picks a decode instance, which
accepts the request and, once it has room, reports a pull → the driver moves the KV → on import
the prefill copy is released. Failures recompute a request on a live instance of the right role
from its prompt plus the tokens generated so far.

Partial disaggregation (EcoServe): temporal instances are entry instances that keep their
requests to the end; their router (``macro_rolling``) may hold a request that no instance can
take within the SLOs — it waits here, in arrival order, and is routed again after each report.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from pdserve.cluster.actions import Action, Fail, Send, Transfer
from pdserve.cluster.cluster_request import ClusterRequest
from pdserve.cluster.decode_dispatch import decode_demand
from pdserve.cluster.flip import NoFlip, TransitionWatcher, parse_flip
from pdserve.cluster.routing import InstanceView, Router, make_router, routers_for
from pdserve.cluster.worker import (
    Abort,
    AddRequest,
    AddTransfer,
    Release,
    StepReport,
    TokenDelta,
)
from pdserve.config import ClusterConfig
from pdserve.engine.engine import EngineStats
from pdserve.predict import make_predictor
from pdserve.request import Prompt, SamplingParams, Timeline

log = logging.getLogger(__name__)

MAX_DISPATCHES = 4  # a request re-dispatched after this many failed attempts fails instead


class Controller:
    def __init__(self, instances: list[InstanceView],
                 prefill_router: str | Router = "shortest_queue",
                 decode_router: str | Router = "least_load", keep_history: bool = False,
                 predictor: Any = None, flips: Any = None) -> None:
        if not instances:
            raise ValueError("a cluster needs at least one instance")
        roles = {i.role for i in instances}
        if roles == {"colocated"}:
            self.entry_role = "colocated"
        elif roles == {"prefill", "decode"}:
            self.entry_role = "prefill"
        elif roles == {"temporal"}:
            self.entry_role = "temporal"
        else:
            raise ValueError(f"instances must be all colocated or prefill + decode (or all "
                             f"temporal), got {roles}")
        self.instances = {i.instance_id: i for i in instances}
        # a name, or a router built by the caller (e.g. Preble's with a latency model)
        self.prefill_router = (make_router(prefill_router) if isinstance(prefill_router, str)
                               else prefill_router)
        self.decode_router = (make_router(decode_router) if isinstance(decode_router, str)
                              else decode_router)
        # TetriInfer: output-length predictor (pdserve.predict), run beside the prefill, and
        # the transition watcher that flips instances (cluster/flip.py)
        self.predictor = predictor
        self.flips = flips
        self.requests: dict[str, ClusterRequest] = {}
        # every request ever seen, finished ones included (the simulator reports from it)
        self.history: dict[str, ClusterRequest] | None = {} if keep_history else None
        self.queued: deque[ClusterRequest] = deque()  # held by the router, arrival order
        self.removing: set[str] = set()  # draining before removal (live scaling)

    @classmethod
    def from_config(cls, config: ClusterConfig, instances: list[InstanceView], *,
                    routers: tuple[Router, Router] | None = None,
                    model_max_len: int | None = None, keep_history: bool = False) -> Controller:
        """The controller of a deployment — the one construction path of both drivers: its
        routers (:func:`~pdserve.cluster.routing.routers_for` unless built by the caller) and,
        for a disaggregated deployment, TetriInfer's length predictor and flip watcher."""
        prefill, decode = routers or routers_for(config)
        predictor, flips = None, None
        if config.strategy == "disaggregated":
            pc = config.predictor
            predictor = make_predictor(pc.name, pc.granularity, pc.accuracy, pc.data)
            policy = parse_flip(config.flip)
            if not isinstance(policy, NoFlip):
                flips = TransitionWatcher(policy, {
                    r.role: config.engine_config(r, model_max_len).scheduler
                    for r in config.roles})
        return cls(instances, prefill, decode, keep_history=keep_history, predictor=predictor,
                   flips=flips)

    # ------------------------------------------------------------------ helpers
    def _router_of(self, instance_id: str) -> Router:
        role = self.instances[instance_id].role
        return self.decode_router if role == "decode" else self.prefill_router

    def _live(self, role: str) -> list[InstanceView]:
        return [i for i in self.instances.values()
                if i.alive and i.role == role and not i.draining]

    def _place(self, req: ClusterRequest, inst: InstanceView, pending_tokens: int = 0) -> None:
        inst.active += 1
        inst.pending_tokens += pending_tokens
        req.placed[inst.instance_id] = pending_tokens

    def _reserved(self, req: ClusterRequest, instance_id: str) -> None:
        """The instance's block pool now holds what was promised."""
        tokens = req.placed.get(instance_id, 0)
        if tokens:
            self.instances[instance_id].pending_tokens -= tokens
            req.placed[instance_id] = 0

    def _detach(self, req: ClusterRequest, instance_id: str | None) -> None:
        """Stop counting ``req`` against an instance."""
        if instance_id is None or instance_id not in req.placed:
            return
        inst = self.instances[instance_id]
        inst.pending_tokens -= req.placed.pop(instance_id)
        inst.active -= 1
        if req.counted_on == instance_id:
            self._count_decode(req, inst, -1)
        if req.stage == "prefill" and req.instance == instance_id:
            inst.queued -= 1

    def _detach_all(self, req: ClusterRequest) -> None:
        for iid in list(req.placed):
            self._detach(req, iid)

    def _count_decode(self, req: ClusterRequest, inst: InstanceView, sign: int) -> None:
        """Heavy/light decode counts and predicted KV tokens per decode instance (TetriInfer
        §3.3.4's load information, cluster/decode_dispatch.py)."""
        heavy, tokens = decode_demand(req)
        if heavy:
            inst.num_heavy += sign
        else:
            inst.num_light += sign
        inst.predicted_tokens += sign * tokens
        req.counted_on = inst.instance_id if sign > 0 else None

    def _aborts(self, req: ClusterRequest, skip: str | None = None) -> list[Action]:
        return [Send(iid, Abort(req.request_id)) for iid in list(req.placed)
                if iid != skip and self.instances[iid].alive]

    # ------------------------------------------------------------------ events
    def on_arrival(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   now: float) -> list[Action]:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        req = ClusterRequest(request_id, Prompt(prompt_token_ids), params, Timeline(arrival=now))
        log.debug("%s arrived at %.6f: %d prompt tokens, max_tokens %d", request_id, now,
                  len(req.prompt_token_ids), params.max_tokens)
        self.requests[request_id] = req
        if self.history is not None:
            self.history[request_id] = req
        if self.predictor is not None and self.entry_role == "prefill":
            req.predicted = self.predictor.predict(req.prompt_token_ids, params.max_tokens)
        if self.queued:  # behind the requests the router holds
            req.stage = "queued"
            self.queued.append(req)
            return self._route_queued(now)
        return self._dispatch(req, now)

    def _route_queued(self, now: float) -> list[Action]:
        """Route held requests in arrival order until the router holds one again."""
        acts: list[Action] = []
        while self.queued:
            req = self.queued[0]
            if req.stage != "queued" or req.request_id not in self.requests:
                self.queued.popleft()  # aborted or failed meanwhile
                continue
            acts += self._dispatch(req, now)
            if req.stage == "queued":
                break
            self.queued.popleft()
        return acts

    def _dispatch(self, req: ClusterRequest, now: float,
                  avoid: str | None = None) -> list[Action]:
        """Route ``req`` to an entry instance (``avoid`` it when another is live)."""
        cands = self._live(self.entry_role)
        if not cands:
            return self._fail(req, f"no live {self.entry_role} instance left")
        cands = [i for i in cands if i.instance_id != avoid] or cands
        self.prefill_router.on_time(now)
        inst = self.prefill_router.select(req, cands)
        if inst is None:  # no instance can take it now (EcoServe Alg. 2): wait
            log.debug("%s held by the %s router", req.request_id, self.prefill_router.name)
            if req.stage != "queued":
                req.stage = "queued"
                self.queued.append(req)
            return []
        log.debug("%s routed to %s", req.request_id, inst.instance_id)
        req.stage, req.instance, req.prefill_instance = "prefill", inst.instance_id, None
        if self.entry_role == "prefill":
            req.prefill_instance = inst.instance_id
        req.decode_instance = None
        req.num_dispatches += 1
        inst.queued += 1
        self._place(req, inst)
        if req.timeline.routed is None:
            req.timeline.routed = now
        return [Send(inst.instance_id, AddRequest(
            req.request_id, req.prompt_token_ids, req.params, req.arrival,
            list(req.output_token_ids)))]

    def on_report(self, rep: StepReport) -> tuple[list[Action], list[tuple[TokenDelta,
                                                                            ClusterRequest]]]:
        """Everything an instance's step report implies, in order: stats, errors, token deltas,
        KV pulls, completed imports. Returns the actions and the deltas that were accepted (with
        their request) so a driver can stream them. Times: imports and pulls happen at
        ``rep.now``; the step's effects at ``rep.now + rep.elapsed``."""
        iid, end = rep.instance_id, rep.now + rep.elapsed
        acts: list[Action] = []
        accepted: list[tuple[TokenDelta, ClusterRequest]] = []
        if rep.stats is not None:
            self.instances[iid].stats = rep.stats
        if self.flips is not None:
            self.flips.observe(rep)
            if rep.role != self.instances[iid].role:  # a SetRole took effect: flip complete
                self.flips.flipped(self.instances[iid], rep.role, rep.now)
        if rep.role == "temporal":
            self.instances[iid].report = rep
        if rep.kv_events and self.instances[iid].alive and iid not in self.removing:
            self._router_of(iid).on_kv_events(iid, rep.kv_events)
        for rid in rep.imported:
            acts += self.on_imported(iid, rid, rep.now)
        for rid, msg in rep.errors:
            acts += self.on_error(iid, rid, msg, end)
        for rid, msg in rep.transfer_failures:
            acts += self.on_transfer_failed(iid, rid, msg, end)
        for d in rep.deltas:
            req = self.requests.get(d.request_id)
            if req is None or req.instance != iid:
                continue
            acts += self.on_report_delta(iid, d, end)
            accepted.append((d, req))
        for rid, first_block in rep.pulls:
            acts += self.on_pull(iid, rid, first_block, end)
        if self.flips is not None:
            acts += self.flips.tick(self.instances, end)
        if self.queued:
            acts += self._route_queued(end)
        return acts, accepted

    def on_report_delta(self, instance_id: str, d: TokenDelta, now: float) -> list[Action]:
        """A token delta from an instance's step report."""
        req = self.requests.get(d.request_id)
        if req is None or req.instance != instance_id:
            return []  # stale: the request ended or moved away from this instance
        inst = self.instances[instance_id]
        if d.timeline is not None:
            req.timeline.merge(d.timeline)
        if d.token_ids:
            if req.stage == "prefill":
                inst.queued -= 1
                req.stage = "decode"
                req.num_cached_tokens = d.num_cached_tokens
            req.output_token_ids.extend(d.token_ids)
            req.timeline.token_times.extend(d.token_times)
        if d.finished:
            return self._finish(req, d.finish_reason, now)
        if d.held:
            return self._to_decode(req, now)
        return []

    def _to_decode(self, req: ClusterRequest, now: float) -> list[Action]:
        cands = self._live("decode")
        if not cands:
            return self._fail(req, "no live decode instance left")
        inst = self.decode_router.select(req, cands)
        assert inst is not None, "a decode router picks an instance (only entry routers hold)"
        log.debug("%s prefilled on %s, routed to decode on %s", req.request_id, req.instance,
                  inst.instance_id)
        req.stage = "transfer"
        req.instance = req.decode_instance = inst.instance_id
        self._place(req, inst, req.num_tokens)
        self._count_decode(req, inst, +1)
        return [Send(inst.instance_id, AddTransfer(
            req.request_id, req.prompt_token_ids, list(req.output_token_ids), req.params,
            req.arrival, req.predicted))]

    def on_pull(self, instance_id: str, request_id: str, first_block: int,
                now: float) -> list[Action]:
        """A decode instance reserved blocks and asks for the KV from ``first_block`` on."""
        req = self.requests.get(request_id)
        if req is None or req.decode_instance != instance_id or req.prefill_instance is None:
            return [Send(instance_id, Abort(request_id))]
        req.timeline.transfer_start = now
        self._reserved(req, instance_id)
        bs = self.instances[instance_id].block_size
        moved = max(req.num_tokens - 1 - first_block * bs, 0)
        log.debug("%s KV transfer %s -> %s from block %d (%d tokens)", request_id,
                  req.prefill_instance, instance_id, first_block, moved)
        return [Transfer(request_id, req.prefill_instance, instance_id, first_block, moved)]

    def on_transfer_done(self, request_id: str, now: float) -> None:
        """The driver finished moving the KV (it waits for the decode instance to import it):
        the transfer's end in the timeline. Waiting for the step in flight on the decode
        instance then counts as decode queue, not as transmission (DistServe §6.3 breakdown)."""
        req = self.requests.get(request_id)
        if req is not None and req.stage == "transfer":
            req.timeline.transfer_end = now

    def on_imported(self, instance_id: str, request_id: str, now: float) -> list[Action]:
        """The KV is in place on the decode instance: release the prefill copy."""
        req = self.requests.get(request_id)
        if req is None or req.decode_instance != instance_id:
            return []
        if req.timeline.transfer_end is None:  # a driver that does not report transfer ends
            req.timeline.transfer_end = now
        src = req.prefill_instance
        log.debug("%s KV imported on %s", request_id, instance_id)
        self._detach(req, src)
        req.stage = "decode"
        if src is None or not self.instances[src].alive:
            return []
        return [Send(src, Release(request_id))]

    def on_transfer_failed(self, instance_id: str, request_id: str, message: str,
                           now: float) -> list[Action]:
        """A decode instance could not pull a request's KV (its prefill instance died, or no
        longer holds the request): the KV is recomputable state, so the request is dispatched
        again from its prompt and generated tokens, as on an instance failure. A request that
        has already been dispatched ``MAX_DISPATCHES`` times fails instead of looping."""
        req = self.requests.get(request_id)
        if req is None or req.decode_instance != instance_id:
            return []
        if req.num_dispatches >= MAX_DISPATCHES:
            return self._fail(req, message, skip=instance_id)
        src = req.prefill_instance  # suspect: its actor may have died unnoticed
        acts = self._aborts(req, skip=instance_id)  # the decode side has dropped it already
        self._detach_all(req)
        return acts + self._dispatch(req, now, avoid=src)

    def on_error(self, instance_id: str, request_id: str, message: str,
                 now: float) -> list[Action]:
        req = self.requests.get(request_id)
        if req is None or instance_id not in req.placed:
            return []
        return self._fail(req, message, skip=None)

    def on_stats(self, instance_id: str, stats: EngineStats) -> None:
        self.instances[instance_id].stats = stats

    def on_abort(self, request_id: str, now: float) -> list[Action]:
        """The client went away: abort everywhere the request lives."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        log.debug("%s aborted", request_id)
        acts = self._aborts(req)
        if req.stage == "transfer":  # the source frees its copy now, maybe before a direct
            # pull has read it all: the decode instance must not cache what it pulled
            acts = [Send(a.instance_id, Abort(request_id, discard_kv=True))
                    if isinstance(a, Send) and a.instance_id == req.decode_instance else a
                    for a in acts]
        self._detach_all(req)
        req.stage, req.finish_reason = "done", "abort"
        req.timeline.finish = now
        return acts

    def on_instance_failed(self, instance_id: str, now: float) -> list[Action]:
        """Recompute every request that depended on the dead instance elsewhere."""
        inst = self.instances[instance_id]
        if not inst.alive:
            return []
        inst.alive = False
        self._router_of(instance_id).on_instance_removed(instance_id)
        acts: list[Action] = []
        for req in list(self.requests.values()):
            if instance_id not in req.placed:
                continue
            if req.num_dispatches >= MAX_DISPATCHES:
                acts += self._fail(req, f"instance {instance_id} failed and the request was "
                                        f"already dispatched {req.num_dispatches} times",
                                   skip=instance_id)
                continue
            acts += self._aborts(req, skip=instance_id)
            self._detach_all(req)
            acts += self._dispatch(req, now)
        inst.queued = inst.active = inst.pending_tokens = 0
        return acts

    # ------------------------------------------------------------------ endings
    def _finish(self, req: ClusterRequest, reason: str | None, now: float) -> list[Action]:
        log.debug("%s finished (%s): %d output tokens", req.request_id, reason,
                  len(req.output_token_ids))
        self._detach_all(req)
        req.stage, req.finish_reason = "done", reason
        if req.timeline.finish is None:
            req.timeline.finish = now
        self.requests.pop(req.request_id, None)
        return []

    def _fail(self, req: ClusterRequest, message: str, skip: str | None = None) -> list[Action]:
        log.debug("%s failed: %s", req.request_id, message)
        acts = self._aborts(req, skip)
        self._detach_all(req)
        req.stage, req.finish_reason = "done", "error"
        self.requests.pop(req.request_id, None)
        return acts + [Fail(req.request_id, message, req.timeline)]

    # ------------------------------------------------------------------ membership
    def add_instance(self, view: InstanceView, now: float) -> list[Action]:
        """A new instance joins (live scaling, replanning): the routers may pick it from now
        on, starting with the requests they hold."""
        if view.instance_id in self.instances:
            raise ValueError(f"instance id {view.instance_id!r} is already in use")
        allowed = {"prefill": ("prefill", "decode")}.get(self.entry_role, (self.entry_role,))
        if view.role not in allowed:
            raise ValueError(f"cannot add a {view.role!r} instance to a deployment of "
                             f"{' + '.join(allowed)} instances")
        self.instances[view.instance_id] = view
        self._router_of(view.instance_id).on_instance_added(view)
        return self._route_queued(now) if self.queued else []

    def remove_instance(self, instance_id: str, now: float) -> list[Action]:
        """Start removing an instance: no request is routed to it any more (its routers forget
        it); the requests on it run to the end there — decodes finish, a prefill instance's
        held KV is pulled — after which :meth:`drained` is true and the driver shuts it down
        and calls :meth:`forget`. A role keeps at least one instance: removing the last one
        raises ``ValueError``."""
        inst = self.instances.get(instance_id)
        if inst is None:
            raise ValueError(f"unknown instance {instance_id!r}; instances: "
                             f"{', '.join(sorted(self.instances))}")
        if instance_id in self.removing:
            raise ValueError(f"instance {instance_id!r} is already being removed")
        if not inst.alive:
            raise ValueError(f"instance {instance_id!r} is dead")
        if inst.draining:
            raise ValueError(f"instance {instance_id!r} is draining for a role flip")
        if not [i for i in self._live(inst.role) if i.instance_id != instance_id]:
            raise ValueError(f"cannot remove {instance_id!r}: it is the last {inst.role} "
                             f"instance (a role keeps at least one)")
        inst.draining = True
        self.removing.add(instance_id)
        self._router_of(instance_id).on_instance_removed(instance_id)
        return self._route_queued(now) if self.queued else []

    def drained(self, instance_id: str) -> bool:
        """An instance being removed holds no request any more (or died)."""
        inst = self.instances[instance_id]
        return instance_id in self.removing and (inst.active == 0 or not inst.alive)

    def forget(self, instance_id: str) -> None:
        """Drop a drained (or dead) instance from the cluster's picture."""
        inst = self.instances[instance_id]
        if inst.alive and not self.drained(instance_id):
            raise ValueError(f"instance {instance_id!r} is not drained (being removed, no "
                             f"request left: {instance_id in self.removing}, "
                             f"{inst.active} requests)")
        self.removing.discard(instance_id)
        del self.instances[instance_id]  # its routers forgot it at removal or failure
        inst.alive = False

    def get(self, request_id: str) -> ClusterRequest | None:
        return self.requests.get(request_id)
