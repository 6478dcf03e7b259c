"""KV transport between instances: payload sizes and the emulated link.

Two transports exist, chosen by the instance backend: in-process (the exported blocks are a CPU
tensor handed to the decode worker) and Ray (the prefill actor's export is an object in Ray's
object store; the decode actor pulls it by reference, so the bytes never pass through the
runtime). Either can be slowed to an emulated link, as TetriInfer's evaluation emulated network
bandwidth: a transfer takes at least ``bytes / bandwidth + latency``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import ModelConfig


@dataclass(frozen=True)
class Link:
    """``bandwidth_gbps`` in GB/s (``None`` = unlimited), ``latency_s`` per transfer."""

    bandwidth_gbps: float | None = None
    latency_s: float = 0.0

    def min_time(self, nbytes: int) -> float:
        t = self.latency_s
        if self.bandwidth_gbps is not None:
            t += nbytes / (self.bandwidth_gbps * 1e9)
        return t

    @property
    def emulated(self) -> bool:
        return self.bandwidth_gbps is not None or self.latency_s > 0


def kv_bytes(model: ModelConfig, dtype: str, num_blocks: int, block_size: int) -> int:
    """Bytes moved for ``num_blocks`` whole blocks of KV (all layers, K and V)."""
    return num_blocks * block_size * model.kv_bytes_per_token(dtype)
