"""Building blocks shared by the models: per-step attention metadata, paged attention, RMSNorm
and rotary embeddings.

KV cache layout (one tensor for the whole model, allocated by the executor; head-major, see
:func:`paged_attention`)::

    kv_cache[layer, 0 = K | 1 = V, kv head, block, offset in block, head dim]

Token ``p`` of a request lives in slot ``block_ids[p // block_size] * block_size + p %
block_size`` of each head's flattened ``[num_blocks * block_size, head dim]`` view.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.cpu_kernels import paged_decode_kernel


@dataclass
class PrefillChunk:
    """A multi-token chunk ``[start, start + n)`` of one sequence, at rows ``[lo, hi)`` of the
    flattened batch. ``blocks`` is set when earlier context lives in the cache (``start > 0``):
    the block ids holding positions ``[0, start + n)``; otherwise the chunk attends to its own
    new K/V. ``mask`` (additive: 0 = visible, -inf = hidden; one row per query, one column per
    key) is ``None`` for a plain causal chunk without earlier context."""

    lo: int
    hi: int
    start: int
    blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Single-token rows ``[lo, hi)`` of similar context length, attended in one padded SDPA:
    ``blocks`` is their block table ``[hi - lo, max_blocks]`` (padded with block 0) and ``mask``
    (additive, ``[1, hi - lo, 1, max_blocks * block_size]``) hides the padding; ``None`` when
    every key is visible."""

    lo: int
    hi: int
    blocks: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything one forward step needs, built once per step by :func:`build_attention_metadata`.

    Rows of the flattened batch are ordered single-token entries (decodes, longest context
    first) then the multi-token chunks; ``sample_indices`` picks the rows to sample, in the
    batch's order. Decodes are split into :class:`DecodeGroup` s so that padding each group to
    its longest context wastes little (see :data:`DECODE_GROUP_RATIO`).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, cache slot each row's K/V is written to
    sample_indices: torch.Tensor  # [S] int64
    num_decode: int = 0
    decodes: list[DecodeGroup] = field(default_factory=list)
    # Most blocks one SDPA call gathers this step, and an optional reusable buffer for them (set
    # by the executor): a fresh multi-MiB tensor per layer costs page faults on every CPU call.
    max_gather_blocks: int = 0
    workspace: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Set instead of ``decodes`` when the decode rows run the in-place paged kernel
    # (:mod:`pdserve.model.cpu_kernels`): their block tables ``[num_decode, max_blocks]`` and
    # context lengths ``[num_decode]``.
    decode_table: torch.Tensor | None = None
    decode_ctx: torch.Tensor | None = None
    sliding_window: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


# A decode group grows while a row needs at least this share of the group's widest block
# table: padding costs gather bandwidth and attention FLOPs, each group one more kernel call.
DECODE_GROUP_RATIO = 0.6


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA takes a float mask without converting it on every call (a bool one it converts)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, -torch.inf)


