"""ModelExecutor: KV export/import, seeded sampling across batches and instances, sizing, EOS,
logprobs, and a run under the real Engine."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.executor import Executor
from pdserve.engine.model_executor import ModelExecutor
from pdserve.request import SamplingParams
from tests.model.helpers import (
    NEW_TOKENS,
    HandDriver,
    hf_reference,
    make_executor,
    make_prompts,
    read_json,
    write_json,
)

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=64)


def _prefill(drv: HandDriver, prompts, params=None):
    reqs = [drv.add(p, params) if params else drv.add(p) for p in prompts]
    drv.step([(r, None) for r in reqs])
    return reqs


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_kv_export_import_continues_exactly(arch, tiny_dirs):
    prompts = make_prompts((33, 150, 7))
    single = HandDriver(make_executor(tiny_dirs[arch]))
    reqs = _prefill(single, prompts)
    single.decode_all(reqs, NEW_TOKENS)

    src = HandDriver(make_executor(tiny_dirs[arch]))
    src_reqs = _prefill(src, prompts)
    dst = HandDriver(make_executor(tiny_dirs[arch]), first_block=3, stride=11)
    for req in src_reqs:
        n_blocks = -(-req.num_prompt_tokens // src.ex.block_size)
        payload = pickle.loads(pickle.dumps(src.ex.export_kv(req.block_ids[:n_blocks])))
        moved = dst.add(req.prompt_token_ids, request_id=req.request_id)
        assert moved.block_ids[:n_blocks] != req.block_ids[:n_blocks]
        dst.ex.import_kv(moved.block_ids[:n_blocks], payload)
        moved.append_token(req.output_token_ids[0])
        moved.num_computed_tokens = req.num_prompt_tokens
        dst.tokens[moved.request_id] = [req.output_token_ids[0]]
    dst.decode_all(dst.reqs, NEW_TOKENS)
    for req in reqs:
        assert dst.tokens[req.request_id] == single.tokens[req.request_id]


def test_kv_payload_shape_and_dtype(tiny_dirs):
    ex = make_executor(tiny_dirs["llama"], dtype="bfloat16", num_blocks=32)
    ex.kv_cache.normal_()
    payload = ex.export_kv([5, 1, 9])
    kv = payload["kv"]
    assert kv.device.type == "cpu" and kv.dtype == torch.bfloat16
    assert kv.shape == (2, 2, 2, 3, 16, 16) and payload["num_blocks"] == 3
    assert torch.equal(kv[:, :, :, 1], ex.kv_cache[:, :, :, 1])
    ex.import_kv([0, 2, 3], pickle.loads(pickle.dumps(payload)))
    assert torch.equal(ex.kv_cache[:, :, :, [0, 2, 3]], ex.kv_cache[:, :, :, [5, 1, 9]])
    with pytest.raises(ValueError, match="does not fit"):
        ex.import_kv([0, 2], payload)


def test_seeded_request_independent_of_batch_and_instance(tiny_dirs):
    d = tiny_dirs["qwen2"]
    prompt = make_prompts((40,))[0]
    alone = HandDriver(make_executor(d, seed=1))
    (req,) = _prefill(alone, [prompt], SEEDED)
    alone.decode_all([req], NEW_TOKENS)
    want = alone.tokens[req.request_id]
    assert len(set(want)) > 1

    # batched with other requests, different executor seed, the seeded request added last
    crowd = HandDriver(make_executor(d, seed=7))
    others = _prefill(crowd, make_prompts((12, 90), seed=3), SamplingParams(temperature=1.0))
    mine = crowd.add(prompt, SEEDED, request_id="mine")
    crowd.step([(others[0], 1), (mine, 25), (others[1], 1)])
    crowd.step([(mine, None), (others[1], 1)])
    crowd.decode_all(others + [mine], NEW_TOKENS)
    assert crowd.tokens["mine"] == want

    # first token on one instance, the rest on another (KV moved)
    pre = HandDriver(make_executor(d, seed=3))
    (p_req,) = _prefill(pre, [prompt], SEEDED)
    dec = HandDriver(make_executor(d, seed=4), first_block=2)
    moved = dec.add(prompt, SEEDED, request_id=p_req.request_id)
    n_blocks = -(-len(prompt) // 16)
    dec.ex.import_kv(moved.block_ids[:n_blocks], pre.ex.export_kv(p_req.block_ids[:n_blocks]))
    moved.append_token(p_req.output_token_ids[0])
    moved.num_computed_tokens = len(prompt)
    dec.tokens[moved.request_id] = [p_req.output_token_ids[0]]
    dec.decode_all([moved], NEW_TOKENS)
    assert dec.tokens[moved.request_id] == want


def test_logprobs_and_min_tokens_through_execute(tiny_dirs):
    ex = make_executor(tiny_dirs["llama"])
    drv = HandDriver(ex)
    a = drv.add(make_prompts((20,))[0], SamplingParams(temperature=0.0, logprobs=2))
    b = drv.add(make_prompts((30,))[0], SamplingParams(temperature=0.0))
    res = drv.step([(a, None), (b, None)])
    lp_a, lp_b = res.logprobs
    assert lp_b is None and len(lp_a) == 2 and res.sampled[0] in lp_a
    ref = torch.log_softmax(ex.last_logits[0], -1)
    assert lp_a[res.sampled[0]] == pytest.approx(ref.max().item(), abs=1e-5)

    eos = ex.eos_token_ids
    row = ex._sample_row(drv.add([5], SamplingParams(min_tokens=2, stop_token_ids=[9])))
    assert set(row.stop_ids) == {9, *eos}
    row = ex._sample_row(drv.add([5], SamplingParams(min_tokens=2, ignore_eos=True)))
    assert row.stop_ids == ()


def test_sizing_and_eos(tiny_dirs, tmp_path):
    d = tiny_dirs["llama"]
    sched = SchedulerConfig(max_model_len=100, max_num_seqs=3, max_num_batched_tokens=256)
    ex = ModelExecutor(EngineConfig(model=d, scheduler=sched))
    assert ex.num_kv_blocks == 7 * 3 + 1  # capped at what 3 sequences of 100 tokens can use
    assert ex.kv_cache.shape == (2, 2, 2, 22, 16, 16)
    assert isinstance(ex, Executor)
    sched = SchedulerConfig(max_model_len=1024, max_num_seqs=256)
    ex = ModelExecutor(EngineConfig(model=d, scheduler=sched,
                                    cache=CacheConfig(cpu_kv_gib=1 / 1024)))
    assert ex.num_kv_blocks == (1 << 20) // ex.block_bytes
    assert ex.block_bytes == 16 * 2 * 2 * 2 * 16 * 4
    assert ex.eos_token_ids == (2,)
    gen = read_json(os.path.join(d, "generation_config.json"))
    gen["eos_token_id"] = [2, 7]
    (tmp_path / "m").mkdir()
    for name in os.listdir(d):
        (tmp_path / "m" / name).write_bytes(Path(d, name).read_bytes())
    write_json(tmp_path / "m" / "generation_config.json", gen)
    ex = make_executor(str(tmp_path / "m"), num_blocks=4)
    assert ex.eos_token_ids == (2, 7)


def test_engine_end_to_end_matches_transformers(tiny_dirs, hf_models):
    """The real scheduler (chunked prefill, small budget) drives the executor."""
    prompts = make_prompts((3, 45, 130, 260, 17), seed=5)
    refs = hf_reference(hf_models("llama"), prompts)
    cfg = EngineConfig(
        model=tiny_dirs["llama"],
        cache=CacheConfig(block_size=16, num_kv_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=4, max_model_len=512),
    )
    engine = Engine(cfg, ModelExecutor(cfg))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    outs, now, kinds = {}, 0.0, set()
    while engine.has_unfinished():
        res = engine.step(now)
        now += res.elapsed
        kinds.add(res.batch.kind)
        engine.check_integrity()
        for o in res.outputs:
            if o.finished:
                outs[o.request_id] = o.token_ids
    assert "mixed" in kinds
    for i, ref in enumerate(refs):
        assert outs[f"q{i}"] == ref.tokens


@pytest.mark.gpu
def test_cuda_sizing_and_kv_round_trip(tiny_dirs):
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    sched = SchedulerConfig(max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=512)
    ex = ModelExecutor(EngineConfig(model=tiny_dirs["llama"], device="cuda", dtype="bfloat16",
                                    scheduler=sched,
                                    cache=CacheConfig(gpu_memory_utilization=0.05)))
    assert 1 <= ex.num_kv_blocks <= 64 * 256 + 1
    assert ex.kv_cache.is_cuda and ex.kv_cache.dtype == torch.bfloat16
    ex.kv_cache[:, :, :, :4].normal_()
    payload = pickle.loads(pickle.dumps(ex.export_kv([0, 1, 2, 3])))
    assert payload["kv"].device.type == "cpu" and payload["kv"].dtype == torch.bfloat16
    ex.import_kv([7, 6, 5, 4], payload)
    assert torch.equal(ex.kv_cache[:, :, :, [7, 6, 5, 4]], ex.kv_cache[:, :, :, :4])
