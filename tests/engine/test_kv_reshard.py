"""The resharding plan of a KV hand-off, by hand-worked cases (pure, no torch)."""

from __future__ import annotations

import pytest

from pdserve.config import ModelConfig
from pdserve.engine.kv_reshard import KVPiece, kv_head_range, reshard_plan, serving_ranks
from pdserve.model.parallel import TPLayout


def test_tp2_to_tp1_takes_each_source_ranks_heads() -> None:
    assert reshard_plan(4, 4, (2, 1), (1, 1), 0) == [KVPiece(0, (0, 4), (0, 2)),
                                                     KVPiece(1, (0, 4), (2, 4))]


def test_tp1_to_tp2_each_destination_rank_takes_its_heads() -> None:
    assert reshard_plan(4, 4, (1, 1), (2, 1), 0) == [KVPiece(0, (0, 4), (0, 2))]
    assert reshard_plan(4, 4, (1, 1), (2, 1), 1) == [KVPiece(0, (0, 4), (2, 4))]


def test_tp2_to_tp4_splits_a_source_ranks_heads() -> None:
    # 8 KV heads: source ranks hold 0-3 and 4-7, destination ranks two each
    assert [reshard_plan(2, 8, (2, 1), (4, 1), r) for r in range(4)] == [
        [KVPiece(0, (0, 2), (0, 2))], [KVPiece(0, (0, 2), (2, 4))],
        [KVPiece(1, (0, 2), (4, 6))], [KVPiece(1, (0, 2), (6, 8))]]


def test_tp2_pp2_to_tp1_is_a_grid_of_layers_by_heads() -> None:
    # global rank = stage * tp + tp rank: stage 1 holds layers 2-3 on ranks 2 and 3
    assert reshard_plan(4, 2, (2, 2), (1, 1), 0) == [
        KVPiece(0, (0, 2), (0, 1)), KVPiece(1, (0, 2), (1, 2)),
        KVPiece(2, (2, 4), (0, 1)), KVPiece(3, (2, 4), (1, 2))]


def test_uneven_stages_on_both_sides() -> None:
    # 5 layers: source pp2 holds 0-2 | 3-4, destination pp3 holds 0-1 | 2-3 | 4
    assert reshard_plan(5, 2, (1, 2), (1, 3), 1) == [KVPiece(0, (2, 3), (0, 2)),
                                                     KVPiece(1, (3, 4), (0, 2))]
    assert reshard_plan(5, 2, (1, 2), (1, 3), 2) == [KVPiece(1, (4, 5), (0, 2))]


def test_replicated_source_heads_come_from_the_first_replica() -> None:
    # tp4 over 2 KV heads: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    assert serving_ranks(2, 4) == [(0, (0, 1)), (2, (1, 2))]
    assert reshard_plan(3, 2, (4, 1), (1, 1), 0) == [KVPiece(0, (0, 3), (0, 1)),
                                                     KVPiece(2, (0, 3), (1, 2))]
    # with pp2 as well: stage 1's serving ranks are 4 and 6
    assert reshard_plan(2, 2, (4, 2), (1, 1), 0) == [
        KVPiece(0, (0, 1), (0, 1)), KVPiece(2, (0, 1), (1, 2)),
        KVPiece(4, (1, 2), (0, 1)), KVPiece(6, (1, 2), (1, 2))]


def test_replicated_destination_heads_each_rank_pulls_its_copy() -> None:
    # decode tp4 over 2 KV heads from prefill tp2: ranks 0, 1 take head 0, ranks 2, 3 head 1
    assert [reshard_plan(2, 2, (2, 1), (4, 1), r) for r in range(4)] == [
        [KVPiece(0, (0, 2), (0, 1))], [KVPiece(0, (0, 2), (0, 1))],
        [KVPiece(1, (0, 2), (1, 2))], [KVPiece(1, (0, 2), (1, 2))]]


def test_same_layout_is_rank_to_rank() -> None:
    assert [reshard_plan(4, 4, (2, 2), (2, 2), r) for r in range(4)] == [
        [KVPiece(r, (2 * (r // 2), 2 * (r // 2) + 2), (2 * (r % 2), 2 * (r % 2) + 2))]
        for r in range(4)]


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 1), (2, 2), (2, 4), (4, 2), (8, 4)])
def test_head_ranges_match_the_executors_layout(kv_heads: int, tp: int) -> None:
    model = ModelConfig(family="llama", vocab_size=64, hidden_size=64, num_layers=2,
                        num_heads=8, num_kv_heads=kv_heads, head_dim=8, intermediate_size=64,
                        max_position_embeddings=128)
    for r in range(tp):
        assert kv_head_range(kv_heads, tp, r) == TPLayout(model, tp, r).kv_head_range()
