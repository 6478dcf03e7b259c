"""What a serving front end (the HTTP server, the demo) needs from a cluster runtime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

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

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def instance_status(self) -> list[InstanceStatus]: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...
