"""Pipeline-parallel instances served live over HTTP answer exactly as TP1 does: a colocated
PP2 deployment (two micro-batches in flight), a PP2 prefill instance handing its KV (both
stages' layers in one payload) to a PP1 decode instance, and ``LLM(pipeline_parallel_size=2)``.
A killed stage makes its instance dead and its requests finish elsewhere (recomputed)."""

from __future__ import annotations

import pytest

from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from tests.cluster.realstack import assert_pools_clean, decoding_on, engine_config, serving
from tests.cluster.test_runtime_real import SHORT, TEXT, complete_all, prompts
from tests.cluster.test_tp_live import model_dir, reference  # noqa: F401 - fixtures


@pytest.mark.parametrize("roles", [
    [{"role": "colocated", "pp": 2}],
    [{"role": "prefill", "pp": 2}, {"role": "decode", "pp": 1}],
], ids=["colocated-pp2", "prefill-pp2-decode-pp1"])
async def test_pp2_deployment_answers_as_tp1(model_dir: str, reference: list[str],  # noqa: F811
                                             roles: list[dict]) -> None:
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "roles": roles,
                                   "backend": "inproc"})
    rt = await build_runtime(cfg)
    async with serving(rt) as url:
        assert await complete_all(url, SHORT) == reference
        await assert_pools_clean(rt)
    if roles[0]["role"] == "colocated":  # six requests at once: both virtual engines busy
        ex = rt.instances["colocated-0"].client.worker.engine.executor  # type: ignore[attr-defined]
        assert ex.max_in_flight == 2


def test_llm_pipeline_parallel_size(model_dir: str, reference: list[str]) -> None:  # noqa: F811
    llm = LLM(model_dir, pipeline_parallel_size=2, num_kv_blocks=96, max_model_len=256)
    try:
        outs = llm.generate([*prompts(), TEXT], SamplingParams(max_tokens=SHORT, temperature=0))
        assert [o.text for o in outs] == reference
    finally:
        llm.close()


async def test_a_dead_stage_kills_its_instance_and_requests_recompute(
        model_dir: str, reference: list[str]) -> None:  # noqa: F811
    """Kill the second stage of a PP2 instance mid-run: its next step fails, the instance is
    dead, and its requests finish on the other PP2 instance with the same greedy text."""
    import asyncio

    import httpx


    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "backend": "inproc",
                                   "roles": [{"role": "colocated", "count": 2, "pp": 2}]})
    rt = await build_runtime(cfg)
    victim = rt.instances["colocated-0"].client.worker.engine.executor  # type: ignore[attr-defined]
    assert victim.pp == 2 and len(victim.ranks.procs) == 1
    async with serving(rt) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        tasks = await decoding_on(rt, c, "colocated-0", [*prompts(), TEXT], SHORT)
        victim.ranks.procs[0].kill()
        assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == reference
        assert not rt.instances["colocated-0"].view.alive
        await assert_pools_clean(rt)


@pytest.mark.ray
@pytest.mark.slow
async def test_ray_prefill_pp2_decode_pp1(model_dir: str, reference: list[str]) -> None:  # noqa: F811
    """On Ray: the PP2 prefill instance's actor is its rank 0 and starts the second stage as
    an actor in the instance's placement group (a bundle per stage); the decode actor pulls
    each stage's layers straight from that stage's actor (the direct path)."""
    ray = pytest.importorskip("ray")
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "backend": "ray",
                                   "roles": [{"role": "prefill", "pp": 2}, {"role": "decode"}]})
    try:
        rt = await build_runtime(cfg)
        prefill = rt.instances["prefill-0"].client
        assert len(await prefill.rank_actors()) == 1  # type: ignore[attr-defined]
        pg = prefill.pg  # type: ignore[attr-defined]
        assert ray.util.placement_group_table(pg)["bundles"] == {0: {"CPU": 1.0},
                                                                1: {"CPU": 1.0}}
        async with serving(rt) as url:
            assert await complete_all(url, SHORT) == reference
            await assert_pools_clean(rt)
            decode = rt.instances["decode-0"].client
            imports = await decode.kv_imports()  # type: ignore[attr-defined]
            assert imports.get("direct", 0) >= 1 and "funnel" not in imports, imports
    finally:
        ray.shutdown()
