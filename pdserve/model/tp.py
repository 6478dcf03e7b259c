"""Tensor parallelism by module surgery (gpt-fast's ``tp.py`` habit): the model files stay
unsharded; this module builds one rank's share of a model and loads only its slices.

A rank builds the model of its :meth:`TPLayout.local_config` (its heads, KV heads and MLP
width: the fused QKV and gate/up matrices come out column-parallel by construction) on the meta
device, swaps in the parallel pieces, then allocates and loads::

    o_proj / out_proj, down_proj / fc2   -> RowParallel: partial product, bias on rank 0,
                                            all-reduce
    embed_tokens                         -> VocabParallelEmbedding: own id range, all-reduce
    lm_head (or the tied embedding)      -> this rank's vocabulary rows; the logits are
                                            all-gathered (ShardedModel.compute_logits)

Each checkpoint tensor is read through ``safe_open(...).get_slice`` so a rank reads only its
rows or columns (:func:`iter_shard`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.layers import Embedding, Linear, RotaryEmbedding, linear
from pdserve.model.parallel import Communicator, TPLayout

_ROW_PARALLEL = ("o_proj", "out_proj", "down_proj", "fc2")


class RowParallel(Linear):
    """A :class:`Linear` whose input features are split across ranks: each rank multiplies its
    slice, rank 0 adds the bias, and an all-reduce sums the partial products."""

    def __init__(self, inner: Linear, comm: Communicator) -> None:
        out, inp = inner.weight.shape
        super().__init__(inp, out, bias=inner.bias is not None)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.comm.rank == 0 else None
        return self.comm.all_reduce(linear(x, self.weight, bias, self.packed))


class VocabParallelEmbedding(Embedding):
    """Rows ``[lo, lo + shard)`` of the embedding; ids outside give zeros, and the all-reduce
    brings every id's row from the rank that holds it."""

    def __init__(self, shard: int, dim: int, lo: int, comm: Communicator) -> None:
        super().__init__(shard, dim)
        self.lo, self.comm = lo, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.comm.all_reduce(out)


class ShardedModel(nn.Module):
    """One rank's model: ``forward`` as the unsharded one, ``compute_logits`` gathering every
    rank's vocabulary columns (the full ``[rows, vocab]`` logits on every rank)."""

    def __init__(self, model: nn.Module, layout: TPLayout, comm: Communicator) -> None:
        super().__init__()
        self.model, self.layout, self.comm = model, layout, comm
        self.config = layout.model

    def forward(self, meta: Any, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.model(meta, kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.model.compute_logits(hidden)
        return self.comm.all_gather(local, dim=-1)[:, : self.layout.model.vocab_size]

    def hf_weight_spec(self) -> dict[str, tuple[str, int]]:
        return {hf: ("model." + p, row)
                for hf, (p, row) in self.model.hf_weight_spec().items()}  # type: ignore[operator]

    def ignored_hf_weight(self, name: str) -> bool:
        return bool(self.model.ignored_hf_weight(name))  # type: ignore[operator]


def build_sharded(cls: type[nn.Module], layout: TPLayout, comm: Communicator,
                  dtype: torch.dtype, device: str) -> ShardedModel:
    """``cls`` (a model family) for rank ``layout.rank``, allocated on ``device`` and
    uninitialised except for the vocabulary shards' padding rows (zero)."""
    cfg = layout.local_config()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(cfg)
            _surgery(model, layout, comm)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_buffers()
    with torch.no_grad():
        model.embed_tokens.weight.zero_()
        if getattr(model, "lm_head", None) is not None:
            model.lm_head.weight.zero_()
    return ShardedModel(model.eval().requires_grad_(False), layout, comm)


def _surgery(model: nn.Module, layout: TPLayout, comm: Communicator) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in _ROW_PARALLEL and isinstance(child, Linear):
                setattr(module, name, RowParallel(child, comm))
    emb = model.embed_tokens
    lo, _ = layout.vocab_range()
    model.embed_tokens = VocabParallelEmbedding(layout.vocab_shard, emb.weight.shape[1], lo, comm)
    head = getattr(model, "lm_head", None)
    if head is not None:
        model.lm_head = Linear(head.weight.shape[1], layout.vocab_shard, bias=False)


def shard_index(name: str, shape: tuple[int, ...], layout: TPLayout) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor ``name`` (of ``shape``) that rank ``layout.rank`` holds, as
    an index, or ``None`` for all of it (replicated)."""
    m = re.search(r"(\w+)\.(weight|bias)$", name)
    if m is None or layout.tp == 1:
        return None
    module, kind = m.groups()
    hd = layout.model.head_dim
    if module in ("embed_tokens", "lm_head") and "position" not in name:
        return (slice(*layout.vocab_range()),)
    rows = {"q_proj": tuple(hd * i for i in layout.head_range()),
            "k_proj": tuple(hd * i for i in layout.kv_head_range()),
            "v_proj": tuple(hd * i for i in layout.kv_head_range()),
            "gate_proj": layout.inter_range(), "up_proj": layout.inter_range(),
            "fc1": layout.inter_range()}.get(module)
    if rows is not None:
        return (slice(*rows),)
    if kind == "weight":
        cols = {"o_proj": tuple(hd * i for i in layout.head_range()),
                "out_proj": tuple(hd * i for i in layout.head_range()),
                "down_proj": layout.inter_range(), "fc2": layout.inter_range()}.get(module)
        if cols is not None:
            return (slice(None), slice(*cols))
    return None  # norms, positions, projections and row-parallel biases are replicated


def iter_shard(files: list[str], layout: TPLayout,
               counter: list[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's part)`` of every checkpoint tensor; safetensors files are read
    slice by slice (nothing else of the tensor is read). ``counter[0]`` accumulates the bytes
    read."""
    from safetensors import safe_open

    for path in files:
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(name)
                    idx = shard_index(name, tuple(sl.get_shape()), layout)
                    t = f.get_tensor(name) if idx is None else sl[idx]
                    if counter is not None:
                        counter[0] += t.numel() * t.element_size()
                    yield name, t
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            for name, t in state.items():
                idx = shard_index(name, tuple(t.shape), layout)
                t = t if idx is None else t[idx].clone()
                if counter is not None:
                    counter[0] += t.numel() * t.element_size()
                yield name, t


def check_model(cfg: ModelConfig) -> None:
    """Families whose modules the surgery knows."""
    if cfg.family not in ("llama", "qwen2", "qwen3", "opt"):
        raise ValueError(f"tensor parallelism does not support model family {cfg.family!r}")
