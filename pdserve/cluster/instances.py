"""Instance clients: how the runtime reaches an instance (in-process thread or Ray actor).

Both run the instance's own loop (:class:`StepLoop`): it steps while the engine has work and
applies, at the start of each step, the commands that arrived since the previous one. The driver
sends commands without waiting for a step (:meth:`InstanceClient.submit`) and receives the
reports as a stream (:meth:`InstanceClient.reports`, a long poll), so no step waits for a round
trip to the driver. Both clients implement :class:`InstanceClient`; the runtime does not know
which it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.cluster import rank_group
from pdserve.cluster.rank_group import RayRanks
from pdserve.cluster.worker import Command, ImportKV, InstanceWorker, PullFailed, StepReport
from pdserve.config import EngineConfig
from pdserve.tokenizer import load_tokenizer

# how long one reports() poll waits for a report before it returns an empty list (so a poll
# left behind by a driver that went away frees its thread)
POLL_S = 1.0


def load_worker(instance_id: str, config: EngineConfig, tokenizer: Any = None,
                num_threads: int | None = None, record_events: bool = False,
                tp: int = 1, pp: int = 1, ranks: Any = None,
                loaded: Callable[[Any], None] | None = None) -> InstanceWorker:
    """An instance over the real model: loads the weights (and the tokenizer unless given);
    ``record_events``: report the block pool's KV events (for prefix-aware routers); ``tp``,
    ``pp``: tensor-parallel ranks per pipeline stage and stages (this process is the driver
    rank and starts the others: child processes, or through ``ranks``, a
    :class:`~pdserve.engine.model_executor.RankLauncher`)."""
    from pdserve.engine.model_executor import ModelExecutor  # lazy: torch

    executor = ModelExecutor(config, num_threads=num_threads, tp=tp, pp=pp, ranks=ranks)
    if loaded is not None:  # the executor, once the ranks are up
        loaded(executor)
    return InstanceWorker(instance_id, config, executor,
                          tokenizer=tokenizer if tokenizer is not None
                          else load_tokenizer(config.model), record_events=record_events)


class InstanceDeadError(RuntimeError):
    """The instance stopped answering (its actor or thread died)."""


class StepLoop:
    """The instance's own loop, on a thread beside the engine (in the driver's process or in a
    Ray actor), so that consecutive steps never wait for the driver.

    - :meth:`submit` queues a batch of commands numbered by the driver (0, 1, ... per session:
      Ray may run a threaded actor's calls out of order; the numbers restore it). The loop
      applies every batch that arrived, in order, at the start of its next step.
    - The loop steps again at once when the last step computed a batch and the engine has more
      work — the rule the driver core's pipelining applies (:mod:`pdserve.cluster.driver`) —
      and otherwise waits for commands.
    - :meth:`next_reports` returns every report produced since the previous call (waiting up to
      ``timeout`` for one). Each report's ``applied`` counts the batches applied so far, so the
      driver knows which of its commands the instance has seen.
    - :meth:`open` starts a session (a driver attaches): numbering restarts and reports nobody
      collected are dropped; a poll of an earlier session returns empty.

    ``step_time`` is a step's date: the clock, but never before the previous step's end (an
    executor may report modelled, not measured, step times). ``resolve`` turns commands into
    what the worker takes (the Ray actor pulls KV payloads by reference).
    """

    def __init__(self, worker: InstanceWorker, clock: Callable[[], float] = time.time,
                 resolve: Callable[[list[Command]], list[Command]] | None = None) -> None:
        self.worker = worker
        self.clock = clock
        self.resolve = resolve
        self._cv = threading.Condition()
        # held while the worker runs: calls that need the engine at rest take it
        self.step_lock = threading.Lock()
        self._epoch = 0
        self._inbox: dict[int, list[Command]] = {}
        self._applied = 0
        self._out: list[StepReport] = []
        self._more = False
        self._end = 0.0
        self._error: BaseException | None = None
        self._stopped = False
        # busy time and steps since the session began (measurements: the actor's busy fraction)
        self.busy_s = 0.0
        self.steps = 0
        self.opened = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pdserve-{worker.instance_id}-loop")
        self._thread.start()

    def open(self) -> int:
        with self._cv:
            self._epoch += 1
            self._inbox.clear()
            self._applied = 0
            self._out.clear()
            self.busy_s, self.steps, self.opened = 0.0, 0, time.perf_counter()
            self._cv.notify_all()
            return self._epoch

    def submit(self, epoch: int, seq: int, commands: list[Command]) -> None:
        with self._cv:
            if epoch == self._epoch and seq >= self._applied:
                self._inbox[seq] = commands
                self._cv.notify_all()

    def next_reports(self, epoch: int, timeout: float = POLL_S) -> list[StepReport]:
        with self._cv:
            self._cv.wait_for(lambda: self._out or self._error is not None or self._stopped
                              or epoch != self._epoch, timeout)
            if self._error is not None:
                raise self._error
            if self._stopped:
                raise InstanceDeadError(f"instance {self.worker.instance_id} was shut down")
            if epoch != self._epoch:
                return []
            out, self._out = self._out, []
            return out

    def stats(self) -> dict[str, float]:
        """Steps, busy seconds and wall seconds since the session began."""
        with self._cv:
            return {"steps": self.steps, "busy_s": self.busy_s,
                    "wall_s": time.perf_counter() - self.opened}

    def stop(self, error: BaseException | None = None) -> None:
        """End the loop (after the step in flight); pollers get ``error`` or
        :class:`InstanceDeadError`."""
        with self._cv:
            self._stopped = True
            if error is not None and self._error is None:
                self._error = error
            self._cv.notify_all()

    def _ready(self) -> bool:
        return self._stopped or self._more or self._applied in self._inbox

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._ready)
                if self._stopped:
                    return
                cmds: list[Command] = []
                while self._applied in self._inbox:
                    cmds += self._inbox.pop(self._applied)
                    self._applied += 1
                epoch, applied = self._epoch, self._applied
            try:
                if self.resolve is not None and cmds:
                    cmds = self.resolve(cmds)
                t0 = time.perf_counter()
                with self.step_lock:
                    now = max(self.clock(), self._end)
                    rep = self.worker.handle(cmds, now)
                busy = time.perf_counter() - t0
            except BaseException as e:  # the instance is broken: the driver recovers
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            rep.applied = applied
            self._end = now + rep.elapsed
            with self._cv:
                self._more = rep.stepped and rep.has_work
                self.busy_s += busy
                self.steps += rep.stepped
                if epoch == self._epoch:
                    self._out.append(rep)
                    self._cv.notify_all()


class InstanceClient:
    """How the driver reaches one instance's :class:`StepLoop`: after :meth:`open`, commands go
    out with :meth:`submit` and reports come back from :meth:`reports`."""

    instance_id: str
    role: str
    num_kv_blocks: int
    block_size: int

    async def open(self, clock: Callable[[], float] = time.time) -> None:
        """Attach a driver (a new session of the instance's loop). ``clock`` dates the steps of
        an in-process instance; a Ray actor uses its own machine's clock."""
        raise NotImplementedError

    def submit(self, commands: list[Command]) -> None:
        """Send commands now, without waiting; they are applied in the order sent."""
        raise NotImplementedError

    async def reports(self) -> list[StepReport]:
        """The reports produced since the last call (empty after a while without one); raises
        :class:`InstanceDeadError` (or the worker's error) once the instance is gone."""
        raise NotImplementedError

    async def export_kv(self, request_id: str, first_block: int) -> Any:
        """A KV payload, or a reference the destination can pull it through."""
        raise NotImplementedError

    async def send_kv(self, request_id: str, first_block: int) -> tuple[Any, Any]:
        """``(payload, pending)``: what to hand to the destination at once, and ``None`` if the
        export is complete, else an awaitable that resolves when it is (errors surface when the
        destination pulls)."""
        return await self.export_kv(request_id, first_block), None

    async def check_integrity(self) -> dict[str, int]:
        raise NotImplementedError

    async def loop_stats(self) -> dict[str, float]:
        """:meth:`StepLoop.stats` of the instance's loop."""
        raise NotImplementedError

    def portable_handle(self) -> Any:
        """A serializable handle that reaches this instance from another process (a Ray actor
        handle), or ``None`` when it has none (a thread)."""
        return None

    def adopt(self, handle: Any) -> None:
        """Reach the instance through ``handle`` (one :meth:`portable_handle` returned, moved and
        rebuilt: EcoServe's instance migration) from now on."""

    async def release(self) -> None:
        """Free what a failed instance still holds on the cluster (a Ray instance's actors
        and placement group), so that its replacement can be placed; nothing by default."""

    async def close(self) -> None:
        pass


class InProcessInstance(InstanceClient):
    """An :class:`InstanceWorker` in this process, stepped by its loop's thread."""

    def __init__(self, worker: InstanceWorker) -> None:
        self.worker = worker
        self.instance_id = worker.instance_id
        self.role = worker.role
        self.num_kv_blocks = worker.num_kv_blocks
        self.block_size = worker.engine.config.cache.block_size
        self.loop: StepLoop | None = None
        name = f"pdserve-{self.instance_id}"
        self._poll_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-poll")
        # Exports read only held blocks, which no step touches, so they need not wait for the
        # step in flight (DistServe §4.3: the prefill instance keeps working while pulled from).
        self._export_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-kv")
        self._epoch = 0
        self._seq = 0
        self.dead = False

    def _check(self) -> None:
        if self.dead:
            raise InstanceDeadError(f"instance {self.instance_id} is dead")

    async def open(self, clock: Callable[[], float] = time.time) -> None:
        self._check()
        if self.loop is None:
            self.loop = StepLoop(self.worker, clock)
        self.loop.clock = clock
        self._epoch, self._seq = self.loop.open(), 0

    def submit(self, commands: list[Command]) -> None:
        if self.dead or self.loop is None:
            return  # its failure reaches the driver through reports()
        self.loop.submit(self._epoch, self._seq, commands)
        self._seq += 1

    async def reports(self) -> list[StepReport]:
        self._check()
        assert self.loop is not None, "open() first"
        return await asyncio.get_running_loop().run_in_executor(
            self._poll_pool, self.loop.next_reports, self._epoch)

    async def export_kv(self, request_id: str, first_block: int) -> Any:
        self._check()
        return await asyncio.get_running_loop().run_in_executor(
            self._export_pool, self.worker.export_kv, request_id, first_block)

    async def check_integrity(self) -> dict[str, int]:
        self._check()
        return await asyncio.get_running_loop().run_in_executor(
            self._export_pool, self._locked, self.worker.check_integrity)

    def _locked(self, fn: Callable[[], Any]) -> Any:
        if self.loop is None:
            return fn()
        with self.loop.step_lock:
            return fn()

    async def loop_stats(self) -> dict[str, float]:
        assert self.loop is not None, "open() first"
        return self.loop.stats()

    def kill(self) -> None:
        """Simulate a crash (tests)."""
        self.dead = True
        if self.loop is not None:
            self.loop.stop(InstanceDeadError(f"instance {self.instance_id} is dead"))

    async def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        close = getattr(self.worker.engine.executor, "close", None)
        if close is not None:  # the other ranks of a tensor-parallel instance
            await asyncio.get_running_loop().run_in_executor(self._export_pool, close)
        self._poll_pool.shutdown(wait=False, cancel_futures=True)
        self._export_pool.shutdown(wait=False, cancel_futures=True)


class _RayWorker:
    """The actor body: one instance per actor process, one torch thread on CPU, stepped by its
    :class:`StepLoop`'s thread. KV pulls happen in the loop (``ray.get`` of the source's
    export), before the sans-IO worker sees the command. With ``tp * pp`` > 1 it is rank 0 and
    starts the other ranks as actors in the instance's placement group ``pg``
    (:mod:`pdserve.cluster.rank_group`)."""

    def __init__(self, instance_id: str, config: EngineConfig,
                 record_events: bool = False, tp: int = 1, pp: int = 1, pg: Any = None) -> None:
        import ray

        self.ranks = RayRanks(pg, instance_id) if pg is not None else None
        self.executor: Any = None

        def loaded(executor: Any) -> None:  # every rank serves and pulls KV slices directly
            me = ray.get_runtime_context().current_actor
            others = self.ranks.actors if self.ranks is not None else []
            rank_group.serve_kv(executor, [me, *others])
            self.executor = executor

        self.worker = load_worker(instance_id, config, num_threads=1,
                                  record_events=record_events, tp=tp, pp=pp, ranks=self.ranks,
                                  loaded=loaded)
        self.loop = StepLoop(self.worker, resolve=_pull)

    def rank_actors(self) -> list[Any]:
        """The handles of ranks 1 .. of the instance (tests)."""
        return list(self.ranks.actors) if self.ranks is not None else []

    def info(self) -> tuple[str, int, int]:
        w = self.worker
        return w.role, w.num_kv_blocks, w.engine.config.cache.block_size

    def open(self) -> int:
        return self.loop.open()

    def submit(self, epoch: int, seq: int, commands: list[Command]) -> None:
        self.loop.submit(epoch, seq, commands)

    def next_reports(self, epoch: int) -> list[StepReport]:
        return self.loop.next_reports(epoch)

    def loop_stats(self) -> dict[str, float]:
        return self.loop.stats()

    def export_kv(self, request_id: str, first_block: int) -> Any:
        return self.worker.export_kv(request_id, first_block)

    def kv_part(self, block_ids: list[int], layers: tuple[int, int],
                heads: tuple[int, int]) -> Any:
        """Rank 0's slice of held blocks, for a decode rank's direct pull."""
        return self.executor.kv_part(block_ids, layers, heads)

    def kv_imports(self) -> dict[str, int]:
        """Imports by path (``direct``, ``funnel``) on this instance (tests)."""
        return dict(self.executor.kv_imports)

    def check_integrity(self) -> dict[str, int]:
        with self.loop.step_lock:
            return self.worker.check_integrity()

    def export_kv_ref(self, request_id: str, first_block: int) -> tuple[bool, Any]:
        """Called with ``num_returns=2``: a small acknowledgement the driver awaits, and the
        payload, which stays in the object store until the decode actor pulls it."""
        return True, self.export_kv(request_id, first_block)


def _pull(commands: list[Command]) -> list[Command]:
    """Resolve the KV payloads passed by reference (in the destination actor's loop)."""
    import ray

    out = list(commands)
    for i, cmd in enumerate(out):
        if isinstance(cmd, ImportKV) and isinstance(cmd.payload, ray.ObjectRef):
            try:
                out[i] = ImportKV(cmd.request_id, ray.get(cmd.payload))
            except Exception as e:  # the source died or no longer holds the request
                out[i] = ImportKV(cmd.request_id, PullFailed(str(e)))
    return out


def _observe(fut: Any) -> None:
    """Retrieve a fire-and-forget call's outcome (a dead actor's error is reported through
    reports(), not as an unhandled Ray error)."""
    with contextlib.suppress(BaseException):
        fut.exception()


class RayInstance(InstanceClient):
    """An instance in its own Ray actor (the distributed engine). KV exports stay in the object
    store; the destination actor pulls them by reference."""

    def __init__(self, actor: Any, instance_id: str, info: tuple[str, int, int],
                 pg: Any = None) -> None:
        self.actor = actor
        self.instance_id = instance_id
        self.role, self.num_kv_blocks, self.block_size = info
        self.pg = pg  # the placement group of a tp * pp > 1 instance's ranks
        self._epoch = 0
        self._seq = 0

    @staticmethod
    def start_actor(instance_id: str, config: EngineConfig, record_events: bool = False,
                    tp: int = 1, pp: int = 1, pg: Any = None) -> Any:
        """Start the actor (it loads the model in the background); returns its handle. A
        tensor- or pipeline-parallel instance's actor is its rank 0, in the first bundle of
        the placement group ``pg`` that holds a CPU (GPU) for each of its ranks
        (:mod:`pdserve.cluster.rank_group`)."""
        import ray

        # max_concurrency=6: the loop's thread steps on its own; the actor's threads serve a
        # report poll, command submissions, KV exports and decode ranks' pulls of KV slices
        # beside it (see InProcessInstance).
        # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1), and the actor pins torch to one
        # thread; no runtime_env, so that Ray can reuse its prestarted worker processes.
        opts: dict[str, Any] = {"max_restarts": 0, "num_cpus": 1, "max_concurrency": 6}
        if config.device.startswith("cuda"):
            opts["num_gpus"] = 1
        if pg is not None:
            opts["scheduling_strategy"] = rank_group.in_bundle(pg, 0)
        return ray.remote(_RayWorker).options(**opts).remote(instance_id, config, record_events,
                                                             tp, pp, pg)

    @classmethod
    async def create(cls, instance_id: str, config: EngineConfig,
                     record_events: bool = False, tp: int = 1, pp: int = 1) -> RayInstance:
        pg = None
        if tp * pp > 1:
            pg = await asyncio.get_running_loop().run_in_executor(
                None, rank_group.reserve, instance_id, tp, pp, config.device)
        actor = cls.start_actor(instance_id, config, record_events, tp, pp, pg)
        try:
            info = await _await(actor.info.remote())
        except BaseException:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            if pg is not None:
                rank_group.release(pg)
            raise
        return cls(actor, instance_id, info, pg)

    async def open(self, clock: Callable[[], float] = time.time) -> None:
        self._epoch, self._seq = await _await(self.actor.open.remote()), 0

    def submit(self, commands: list[Command]) -> None:
        ref = self.actor.submit.remote(self._epoch, self._seq, commands)
        self._seq += 1
        ref.future().add_done_callback(_observe)

    async def reports(self) -> list[StepReport]:
        return await _await(self.actor.next_reports.remote(self._epoch))

    async def loop_stats(self) -> dict[str, float]:
        return await _await(self.actor.loop_stats.remote())

    async def export_kv(self, request_id: str, first_block: int) -> Any:
        return (await self.send_kv(request_id, first_block))[0]

    async def send_kv(self, request_id: str, first_block: int) -> tuple[Any, Any]:
        # The payload's ObjectRef goes to the decode actor at once, which pulls the blocks as
        # soon as they are exported: they never pass through the driver, and the driver does
        # not wait for the export (one hop less). The small acknowledgement tells it when the
        # export is done.
        ack, payload = self.actor.export_kv_ref.options(num_returns=2).remote(
            request_id, first_block)
        return payload, ack

    async def check_integrity(self) -> dict[str, int]:
        return await _await(self.actor.check_integrity.remote())

    def portable_handle(self) -> Any:
        return self.actor

    def adopt(self, handle: Any) -> None:
        self.actor = handle

    async def rank_actors(self) -> list[Any]:
        """The actors of ranks 1 .. (tests)."""
        return await _await(self.actor.rank_actors.remote())

    async def kv_imports(self) -> dict[str, int]:
        """The instance's KV imports by path, ``direct`` or ``funnel`` (tests)."""
        return await _await(self.actor.kv_imports.remote())

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    async def release(self) -> None:
        await self.close()

    async def close(self) -> None:
        """End the actor and its rank actors (removing their placement group); idempotent."""
        with contextlib.suppress(Exception):
            self.kill()
        pg, self.pg = self.pg, None
        if pg is not None:
            rank_group.release(pg)


async def _await(ref: Any) -> Any:
    import ray

    try:
        return await ref
    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
        raise InstanceDeadError(str(e)) from e


def init_ray(address: str | None, num_instances: int) -> bool:
    """Join ``address`` or start a local Ray instance with room for every instance actor;
    ``True`` when this call started Ray.

    A local Ray starts its workers at normal priority: Ray's default (niceness 15, meant for
    background tasks) leaves an instance actor a few per cent of a core whenever any other
    process wants one, and on a shared machine the serving loop then crawls. Ray's own
    ``RAY_worker_niceness``, when set, still decides; a joined cluster keeps its nodes'
    setting. Ray's own warnings (e.g. about token authentication) are silenced: pdserve reports
    what goes wrong itself. A cluster that refuses the connection is a ``RuntimeError`` saying
    what to check."""
    import ray

    if ray.is_initialized():
        return False
    quiet = {"ignore_reinit_error": True, "log_to_driver": False,
             "logging_level": logging.ERROR}
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            nice = ({} if "RAY_worker_niceness" in os.environ  # Ray's own variable decides
                    else {"_system_config": {"worker_niceness": 0}})
            ray.init(num_cpus=max(os.cpu_count() or 1, num_instances), include_dashboard=False,
                     **nice, **quiet)
    except Exception as e:  # ConnectionError, RuntimeError, auth and version errors
        raise RuntimeError(ray_connect_hint(address, e)) from None
    return True


def ray_connect_hint(address: str | None, error: BaseException) -> str:
    import ray

    where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
    return (f"cannot start or join {where}: {type(error).__name__}: {error}. Check that the "
            f"address is the head node's (`ray status` there prints it), that the cluster "
            f"runs Ray {ray.__version__} like this process, and, for a cluster started with "
            f"token authentication, that RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) holds its "
            f"token")


def wait_for_resources(need: dict[str, float], timeout_s: float = 30.0,
                       poll_s: float = 0.5) -> None:
    """Return once the Ray cluster has ``need`` (e.g. ``{"CPU": 3}``) available; after
    ``timeout_s`` raise a ``RuntimeError`` naming what is missing (instead of actors that
    wait forever for resources the cluster does not have)."""
    import ray

    total = ray.cluster_resources()
    short = {k: v for k, v in need.items() if total.get(k, 0.0) < v}
    if short:
        raise RuntimeError(_resource_message(need, total, ray.available_resources(), False))
    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources()
        if all(free.get(k, 0.0) >= v for k, v in need.items()):
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(_resource_message(need, total, free, True))
        time.sleep(poll_s)


def _resource_message(need: dict[str, float], total: dict[str, float],
                      free: dict[str, float], waited: bool) -> str:
    parts = ", ".join(f"{v:g} {k} (cluster total {total.get(k, 0.0):g}, free "
                      f"{free.get(k, 0.0):g})" for k, v in need.items())
    why = ("others hold them; free them or wait" if waited
           else "add nodes or lower the instance counts")
    return (f"the Ray cluster cannot place this deployment's instances (a CPU, or a GPU, per "
            f"rank): it needs {parts}; {why}")
