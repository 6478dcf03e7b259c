"""The real stack end to end: tiny model, real instances (threads or Ray actors), uvicorn, HTTP.

Greedy outputs must not depend on the deployment: colocated with 1 or 2 instances and
disaggregated with 1P+1D or 2P+1D, in-process and on Ray, all equal offline ``LLM.generate``.
Cancelled streams and killed decode actors must leave no request hanging and no block leaked.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pdserve.cluster.instances import init_ray
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from tests.cluster.realstack import (
    assert_pools_clean,
    engine_config,
    prompts,
    runtime_over,
    serving,
    tiny_model,
    wait_until,
)
from tests.deploy import role_counts

SHORT, LONG = 12, 120
TEXT = "Hello, how are you today?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> dict[int, list[str]]:
    """Offline greedy texts for every prompt (token-id prompts, then one text prompt)."""
    llm = LLM(model_dir, num_kv_blocks=96, max_model_len=256)
    return {n: [o.text for o in llm.generate([*prompts(), TEXT],
                                             SamplingParams(max_tokens=n, temperature=0))]
            for n in (SHORT, LONG)}


async def complete_all(url: str, max_tokens: int) -> list[str]:
    """All prompts at once over HTTP (non-streaming), plus the text prompt streamed."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:

        async def one(p: Any) -> str:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": max_tokens,
                                                      "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] <= max_tokens
            return body["choices"][0]["text"]

        async def streamed(p: Any) -> str:
            text = ""
            async with c.stream("POST", "/v1/completions", json={
                    "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        return list(await asyncio.gather(*(one(p) for p in prompts()), streamed(TEXT)))


INPROC = [("colocated", 1, 1, 1), ("colocated", 2, 1, 1), ("disaggregated", 1, 1, 1),
          ("disaggregated", 1, 2, 1), ("partial", 2, 1, 1)]


@pytest.mark.parametrize("strategy,n,p,d", INPROC,
                         ids=["colocated-1", "colocated-2", "disagg-1P1D", "disagg-2P1D",
                              "partial-2"])
async def test_inproc_outputs_match_offline(model_dir: str, reference: dict[int, list[str]],
                                            strategy: str, n: int, p: int, d: int) -> None:
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir),
                                   **role_counts(strategy, n, p, d), "backend": "inproc"})
    rt = await build_runtime(cfg)
    async with serving(rt) as url:
        assert await complete_all(url, SHORT) == reference[SHORT]
        await assert_pools_clean(rt)


