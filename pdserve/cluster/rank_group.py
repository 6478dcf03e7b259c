"""An instance with ``tp * pp`` > 1 under the Ray runtime: one placement group, one actor per
rank.

The group reserves one bundle per pipeline stage, each of ``tp`` CPUs (GPUs on CUDA), with
the ``PACK`` strategy. Ray places a bundle on one node, so a stage's TP ranks — which
all-reduce every layer — always share a node, while stages, which exchange hidden states once
per step, may land on different nodes when no one node has room for the whole instance (Ray's
single strategy per group cannot say "strict within a stage, loose across stages" with
one-rank bundles; a bundle per stage says exactly that)::

    tp=2, pp=2:   bundle 0 {CPU: 2}  rank 0 (the instance's actor)  rank 1 (a rank actor)
                  bundle 1 {CPU: 2}  rank 2 (a rank actor)          rank 3 (a rank actor)

Rank 0 is the instance's actor (:class:`pdserve.cluster.instances.RayInstance`), its
scheduler and step loop; it starts ranks ``1 .. tp * pp - 1`` as :class:`_RankActor`\\ s in
its stage's bundle (:class:`RayRanks`, the executor's rank launcher), each running the rank
loop a child process would (:func:`pdserve.engine.model_executor.serve_rank`). Every rank
serves its own KV slices (``kv_part``) to the ranks of a decode instance, which pull them
directly (:func:`fetch_kv_parts`), nothing funnelled through rank 0. The rank actors
are owned by the instance's actor and die with it; removing the placement group ends every
actor in it. One rank dying fails the instance's next step, so the instance is dead and the
runtime recomputes its requests elsewhere, as for any dead instance.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.config import EngineConfig

log = logging.getLogger(__name__)

# how long a placement group that fits the cluster may wait for others to free resources
READY_TIMEOUT_S = 60.0
# how long a destination rank waits for the KV slices it pulls from a source rank
FETCH_TIMEOUT_S = 120.0


def stage_bundles(tp: int, pp: int, device: str) -> list[dict[str, float]]:
    """One bundle per stage: ``tp`` CPUs, or ``tp`` GPUs (and a CPU per rank) on CUDA."""
    bundle = {"CPU": float(tp)}
    if device.startswith("cuda"):
        bundle["GPU"] = float(tp)
    return [dict(bundle) for _ in range(pp)]


def placement_problem(tp: int, pp: int, device: str,
                      nodes: list[dict[str, float]]) -> str | None:
    """Why an instance of ``tp`` x ``pp`` ranks can never be placed on a cluster whose alive
    nodes have these total resources (``None``: it can be, once the resources are free)."""
    what = "GPU" if device.startswith("cuda") else "CPU"
    per_node = [n.get(what, 0.0) for n in nodes]
    total, largest = sum(per_node), max(per_node, default=0.0)
    if tp * pp > total:
        return (f"tp={tp} x pp={pp} needs {tp * pp} ranks (one {what} each), more than the "
                f"{total:g} {what}s of the Ray cluster")
    if tp > largest:
        return (f"tp={tp} needs {tp} {what}s on one node (a stage's TP ranks share a node), "
                f"more than the largest node of the Ray cluster has ({largest:g})")
    fits = sum(int(n // tp) for n in per_node)  # whole stages each node can hold
    if fits < pp:
        return (f"tp={tp} x pp={pp}: the Ray cluster's nodes have room for {fits} of the {pp} "
                f"stages of {tp} {what}s (a stage's TP ranks share a node)")
    return None


def check_placeable(specs: list[Any]) -> None:
    """``ValueError`` naming the role and value when an instance spec's ranks cannot ever be
    placed on the connected Ray cluster (before anything starts)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for s in specs:
        if s.tp * s.pp > 1:
            why = placement_problem(s.tp, s.pp, s.engine.device, nodes)
            if why is not None:
                raise ValueError(f"{s.role} instances: {why}")


