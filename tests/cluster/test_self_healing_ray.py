"""Self-healing on Ray: a killed instance actor is replaced by a new actor under the same id
without an operator; the server answers again with the same greedy output, and ``/metrics``
shows the new instance only (no stale series of the dead actor)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.cluster.instances import init_ray
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.server.app import serve_locally
from tests.cluster.realstack import engine_config, prompts, tiny_model


@pytest.mark.ray
async def test_a_killed_ray_actor_is_refilled_without_an_operator(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    ray = pytest.importorskip("ray")
    init_ray(None, 4)
    try:
        cfg = ClusterConfig.from_dict({"engine": engine_config(tiny_model(tmp_path_factory)),
                                       "strategy": "disaggregated", "backend": "ray"})
        rt = await build_runtime(cfg)
        body = {"prompt": prompts()[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        async with serve_locally(rt) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            want = r.json()["choices"][0]["text"]
            old = rt.instances["decode-0"].client.actor
            ray.kill(old, no_restart=True)
            deadline = asyncio.get_running_loop().time() + 120
            while not rt.restarts:
                assert asyncio.get_running_loop().time() < deadline, "no restart in 120 s"
                await asyncio.sleep(0.05)
            new = rt.instances["decode-0"]
            assert new.view.alive and new.client.actor != old
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
            metrics = (await c.get("/metrics")).text
            alive = [ln for ln in metrics.splitlines()
                     if ln.startswith("pdserve:instance_alive{")]
            assert len(alive) == 2 and all(ln.endswith(" 1.0") for ln in alive), alive
            assert any('instance="decode-0"' in ln for ln in alive), alive
    finally:
        ray.shutdown()
