"""Instance clients: how the runtime reaches an instance (in-process thread or Ray actor).

Both implement :class:`InstanceClient`; the runtime does not know which it holds. Calls to one
instance are serialized (one thread per in-process instance; Ray actors run one method at a time),
so a step and the commands applied around it never race.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.cluster.worker import Command, ImportKV, InstanceWorker, PullFailed, StepReport
from pdserve.config import EngineConfig


def load_worker(instance_id: str, config: EngineConfig, tokenizer: Any = None,
                num_threads: int | None = None, record_events: bool = False) -> InstanceWorker:
    """An instance over the real model: loads the weights (and the tokenizer unless given);
    ``record_events``: report the block pool's KV events (for prefix-aware routers)."""
    from pdserve.engine.model_executor import ModelExecutor
    from pdserve.tokenizer import load_tokenizer

    executor = ModelExecutor(config, num_threads=num_threads)
    return InstanceWorker(instance_id, config, executor,
                          tokenizer=tokenizer if tokenizer is not None
                          else load_tokenizer(config.model), record_events=record_events)


class InstanceDeadError(RuntimeError):
    """The instance stopped answering (its actor or thread died)."""


class InstanceClient:
    instance_id: str
    role: str
    num_kv_blocks: int
    block_size: int

    def start_step(self, commands: list[Command], now: float) -> Awaitable[StepReport]:
        """Submit ``handle(commands, now)`` now (before returning) and return an awaitable of its
        report, so that a driver can start a step and then do other work while it runs."""
        return asyncio.ensure_future(self.handle(commands, now))

    async def handle(self, commands: list[Command], now: float) -> StepReport:
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

    def portable_handle(self) -> Any:
        """A serializable handle that reaches this instance from another process (a Ray actor
        handle), or ``None`` when it has none (a thread)."""
        return None

    def adopt(self, handle: Any) -> None:
        """Reach the instance through ``handle`` (one :meth:`portable_handle` returned, moved and
        rebuilt: EcoServe's instance migration) from now on."""

    async def close(self) -> None:
        pass


class InProcessInstance(InstanceClient):
    """An :class:`InstanceWorker` in this process, stepped on its own thread."""

    def __init__(self, worker: InstanceWorker) -> None:
        self.worker = worker
        self.instance_id = worker.instance_id
        self.role = worker.role
        self.num_kv_blocks = worker.num_kv_blocks
        self.block_size = worker.engine.config.cache.block_size
        name = f"pdserve-{self.instance_id}"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        # Exports read only held blocks, which no step touches, so they need not wait for the
        # step in flight (DistServe §4.3: the prefill instance keeps working while pulled from).
        self._export_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-kv")
        self.dead = False

    async def _call(self, fn: Any, *args: Any, pool: ThreadPoolExecutor | None = None) -> Any:
        if self.dead:
            raise InstanceDeadError(f"instance {self.instance_id} is dead")
        return await asyncio.get_running_loop().run_in_executor(pool or self._pool, fn, *args)

    def start_step(self, commands: list[Command], now: float) -> Awaitable[StepReport]:
        if self.dead:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(InstanceDeadError(f"instance {self.instance_id} is dead"))
            return fut
        return asyncio.get_running_loop().run_in_executor(self._pool, self.worker.handle,
                                                          commands, now)

    async def handle(self, commands: list[Command], now: float) -> StepReport:
        return await self.start_step(commands, now)

    async def export_kv(self, request_id: str, first_block: int) -> Any:
        return await self._call(self.worker.export_kv, request_id, first_block,
                                pool=self._export_pool)

    async def check_integrity(self) -> dict[str, int]:
        return await self._call(self.worker.check_integrity)

    def kill(self) -> None:
        """Simulate a crash (tests)."""
        self.dead = True

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._export_pool.shutdown(wait=False, cancel_futures=True)


