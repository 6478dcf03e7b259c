"""The asyncio runtime and controller driven with the deterministic fake executor (no torch)."""

import asyncio

import pytest

from pdserve.cluster.instances import InProcessInstance
from pdserve.cluster.runtime import ClusterRuntime
from pdserve.cluster.serving_api import QueueFullError, RequestFailedError
from pdserve.cluster.worker import InstanceWorker
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.request import SamplingParams
from tests.deploy import role_counts
from tests.engine.fakes import FakeExecutor, reference_generate

VOCAB = 50
MODEL = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=128)


def cluster(strategy="colocated", n=1, p=1, d=1, blocks=32, bs=4, **kw):
    eng = EngineConfig(cache=CacheConfig(block_size=bs, num_kv_blocks=blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=128))
    cfg = ClusterConfig.from_dict({"engine": eng, **role_counts(strategy, n, p, d), **kw})
    clients = [InProcessInstance(InstanceWorker(s.instance_id, s.engine,
                                                executor=FakeExecutor(blocks, bs, VOCAB, 0.001)))
               for s in cfg.instance_specs()]
    return ClusterRuntime(cfg, clients, tokenizer=None, model_config=MODEL, model_name="fake")


async def collect(rt, rid, prompt, n):
    outs = [o async for o in rt.generate(rid, prompt, SamplingParams(max_tokens=n, temperature=0,
                                                                     ignore_eos=True))]
    return outs


PROMPTS = [[1, 2, 3], list(range(5, 25)), [7] * 9, list(range(30, 47)), [4, 4, 2, 1, 9, 9, 3]]


@pytest.mark.parametrize("strategy,n,p,d", [("colocated", 1, 1, 1), ("colocated", 2, 1, 1),
                                            ("disaggregated", 1, 1, 1),
                                            ("disaggregated", 1, 2, 1),
                                            ("disaggregated", 1, 2, 2)])
async def test_outputs_match_reference(strategy, n, p, d):
    rt = cluster(strategy, n, p, d)
    await rt.start()
    try:
        res = await asyncio.gather(*(collect(rt, f"r{i}", pr, 6) for i, pr in enumerate(PROMPTS)))
        for pr, outs in zip(PROMPTS, res):
            assert [t for o in outs for t in o.new_token_ids] == reference_generate(pr, 6, VOCAB)
            assert len(outs) == 6 and outs[-1].finished and outs[-1].finish_reason == "length"
            tl = outs[-1].timeline
            assert len(tl.token_times) == 6 and tl.arrival <= tl.prefill_start <= tl.prefill_end
            if strategy == "disaggregated":
                assert tl.transfer_start <= tl.transfer_end <= tl.token_times[1]
                assert tl.decode_admitted is not None
        await rt.drain()
        for stats in (await rt.check_integrity()).values():
            assert stats["used_blocks"] == 0 and stats["num_requests"] == 0
    finally:
        await rt.shutdown()


async def test_cancel_mid_stream_frees_everything():
    rt = cluster("disaggregated", p=1, d=1)
    await rt.start()
    try:
        gens = [rt.generate(f"r{i}", pr, SamplingParams(max_tokens=40, ignore_eos=True))
                for i, pr in enumerate(PROMPTS)]
        for g in gens:  # read two tokens of each, then hang up
            await g.__anext__()
            await g.__anext__()
            await g.aclose()
        await rt.drain()
        await asyncio.sleep(0.05)
        for stats in (await rt.check_integrity()).values():
            assert stats["used_blocks"] == 0 and stats["num_requests"] == 0
    finally:
        await rt.shutdown()


def slow_down(rt, iid: str, seconds: float = 0.005) -> None:
    """Make an instance's steps take ``seconds``: its loop steps on its own, and the fake
    executor alone takes microseconds, so a request could finish before a test kills it."""
    ex = rt.instances[iid].client.worker.engine.executor
    ex.step_time, ex.sleep = seconds, True


async def test_dead_decode_instance_recomputes_elsewhere():
    rt = cluster("disaggregated", p=1, d=2)
    slow_down(rt, "decode-0")
    await rt.start()
    try:
        tasks = [asyncio.create_task(collect(rt, f"r{i}", pr, 60)) for i, pr in enumerate(PROMPTS)]
        dec = rt.instances["decode-0"]
        for _ in range(2000):  # kill it while it decodes (a fixed sleep races a loaded CPU)
            if dec.view.active:
                break
            await asyncio.sleep(0.001)
        assert dec.view.active, "decode-0 never got a request"
        dec.client.kill()
        res = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        for pr, outs in zip(PROMPTS, res):
            assert [t for o in outs for t in o.new_token_ids] == reference_generate(pr, 60, VOCAB)
        assert not rt.instances["decode-0"].view.alive
        await rt.drain()
    finally:
        await rt.shutdown()


async def test_last_instance_dead_ends_requests_with_error():
    rt = cluster("disaggregated", p=1, d=1)
    slow_down(rt, "decode-0")
    await rt.start()
    try:
        outs = []
        async for o in rt.generate("r", [1, 2, 3], SamplingParams(max_tokens=200, temperature=0,
                                                                  ignore_eos=True)):
            outs.append(o)
            if o.instance_id == "decode-0" and rt.instances["decode-0"].view.alive:
                rt.instances["decode-0"].client.kill()  # at its first token: mid-decode
        assert outs[-1].finish_reason == "error" and "decode" in outs[-1].error
        # a new request is refused at once (HTTP 503) instead of being prefilled for nothing
        with pytest.raises(RequestFailedError, match="no live decode instance"):
            rt.generate("s", [5, 6], SamplingParams(max_tokens=5))
        await rt.drain()
        assert (await rt.check_integrity())["prefill-0"]["used_blocks"] == 0
    finally:
        await rt.shutdown()


async def test_bad_input_and_queue_limit():
    rt = cluster(max_waiting_requests=1)
    # not started: nothing is processed, so the first request stays waiting
    with pytest.raises(ValueError, match="empty"):
        rt.generate("a", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rt.generate("a", [VOCAB + 1], SamplingParams())
    g = rt.generate("a", [1, 2], SamplingParams())
    with pytest.raises(QueueFullError):
        rt.generate("b", [1, 2], SamplingParams())
    await g.aclose()
