"""Which slices of a KV hand-off each destination rank takes from which source rank.

A rank of an instance of ``tp`` x ``pp`` holds the layers of its stage
(:func:`pdserve.model.parallel.stage_layers`) and the KV heads of its TP rank (the heads split
in ``tp`` ranges; when ``tp`` exceeds the KV heads each head is replicated on ``tp / kv_heads``
consecutive ranks, and only the first of them serves it). A destination rank takes the grid
(its layers ∩ each source stage's) x (its KV heads ∩ each serving source rank's)::

    source tp=2 pp=1, 4 layers, 4 KV heads      destination tp=1 pp=2, its rank 1 (layers 2-3)
      rank 0: layers 0-3, heads 0-1       ─▶      (layers 2-3, heads 0-1) from rank 0
      rank 1: layers 0-3, heads 2-3       ─▶      (layers 2-3, heads 2-3) from rank 1

Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.model.parallel import kv_head_range, stage_layers


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Layers ``[layers[0], layers[1])`` and KV heads ``[heads[0], heads[1])`` (model-wide
    indices) of the blocks, read from global rank ``src_rank`` of the source instance."""

    src_rank: int
    layers: tuple[int, int]
    heads: tuple[int, int]


def serving_ranks(num_kv_heads: int, tp: int) -> list[tuple[int, tuple[int, int]]]:
    """``(tp rank, its KV heads)`` of one copy of every KV head: the first rank of each
    replica set."""
    replicas = max(tp // num_kv_heads, 1)
    return [(r, kv_head_range(num_kv_heads, tp, r)) for r in range(0, tp, replicas)]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def reshard_plan(num_layers: int, num_kv_heads: int, src: tuple[int, int],
                 dst: tuple[int, int], dst_rank: int) -> list[KVPiece]:
    """The pieces global rank ``dst_rank`` of a destination of ``dst = (tp, pp)`` takes from a
    source of ``src = (tp, pp)``, ordered by layers then heads: concatenating each layer
    range's pieces along the heads, then the layer ranges, gives exactly that rank's KV."""
    dst_tp, dst_pp = dst
    src_tp, src_pp = src
    stage, tp_rank = divmod(dst_rank, dst_tp)
    my_layers = stage_layers(num_layers, dst_pp)[stage]
    my_heads = kv_head_range(num_kv_heads, dst_tp, tp_rank)
    out = []
    for s, layers in enumerate(stage_layers(num_layers, src_pp)):
        lay = _overlap(my_layers, layers)
        if lay is None:
            continue
        for r, heads in serving_ranks(num_kv_heads, src_tp):
            hd = _overlap(my_heads, heads)
            if hd is not None:
                out.append(KVPiece(s * src_tp + r, lay, hd))
    return out
