"""Live scaling (DistServe §4.4 replanning, EcoServe §4.2.4): instances added to and removed
from a serving runtime. A removed instance drains first; no accepted request is lost, every
output equals the reference model's, and no KV block leaks (the removed instance's pool is
checked at shutdown, the others after the run)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.cluster.instances import InProcessInstance
from pdserve.cluster.runtime import ClusterRuntime
from pdserve.cluster.worker import InstanceWorker
from pdserve.config import (
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    InstanceSpec,
    ModelConfig,
    SchedulerConfig,
)
from pdserve.request import SamplingParams
from tests.deploy import role_counts
from tests.engine.fakes import FakeExecutor, reference_generate

VOCAB = 50
MODEL = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=256)
BLOCKS, BS, STEP = 64, 4, 0.002


def fake_client(spec: InstanceSpec) -> InProcessInstance:
    executor = FakeExecutor(BLOCKS, BS, VOCAB, STEP, sleep=True)  # paced: tests watch load
    return InProcessInstance(InstanceWorker(spec.instance_id, spec.engine, executor=executor))


def runtime(strategy: str = "colocated", n: int = 2, p: int = 1, d: int = 1,
            router: str | None = None, **kw: Any) -> ClusterRuntime:
    eng = EngineConfig(cache=CacheConfig(block_size=BS, num_kv_blocks=BLOCKS),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=256))
    cfg = ClusterConfig.from_dict({"engine": eng, **role_counts(strategy, n, p, d),
                                   "prefill_router": router})
    rt = ClusterRuntime(cfg, [fake_client(s) for s in cfg.instance_specs()], tokenizer=None,
                        model_config=MODEL, model_name="fake", **kw)

    async def make_client(spec: InstanceSpec) -> InProcessInstance:
        await asyncio.sleep(0.01)  # starting an instance takes a while; requests go on
        return fake_client(spec)

    rt.make_client = make_client
    return rt


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % (VOCAB - 1) + 1 for j in range(5 + (i * 11) % 23)]


async def run(rt: ClusterRuntime, rid: str, pr: list[int], n: int) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = [o async for o in rt.generate(rid, pr, params)]
    return [t for o in outs for t in o.new_token_ids], outs[-1].instance_id or ""


async def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def pools_clean(rt: ClusterRuntime) -> None:
    await rt.drain()
    for _ in range(200):
        stats = await rt.check_integrity()
        if all(s["used_blocks"] == 0 and s["num_requests"] == 0 for s in stats.values()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"blocks in use after the run: {stats}")


async def test_colocated_remove_drains_and_add_takes_new_requests() -> None:
    rt = runtime("colocated", n=2, router="round_robin")  # the new instance surely serves
    await rt.start()
    try:
        n_tok = 40
        first = [asyncio.create_task(run(rt, f"a{i}", prompt(i), n_tok)) for i in range(8)]
        victim = rt.instances["colocated-0"]
        await wait_for(lambda: victim.view.active >= 2, "requests on colocated-0")
        on_victim = {r.request_id for r in rt.controller.requests.values()
                     if r.instance == "colocated-0"}
        removal = asyncio.create_task(rt.remove_instance("colocated-0"))
        added = await rt.add_instance("colocated")
        assert added == "colocated-2"
        await asyncio.sleep(0)
        # routed after the removal began: never to the draining instance
        later = [asyncio.create_task(run(rt, f"b{i}", prompt(20 + i), n_tok)) for i in range(8)]
        rec = await asyncio.wait_for(removal, 20)
        # it left only once the requests it held had finished
        assert not on_victim & set(rt.controller.requests)
        res = await asyncio.wait_for(asyncio.gather(*first, *later), 20)
        prompts = [prompt(i) for i in range(8)] + [prompt(20 + i) for i in range(8)]
        for pr, (toks, _) in zip(prompts, res):
            assert toks == reference_generate(pr, n_tok, VOCAB)
        # the requests it held finished there; nothing new went to it
        served = {f"a{i}": iid for i, (_, iid) in enumerate(res[:8])}
        assert all(served[r] == "colocated-0" for r in on_victim)
        assert all(iid != "colocated-0" for _, iid in res[8:])
        assert any(iid == "colocated-2" for _, iid in res[8:])
        assert rec.pool == {"used_blocks": 0, "num_blocks": BLOCKS, "num_requests": 0}
        assert rec.drained >= rec.requested and "colocated-0" not in rt.instances
        assert sorted(s.instance_id for s in rt.instance_status()) == ["colocated-1",
                                                                        "colocated-2"]
        await pools_clean(rt)
    finally:
        await rt.shutdown()


async def test_disaggregated_remove_prefill_and_decode_under_load() -> None:
    """A removed prefill instance stays until its held KV has been pulled; a removed decode
    instance until its decodes (and the transfers routed to it) are done."""
    rt = runtime("disaggregated", p=2, d=2)
    await rt.start()
    try:
        n_tok = 30
        tasks = [asyncio.create_task(run(rt, f"r{i}", prompt(i), n_tok)) for i in range(12)]
        await wait_for(lambda: rt.instances["decode-0"].view.active >= 2
                       and rt.instances["prefill-1"].view.active >= 1, "load on both")
        removals = [asyncio.create_task(rt.remove_instance(i))
                    for i in ("prefill-1", "decode-0")]
        assert await rt.add_instance("decode") == "decode-2"
        tasks += [asyncio.create_task(run(rt, f"s{i}", prompt(40 + i), n_tok))
                  for i in range(6)]
        recs = await asyncio.wait_for(asyncio.gather(*removals), 20)
        res = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        prompts = [prompt(i) for i in range(12)] + [prompt(40 + i) for i in range(6)]
        for pr, (toks, _) in zip(prompts, res):
            assert toks == reference_generate(pr, n_tok, VOCAB)
        for rec in recs:
            assert rec.pool is not None and rec.pool["used_blocks"] == 0
            assert rec.pool["num_requests"] == 0
        assert sorted(rt.instances) == ["decode-1", "decode-2", "prefill-0"]
        await pools_clean(rt)
    finally:
        await rt.shutdown()


async def test_bad_scaling_requests_get_clear_errors() -> None:
    rt = runtime("disaggregated", p=1, d=2)
    await rt.start()
    try:
        with pytest.raises(ValueError, match="last prefill instance"):
            await rt.remove_instance("prefill-0")
        with pytest.raises(ValueError, match="unknown instance 'nope'"):
            await rt.remove_instance("nope")
        with pytest.raises(ValueError, match="cannot add a 'colocated' instance"):
            await rt.add_instance("colocated")
        with pytest.raises(ValueError, match="'decode-1' is already in use"):
            await rt.add_instance("decode", instance_id="decode-1")
        await rt.remove_instance("decode-0")  # one decode instance is left: allowed
        with pytest.raises(ValueError, match="last decode instance"):
            await rt.remove_instance("decode-1")
        toks, _ = await run(rt, "x", prompt(1), 5)  # still serving
        assert toks == reference_generate(prompt(1), 5, VOCAB)
    finally:
        await rt.shutdown()


async def test_admin_endpoint_adds_and_removes_with_openai_errors() -> None:
    import httpx

    from pdserve.server.app import build_app

    rt = runtime("disaggregated", p=1, d=1)
    await rt.start()
    app = build_app(rt, "fake", api_key="k", enable_admin=True)
    auth = {"Authorization": "Bearer k"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://t", headers=auth) as c:
            r = await c.post("/admin/instances", json={"action": "add", "role": "decode"})
            assert r.status_code == 200, r.text
            assert r.json()["instance_id"] == "decode-1"
            busy = asyncio.create_task(run(rt, "x", prompt(3), 30))
            await wait_for(lambda: rt.instances["decode-0"].view.active
                           + rt.instances["decode-1"].view.active > 0, "a decode")
            target = "decode-0" if rt.instances["decode-0"].view.active else "decode-1"
            r = await c.post("/admin/instances", json={"action": "remove",
                                                       "instance_id": target})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["pool"]["used_blocks"] == 0 and body["drain_seconds"] >= 0
            assert busy.done()  # the request it held finished before the removal answered
            assert (await busy)[0] == reference_generate(prompt(3), 30, VOCAB)
            listed = (await c.get("/admin/instances")).json()["instances"]
            assert sorted(i["instance_id"] for i in listed) == sorted(rt.instances)
            bad = [({"action": "remove", "instance_id": "prefill-0"}, "last prefill instance"),
                   ({"action": "remove", "instance_id": "zz"}, "unknown instance 'zz'"),
                   ({"action": "add"}, "needs a role"),
                   ({"action": "add", "role": "gpu"}, "unknown role 'gpu'"),
                   ({"action": "add", "role": "colocated"}, "cannot add a 'colocated'"),
                   ({"action": "grow", "role": "decode"}, "action"),
                   ({"action": "add", "role": "decode", "extra": 1}, "extra")]
            for payload, msg in bad:
                r = await c.post("/admin/instances", json=payload)
                assert r.status_code == 400, (payload, r.text)
                assert msg in r.json()["error"]["message"], (payload, r.text)
            r = await c.post("/admin/instances", json={"action": "add", "role": "decode"},
                             headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
    finally:
        await rt.shutdown()


async def test_live_replanning_follows_a_rate_shift() -> None:
    """10 req/s, then 30 req/s, then 10 req/s again (a virtual clock): the monitor detects
    each shift, the planner asks for rate / 10 instances (rounded), the runtime grows to 3 and
    shrinks back to 1 (the removed ones drain) while serving every request."""
    from pdserve.planner.replan import LiveReplanner, ShiftDetector

    now = [0.0]
    # round robin: every instance takes its share (shortest-queue ties would all go to the
    # first instance when requests finish at once)
    rt = runtime("colocated", n=1, router="round_robin", clock=lambda: now[0])
    rp = LiveReplanner(rt, ShiftDetector(window_s=1.0, min_requests=5),
                       lambda w: {"colocated": round(w.rate / 10)})
    await rt.start()
    try:
        tasks, k = [], 0
        for rate, seconds in ((10, 2.5), (30, 2.5), (10, 3.0)):
            for _ in range(int(rate * seconds)):
                now[0] += 1 / rate
                tasks.append(asyncio.create_task(run(rt, f"r{k}", prompt(k), 8)))
                k += 1
                await asyncio.sleep(0.003)
                if rp.replans and rp.replans[-1].applied is None:
                    await rp.wait()  # (arrivals wait for the change in virtual time)
        res = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await rp.wait()
        for i, (toks, _) in enumerate(res):
            assert toks == reference_generate(prompt(i), 8, VOCAB)
        assert [r.planned for r in rp.replans] == [{"colocated": 3}, {"colocated": 1}]
        assert [r.before for r in rp.replans] == [{"colocated": 1}, {"colocated": 3}]
        assert [r.shift.reasons[0].split()[0] for r in rp.replans] == ["rate", "rate"]
        assert rp.counts() == {"colocated": 1} and len(rt.removals) == 2
        assert all(r.pool["used_blocks"] == 0 for r in rt.removals)
        served = {iid for _, iid in res}
        assert {"colocated-1", "colocated-2"} <= served  # the added instances served
        await pools_clean(rt)
    finally:
        await rt.shutdown()


def test_placement_counts_of_planned_deployments() -> None:
    from pdserve.planner.replan import placement_counts

    assert placement_counts({"model": "opt-13b", "strategy": "disaggregated",
                             "num_prefill": 2, "num_decode": 3}) == {"prefill": 2, "decode": 3}
    assert placement_counts({"model": "opt-13b", "num_instances": 4}) == {"colocated": 4}


async def test_live_mitosis_in_process_migrates_under_load_and_loses_nothing() -> None:
    """The macro router's mitosis on the live runtime (threads; the Ray variant with real actor
    handles is test_live_mitosis_ray.py): a tight TTFT SLO holds requests, so it expands and
    splits under load; an instance added live is parked, one removed drains."""
    eng = EngineConfig(cache=CacheConfig(block_size=BS, num_kv_blocks=BLOCKS),
                       scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=256))
    cfg = ClusterConfig.from_dict({"engine": eng, "strategy": "partial", "num_instances": 2,
                                   "mitosis": True, "mitosis_lower": 1, "mitosis_upper": 1,
                                   "mitosis_interval": 0.01, "slo_ttft": 1e-4,
                                   "slo_tpot": 1.0})
    rt = ClusterRuntime(cfg, [fake_client(s) for s in cfg.instance_specs()], tokenizer=None,
                        model_config=MODEL, model_name="fake")
    await rt.start()
    try:
        spec = InstanceSpec("temporal-2", "temporal", cfg.instance_specs()[0].engine)
        assert await rt.add_instance("temporal", client=fake_client(spec)) == "temporal-2"
        router = rt.controller.prefill_router

        async def one(i: int) -> tuple[list[int], str]:
            await asyncio.sleep(0.004 * i)
            return await run(rt, f"r{i}", prompt(i), 30)

        tasks = [asyncio.create_task(one(i)) for i in range(40)]
        await wait_for(lambda: any(m.src is not None and m.dst is not None
                                   for _, m in router.moves), "a split")
        assert not all(t.done() for t in tasks)  # under load
        victim = next(i for i in router.mitosis.members if i != "temporal-0")
        rec = await asyncio.wait_for(rt.remove_instance(victim), 20)
        assert rec.pool == {"used_blocks": 0, "num_blocks": BLOCKS, "num_requests": 0}
        res = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        for i, (toks, _) in enumerate(res):
            assert toks == reference_generate(prompt(i), 30, VOCAB)
        assert {"temporal-1", "temporal-2"} & {m.instance_id for _, m in router.moves}
        await pools_clean(rt)
    finally:
        await rt.shutdown()