class _RayWorker:
    """The actor body: one instance per actor process, one torch thread on CPU. KV pulls happen
    here (``ray.get`` of the source's export), before the sans-IO worker sees the command."""

    def __init__(self, instance_id: str, config: EngineConfig,
                 record_events: bool = False) -> None:
        self.worker = load_worker(instance_id, config, num_threads=1,
                                  record_events=record_events)

    def info(self) -> tuple[str, int, int]:
        w = self.worker
        return w.role, w.num_kv_blocks, w.engine.config.cache.block_size

    def handle(self, commands: list[Command], now: float) -> StepReport:
        import ray

        for i, cmd in enumerate(commands):
            if isinstance(cmd, ImportKV) and isinstance(cmd.payload, ray.ObjectRef):
                try:
                    commands[i] = ImportKV(cmd.request_id, ray.get(cmd.payload))
                except Exception as e:  # the source died or no longer holds the request
                    commands[i] = ImportKV(cmd.request_id, PullFailed(str(e)))
        return self.worker.handle(commands, now)

    def export_kv(self, request_id: str, first_block: int) -> Any:
        return self.worker.export_kv(request_id, first_block)

    def check_integrity(self) -> dict[str, int]:
        return self.worker.check_integrity()

    def export_kv_ref(self, request_id: str, first_block: int) -> tuple[bool, Any]:
        """Called with ``num_returns=2``: a small acknowledgement the driver awaits, and the
        payload, which stays in the object store until the decode actor pulls it."""
        return True, self.export_kv(request_id, first_block)


class RayInstance(InstanceClient):
    """An instance in its own Ray actor (the distributed engine). KV exports stay in the object
    store; the destination actor pulls them by reference."""

    def __init__(self, actor: Any, instance_id: str, info: tuple[str, int, int]) -> None:
        self.actor = actor
        self.instance_id = instance_id
        self.role, self.num_kv_blocks, self.block_size = info

    @staticmethod
    def start_actor(instance_id: str, config: EngineConfig, record_events: bool = False) -> Any:
        """Start the actor (it loads the model in the background); returns its handle."""
        import ray

        # max_concurrency=2: a KV export may run beside the step in flight (see
        # InProcessInstance); the runtime never issues two handle() calls at once. Ray sets
        # OMP_NUM_THREADS to the actor's num_cpus (1), and the actor pins torch to one thread;
        # no runtime_env, so that Ray can reuse its prestarted worker processes.
        opts: dict[str, Any] = {"max_restarts": 0, "num_cpus": 1, "max_concurrency": 2}
        if config.device.startswith("cuda"):
            opts["num_gpus"] = 1
        return ray.remote(_RayWorker).options(**opts).remote(instance_id, config, record_events)

    @classmethod
    async def create(cls, instance_id: str, config: EngineConfig,
                     record_events: bool = False) -> RayInstance:
        actor = cls.start_actor(instance_id, config, record_events)
        info = await _await(actor.info.remote())
        return cls(actor, instance_id, info)

    def start_step(self, commands: list[Command], now: float) -> Awaitable[StepReport]:
        return asyncio.ensure_future(_await(self.actor.handle.remote(commands, now)))

    async def handle(self, commands: list[Command], now: float) -> StepReport:
        return await self.start_step(commands, now)

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

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()


async def _await(ref: Any) -> Any:
    import ray

    try:
        return await ref
    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
        raise InstanceDeadError(str(e)) from e


def init_ray(address: str | None, num_instances: int) -> None:
    """Join ``address`` or start a local Ray instance with room for every instance actor.

    Ray's own warnings (e.g. about token authentication) are silenced: pdserve reports what
    goes wrong itself. A cluster that refuses the connection is a ``RuntimeError`` saying what
    to check."""
    import ray

    if ray.is_initialized():
        return
    quiet = {"ignore_reinit_error": True, "log_to_driver": False,
             "logging_level": logging.ERROR}
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, num_instances), include_dashboard=False,
                     **quiet)
    except Exception as e:  # ConnectionError, RuntimeError, auth and version errors
        raise RuntimeError(ray_connect_hint(address, e)) from None


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
    return (f"the Ray cluster cannot place this deployment's instance actors (one per "
            f"instance): it needs {parts}; {why}")
