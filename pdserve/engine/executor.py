"""The executor seam: the one thing the simulator swaps (torch-free protocol)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pdserve.engine.batch import ExecuteResult, ScheduledBatch


class KVPullError(RuntimeError):
    """:meth:`Executor.import_kv` could not pull the KV from its source (a source rank died or
    stopped answering): the transfer failed, the importing instance lives on."""


@runtime_checkable
class Executor(Protocol):
    """Runs scheduled batches against a paged KV cache of ``num_kv_blocks`` blocks.

    Implementations: :class:`pdserve.engine.model_executor.ModelExecutor` (torch, CPU/CUDA) and
    the simulator's latency-model executor.
    """

    num_kv_blocks: int

    def execute(self, batch: ScheduledBatch) -> ExecuteResult:
        """Compute every ``batch.seqs`` chunk, write its KV, and sample where ``seq.sample``."""
        ...

    def export_kv(self, block_ids: list[int]) -> Any:
        """The KV of ``block_ids`` (all layers) as a serializable payload: a copy, or a
        description of where the destination pulls it from (the blocks then stay held until
        it has imported them)."""
        ...

    def import_kv(self, block_ids: list[int], payload: Any) -> None:
        """Write a payload made by :meth:`export_kv` into ``block_ids`` (same length and order)."""
        ...