def build_attention_metadata(seqs: Sequence[Any], block_size: int,
                             device: torch.device | str = "cpu",
                             dtype: torch.dtype = torch.float32,
                             sliding_window: int | None = None,
                             decode_kernel: bool = False) -> AttentionMetadata:
    """The one place where per-step metadata is built from scheduled sequences.

    ``seqs`` are :class:`pdserve.engine.batch.ScheduledSeq`-like objects (``request`` with
    ``all_token_ids`` and ``block_ids``, ``start``, ``num_tokens``, ``sample``). Attention masks
    are additive, in ``dtype`` (the model's). ``sliding_window=w`` lets position ``q`` see only
    keys ``q - w < k <= q`` (Mistral). ``decode_kernel``: the decode rows will run
    :func:`pdserve.model.cpu_kernels.paged_decode_kernel` (CPU, float32): one block table for
    all of them (``decode_table``/``decode_ctx``) instead of padded :class:`DecodeGroup` s.
    """
    if not seqs:
        raise ValueError("cannot build attention metadata for an empty batch")
    bs = block_size
    decodes = sorted((s for s in seqs if s.num_tokens == 1), key=lambda s: -s.start)
    order = decodes + [s for s in seqs if s.num_tokens > 1]
    n = len(order)
    nd = n - sum(1 for s in order if s.num_tokens > 1)
    q_lens = np.fromiter((s.num_tokens for s in order), np.int64, n)
    starts = np.fromiter((s.start for s in order), np.int64, n)
    ctx = starts + q_lens
    cu = np.zeros(n + 1, np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])

    input_ids: list[int] = []
    nblocks = (ctx + bs - 1) // bs
    table = np.zeros((n, int(nblocks.max())), np.int64)
    for i, s in enumerate(order):
        toks = s.request.all_token_ids
        input_ids += toks[s.start : s.start + s.num_tokens]
        nb = int(nblocks[i])
        ids = s.request.block_ids
        if len(ids) < nb:
            raise ValueError(f"request {s.request.request_id!r} has {len(ids)} blocks, needs {nb} "
                             f"for {int(ctx[i])} tokens")
        table[i, :nb] = ids[:nb]
    if len(input_ids) != total:
        raise ValueError("a scheduled chunk extends beyond its request's tokens")
    seq_of_row = np.repeat(np.arange(n), q_lens)
    positions = np.arange(total, dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)
    slots = table[seq_of_row, positions // bs] * bs + positions % bs

    row_of = {id(s): int(cu[i + 1]) - 1 for i, s in enumerate(order)}
    sample = [row_of[id(s)] for s in seqs if s.sample]

    dev = torch.device(device)

    def tensor(a: Any) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.int64).to(dev, non_blocking=True)

    meta = AttentionMetadata(input_ids=tensor(input_ids), positions=tensor(positions),
                             slot_mapping=tensor(slots), sample_indices=tensor(sample),
                             num_decode=nd, sliding_window=sliding_window)
    lo = nd if decode_kernel else 0
    if decode_kernel and nd:
        meta.decode_table = tensor(table[:nd, : int(nblocks[:nd].max())])
        meta.decode_ctx = tensor(ctx[:nd])
    while lo < nd:  # rows are sorted by context, longest first
        mb = int(nblocks[lo])
        hi = lo + 1
        while hi < nd and nblocks[hi] >= DECODE_GROUP_RATIO * mb:
            hi += 1
        group = DecodeGroup(lo, hi, tensor(table[lo:hi, :mb]))
        full = bool((ctx[lo:hi] == mb * bs).all())
        if not full or (sliding_window is not None and mb * bs > sliding_window):
            keys = torch.arange(mb * bs, device=dev)
            ends = tensor(ctx[lo:hi])[:, None]
            visible = keys[None, :] < ends
            if sliding_window is not None:
                visible &= keys[None, :] >= ends - sliding_window
            group.mask = _additive(visible, dtype)[None, :, None, :]
        meta.decodes.append(group)
        meta.max_gather_blocks = max(meta.max_gather_blocks, (hi - lo) * mb)
        lo = hi
    for i in range(nd, n):
        chunk = PrefillChunk(int(cu[i]), int(cu[i + 1]), int(starts[i]))
        windowed = sliding_window is not None and int(ctx[i]) > sliding_window
        if chunk.start > 0 or windowed:
            if chunk.start > 0:
                nb = int(nblocks[i])
                chunk.blocks = tensor(table[i, :nb])
                meta.max_gather_blocks = max(meta.max_gather_blocks, nb)
                keys = torch.arange(nb * bs, device=dev)
            else:
                keys = torch.arange(int(ctx[i]), device=dev)
            query = torch.arange(chunk.start, int(ctx[i]), device=dev)[:, None]
            visible = keys[None, :] <= query
            if windowed:
                visible &= keys[None, :] > query - sliding_window
            chunk.mask = _additive(visible, dtype)
        meta.prefills.append(chunk)
    return meta


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor,
            workspace: torch.Tensor | None = None) -> torch.Tensor:
    """K and V of ``blocks`` in one copy: ``[2 * kv_heads, len(blocks), block_size, hd]``,
    written into ``workspace`` when it is large enough."""
    two, kv_heads, num_blocks, block_size, hd = kv_cache.shape
    src = kv_cache.view(two * kv_heads, num_blocks, block_size, hd)
    shape = (two * kv_heads, blocks.shape[0], block_size, hd)
    size = math.prod(shape)
    if workspace is None or workspace.numel() < size or workspace.dtype != kv_cache.dtype:
        return src.index_select(1, blocks)
    return torch.index_select(src, 1, blocks, out=workspace[:size].view(shape))


