"""Tensor-parallel layout (which heads, rows and vocabulary ids a rank holds), the live checks of
a ``tp``/``pp``/``ep`` setting, and the communicator the sharded model talks through.

Megatron-style sharding, as nano-vllm and mini-sglang do it::

    column-parallel (split outputs)        row-parallel (split inputs, then all-reduce)
    q/k/v heads, gate/up rows, fc1 rows    o_proj/out_proj, down_proj/fc2 columns

Query heads split evenly; KV heads split evenly when ``tp`` divides them and are replicated
when ``tp`` exceeds them (rank ``r`` holds KV head ``r // (tp / kv_heads)``). The vocabulary is
split in ``ceil(vocab / tp)``-row shards (the last padded); logits are gathered before sampling.

Pipeline parallelism splits the layers into ``pp`` balanced stages (:func:`stage_layers`); a
stage is a TP group, and global rank ``stage * tp + r`` is TP rank ``r`` of its stage.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from pdserve.config import ModelConfig, cdiv


def kv_head_range(num_kv_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads ``[lo, hi)`` TP rank ``tp_rank`` of ``tp`` holds: an even split, or (``tp``
    above the KV heads) head ``tp_rank // (tp / num_kv_heads)`` replicated."""
    per = max(num_kv_heads // tp, 1)
    first = tp_rank // max(tp // num_kv_heads, 1) * per
    return first, first + per


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of a ``tp``-way tensor-parallel group holds of ``model``."""

    model: ModelConfig
    tp: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        check_tp(self.model, self.tp)
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} is outside a tp={self.tp} group")

    @property
    def heads(self) -> int:
        return self.model.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return max(self.model.num_kv_heads // self.tp, 1)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless ``tp`` > KV heads)."""
        return max(self.tp // self.model.num_kv_heads, 1)

    def head_range(self) -> tuple[int, int]:
        return self.rank * self.heads, (self.rank + 1) * self.heads

    def kv_head_range(self, rank: int | None = None) -> tuple[int, int]:
        return kv_head_range(self.model.num_kv_heads, self.tp,
                             self.rank if rank is None else rank)

    def kv_owner(self, kv_head: int) -> int:
        """The first rank holding ``kv_head`` (where a KV export reads it)."""
        return kv_head // self.kv_heads * self.kv_replicas

    def inter_range(self) -> tuple[int, int]:
        n = self.model.intermediate_size // self.tp
        return self.rank * n, (self.rank + 1) * n

    @property
    def vocab_shard(self) -> int:
        return cdiv(self.model.vocab_size, self.tp)

    def vocab_range(self) -> tuple[int, int]:
        """Vocabulary ids ``[lo, hi)`` of this rank (``hi - lo`` may fall short of
        :attr:`vocab_shard` on the last rank: its rows past the vocabulary stay zero)."""
        lo = self.rank * self.vocab_shard
        return min(lo, self.model.vocab_size), min(lo + self.vocab_shard, self.model.vocab_size)

    def local_config(self) -> ModelConfig:
        """The model as one rank builds it: its heads, KV heads and MLP width."""
        if self.tp == 1:
            return self.model
        return replace(self.model, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=self.model.intermediate_size // self.tp,
                       head_dim=self.model.head_dim)


def check_tp(model: ModelConfig, tp: int) -> None:
    """``ValueError`` naming ``tp`` when ``model`` cannot be split ``tp`` ways."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    name = model.name or model.family
    h, kv, inter = model.num_heads, model.num_kv_heads, model.intermediate_size
    if h % tp:
        raise ValueError(f"tp={tp} does not divide the {h} attention heads of {name!r}")
    if kv % tp and tp % kv:
        raise ValueError(f"tp={tp} neither divides the {kv} KV heads of {name!r} nor is a "
                         f"multiple of them (KV heads are split, or replicated when tp exceeds "
                         f"them)")
    if inter % tp:
        raise ValueError(f"tp={tp} does not divide the MLP width {inter} of {name!r}")


def check_live_layout(model: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1,
                      device: str = "cpu", ranks_available: int | None = None) -> None:
    """``ValueError`` naming the value when the live engine cannot run an instance of ``model``
    with this parallelism (``pdserve simulate`` and ``plan`` model any of them).

    ``ranks_available``: the CPUs (or GPUs) one instance may use; ``None`` = this machine's."""
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if ep != 1:
        raise ValueError(f"ep={ep}: the live engine runs dense models without expert "
                         f"parallelism; expert parallelism is simulated only (pdserve simulate)")
    if pp > model.num_layers:
        raise ValueError(f"pp={pp} exceeds the {model.num_layers} layers of "
                         f"{model.name or model.family!r}")
    check_tp(model, tp)
    ranks = tp * pp
    if ranks_available is None and device.startswith("cuda"):
        import torch

        ranks_available = torch.cuda.device_count()
    elif ranks_available is None:
        ranks_available = os.cpu_count() or 1
    if ranks_available is not None and ranks > ranks_available:
        what = "GPUs" if device.startswith("cuda") else "CPUs"
        raise ValueError(f"tp={tp} x pp={pp} needs {ranks} ranks, more than the "
                         f"{ranks_available} {what} available")


def stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """The layer range ``[lo, hi)`` of each of ``pp`` pipeline stages, balanced (the first
    ``num_layers % pp`` stages hold one layer more)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp={pp} must be between 1 and the {num_layers} layers")
    q, r = divmod(num_layers, pp)
    out, lo = [], 0
    for s in range(pp):
        hi = lo + q + (s < r)
        out.append((lo, hi))
        lo = hi
    return out


# A rank waits for the next step for as long as the instance idles. A dead peer shows up at the
# next collective (gloo reports the closed connection); an idle rank also watches its parent
# process (pdserve.engine.model_executor).
IDLE_TIMEOUT = datetime.timedelta(days=365)


def master_store(world: int) -> Any:
    """The rendezvous store of a group on this machine (rank 0 holds it; the others connect to
    ``("127.0.0.1", store.port)``)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=120))


