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

A pipeline stage (``layers=(lo, hi)``, :func:`pdserve.model.parallel.stage_layers`) is built with
``hi - lo`` layers and only its pieces: the embedding on the first stage, the final norm and LM
head on the last (the tied embedding there too); it reads only those tensors, its layers renamed
to local indices (:func:`stage_renamer`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
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

    def forward(self, meta: Any, kv_cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(meta, kv_cache, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.model.compute_logits(hidden)
        return self.comm.all_gather(local, dim=-1)[:, : self.layout.model.vocab_size]

    def hf_weight_spec(self) -> dict[str, tuple[str, int]]:
        """The inner model's, less the parameters a pipeline stage dropped."""
        params = dict(self.model.named_parameters())
        return {hf: ("model." + p, row)
                for hf, (p, row) in self.model.hf_weight_spec().items()  # type: ignore[operator]
                if p in params}

    def ignored_hf_weight(self, name: str) -> bool:
        return bool(self.model.ignored_hf_weight(name))  # type: ignore[operator]


def build_sharded(cls: type[nn.Module], layout: TPLayout, comm: Communicator,
                  dtype: torch.dtype, device: str,
                  layers: tuple[int, int] | None = None) -> ShardedModel:
    """``cls`` (a model family) for rank ``layout.rank``, allocated on ``device`` and
    uninitialised except for the vocabulary shards' padding rows (zero). ``layers``: the
    pipeline stage's layer range (default: all)."""
    cfg = layout.local_config()
    lo, hi = layers or (0, cfg.num_layers)
    first, last = lo == 0, hi == cfg.num_layers
    if (lo, hi) != (0, cfg.num_layers):
        cfg = replace(cfg, num_layers=hi - lo)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(cfg)
            _surgery(model, layout, comm)
            _drop_for_stage(model, first, last, cfg.tie_word_embeddings)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_buffers()
    with torch.no_grad():
        if model.embed_tokens is not None:
            model.embed_tokens.weight.zero_()
        if getattr(model, "lm_head", None) is not None:
            model.lm_head.weight.zero_()
    return ShardedModel(model.eval().requires_grad_(False), layout, comm)


def _drop_for_stage(model: nn.Module, first: bool, last: bool, tied: bool) -> None:
    """Remove what pipeline stage (``first``, ``last``) does not run: the embedding (kept on the
    last stage when the LM head is tied to it), positions and input projection before the
    layers, the final norm, output projection and LM head after them."""
    if not first:
        if not (last and tied):
            model.embed_tokens = None
        for name in ("embed_positions", "project_in"):
            if getattr(model, name, None) is not None:
                setattr(model, name, None)
    if not last:
        model.last_stage = False
        for name in ("norm", "final_layer_norm", "project_out", "lm_head"):
            if getattr(model, name, None) is not None:
                setattr(model, name, None)


_LAYER = re.compile(r"\blayers\.(\d+)\.")


def stage_renamer(cls: type[nn.Module], full: ModelConfig, layers: tuple[int, int],
                  stage: ShardedModel) -> Callable[[str], str | None]:
    """For pipeline stage ``stage`` holding ``layers`` of ``full``: a checkpoint tensor's name
    as the stage loads it (its layers renumbered from 0), or ``None`` for a tensor of another
    stage (not read at all)."""
    with torch.device("meta"):
        everything = set(cls(full).hf_weight_spec())  # type: ignore[operator]
    mine = set(stage.hf_weight_spec())
    lo, hi = layers

    def rename(name: str) -> str | None:
        m = _LAYER.search(name)
        if m is not None:
            i = int(m.group(1))
            return f"{name[:m.start(1)]}{i - lo}{name[m.end(1):]}" if lo <= i < hi else None
        key = name if name in everything else f"model.{name}"
        if key in everything and key not in mine:
            return None
        return name

    return rename


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


def iter_shard(files: list[str], layout: TPLayout, counter: list[int] | None = None,
               rename: Callable[[str], str | None] | None = None,
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's part)`` of every checkpoint tensor; safetensors files are read
    slice by slice (nothing else of the tensor is read). ``counter[0]`` accumulates the bytes
    read. ``rename``: a pipeline stage's :func:`stage_renamer` (``None`` skips a tensor)."""
    from safetensors import safe_open

    for path in files:
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt", device="cpu") as f:
                for hf_name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = hf_name if rename is None else rename(hf_name)
                    if name is None:
                        continue
                    sl = f.get_slice(hf_name)
                    idx = shard_index(name, tuple(sl.get_shape()), layout)
                    t = f.get_tensor(hf_name) if idx is None else sl[idx]
                    if counter is not None:
                        counter[0] += t.numel() * t.element_size()
                    yield name, t
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            for hf_name, t in state.items():
                name = hf_name if rename is None else rename(hf_name)
                if name is None:
                    continue
                idx = shard_index(name, tuple(t.shape), layout)
                t = t if idx is None else t[idx].clone()
                if counter is not None:
                    counter[0] += t.numel() * t.element_size()
                yield name, t


def check_model(cfg: ModelConfig) -> None:
    """Families whose modules the surgery knows."""
    if cfg.family not in ("llama", "qwen2", "qwen3", "opt"):
        raise ValueError(f"tensor parallelism does not support model family {cfg.family!r}")
