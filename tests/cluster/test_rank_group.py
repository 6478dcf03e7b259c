"""The placement of a tp x pp instance's ranks under Ray: one bundle per stage (its TP ranks
on one node), and the layouts no cluster can hold refused with the value that does not fit."""

from __future__ import annotations

from pdserve.cluster.rank_group import placement_problem, stage_bundles


def test_a_bundle_per_stage_holds_its_tp_ranks() -> None:
    assert stage_bundles(2, 3, "cpu") == [{"CPU": 2.0}] * 3
    assert stage_bundles(4, 1, "cuda") == [{"CPU": 4.0, "GPU": 4.0}]


def test_layouts_the_cluster_can_hold() -> None:
    two_nodes = [{"CPU": 4.0}, {"CPU": 4.0}]
    assert placement_problem(4, 2, "cpu", two_nodes) is None  # a stage per node
    assert placement_problem(2, 4, "cpu", two_nodes) is None
    assert placement_problem(1, 8, "cpu", two_nodes) is None


def test_layouts_no_cluster_node_can_hold_name_the_value() -> None:
    two_nodes = [{"CPU": 4.0}, {"CPU": 4.0}]
    assert placement_problem(4, 3, "cpu", two_nodes) == (
        "tp=4 x pp=3 needs 12 ranks (one CPU each), more than the 8 CPUs of the Ray cluster")
    assert placement_problem(8, 1, "cpu", two_nodes) == (
        "tp=8 needs 8 CPUs on one node (a stage's TP ranks share a node), more than the "
        "largest node of the Ray cluster has (4)")
    assert placement_problem(3, 2, "cpu", [{"CPU": 4.0}, {"CPU": 2.0}]) == (
        "tp=3 x pp=2: the Ray cluster's nodes have room for 1 of the 2 stages of 3 CPUs (a "
        "stage's TP ranks share a node)")
    assert placement_problem(2, 1, "cuda", [{"CPU": 16.0, "GPU": 1.0}]) == (
        "tp=2 x pp=1 needs 2 ranks (one GPU each), more than the 1 GPUs of the Ray cluster")