def reserve(instance_id: str, tp: int, pp: int, device: str,
            timeout_s: float = READY_TIMEOUT_S) -> Any:
    """A ready placement group for the instance's ranks. ``RuntimeError`` (the group
    removed) when the cluster has not freed room for it within ``timeout_s``: Ray would keep
    an unplaceable group pending forever."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = stage_bundles(tp, pp, device)
    pg = placement_group(bundles, strategy="PACK", name=f"pdserve-{instance_id}")
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise RuntimeError(f"instance {instance_id}: the Ray cluster did not free room for its "
                           f"{tp * pp} ranks (bundles {bundles}) within {timeout_s:g} s; free "
                           f"resources ({ray.available_resources()}) or add nodes")
    log.info("instance %s: placement group of %d ranks (%s) ready", instance_id, tp * pp,
             bundles)
    return pg


def release(pg: Any) -> None:
    """Remove the placement group (ending any actor still in it); idempotent."""
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception as e:  # already removed, or Ray is shutting down
        log.debug("removing placement group %s: %s", pg.id, e)


def in_bundle(pg: Any, stage: int) -> Any:
    """The scheduling strategy of an actor of stage ``stage`` of the instance."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=stage,
                                            placement_group_capture_child_tasks=False)


def fetch_kv_parts(pieces: list[tuple[Any, list[int], tuple[int, int], tuple[int, int]]]
                   ) -> list[Any]:
    """A direct KV hand-off's pieces (source rank actor, block ids, layers, KV heads), each
    read by that actor's ``kv_part``, all at once; raises when a source rank is dead or does
    not answer within ``FETCH_TIMEOUT_S`` (the pull fails, the destination lives on)."""
    import ray

    refs = [actor.kv_part.remote(ids, layers, heads) for actor, ids, layers, heads in pieces]
    return list(ray.get(refs, timeout=FETCH_TIMEOUT_S))


def serve_kv(executor: Any, sources: list[Any] | None) -> None:
    """Make ``executor`` (one rank of a Ray instance) pull KV straight from other instances'
    ranks; on rank 0, ``sources`` (every rank's actor, in rank order) makes its exports
    direct payloads that name them (:meth:`ModelExecutor.export_kv`)."""
    executor.kv_fetch = fetch_kv_parts
    if sources is not None:
        executor.kv_sources = sources


class _RankActor:
    """One rank > 0 of an instance: its shard of the model, following rank 0's steps, and
    serving its KV slices to the ranks of the instances that pull them."""

    executor: Any = None

    def serve(self, config: EngineConfig, tp: int, pp: int, rank: int,
              address: tuple[str, int], num_threads: int) -> int:
        from pdserve.engine.model_executor import serve_rank  # lazy: torch

        def loaded(executor: Any) -> None:
            serve_kv(executor, None)
            self.executor = executor

        return serve_rank(config, tp, pp, rank, address, num_threads,
                          own_device=config.device.startswith("cuda"), loaded=loaded)

    def kv_part(self, block_ids: list[int], layers: tuple[int, int],
                heads: tuple[int, int]) -> Any:
        """A slice of held blocks (beside ``serve``: see :meth:`ModelExecutor.kv_part`)."""
        if self.executor is None:
            raise RuntimeError("this rank has not loaded its model")
        return self.executor.kv_part(block_ids, layers, heads)

    def ping(self) -> bool:
        return True


class RayRanks:
    """The executor's rank launcher inside an instance's actor (rank 0): ranks ``1 ..`` as
    :class:`_RankActor`\\ s in their stages' bundles of ``pg``."""

    def __init__(self, pg: Any, instance_id: str) -> None:
        import ray

        self.pg, self.instance_id = pg, instance_id
        self.host = ray.util.get_node_ip_address()
        self.actors: list[Any] = []
        self._runs: list[Any] = []

    def start(self, config: EngineConfig, tp: int, pp: int, address: tuple[str, int],
              num_threads: int) -> None:
        import ray

        cuda = config.device.startswith("cuda")
        for r in range(1, tp * pp):
            # max_concurrency=4: ping() and destination ranks' kv_part() calls answer beside
            # the long serve() call
            actor = ray.remote(_RankActor).options(
                num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0, max_concurrency=4,
                scheduling_strategy=in_bundle(self.pg, r // tp)).remote()
            self.actors.append(actor)
            self._runs.append(actor.serve.remote(config, tp, pp, r, address, num_threads))
        log.info("instance %s: %d rank actors started", self.instance_id, len(self.actors))

    def stop(self, wait_s: float = 10.0) -> None:
        import ray

        actors, runs, self.actors, self._runs = self.actors, self._runs, [], []
        if runs and wait_s > 0:
            ray.wait(runs, num_returns=len(runs), timeout=wait_s)
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:  # Ray is shutting down
                log.debug("killing a rank actor of %s: %s", self.instance_id, e)