def gather_elements_per_block(kv_cache: torch.Tensor) -> int:
    """Elements one gathered block takes (K and V, all KV heads of one layer)."""
    two, kv_heads, _, block_size, hd = kv_cache.shape[-5:]
    return two * kv_heads * block_size * hd


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float | None = None) -> torch.Tensor:
    """Write the batch's new K/V into ``kv_cache`` (this layer's
    ``[2, kv_heads, blocks, block_size, hd]``), then attend every query row to its sequence's
    context.

    ``q``: ``[T, heads, hd]``, ``k``/``v``: ``[T, kv_heads, hd]``. Returns ``[T, heads * hd]``.
    Single-token rows (decodes) run as one padded SDPA per :class:`DecodeGroup` with a
    key-padding mask; each multi-token chunk runs its own causal SDPA (offset by its start).
    The cache is head-major so that a gather of blocks yields, per KV head, one contiguous
    ``[keys, hd]`` matrix: CPU attention kernels are several times slower on strided keys.
    """
    num_tokens, heads, hd = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_size = k_cache.shape[2]
    k_cache.view(kv_heads, -1, hd).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, hd).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    out = q.new_empty(num_tokens, heads, hd)
    if meta.decode_table is not None:
        nd = meta.num_decode
        od = paged_decode_kernel(q[:nd], kv_cache, meta.decode_table, meta.decode_ctx,
                                 1.0 / math.sqrt(hd) if scale is None else scale,
                                 meta.sliding_window)
        if od is None:
            raise RuntimeError("metadata asks for the CPU decode kernel, which does not apply "
                               f"here ({q.device}, {q.dtype})")
        out[:nd] = od
    for d in meta.decodes:
        n = d.hi - d.lo
        keys = d.blocks.shape[1] * block_size
        kd, vd = _gather(kv_cache, d.blocks.reshape(-1), meta.workspace).view(
            2, kv_heads, n, keys, hd)
        # GQA without repeating K/V: the `group` query heads of a KV head act as query rows.
        qd = q[d.lo : d.hi].view(n, kv_heads, group, hd).transpose(0, 1)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale)
        out[d.lo : d.hi] = od.transpose(0, 1).reshape(n, heads, hd)
    gqa = group > 1
    for c in meta.prefills:
        qc = q[c.lo : c.hi].transpose(0, 1).contiguous()  # [heads, n, hd]
        if c.blocks is None:
            kc = k[c.lo : c.hi].transpose(0, 1).contiguous()
            vc = v[c.lo : c.hi].transpose(0, 1).contiguous()
        else:
            keys = c.blocks.shape[0] * block_size
            kc, vc = _gather(kv_cache, c.blocks, meta.workspace).view(2, kv_heads, keys, hd)
        oc = F.scaled_dot_product_attention(qc[None], kc[None], vc[None], attn_mask=c.mask,
                                            is_causal=c.mask is None, scale=scale,
                                            enable_gqa=gqa)
        out[c.lo : c.hi] = oc[0].transpose(0, 1)
    return out.view(num_tokens, heads * hd)


# Parameter-holding layers below are created uninitialised (the loader fills them): a random
# init of billions of parameters would only be overwritten.


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


