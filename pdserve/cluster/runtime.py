"""The live driver: a sans-IO :class:`Controller` plus instance clients, on asyncio.

Each instance runs its own loop (:class:`pdserve.cluster.instances.StepLoop`, a thread here or
in its Ray actor): it steps while it has work. The driver core (:mod:`pdserve.cluster.driver`,
loop mode) turns the controller's actions into commands, which this module sends at once
without waiting for a step; one task per instance receives the stream of its reports and feeds
them to the core; a KV transfer is a task. Each request's tokens stream to its caller through a
queue.

Instances come and go while serving (:meth:`ClusterRuntime.add_instance`,
:meth:`ClusterRuntime.remove_instance`: live scaling and replanning, DistServe §4.4): a new one
is started like the deployment's own (a thread or a Ray actor) and joins the routers; a removed
one stops receiving requests, drains, is checked for leaked KV blocks and shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.cluster.controller import Controller, Fail, Transfer
from pdserve.cluster.driver import Deliver, DriverCore, Effect, StartStep
from pdserve.cluster.instances import (
    InProcessInstance,
    InstanceClient,
    InstanceDeadError,
    RayInstance,
    init_ray,
    load_worker,
    wait_for_resources,
)
from pdserve.cluster.macro import MacroRolling
from pdserve.cluster.rank_group import check_placeable
from pdserve.cluster.routing import InstanceView, Router, role_router, routers_for
from pdserve.cluster.scaling import InstanceHandle
from pdserve.cluster.serving_api import (
    InstanceStatus,
    QueueFullError,
    Removal,
    RequestFailedError,
)
from pdserve.config import ClusterConfig, InstanceSpec, Link, ModelConfig, cdiv
from pdserve.request import RequestOutput, SamplingParams, Timeline, validate_prompt
from pdserve.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Instance:
    client: InstanceClient
    view: InstanceView
    # end of the last step the instance reported; its time never runs backwards, even with an
    # executor that reports modelled (not measured) step times
    step_end: float = 0.0
    pump: asyncio.Task | None = None  # receives the instance's reports


RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
RESTART_WINDOW_S = 300.0  # failures of one instance longer ago than this are forgotten


@dataclass
class Restart:
    """A failed instance restarted in place: when it failed and when its replacement joined
    (``time.monotonic()``)."""

    instance_id: str
    role: str
    failed: float
    joined: float


@dataclass
class _Stream:
    prompt_token_ids: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    timeline: Timeline = field(default_factory=Timeline)


class ClusterRuntime:
    """Serves requests on a set of instances (implements ``ServingRuntime``)."""

    def __init__(self, config: ClusterConfig, clients: list[InstanceClient], tokenizer: Any,
                 model_config: ModelConfig, model_name: str | None = None,
                 clock: Any = time.time,
                 routers: tuple[Router, Router] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_name = model_name or config.model
        engine = config.engine_config(model_max_len=model_config.max_position_embeddings)
        self.max_model_len = engine.scheduler.max_model_len
        self.kv_dtype = engine.dtype
        self.vocab_size = model_config.vocab_size
        self.num_gpus = config.num_gpus
        self.clock = clock
        self.link = config.kv_link or Link()
        self.instances = {
            c.instance_id: _Instance(c, InstanceView(c.instance_id, c.role, c.num_kv_blocks,
                                                     c.block_size))
            for c in clients
        }
        self.controller = Controller.from_config(
            config, [i.view for i in self.instances.values()], routers=routers,
            model_max_len=model_config.max_position_embeddings)
        self.core = DriverCore(self.controller, self.instances, loop=True)
        # starts the client of a new instance (add_instance); build_runtime sets it
        self.make_client: Callable[[InstanceSpec], Awaitable[InstanceClient]] | None = None
        self.removals: list[Removal] = []
        # called with (prompt length, max_tokens, time) at every accepted arrival (replanning)
        self.arrival_hooks: list[Callable[[int, int, float], None]] = []
        self._adding: set[str] = set()  # ids of instances being started
        # self-healing: a failed instance is restarted in place (same id and role) when the
        # runtime can start instances (make_client), after RESTART_BACKOFF_S[k] seconds for
        # its k-th failure within RESTART_WINDOW_S
        self.self_heal = True
        self.restarts: list[Restart] = []
        self._failures: dict[str, list[float]] = {}
        router = self.controller.prefill_router
        if isinstance(router, MacroRolling):  # mitosis moves the instances' real handles
            router.handle_of, router.on_migrated = self._handle_of, self._adopt
        self._streams: dict[str, _Stream] = {}
        self.batch_log: list[tuple[str, list[tuple[str, int, int]]]] | None = None  # tests
        self._running = False
        self._bg: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for inst in self.instances.values():
            await self._open(inst)
        self._running = True
        for iid in self.instances:
            self._run(self.core.kick(iid))  # commands queued before the start

    async def _open(self, inst: _Instance) -> None:
        """Attach to the instance's loop and start receiving its reports."""
        await inst.client.open(self.clock)
        inst.pump = asyncio.create_task(self._pump(inst))
        self._bg.add(inst.pump)
        inst.pump.add_done_callback(self._bg.discard)

    async def shutdown(self) -> None:
        self._running = False
        tasks = list(self._bg)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rid in list(self._streams):
            self._end_with_error(rid, "server shutting down")
        for inst in self.instances.values():
            await inst.client.close()

    # ------------------------------------------------------------------ scaling
    async def add_instance(self, role: str, instance_id: str | None = None,
                           client: InstanceClient | None = None) -> str:
        """Start a new ``role`` instance (the deployment's settings for that role; a thread or a
        Ray actor per its backend, unless ``client`` is given) and let the routers use it.
        Returns its id (default ``ROLE-N``, the first free N)."""
        allowed = {"prefill": ("prefill", "decode")}.get(self.controller.entry_role,
                                                          (self.controller.entry_role,))
        if role not in allowed:
            raise ValueError(f"cannot add a {role!r} instance to this deployment; it takes "
                             f"{' or '.join(allowed)} instances")
        taken = set(self.instances) | self._adding
        if instance_id is None:
            instance_id = next(f"{role}-{n}" for n in range(len(taken) + 1)
                               if f"{role}-{n}" not in taken)
        elif instance_id in taken:
            raise ValueError(f"instance id {instance_id!r} is already in use")
        spec = next(s for s in self.config.instance_specs(
            self.model_config.max_position_embeddings) if s.role == role)
        spec = replace(spec, instance_id=instance_id)
        if client is None and self.make_client is None:
            raise RuntimeError("this runtime was built over given instance clients and cannot "
                               "start instances; pass client=")
        self._adding.add(instance_id)
        try:
            if client is None:
                assert self.make_client is not None
                client = await self.make_client(spec)
            view = InstanceView(instance_id, client.role, client.num_kv_blocks,
                                client.block_size)
            inst = self.instances[instance_id] = _Instance(client, view)
            try:
                await self._open(inst)
                effects = self.core.add_instance(view, self.clock())
            except Exception:
                del self.instances[instance_id]
                if inst.pump is not None:
                    inst.pump.cancel()
                await client.close()
                raise
        finally:
            self._adding.discard(instance_id)
        self.num_gpus += spec.num_gpus
        log.info("instance %s (%s) added", instance_id, role)
        self._run(effects)
        return instance_id

    async def _discard(self, instance_id: str, dead: _Instance) -> None:
        """Forget a dead instance: the driver's and the runtime's entries, its report pump and
        its client."""
        self.core.forget(instance_id)
        del self.instances[instance_id]
        if dead.pump is not None:
            dead.pump.cancel()
        with contextlib.suppress(Exception):
            await dead.client.close()

    async def remove_instance(self, instance_id: str,
                              drain_timeout: float | None = None) -> Removal:
        """Stop routing to ``instance_id``, let it finish what it holds (running decodes
        complete; a prefill instance's held KV is pulled), then check its block pool and shut
        it down. After ``drain_timeout`` seconds (wall clock; ``None``: no limit) what it still
        holds is recomputed elsewhere, as if it had died, and it is shut down unchecked.
        A dead instance (awaiting its restart) is removed at once. ``ValueError`` for an
        unknown instance, or the last live one of its role."""
        requested = self.clock()
        role = self.instances[instance_id].view.role if instance_id in self.instances else ""
        dead = self.instances.get(instance_id)
        if dead is not None and not dead.view.alive and instance_id not in \
                self.controller.removing:  # nothing to drain; its restart is called off
            await self._discard(instance_id, dead)
            spec = self.config.role(role)
            self.num_gpus -= spec.tp * spec.pp if spec is not None else 1
            rec = Removal(instance_id, role, requested, self.clock(), None)
            self.removals.append(rec)
            log.info("dead instance %s removed", instance_id)
            return rec
        self._run(self.core.remove_instance(instance_id, requested))
        log.info("instance %s (%s) draining for removal", instance_id, role)
        deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
        timed_out = False
        while not self.core.drained(instance_id):
            if not self._running:
                raise RuntimeError(f"shut down while {instance_id} was draining")
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("instance %s did not drain in %.1f s; its requests are recomputed "
                            "elsewhere", instance_id, drain_timeout)
                timed_out = True
                self._run(self.core.instance_failed(instance_id, self.clock()))
                continue
            await asyncio.sleep(0.01)
        inst = self.instances.pop(instance_id)
        was_alive = inst.view.alive and not timed_out
        self.core.forget(instance_id)
        drained = self.clock()
        if inst.pump is not None:
            inst.pump.cancel()
        pool = None
        if was_alive:
            with contextlib.suppress(InstanceDeadError):
                pool = await inst.client.check_integrity()
        await inst.client.close()
        if pool is not None and (pool["used_blocks"] or pool["num_requests"]):
            log.error("instance %s removed with blocks in use: %s", instance_id, pool)
        spec = self.config.role(role)
        self.num_gpus -= spec.tp * spec.pp if spec is not None else 1
        rec = Removal(instance_id, role, requested, drained, pool, timed_out)
        self.removals.append(rec)
        log.info("instance %s removed after %.3f s of draining", instance_id,
                 drained - requested)
        return rec

    async def _restart(self, dead: _Instance) -> None:
        """Replace a failed instance by a new one of its role under its id (its requests were
        recomputed elsewhere, or failed with an explicit error if none of its role was left).
        Backs off when the same instance keeps failing; retries a failed start until the
        runtime shuts down or the instance is removed."""
        iid, role = dead.view.instance_id, dead.view.role
        failed_at = time.monotonic()
        recent = [t for t in self._failures.get(iid, []) if failed_at - t < RESTART_WINDOW_S]
        self._failures[iid] = [*recent, failed_at]
        attempt = len(recent)
        while self._running and self.instances.get(iid) is dead:
            delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
            if delay:
                log.info("restarting instance %s (%s) in %.1f s", iid, role, delay)
                await asyncio.sleep(delay)
            if not self._running or self.instances.get(iid) is not dead:
                return
            attempt += 1
            spec = next(s for s in self.config.instance_specs(
                self.model_config.max_position_embeddings) if s.role == role)
            try:
                assert self.make_client is not None
                client = await self.make_client(replace(spec, instance_id=iid))
            except Exception as e:  # no room on the cluster yet, a load failure: back off
                log.error("restarting instance %s (%s) failed: %s", iid, role, e)
                continue
            if not self._running or self.instances.get(iid) is not dead:
                await client.close()
                return
            await self._discard(iid, dead)
            view = InstanceView(iid, client.role, client.num_kv_blocks, client.block_size)
            inst = self.instances[iid] = _Instance(client, view)
            try:
                await self._open(inst)
                effects = self.core.add_instance(view, self.clock())
            except Exception as e:
                log.error("instance %s (%s) restarted but did not join: %s", iid, role, e)
                self.instances.pop(iid, None)
                with contextlib.suppress(Exception):
                    self.core.forget(iid)
                await client.close()
                return
            self.restarts.append(Restart(iid, role, failed_at, time.monotonic()))
            log.info("instance %s (%s) restarted after %.2f s", iid, role,
                     time.monotonic() - failed_at)
            self._run(effects)
            return

    def _handle_of(self, instance_id: str) -> InstanceHandle:
        """What mitosis hands between macro instances: the id, pool size and the client's
        serializable handle (a Ray actor handle; ``None`` for a thread)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return InstanceHandle(instance_id)
        return InstanceHandle(instance_id, inst.view.num_kv_blocks, inst.view.block_size,
                              inst.client.portable_handle())

    def _adopt(self, handle: InstanceHandle) -> None:
        """A migrated handle arrived: from now on the instance is reached through it."""
        inst = self.instances.get(handle.instance_id)
        if inst is not None and handle.actor is not None:
            inst.client.adopt(handle.actor)

    # ------------------------------------------------------------------ requests
    @property
    def max_waiting_requests(self) -> int:
        return self.config.max_waiting_requests

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, admitted: bool = False
                 ) -> AsyncIterator[RequestOutput]:
        """Validate and dispatch now (raising ``ValueError``/``QueueFullError`` at the call),
        then stream outputs through the returned iterator; iterate it to the end or close it.
        ``admitted`` skips the queue bound (a later sample of an admitted request)."""
        validate_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        dead = self._dead_roles()
        if dead:  # fail fast (HTTP 503) rather than prefill a request nobody can finish
            raise RequestFailedError(f"no live {' or '.join(dead)} instance left")
        if not admitted and self.num_waiting() >= self.config.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting()} requests are waiting (limit "
                                 f"{self.config.max_waiting_requests}); retry later")
        stream = _Stream(list(prompt_token_ids),
                         logprobs=[] if params.logprobs is not None else None)
        self._streams[request_id] = stream
        now = self.clock()
        acts = self.controller.on_arrival(request_id, prompt_token_ids, params, now)
        req = self.controller.get(request_id)
        if req is not None:
            stream.timeline = req.timeline
        self._run(self.core.dispatch(acts))
        for hook in self.arrival_hooks:
            try:
                hook(len(prompt_token_ids), params.max_tokens, now)
            except Exception:  # a monitor's bug must not fail the request
                log.exception("arrival hook %r failed", hook)
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._run(self.core.dispatch(self.controller.on_abort(request_id,
                                                                      self.clock())))

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        self._run(self.core.dispatch(self.controller.on_abort(request_id, self.clock())))
        if stream is not None:
            stream.queue.put_nowait(self._final(request_id, stream, "abort", None))

    def _dead_roles(self) -> list[str]:
        """Roles a new request needs that have no live instance."""
        views = [i.view for i in self.instances.values()]
        return [role for role in dict.fromkeys(v.role for v in views)
                if not any(v.alive for v in views if v.role == role)]

    def num_waiting(self) -> int:
        """Accepted requests whose first token has not been produced yet."""
        return sum(1 for r in self.controller.requests.values()
                   if r.stage in ("queued", "prefill"))

    def instance_status(self) -> list[InstanceStatus]:
        removing = self.controller.removing
        # a dead instance shows as dead and nothing else: its last stats would be phantom load
        return [InstanceStatus(i.view.instance_id, i.view.role, i.view.alive,
                               i.view.stats if i.view.alive else None,
                               i.view.draining or i.view.instance_id in removing,
                               i.view.num_kv_blocks)
                for i in self.instances.values()]

    async def check_integrity(self) -> dict[str, dict[str, int]]:
        """Block-pool invariants on every live instance (raises on violation)."""
        return {iid: await i.client.check_integrity()
                for iid, i in self.instances.items() if i.view.alive}

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until no request is in flight anywhere and every live instance has applied
        the commands sent to it (a prefill copy's release, say)."""
        deadline = time.monotonic() + timeout
        while self.controller.requests or self._streams or any(
                i.view.alive and not self.core.idle(iid) for iid, i in self.instances.items()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still in flight: {sorted(self.controller.requests)}")
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ effects
    def _run(self, effects: list[Effect]) -> None:
        """Carry out what the driver core decided (its module docstring: pipelining)."""
        for e in effects:
            if isinstance(e, StartStep):
                self._start(e)
            elif isinstance(e, Deliver):
                self._deliver(e)
            elif isinstance(e, Transfer):
                self._spawn(self._transfer(e))
            elif isinstance(e, Fail):
                stream = self._streams.get(e.request_id)
                if stream is not None:
                    stream.timeline = e.timeline
                self._end_with_error(e.request_id, e.message)

    def _start(self, e: StartStep) -> None:
        if not self._running:
            return  # not started yet, or shutting down
        # sent now, without waiting; the instance's loop applies them with its next step
        self.instances[e.instance_id].client.submit(e.commands)

    async def _pump(self, inst: _Instance) -> None:
        """Feed the instance's reports to the core as they come, until it fails."""
        iid = inst.view.instance_id
        while True:
            try:
                reports = await inst.client.reports()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the instance is gone: recompute its requests elsewhere
                if self.instances.get(iid) is not inst:
                    return  # removed (and shut down) meanwhile
                log.error("instance %s failed: %s", iid, e)
                self._run(self.core.instance_failed(iid, self.clock()))
                self._spawn(inst.client.release())  # room for its replacement
                if self.make_client is not None and self._running and self.self_heal:
                    self._spawn(self._restart(inst))
                return
            for rep in reports:
                inst.step_end = rep.now + rep.elapsed
                try:
                    self.core.step_done(iid, rep, self._run)
                except Exception:  # a bug in the driver must not silently stall the instance
                    log.exception("processing a report from %s failed", iid)

    def _now(self, inst: _Instance) -> float:
        """The time for an event on ``inst``: the clock, but never before its last step's end
        (the controller dates a step's effects at ``now + elapsed``)."""
        return max(self.clock(), inst.step_end)

    def _deliver(self, e: Deliver) -> None:
        rep = e.report
        if self.batch_log is not None and rep.batch:
            self.batch_log.append((rep.instance_id, rep.batch))
        for d, req in e.accepted:
            stream = self._streams.get(d.request_id)
            if stream is None or not (d.token_ids or d.finished):
                continue
            stream.token_ids.extend(d.token_ids)
            stream.text += d.text
            if stream.logprobs is not None and d.logprobs:
                stream.logprobs.extend(d.logprobs)
            stream.queue.put_nowait(RequestOutput(
                request_id=d.request_id, prompt_token_ids=stream.prompt_token_ids,
                token_ids=list(stream.token_ids), text=stream.text,
                new_token_ids=list(d.token_ids), new_text=d.text, finished=d.finished,
                finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                num_cached_tokens=req.num_cached_tokens, logprobs=stream.logprobs,
                timeline=req.timeline, instance_id=rep.instance_id))

    async def _transfer(self, t: Transfer) -> None:
        src, dst = self.instances.get(t.src), self.instances.get(t.dst)
        if src is None or dst is None:
            return  # removed meanwhile: the request had been aborted
        start = time.monotonic()
        try:
            payload, pending = await src.client.send_kv(t.request_id, t.first_block)
        except (KeyError, InstanceDeadError) as e:
            log.info("KV export of %s from %s failed: %s", t.request_id, t.src, e)
            return  # aborted meanwhile, or the source died (its failure handling recomputes)
        if self.link.emulated:
            if pending is not None:
                with contextlib.suppress(Exception):
                    await pending
                pending = None
            bs = dst.view.block_size
            need = self.link.min_time(cdiv(t.num_tokens, bs) * bs
                                      * self.model_config.kv_bytes_per_token(self.kv_dtype))
            wait = need - (time.monotonic() - start)
            if wait > 0:
                await asyncio.sleep(wait)
        # The end of the move; waiting for the decode instance's step in flight to import the
        # KV is decode queue, not transmission (as in the simulator).
        now = None
        if pending is None:
            now = self._now(dst)
        else:
            self._spawn(self._transfer_done_when(pending, t.request_id, dst))
        self._run(self.core.transfer_done(t.request_id, t.dst, payload, now))

    async def _transfer_done_when(self, pending: Any, request_id: str, dst: _Instance) -> None:
        with contextlib.suppress(Exception):  # a failed export surfaces at the import
            await pending
        self.controller.on_transfer_done(request_id, self._now(dst))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _final(self, rid: str, stream: _Stream, reason: str, error: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=rid, prompt_token_ids=stream.prompt_token_ids,
            token_ids=list(stream.token_ids), text=stream.text, finished=True,
            finish_reason=reason, error=error, timeline=stream.timeline)

    def _end_with_error(self, rid: str, message: str) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.queue.put_nowait(self._final(rid, stream, "error", message))


async def build_runtime(config: ClusterConfig, model_name: str | None = None) -> ClusterRuntime:
    """Load the model on every instance of the deployment (in-process or one Ray actor each)
    and start serving."""
    model_config = ModelConfig.from_dir(config.model)
    specs = config.instance_specs(model_config.max_position_embeddings)
    check_specs(specs, model_config, remote=bool(config.ray_address))
    tokenizer = load_tokenizer(config.model)
    routers = routers_for(config)
    if config.backend == "ray":
        init_ray(config.ray_address, sum(s.tp * s.pp for s in specs))
    clients = await start_clients(config, specs, tokenizer, routers)
    runtime = ClusterRuntime(config, clients, tokenizer, model_config, model_name,
                             routers=routers)

    async def make_client(spec: InstanceSpec) -> InstanceClient:
        return (await start_clients(config, [spec], tokenizer, routers))[0]

    runtime.make_client = make_client
    await runtime.start()
    return runtime


def check_specs(specs: list[InstanceSpec], model_config: ModelConfig,
                remote: bool = False) -> None:
    """``ValueError`` naming the role and value when an instance's ``tp``/``pp``/``ep`` cannot
    run live (before anything loads). ``remote``: the ranks run on a Ray cluster's nodes, whose
    CPUs and GPUs Ray counts (:func:`pdserve.cluster.rank_group.check_placeable`), not this
    machine's."""
    import sys

    from pdserve.model.parallel import check_live_layout  # lazy: torch (pdserve.model)

    for s in specs:
        ranks = sys.maxsize if remote else None
        try:
            check_live_layout(model_config, s.tp, s.pp, s.ep, s.engine.device, ranks)
        except ValueError as e:
            raise ValueError(f"{s.role} instances: {e}") from None


async def start_clients(config: ClusterConfig, specs: list[InstanceSpec], tokenizer: Any,
                        routers: tuple[Router, Router]) -> list[InstanceClient]:
    """Start the instances of ``specs`` as the deployment's backend runs them: a Ray actor
    each, and a placement group with an actor per further rank when ``tp * pp`` > 1 (Ray
    already initialised; waits for the CPUs/GPUs, or says what is missing), or
    in-process workers loaded off the event loop. Workers report KV events when their role's
    router wants them."""
    events = {s.instance_id: role_router(s.role, *routers).wants_kv_events for s in specs}
    loop = asyncio.get_running_loop()
    if config.backend == "ray":
        check_placeable(specs)  # a layout no node (or the whole cluster) can hold: say so
        need = {"CPU": float(sum(s.tp * s.pp for s in specs))}  # one per rank
        gpus = sum(s.tp * s.pp for s in specs if s.engine.device.startswith("cuda"))
        if gpus:
            need["GPU"] = float(gpus)
        await loop.run_in_executor(None, wait_for_resources, need)
        return list(await asyncio.gather(*(
            RayInstance.create(s.instance_id, s.engine, events[s.instance_id], s.tp, s.pp)
            for s in specs)))
    workers = [await loop.run_in_executor(None, functools.partial(
        load_worker, s.instance_id, s.engine, tokenizer, record_events=events[s.instance_id],
        tp=s.tp, pp=s.pp))
        for s in specs]
    return [InProcessInstance(w) for w in workers]
