"""TetriInfer on the live runtime (tiny model, in-process instances): SJF + fixed prefill chunks
+ reserve-dynamic admission + length-aware dispatch + an oracle predictor give exactly the
offline greedy outputs, and an instance flipped while requests flow loses none and leaks no
block (§3.5: the worker's scheduler changes role in place)."""

from __future__ import annotations

import asyncio
import json

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


def _serve_flags(model_dir: str, *extra: str) -> list[str]:
    """The issue's "done when" command line (TetriInfer's setting), on the tiny model."""
    return ["serve", "--model", model_dir, "--strategy", "disaggregated", "--policy", "sjf",
            "--prefill-sched-batch", "16", "--prefill-chunk-size", "48",
            "--decode-router", "power_of_two_length", "--admission", "reserve-dynamic",
            "--flip", "idle:60", "--backend", "inproc", "--max-model-len", "256",
            "--num-kv-blocks", "96", "--max-num-batched-tokens", "512", *extra]


async def test_serve_with_tetriinfer_flags_logs_pairs_that_train_the_predictor(
        model_dir: str, tmp_path) -> None:  # noqa: ANN001
    """``pdserve serve``'s TetriInfer flags, parsed as the CLI does, over HTTP: greedy answers
    equal the offline ones (a single choice, a streamed one, n = 2); ``--log-length-pairs``
    writes one (prompt ids, output length) line per finished choice; ``pdserve predictor
    train`` fits a classifier on that log, and a second server runs with it
    (``--length-predictor classifier --predictor-data model.npz``)."""
    import httpx

    from pdserve.cli import build_parser
    from pdserve.cli import main as pdserve_main
    from pdserve.predict.data import PairLog, load_pairs
    from pdserve.server.app import serve_locally
    from pdserve.server.cli import config_from_args

    ps = prompts()
    lens = [3 + 2 * i for i in range(len(ps))]  # max_tokens per prompt: 3, 5, ..., 13
    ref = [LLM(model_dir, num_kv_blocks=96, max_model_len=256).generate(
        [p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text
        for p, n in zip(ps, lens)]
    log_path = tmp_path / "pairs.jsonl"

    async def serve_and_ask(flags: list[str], log: PairLog | None) -> None:
        cfg = config_from_args(build_parser().parse_args(flags))
        assert cfg.strategy == "disaggregated" and cfg.flip == "idle:60"
        rt = await build_runtime(cfg)
        async with serve_locally(rt, pair_log=log) as url, httpx.AsyncClient(
                base_url=url, timeout=60) as c:
            def body(i: int, **kw: object) -> dict[str, object]:
                return {"prompt": ps[i], "max_tokens": lens[i], "temperature": 0,
                        "ignore_eos": True, **kw}

            rs = await asyncio.gather(*(c.post("/v1/completions", json=body(i))
                                        for i in range(len(ps))))
            assert [r.json()["choices"][0]["text"] for r in rs] == ref
            two = (await c.post("/v1/completions", json=body(1, n=2))).json()
            assert [ch["text"] for ch in two["choices"]] == [ref[1]] * 2
            async with c.stream("POST", "/v1/completions",
                                json=body(2, stream=True)) as s:
                text = "".join([json.loads(line[6:])["choices"][0]["text"]
                                async for line in s.aiter_lines()
                                if line.startswith("data: {")])
            assert text == ref[2]
            await assert_pools_clean(rt)

    log = PairLog(log_path)
    await serve_and_ask(_serve_flags(model_dir, "--length-predictor", "oracle"), log)
    log.close()
    # one line per finished choice: the six prompts, the two samples of prompt 1, prompt 2
    pairs = load_pairs(str(log_path))
    got = sorted(zip(map(tuple, pairs.prompts), pairs.output_lens.tolist()))
    want = sorted([(tuple(p), n) for p, n in zip(ps, lens)]
                  + [(tuple(ps[1]), lens[1])] * 2 + [(tuple(ps[2]), lens[2])])
    assert got == want and log.count == 9

    model = tmp_path / "len.npz"
    assert pdserve_main(["predictor", "train", "--data", str(log_path), "--granularity", "4",
                         "--eval-share", "0", "--output", str(model)]) == 0
    await serve_and_ask(_serve_flags(model_dir, "--length-predictor", "classifier",
                                     "--predictor-data", str(model)), None)
