"""Self-healing: a failed instance is restarted in place (same id and role) by the runtime's
supervisor, without an operator; its requests are recomputed elsewhere as before (or end with
an explicit error when its role had no other instance); a dead instance exports no stale
gauges and can be removed; a restart that fails is retried with back-off."""

from __future__ import annotations

import asyncio

import pytest

import pdserve.cluster.runtime as runtime_module
from pdserve.cluster.instances import InProcessInstance
from pdserve.config import InstanceSpec
from pdserve.request import SamplingParams
from pdserve.server.metrics import ServerMetrics
from tests.cluster.test_live_scaling import (
    VOCAB,
    fake_client,
    pools_clean,
    prompt,
    run,
    runtime,
    wait_for,
)
from tests.engine.fakes import reference_generate


async def test_a_killed_instance_is_restarted_in_place_and_its_role_refills() -> None:
    rt = runtime("disaggregated", p=1, d=1)
    await rt.start()
    try:
        old = rt.instances["decode-0"]
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        outs = []
        async for o in rt.generate("r", prompt(1), params):
            outs.append(o)
            if o.instance_id == "decode-0" and old.view.alive:
                old.client.kill()  # mid-decode: the role has no other instance
        assert outs[-1].finish_reason == "error" and "decode" in (outs[-1].error or "")
        await wait_for(lambda: rt.instances["decode-0"] is not old
                       and rt.instances["decode-0"].view.alive, "decode-0 restarted")
        [rs] = rt.restarts
        assert (rs.instance_id, rs.role) == ("decode-0", "decode") and rs.joined >= rs.failed
        assert sorted(rt.instances) == ["decode-0", "prefill-0"]
        toks, where = await run(rt, "s", prompt(2), 12)  # served without an operator
        assert toks == reference_generate(prompt(2), 12, VOCAB) and where == "decode-0"
        await pools_clean(rt)
    finally:
        await rt.shutdown()


async def test_requests_of_a_killed_instance_recompute_while_it_restarts() -> None:
    rt = runtime("colocated", n=2, router="round_robin")
    await rt.start()
    try:
        tasks = [asyncio.create_task(run(rt, f"r{i}", prompt(i), 40)) for i in range(6)]
        old = rt.instances["colocated-0"]
        await wait_for(lambda: old.view.active > 0, "a request on colocated-0")
        old.client.kill()
        for i, t in enumerate(tasks):
            toks, _ = await asyncio.wait_for(t, 30)
            assert toks == reference_generate(prompt(i), 40, VOCAB)
        await wait_for(lambda: rt.instances["colocated-0"].view.alive, "colocated-0 back")
        assert [r.instance_id for r in rt.restarts] == ["colocated-0"]
        await pools_clean(rt)
    finally:
        await rt.shutdown()


async def test_a_dead_instance_has_no_stale_series_and_can_be_removed() -> None:
    rt = runtime("colocated", n=2, router="round_robin")
    rt.self_heal = False  # hold the dead state still to look at it
    await rt.start()
    try:
        await asyncio.gather(*(run(rt, f"r{i}", prompt(i), 5) for i in range(2)))
        await wait_for(lambda: all(i.view.stats is not None for i in rt.instances.values()),
                       "stats of both")
        rt.instances["colocated-0"].client.kill()
        await wait_for(lambda: not rt.instances["colocated-0"].view.alive, "the failure")
        text = ServerMetrics(rt, "m").render().decode()
        series = [ln for ln in text.splitlines() if 'instance="colocated-0"' in ln]
        assert series == ['pdserve:instance_alive{instance="colocated-0",model_name="m",'
                          'role="colocated"} 0.0'], series
        assert any('instance="colocated-1"' in ln and "kv_cache_usage" in ln
                   for ln in text.splitlines())
        rec = await rt.remove_instance("colocated-0")
        assert rec.pool is None and sorted(rt.instances) == ["colocated-1"]
        assert 'instance="colocated-0"' not in ServerMetrics(rt, "m").render().decode()
    finally:
        await rt.shutdown()


async def test_a_failing_restart_is_retried_with_back_off(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(runtime_module, "RESTART_BACKOFF_S", (0.0, 0.01, 0.02))
    rt = runtime("colocated", n=1)
    attempts: list[str] = []

    async def flaky(spec: InstanceSpec) -> InProcessInstance:
        attempts.append(spec.instance_id)
        if len(attempts) < 3:
            raise RuntimeError("no CPU free on the cluster")
        return fake_client(spec)

    rt.make_client = flaky
    await rt.start()
    try:
        rt.instances["colocated-0"].client.kill()
        await wait_for(lambda: rt.instances["colocated-0"].view.alive and rt.restarts,
                       "the restart")
        assert attempts == ["colocated-0"] * 3
        toks, _ = await run(rt, "r", prompt(3), 6)
        assert toks == reference_generate(prompt(3), 6, VOCAB)
    finally:
        await rt.shutdown()


async def test_remove_instance_with_a_drain_timeout_recomputes_what_it_held() -> None:
    rt = runtime("colocated", n=2, router="round_robin")
    await rt.start()
    try:
        long = asyncio.create_task(run(rt, "long", prompt(4), 150))
        await wait_for(lambda: any(i.view.active for i in rt.instances.values()), "a request")
        busy = next(iid for iid, i in rt.instances.items() if i.view.active)
        rec = await rt.remove_instance(busy, drain_timeout=0.05)
        assert rec.timed_out and rec.pool is None and busy not in rt.instances
        toks, where = await asyncio.wait_for(long, 60)
        assert toks == reference_generate(prompt(4), 150, VOCAB) and where != busy
        await pools_clean(rt)
    finally:
        await rt.shutdown()
