"""TetriInfer on the live runtime (tiny model, in-process instances): SJF + fixed prefill chunks
+ reserve-dynamic admission + length-aware dispatch + an oracle predictor give exactly the
offline greedy outputs, and an instance flipped while requests flow loses none and leaks no
block (§3.5: the worker's scheduler changes role in place)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster.flip import FlipPolicy, TransitionWatcher
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from tests.cluster.realstack import assert_pools_clean, engine_config, prompts, tiny_model

N = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory)


class FlipFirstCheck(FlipPolicy):
    """Flip ``iid`` at the watcher's first look, backlog or not."""

    name = "test"
    window_s = 1.0
    needs_backlog = False

    def __init__(self, iid: str) -> None:
        self.iid = iid

    def wants_flip(self, inst, act, now):  # noqa: ANN001
        return inst.instance_id == self.iid and inst.role == "prefill"  # once


async def test_tetri_live_matches_offline_and_flips_without_loss(model_dir: str) -> None:
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(model_dir, num_kv_blocks=96, max_model_len=256)
           .generate(prompts(), params)]
    cfg = ClusterConfig.from_dict({
        "engine": engine_config(model_dir, policy="sjf", prefill_sched_batch=4,
                                prefill_chunk_size=48, admission="reserve-dynamic"),
        "strategy": "disaggregated", "num_prefill": 2, "num_decode": 1, "backend": "inproc",
        "decode_router": "power_of_two_length", "length_predictor": "oracle",
        "predictor_granularity": 8})
    rt = await build_runtime(cfg)
    watcher = TransitionWatcher(FlipFirstCheck("prefill-1"), {
        r.role: cfg.engine_config(r, 1024).scheduler for r in cfg.roles})
    rt.controller.flips = watcher
    try:
        async def one(i: int, p: list[int]) -> list[int]:
            last = None
            async for out in rt.generate(f"r{i}", p, params):
                last = out
            assert last is not None and last.finish_reason == "length", last
            return last.token_ids

        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts() * 2)))
        assert got == ref * 2
        await assert_pools_clean(rt)
        [rec] = watcher.records
        assert rec.instance_id == "prefill-1" and rec.done is not None
        assert rt.controller.instances["prefill-1"].role == "decode"
        worker = rt.instances["prefill-1"].client.worker  # in-process: the worker itself
        assert worker.role == "decode" and worker.engine.scheduler.role == "decode"
    finally:
        await rt.shutdown()