async def hang_up_midway(rt: Any, url: str, ps: list[list[int]]) -> None:
    """Read one token of every stream; once some request is held on a prefill instance for
    transfer (the decode pool is full) and some is decoding, hang up on all of them: no block
    may leak anywhere."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        got_first = 0
        hang_up = asyncio.Event()

        async def one(pr: list[int]) -> None:
            nonlocal got_first
            async with c.stream("POST", "/v1/completions", json={
                    "prompt": pr, "max_tokens": 90, "stream": True, "ignore_eos": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):  # one token, then silence until we hang up
                        got_first += 1
                        await hang_up.wait()
                        break

        tasks = [asyncio.create_task(one(pr)) for pr in ps]
        stages = lambda: [q.stage for q in rt.controller.requests.values()]  # noqa: E731
        await wait_until(lambda: "transfer" in stages() and "decode" in stages(),
                         what="a request held for transfer and one decoding")
        hang_up.set()
        await asyncio.gather(*tasks)
        assert got_first >= 2
    await assert_pools_clean(rt)


async def test_cancelled_streams_free_every_block(model_dir: str) -> None:
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir, num_kv_blocks=40),
                                   "strategy": "disaggregated", "backend": "inproc"})
    rt = await build_runtime(cfg)
    async with serving(rt) as url:
        await hang_up_midway(rt, url, [pr + pr[:60] for pr in prompts()[1:]] * 2)


# ------------------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_instances(model_dir: str) -> Any:
    """Four actors shared by the Ray tests (2 prefill, 2 decode); one Ray instance."""
    ray = pytest.importorskip("ray")
    from pdserve.cluster.instances import RayInstance

    init_ray(None, 4)
    try:
        cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir),
                                       "strategy": "disaggregated", "num_prefill": 2,
                                       "num_decode": 2, "backend": "ray"})
        actors = {s.instance_id: RayInstance.start_actor(s.instance_id, s.engine)
                  for s in cfg.instance_specs()}
        infos = ray.get([a.info.remote() for a in actors.values()])
        yield {iid: RayInstance(a, iid, info) for (iid, a), info in zip(actors.items(), infos)}
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_ray_instance_actors_run_at_normal_priority(ray_instances: dict[str, Any]) -> None:
    """Ray starts workers at niceness 15; an instance actor there gets a few per cent of a core
    whenever another process wants one. The local Ray that pdserve starts keeps them at 0."""
    import os

    import ray

    nice = ray.get([i.actor.__ray_call__.remote(lambda _self: os.nice(0))
                    for i in ray_instances.values()])
    assert nice == [0] * len(ray_instances)


@pytest.mark.ray
@pytest.mark.parametrize("ids", [("prefill-0", "decode-0"), ("prefill-0", "prefill-1",
                                                             "decode-0")],
                         ids=["1P1D", "2P1D"])
async def test_ray_outputs_match_offline(model_dir: str, reference: dict[int, list[str]],
                                         ray_instances: dict[str, Any],
                                         ids: tuple[str, ...]) -> None:
    rt = await runtime_over(model_dir, [ray_instances[i] for i in ids], engine_config(model_dir))
    async with serving(rt) as url:
        assert await complete_all(url, SHORT) == reference[SHORT]
        await assert_pools_clean(rt)


@pytest.mark.ray
async def test_ray_cancelled_streams_free_every_block(model_dir: str,
                                                      ray_instances: dict[str, Any]) -> None:
    ids = ("prefill-0", "prefill-1", "decode-0")
    rt = await runtime_over(model_dir, [ray_instances[i] for i in ids], engine_config(model_dir))
    async with serving(rt) as url:
        await hang_up_midway(rt, url, [pr + pr[:60] for pr in prompts()[1:]] * 3)


@pytest.mark.ray
async def test_ray_decode_actor_killed(model_dir: str, reference: dict[int, list[str]],
                                       ray_instances: dict[str, Any]) -> None:
    """Kill a decode actor mid-run: its requests recompute on the other decode actor with the
    same greedy output. Kill the last one: requests end with an explicit error, the server
    keeps answering. (Runs last: it destroys the shared decode actors.)"""
    import ray

    insts = [ray_instances[i] for i in ("prefill-0", "decode-0", "decode-1")]
    rt = await runtime_over(model_dir, insts, engine_config(model_dir))
    async with serving(rt) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        on_d0 = lambda: [q for q in rt.controller.requests.values()  # noqa: E731
                         if q.decode_instance == "decode-0" and q.stage == "decode"
                         and len(q.output_token_ids) > 3]

        async def one(p: Any) -> str:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": LONG,
                                                      "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        tasks = [asyncio.create_task(one(p)) for p in [*prompts(), TEXT]]
        await wait_until(lambda: len(on_d0()) >= 2, what="requests decoding on decode-0")
        ray.kill(ray_instances["decode-0"].actor, no_restart=True)
        texts = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert texts == reference[LONG]
        assert not rt.instances["decode-0"].view.alive
        # a new request is served by what is left
        assert await one(prompts()[0]) == reference[LONG][0]

        # the last decode actor dies: an explicit error, not a hang
        task = asyncio.create_task(c.post("/v1/completions", json={
            "prompt": prompts()[3], "max_tokens": LONG, "ignore_eos": True}))
        await wait_until(lambda: any(q.stage == "decode" and q.decode_instance == "decode-1"
                                     for q in rt.controller.requests.values()),
                         what="a request decoding on decode-1")
        ray.kill(ray_instances["decode-1"].actor, no_restart=True)
        r = await asyncio.wait_for(task, 30)
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
        r = await asyncio.wait_for(c.post("/v1/completions", json={
            "prompt": prompts()[0], "max_tokens": 4}), 30)
        assert r.status_code == 503 and "no live decode instance" in r.json()["error"]["message"]
        assert (await c.get("/v1/models")).status_code == 200
        assert (await c.get("/health")).status_code == 503
        await assert_pools_clean(rt)


async def test_preble_router_is_fed_by_the_instances_kv_events(model_dir: str) -> None:
    """`--prefill-router preble-paper` live: the workers report KV events, so the router's index
    holds exactly the blocks the instances cached, and a shared prefix is exploited."""
    cfg = ClusterConfig.from_dict({"engine": engine_config(model_dir), "num_instances": 2,
                                   "prefill_router": "preble-paper", "backend": "inproc"})
    rt = await build_runtime(cfg)
    try:
        shared = prompts(512)[1]  # 40 tokens: two full blocks of 16
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for i in range(4):
            outs = [o async for o in rt.generate(f"r{i}", shared + [5 + i], params)]
            assert outs[-1].finished
        router = rt.controller.prefill_router
        await rt.drain()
        # the index knows exactly the blocks each instance's pool has cached
        for iid, inst in rt.instances.items():
            pool = inst.client.worker.engine.scheduler.pool
            assert router.index.num_blocks(iid) == len(pool.cached), iid
        assert sum(router.index.num_blocks(i) for i in rt.instances) >= 2
        assert router.decisions["exploit"] >= 3  # the shared prefix was exploited
    finally:
        await rt.shutdown()


@pytest.mark.ray
def test_unplaceable_instances_fail_with_the_missing_resources(ray_instances: Any) -> None:
    """Instead of actors that wait forever: a deployment larger than the cluster fails at once,
    one that others' actors crowd out fails after the timeout; both name the resources."""
    import ray

    from pdserve.cluster.instances import wait_for_resources

    total = ray.cluster_resources()["CPU"]
    with pytest.raises(RuntimeError, match=rf"needs {total + 5:g} CPU \(cluster total "
                                           rf"{total:g}, free .*\); add nodes"):
        wait_for_resources({"CPU": total + 5})
    # the instance actors hold CPUs: asking for one more than is free times out
    free = ray.available_resources().get("CPU", 0.0)
    assert free < total
    with pytest.raises(RuntimeError, match=rf"needs {free + 1:g} CPU \(cluster total "
                                           rf"{total:g}, free {free:g}\); others hold them"):
        wait_for_resources({"CPU": free + 1}, timeout_s=0.3, poll_s=0.1)
