"""What a serving front end (the HTTP server, the demo) needs from a cluster runtime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pdserve.engine.engine import EngineStats
from pdserve.request import RequestOutput, SamplingParams


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the server answers HTTP 429."""


class RequestFailedError(RuntimeError):
    """An accepted request could not be completed (e.g. every instance of a role died)."""


@dataclass
class InstanceStatus:
    """One instance as the metrics endpoint shows it."""

    instance_id: str
    role: str  # colocated | prefill | decode
    alive: bool
    stats: EngineStats | None
    draining: bool = False  # being removed: no new requests, finishing what it holds
    num_kv_blocks: int | None = None  # its KV pool (known before its first report)


@dataclass
class Removal:
    """One completed ``remove_instance``: when it was asked for, when the instance had drained
    (or the drain timed out: ``timed_out``, its remaining requests recomputed elsewhere), and
    its block pool's ``check_integrity`` at shutdown (``None`` if it had died)."""

    instance_id: str
    role: str
    requested: float
    drained: float
    pool: dict[str, int] | None
    timed_out: bool = False


class ServingRuntime(Protocol):
    """A running cluster of model instances behind one request interface.

    ``generate`` is a plain (non-async) call: it validates and dispatches the request at once,
    raising ``ValueError`` naming the bad value or ``QueueFullError`` when the waiting queue is
    full, and returns an async iterator (``async for out in runtime.generate(...)``) yielding
    one :class:`RequestOutput` delta per generated token (``new_token_ids``/``new_text``; cumulative
    ``token_ids``/``text``), the last one with ``finished=True`` and ``finish_reason``
    ``'stop'``/``'length'`` (or ``'abort'``/``'error'`` with ``error`` set). The final output's
    ``timeline`` is the request's full cluster timeline. Closing the iterator early (client gone)
    aborts the request on every instance and frees its KV.
    """

    model_name: str
    max_model_len: int
    tokenizer: Any
    num_gpus: int
    # the bound of the waiting queue (``None``: unbounded); a front end refuses a request with
    # more choices than it at once, and one that does not fit now before any sample runs
    max_waiting_requests: int | None

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, admitted: bool = False
                 ) -> AsyncIterator[RequestOutput]:
        """``admitted``: a later sample of a request the front end already admitted (its
        queue check passed for all of them): not refused for a full queue."""
        ...

    def num_waiting(self) -> int:
        """Accepted requests waiting for their first token (what ``max_waiting_requests``
        bounds)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def instance_status(self) -> list[InstanceStatus]: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class ScalableRuntime(Protocol):
    """A runtime whose instances come and go while it serves (live scaling, the admin API)."""

    async def add_instance(self, role: str, instance_id: str | None = None) -> str:
        """Start a ``role`` instance; returns its id. ``ValueError`` for a role the deployment
        does not take or an id in use; ``RuntimeError`` when the backend cannot start it."""
        ...

    async def remove_instance(self, instance_id: str,
                              drain_timeout: float | None = None) -> Removal:
        """Stop routing to the instance, let it drain (at most ``drain_timeout`` seconds, then
        its requests are recomputed elsewhere), check and shut it down. ``ValueError`` for an
        unknown instance or the last of its role."""
        ...

    def instance_status(self) -> list[InstanceStatus]: ...