# Rows of a matmul for which a pre-packed oneDNN weight beats torch's F.linear (MKL) on CPU in
# float32: decode-sized batches (faster at 1-64 rows, equal or slower at prefill sizes on the
# CPUs measured: docs/benchmarks.md, "Engine profile"). One row counts too: timed alone, a small
# weight stays in cache and MKL's matrix-vector product looks faster, but in a decode step every
# weight comes from memory once, and oneDNN's blocked layout streams it faster. Above 256 rows
# it depends on the CPU: :func:`choose_prefill_path` times both once per process.
PACKED_ROWS = (1, 256)
PREFILL_ROWS = 512  # the prefill-sized input choose_prefill_path times
_prefill_chosen = False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) reordered once into oneDNN's blocked layout for
    :func:`linear`, or ``None`` where that does not apply (not CPU float32, no oneDNN,
    ``PDSERVE_ONEDNN_LINEAR=0``)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()
            or os.environ.get("PDSERVE_ONEDNN_LINEAR", "1") == "0"):
        return None
    try:
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):  # an op this torch build lacks
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the pre-packed ``packed`` (:func:`pack_weight`) for 2-D inputs of
    :data:`PACKED_ROWS` rows."""
    if (packed is not None and x.dim() == 2 and PACKED_ROWS[0] <= x.shape[0] <= PACKED_ROWS[1]
            and x.is_contiguous()):
        return _packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # set by prepack(); not part of the state

    def prepack(self) -> None:
        """Keep a oneDNN-packed copy of the weight (after loading; see :func:`pack_weight`)."""
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module) -> int:
    """Pre-pack every :class:`Linear` of ``model`` and a tied output head (``packed_head``) for
    CPU float32 inference; returns how many weights were packed. Costs a second copy of those
    weights in memory (F.linear keeps the plain one for inputs outside :data:`PACKED_ROWS`).
    The first call in a process also chooses the prefill path (:func:`choose_prefill_path`)."""
    lins = [m for m in model.modules() if isinstance(m, Linear)]
    for m in lins:
        m.prepack()
    lins = [m for m in lins if m.packed is not None]
    count = len(lins)
    if (hasattr(model, "packed_head") and getattr(model, "lm_head", None) is None
            and getattr(model, "last_stage", True) and model.embed_tokens is not None):
        model.packed_head = pack_weight(model.embed_tokens.weight)
        count += model.packed_head is not None
    if lins and not _prefill_chosen:
        choose_prefill_path(max(lins, key=lambda m: m.weight.numel()))
    return count


def choose_prefill_path(lin: Linear, repeats: int = 3) -> bool:
    """Time ``lin`` on a :data:`PREFILL_ROWS`-row input through F.linear and through its packed
    weight, alternately, ``repeats`` times each (a few ms per call), and widen
    :data:`PACKED_ROWS` to every row count when the packed path is at least 10 % faster by the
    median: MKL's large-matrix path is the faster one on some CPUs and the slower on others
    (e.g. 2.4x slower on an AVX-512 AMD EPYC). Once per process (the CPU does not change);
    ``PDSERVE_ONEDNN_PREFILL=0|1`` decides instead. Returns whether prefill is packed."""
    global PACKED_ROWS, _prefill_chosen
    _prefill_chosen = True
    env = os.environ.get("PDSERVE_ONEDNN_PREFILL")
    if env is not None:
        packed = env == "1"
    else:
        x = torch.randn(PREFILL_ROWS, lin.weight.shape[1])
        times: dict[bool, list[float]] = {False: [], True: []}
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first round warms both paths up
                for use in (False, True):
                    t = time.perf_counter()
                    if use:
                        _packed_linear(x, lin.packed, lin.bias)
                    else:
                        F.linear(x, lin.weight, lin.bias)
                    times[use].append(time.perf_counter() - t)
        packed = statistics.median(times[True][1:]) < 0.9 * statistics.median(times[False][1:])
    PACKED_ROWS = (PACKED_ROWS[0], sys.maxsize if packed else 256)
    return packed


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = (dim,), eps
        self.weight = nn.Parameter(torch.empty(dim)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.empty(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.dim, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 (as Llama's reference does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with ``linear`` and ``llama3`` scaling.

    Unknown scaling types raise ``ValueError`` (serving them silently would be wrong)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv
    assert scaling is not None
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout of Hugging Face Llama checkpoints.

    Holds a float32 ``[max_positions, head_dim]`` table of ``cos | sin`` halves; the model
    indexes it once per step (:meth:`cos_sin`) and every layer applies it (:func:`apply_rope`).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("table", torch.empty(max_positions, head_dim, dtype=torch.float32),
                             persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the table on its device."""
        inv = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.table = table.to(self.table.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``[T, 1, head_dim // 2]`` in ``dtype``."""
        cs = self.table.index_select(0, positions).to(dtype).unsqueeze(1)
        return cs.chunk(2, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``): halves ``(a, b)`` -> ``(a cos - b sin,
    b cos + a sin)``."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
