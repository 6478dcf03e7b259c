"""Tensor parallelism (gloo on CPU, ranks as processes): the greedy tokens of a TP2/TP4 instance
equal TP1's and transformers', each rank reads about 1/tp of the weights, and KV moves between
instances of different TP degrees unchanged (byte for byte), continuing as it would have."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, cdiv
from pdserve.engine.engine import Engine
from pdserve.engine.model_executor import ModelExecutor
from pdserve.request import Request
from tests.model.helpers import GREEDY, NEW_TOKENS, HandDriver, hf_reference, make_prompts

PROMPTS = (3, 37, 90)


def executor(model_dir: str, tp: int, blocks: int = 64) -> ModelExecutor:
    cfg = EngineConfig(model=model_dir, cache=CacheConfig(num_kv_blocks=blocks))
    ex = ModelExecutor(cfg, num_threads=1, tp=tp)
    ex.capture_logits = True  # (HandDriver records them)
    return ex


def generate(ex: ModelExecutor, prompts: list[list[int]], eng: Any = None) -> list[list[int]]:
    """Greedy tokens of ``prompts`` through ``eng`` (default: one engine over ``ex``), the
    block pool's integrity checked after every step."""
    eng = Engine(ex.config, ex) if eng is None else eng
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step().outputs:
            if o.finished:
                out[o.request_id] = o.token_ids
        eng.check_integrity()
    return [out[f"r{i}"] for i in range(len(prompts))]


def check_parity(model_dir: str, hf_model, tp: int) -> ModelExecutor:
    prompts = make_prompts(PROMPTS)
    one = executor(model_dir, 1)
    want = generate(one, prompts)
    ex = executor(model_dir, tp)
    try:
        got = generate(ex, prompts)
    finally:
        ex.close()
    assert got == want  # all 64 tokens of each request
    ref = hf_reference(hf_model, prompts)
    assert [t[:NEW_TOKENS] for t in got] == [r.tokens for r in ref]
    return ex


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_tp2_greedy_equals_tp1_and_transformers(tiny_dirs, hf_models, arch) -> None:
    ex = check_parity(tiny_dirs[arch], hf_models(arch), 2)
    assert ex.local_config.num_heads == ex.model_config.num_heads // 2


@pytest.mark.slow
def test_tp4_beyond_the_kv_heads(tiny_dirs, hf_models) -> None:
    """4 ranks over the tiny llama's 2 KV heads: each KV head is replicated on two ranks."""
    ex = check_parity(tiny_dirs["llama"], hf_models("llama"), 4)
    assert ex.local_config.num_kv_heads == 1 and ex.layout.kv_replicas == 2


def test_each_rank_loads_its_share(tiny_dirs) -> None:
    full = executor(tiny_dirs["llama"], 1)
    ex = executor(tiny_dirs["llama"], 2)
    try:
        # replicated: the norms only (2 * layers + 1 vectors of the hidden size)
        assert abs(ex.loaded_bytes - full.loaded_bytes / 2) < 0.01 * full.loaded_bytes
        assert ex.weight_bytes == ex.loaded_bytes
        assert ex.kv_cache.numel() == full.kv_cache.numel() // 2
    finally:
        ex.close()


def _prefill(ex: ModelExecutor, prompt: list[int]) -> tuple[HandDriver, Request, list[int]]:
    hd = HandDriver(ex)
    req = hd.add(prompt)
    hd.step([(req, None)])
    return hd, req, req.block_ids[: cdiv(len(prompt), ex.block_size)]


def _continue(ex: ModelExecutor, prompt: list[int], blocks: list[int], first: int) -> list[int]:
    """Decode on ``ex`` after the KV of ``prompt`` was imported into ``blocks``."""
    hd = HandDriver(ex)
    req = hd.add(prompt)
    req.block_ids[: len(blocks)] = blocks
    req.num_computed_tokens = len(prompt)
    req.append_token(first)
    hd.tokens[req.request_id].append(first)
    hd.decode_all([req], NEW_TOKENS)
    return hd.tokens[req.request_id]


def test_kv_hand_off_across_tp_degrees(tiny_dirs) -> None:
    """TP2 -> TP1 and TP1 -> TP2: the KV arrives byte-identical (re-exported from the
    destination it is the source's payload) and the destination continues the request exactly
    as the source instance would have."""
    model = tiny_dirs["llama"]
    p1, p2 = make_prompts((45, 70), seed=3)
    one, two = executor(model, 1, 256), executor(model, 2, 256)
    try:
        for src, dst, prompt in ((two, one, p1), (one, two, p2)):
            hd, req, blocks = _prefill(src, prompt)
            payload = src.export_kv(blocks)
            assert payload["kv"].shape[2] == src.model_config.num_kv_heads
            dst_blocks = [b + 20 for b in blocks]  # other blocks on the destination
            dst.import_kv(dst_blocks, payload)
            assert torch.equal(dst.export_kv(dst_blocks)["kv"], payload["kv"])
            first = hd.tokens[req.request_id][0]
            hd.decode_all([req], NEW_TOKENS)
            assert _continue(dst, prompt, dst_blocks, first) == hd.tokens[req.request_id]
    finally:
        two.close()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="tensor parallelism over NCCL needs 2 CUDA devices")
def test_tp2_over_nccl_equals_tp1_on_cuda(tiny_dirs) -> None:
    """The same code path on CUDA: NCCL for the all-reduces, gloo for the step plans."""
    model = tiny_dirs["llama"]
    prompts = make_prompts(PROMPTS)

    def on_cuda(tp: int) -> ModelExecutor:
        cfg = EngineConfig(model=model, device="cuda", cache=CacheConfig(num_kv_blocks=64))
        return ModelExecutor(cfg, tp=tp)

    want = generate(on_cuda(1), prompts)
    ex = on_cuda(2)
    try:
        assert generate(ex, prompts) == want
    finally:
        ex.close()


def test_ranks_end_with_their_driver(tiny_dirs, tmp_path) -> None:
    """A driver killed outright (SIGKILL: no cleanup runs) leaves no rank behind."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, time\n"
        "from pdserve.config import CacheConfig, EngineConfig\n"
        "from pdserve.engine.model_executor import ModelExecutor\n"
        f"cfg = EngineConfig(model={tiny_dirs['llama']!r}, cache=CacheConfig(num_kv_blocks=8))\n"
        "ex = ModelExecutor(cfg, num_threads=1, tp=2)\n"
        "print(ex.ranks.procs[0].pid, flush=True)\n"
        "time.sleep(300)\n")
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert driver.stdout is not None
    rank = int(driver.stdout.readline())
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(rank, 9)
    raise AssertionError("the rank outlived its driver")


def test_generate_cli_with_tp2_prints_what_tp1_prints(tiny_dirs, capsys) -> None:
    from pdserve import cli

    argv = ["generate", "--model", tiny_dirs["opt"], "--prompt", "The quick brown fox",
            "--max-tokens", "12", "--num-kv-blocks", "32", "--max-model-len", "256"]
    assert cli.main([*argv, "--tp", "1"]) == 0
    one = capsys.readouterr().out
    assert cli.main([*argv, "--tp", "2"]) == 0
    assert capsys.readouterr().out == one and "12 tokens" in one
