"""Tensor-parallel instances served live over HTTP answer exactly as TP1 does: a colocated TP2
deployment, and a disaggregated one whose TP2 prefill instance hands its KV to a TP1 decode
instance (KV resharded from two ranks' head ranges into one cache)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.cluster import rank_group
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from tests.cluster.realstack import (
    assert_pools_clean,
    decoding_on,
    engine_config,
    serving,
    tiny_model,
)
from tests.cluster.test_runtime_real import SHORT, TEXT, complete_all, prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[str]:
    llm = LLM(model_dir, num_kv_blocks=96, max_model_len=256)
    return [o.text for o in llm.generate([*prompts(), TEXT],
                                         SamplingParams(max_tokens=SHORT, temperature=0))]


@pytest.mark.parametrize("roles", [
    [{"role": "colocated", "tp": 2}],
    [{"role": "prefill", "tp": 2}, {"role": "decode", "tp": 1}],
    [{"role": "prefill", "tp": 1}, {"role": "decode", "tp": 2}],
], ids=["colocated-tp2", "prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
async def test_tp2_deployment_answers_as_tp1(model_dir: str, reference: list[str],
                                             roles: list[dict]) -> None:
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "roles": roles,
                                   "backend": "inproc"})
    rt = await build_runtime(cfg)
    async with serving(rt) as url:
        assert await complete_all(url, SHORT) == reference
        await assert_pools_clean(rt)


def test_llm_tensor_parallel_size(model_dir: str, reference: list[str]) -> None:
    llm = LLM(model_dir, tensor_parallel_size=2, num_kv_blocks=96, max_model_len=256)
    try:
        outs = llm.generate([*prompts(), TEXT], SamplingParams(max_tokens=SHORT, temperature=0))
        assert [o.text for o in outs] == reference
    finally:
        llm.close()


async def test_a_dead_rank_kills_its_instance_and_requests_recompute(
        model_dir: str, reference: list[str]) -> None:
    """Kill the second rank of a TP2 instance mid-run: its next step fails, the instance is
    dead, and its requests finish on the other TP2 instance with the same greedy text."""
    import asyncio

    import httpx

    from tests.cluster.realstack import wait_until

    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "backend": "inproc",
                                   "roles": [{"role": "colocated", "count": 2, "tp": 2}]})
    rt = await build_runtime(cfg)
    dead = rt.instances["colocated-0"]  # the supervisor may restart it in place meanwhile
    victim = dead.client.worker.engine.executor  # type: ignore[attr-defined]
    async with serving(rt) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        tasks = await decoding_on(rt, c, "colocated-0", [*prompts(), TEXT], SHORT)
        victim.ranks.procs[0].kill()
        assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == reference
        assert not dead.view.alive
        back = lambda: rt.instances.get("colocated-0")  # noqa: E731  (absent while restarting)
        await wait_until(lambda: back() is not None and back().view.alive and rt.restarts,
                         timeout=60, what="the TP2 instance restarted in place")
        assert [r.instance_id for r in rt.restarts] == ["colocated-0"]
        await assert_pools_clean(rt)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)],
                         ids=["tp2-tp1", "tp1-tp2"])
async def test_ray_prefill_tp2_decode_tp1(model_dir: str, reference: list[str],
                                          prefill_tp: int, decode_tp: int) -> None:
    """On Ray: a TP2 instance is its actor (rank 0) and a rank actor in its placement group;
    each decode rank pulls its KV heads straight from the prefill ranks that hold them (the
    direct path: nothing is gathered on either rank 0), both ways."""
    ray = pytest.importorskip("ray")
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "backend": "ray",
                                   "roles": [{"role": "prefill", "tp": prefill_tp},
                                             {"role": "decode", "tp": decode_tp}]})
    try:
        rt = await build_runtime(cfg)
        for iid, tp in (("prefill-0", prefill_tp), ("decode-0", decode_tp)):
            client = rt.instances[iid].client
            assert len(await client.rank_actors()) == tp - 1  # type: ignore[attr-defined]
            assert (client.pg is None) == (tp == 1)  # type: ignore[attr-defined]
        async with serving(rt) as url:
            assert await complete_all(url, SHORT) == reference
            await assert_pools_clean(rt)
            decode = rt.instances["decode-0"].client
            imports = await decode.kv_imports()  # type: ignore[attr-defined]
            assert imports.get("direct", 0) >= 1 and "funnel" not in imports, imports
    finally:
        ray.shutdown()


def pg_state(pg: object) -> str:
    import ray

    return ray.util.placement_group_table()[pg.id.hex()]["state"]  # type: ignore[attr-defined]


def is_alive(actor: object) -> bool:
    import ray

    try:
        return ray.get(actor.ping.remote(), timeout=30)  # type: ignore[attr-defined]
    except ray.exceptions.RayActorError:
        return False


@pytest.mark.ray
@pytest.mark.slow
async def test_ray_dead_rank_actor_kills_its_instance_and_nothing_leaks(
        model_dir: str, reference: list[str]) -> None:
    """On Ray, kill the rank actor of a TP2 instance mid-run: the instance is dead, its
    requests finish on the other TP2 instance with the same greedy text, its placement group
    is removed and it restarts in place. Removing an instance removes its placement group and
    ends its rank actors; a group the cluster has no room for fails instead of waiting."""
    import asyncio

    import httpx

    ray = pytest.importorskip("ray")
    from tests.cluster.realstack import wait_until

    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "backend": "ray",
                                   "roles": [{"role": "colocated", "count": 2, "tp": 2}]})
    try:
        rt = await build_runtime(cfg)
        dead = rt.instances["colocated-0"]
        dead_pg = dead.client.pg  # type: ignore[attr-defined]
        [victim] = await dead.client.rank_actors()  # type: ignore[attr-defined]
        assert pg_state(dead_pg) == "CREATED" and is_alive(victim)
        # the instances hold CPUs: a group one CPU larger than what is free times out and is
        # removed; one larger than the cluster is refused at once; both name what they need
        total = int(ray.cluster_resources()["CPU"])
        free = int(ray.available_resources().get("CPU", 0.0))
        assert free < total
        with pytest.raises(RuntimeError, match=rf"did not free room for its {free + 1} ranks"):
            rank_group.reserve("extra", free + 1, 1, "cpu", timeout_s=0.5)
        with pytest.raises(ValueError, match=rf"colocated instances: tp={total + 1} x pp=1 "
                                             rf"needs {total + 1} ranks \(one CPU each\), "
                                             rf"more than the {total} CPUs"):
            rank_group.check_placeable([replace(s, tp=total + 1) for s in
                                        cfg.instance_specs(1024)[:1]])
        async with serving(rt) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
            tasks = await decoding_on(rt, c, "colocated-0", [*prompts(), TEXT], SHORT, timeout=60)
            ray.kill(victim, no_restart=True)
            assert await asyncio.wait_for(asyncio.gather(*tasks), 120) == reference
            assert not dead.view.alive
            back = lambda: rt.instances.get("colocated-0")  # noqa: E731
            await wait_until(lambda: back() is not None and back().view.alive and rt.restarts,
                             timeout=120, what="the TP2 instance restarted in place")
            assert [r.instance_id for r in rt.restarts] == ["colocated-0"]
            assert pg_state(dead_pg) == "REMOVED"
            await assert_pools_clean(rt)

            gone = rt.instances["colocated-1"].client
            gone_pg = gone.pg  # type: ignore[attr-defined]
            [rank] = await gone.rank_actors()  # type: ignore[attr-defined]
            await rt.remove_instance("colocated-1")
            assert pg_state(gone_pg) == "REMOVED"
            assert not is_alive(rank)
            assert await complete_all(url, SHORT) == reference
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
async def test_ray_a_dead_source_rank_fails_the_pull_not_the_decode(model_dir: str) -> None:
    """Driven by hand on Ray: a TP2 prefill instance holds a request's KV and exports it (a
    direct payload naming its two ranks); its rank actor dies before the TP1 decode instance
    pulls. The decode reports a failed transfer (the driver would prefill the request again)
    and lives on with no block used, nothing imported."""
    import asyncio

    ray = pytest.importorskip("ray")
    from pdserve.cluster.instances import RayInstance, init_ray
    from pdserve.cluster.worker import AddRequest, AddTransfer, ImportKV, StepReport

    async def until(client: RayInstance, what: str, done: object) -> StepReport:
        for _ in range(600):  # polls, not a clock: each waits for the instance's next report
            for rep in await client.reports():
                if done(rep):  # type: ignore[operator]
                    return rep
            await asyncio.sleep(0.05)
        raise AssertionError(f"no report with {what}")

    init_ray(None, 3)
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "backend": "ray",
                                   "roles": [{"role": "prefill", "tp": 2}, {"role": "decode"}]})
    pre_spec, dec_spec = cfg.instance_specs(1024)
    try:
        prefill = await RayInstance.create(pre_spec.instance_id, pre_spec.engine, tp=2)
        decode = await RayInstance.create(dec_spec.instance_id, dec_spec.engine)
        await prefill.open()
        await decode.open()
        prompt, params = prompts()[2], SamplingParams(max_tokens=4, temperature=0)
        prefill.submit([AddRequest("r0", prompt, params, 0.0)])
        held = await until(prefill, "r0 held", lambda r: any(d.held for d in r.deltas))
        first = next(d for d in held.deltas if d.held).token_ids
        decode.submit([AddTransfer("r0", prompt, first, params, 0.0)])
        rep = await until(decode, "a pull of r0", lambda r: r.pulls)
        [(rid, first_block)] = rep.pulls
        payload, pending = await prefill.send_kv(rid, first_block)
        await asyncio.wrap_future(pending.future())  # exported: a descriptor, no KV
        [victim] = await prefill.rank_actors()
        ray.kill(victim, no_restart=True)
        decode.submit([ImportKV(rid, payload)])
        rep = await until(decode, "a failed transfer", lambda r: r.transfer_failures)
        [(rid, why)] = rep.transfer_failures
        assert rid == "r0" and why.startswith("KV transfer failed: ") and "Actor" in why, why
        assert (await decode.check_integrity())["used_blocks"] == 0
        assert await decode.kv_imports() == {}
        decode.kill()
        prefill.kill()
        rank_group.release(prefill.pg)
    finally:
        ray.shutdown()