class Communicator:
    """The collectives a tensor-parallel rank needs: gloo on CPU, NCCL on CUDA, one code path.

    Each instance's ranks form their own process groups (built from a rendezvous store, not the
    process-global default group), so one process can drive several instances. Objects (step
    plans, KV payloads) always travel through a gloo group. ``world == 1``: every call is a
    no-op."""

    def __init__(self, rank: int = 0, world: int = 1, store: Any = None,
                 address: tuple[str, int] | None = None, device: str = "cpu",
                 prefix: str = "") -> None:
        self.rank, self.world = rank, world
        self.seconds = 0.0  # time spent in all_reduce / all_gather (waits for peers included)
        if world == 1:
            return
        import torch.distributed as dist

        if store is None:
            if address is None:
                raise ValueError("a rank of a group needs the rendezvous store or its address")
            store = dist.TCPStore(address[0], address[1], world, is_master=False,
                                  timeout=datetime.timedelta(seconds=120))
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "cpu/", store), rank,
                                         world, IDLE_TIMEOUT)
        self.dev = self.cpu
        if device.startswith("cuda"):
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "dev/", store), rank,
                                             world)
        self._store = store

    def all_reduce(self, x: Any) -> Any:
        """Sum ``x`` over the ranks, in place."""
        if self.world > 1:
            t = time.perf_counter()
            self.dev.allreduce([x]).wait()
            self.seconds += time.perf_counter() - t
        return x

    def all_gather(self, x: Any, dim: int = -1) -> Any:
        """``x`` of every rank concatenated along ``dim``, in rank order."""
        if self.world == 1:
            return x
        import torch

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        t = time.perf_counter()
        self.dev.allgather([parts], [x]).wait()
        self.seconds += time.perf_counter() - t
        return torch.cat(parts, dim=dim)

    def gather_cpu(self, x: Any) -> list[Any] | None:
        """Every rank's CPU tensor ``x`` (same shape on all) on rank 0; ``None`` elsewhere."""
        if self.world == 1:
            return [x]
        import torch

        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else []
        self.cpu.gather([out] if self.rank == 0 else [], [x],
                        _gather_options(0)).wait()
        return out if self.rank == 0 else None

    def scatter_cpu(self, parts: list[Any] | None, like: Any) -> Any:
        """Rank ``r`` receives ``parts[r]`` (CPU tensors of ``like``'s shape and dtype, given on
        rank 0 only)."""
        if self.world == 1:
            assert parts is not None
            return parts[0]
        import torch

        out = torch.empty_like(like)
        inputs = [p.contiguous() for p in parts] if self.rank == 0 and parts else []
        opts = _scatter_options(0)
        self.cpu.scatter([out], [inputs] if self.rank == 0 else [], opts).wait()
        return out

    def send(self, x: Any, dst: int, cpu: bool = False, tag: int = 0) -> None:
        """Send ``x`` to rank ``dst`` (point to point: a pipeline stage's hidden states through
        the device group, KV through the CPU group when ``cpu``)."""
        group = self.cpu if cpu else self.dev
        t = time.perf_counter()
        group.send([x.contiguous()], dst, tag).wait()
        self.seconds += time.perf_counter() - t

    def recv(self, like: Any, src: int, cpu: bool = False, tag: int = 0) -> Any:
        """A tensor of ``like``'s shape, dtype and device from rank ``src``."""
        import torch

        out = torch.empty_like(like)
        group = self.cpu if cpu else self.dev
        t = time.perf_counter()
        group.recv([out], src, tag).wait()
        self.seconds += time.perf_counter() - t
        return out

    def isend(self, x: Any, dst: int, tag: int = 0, cpu: bool = False) -> Any:
        """Start sending ``x`` to ``dst`` under ``tag``; returns the work (``wait()`` it, and keep
        ``x`` alive, before reusing ``x``). Sends of one tag to one rank arrive in order."""
        return (self.cpu if cpu else self.dev).send([x], dst, tag)

    def irecv(self, out: Any, src: int, tag: int = 0, cpu: bool = False) -> Any:
        """Start receiving into ``out`` from ``src`` under ``tag``; returns the work."""
        return (self.cpu if cpu else self.dev).recv([out], src, tag)

    def isend_object(self, obj: Any, dst: int, tag: int) -> list[tuple[Any, Any]]:
        """Start sending ``obj`` (pickled) to ``dst``: its size under ``tag``, its bytes under
        ``tag + 1``; returns the ``(work, tensor)`` pairs to wait for."""
        import pickle

        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        return [(self.cpu.send([size], dst, tag), size), (self.cpu.send([data], dst, tag + 1),
                                                          data)]

    def recv_object(self, src: int, tag: int) -> Any:
        """An object :meth:`isend_object` sent from ``src`` under ``tag``."""
        import pickle

        import torch

        size = torch.zeros(1, dtype=torch.int64)
        self.cpu.recv([size], src, tag).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu.recv([data], src, tag + 1).wait()
        return pickle.loads(data.numpy().tobytes())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` (pickled), on every rank."""
        if self.world == 1:
            return obj
        import pickle

        import torch

        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.cpu.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu.broadcast(data, 0).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())


def _gather_options(root: int) -> Any:
    import torch.distributed as dist

    opts = dist.GatherOptions()
    opts.rootRank = root
    return opts


def _scatter_options(root: int) -> Any:
    import torch.distributed as dist

    opts = dist.ScatterOptions()
    opts.rootRank = root
    return opts
