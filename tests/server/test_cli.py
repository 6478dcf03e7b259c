"""``pdserve serve`` flags, config building, and a serve/shutdown cycle with the fake runtime."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import types
from pathlib import Path

import httpx
import pytest

from pdserve.config import EngineConfig
from pdserve.server import cli
from tests.server.conftest import _free_port
from tests.server.fakes import FakeRuntime

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "max_position_embeddings": 256}


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_engine_flags_are_generated_from_kwargs() -> None:
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == set(EngineConfig.KWARGS)
    args = parser.parse_args(["--block-size", "8", "--no-enable-prefix-caching", "--dtype",
                              "bfloat16", "--memory-utilization", "0.5", "--role", "prefill",
                              "--enable-chunked-prefill"])
    assert cli.engine_kwargs_from_args(args) == {
        "block_size": 8, "enable_prefix_caching": False, "dtype": "bfloat16",
        "memory_utilization": 0.5, "role": "prefill", "enable_chunked_prefill": True}
    assert cli.engine_kwargs_from_args(parser.parse_args([])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--role", "nonsense"])


def test_config_from_args(model_dir: str) -> None:
    args = parse("--model", model_dir, "--strategy", "disaggregated", "--num-prefill", "2",
                 "--num-decode", "3", "--prefill-token-target", "512", "--backend", "inproc",
                 "--link-bandwidth", "25", "--link-latency", "0.5", "--max-waiting-requests",
                 "7", "--decode-router", "round_robin", "--max-model-len", "128",
                 "--num-kv-blocks", "40", "--no-enable-chunked-prefill")
    cfg = cli.config_from_args(args)
    assert (cfg.strategy, cfg.num_prefill, cfg.num_decode, cfg.prefill_token_target) == \
        ("disaggregated", 2, 3, 512)
    assert (cfg.backend, cfg.link_bandwidth_gbps, cfg.link_latency_ms) == ("inproc", 25.0, 0.5)
    assert (cfg.max_waiting_requests, cfg.decode_router, cfg.prefill_router) == \
        (7, "round_robin", "shortest_queue")
    assert cfg.engine.model == model_dir and cfg.engine.cache.num_kv_blocks == 40
    assert cfg.engine.scheduler.max_model_len == 128
    assert cfg.engine.scheduler.enable_chunked_prefill is False
    default = cli.config_from_args(parse("--model", model_dir))
    assert default.backend == "ray" and default.strategy == "colocated"
    assert default.engine.scheduler.max_model_len == 256  # the model's max_position_embeddings


def test_demo_uses_the_tiny_model(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("pdserve.model.tiny")
    fake.default_model_dir = lambda: model_dir  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pdserve.model.tiny", fake)
    assert cli.config_from_args(parse("--demo")).engine.model == model_dir


@pytest.mark.parametrize(("argv", "message"), [
    ((), "give --model"),
    (("--demo", "--model", "x"), "either --model or --demo"),
    (("--model", "/nonexistent/dir"), "has no config.json"),
    (("--num-instances", "0"), "num_instances must be >= 1"),
    (("--max-model-len", "1000"), "exceeds the model's max_position_embeddings"),
    (("--block-size", "0"), "block_size must be >= 1"),
    (("--link-bandwidth", "-1"), "link_bandwidth_gbps must be > 0"),
])
def test_bad_flags_exit_2(model_dir: str, capsys: pytest.CaptureFixture[str],
                          argv: tuple[str, ...], message: str) -> None:
    if argv and argv[0].startswith("--") and argv[0] not in ("--demo", "--model"):
        argv = ("--model", model_dir, *argv)
    args = parse(*argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


async def test_serve_and_shutdown(model_dir: str, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    runtime = FakeRuntime()

    async def build_runtime(config: object) -> FakeRuntime:
        await runtime.start()
        return runtime

    import pdserve.cluster.runtime

    monkeypatch.setattr(pdserve.cluster.runtime, "build_runtime", build_runtime)
    config = cli.config_from_args(parse("--model", model_dir, "--backend", "inproc"))
    port = _free_port()
    task = asyncio.create_task(cli.serve(config, port=port, served_model_name="tiny",
                                         api_key="k", log_level="warning"))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url) as c:
        for _ in range(500):
            if "serving 'tiny'" in capsys.readouterr().out:
                break
            assert not task.done(), task
            await asyncio.sleep(0.01)
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/v1/models")).status_code == 401
        r = await c.post("/v1/completions", headers={"Authorization": "Bearer k"},
                         json={"model": "tiny", "prompt": "abc", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "de"
    assert runtime.started
    os.kill(os.getpid(), signal.SIGINT)  # handled by serve(): graceful shutdown
    await asyncio.wait_for(task, timeout=10)
    assert not runtime.started
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
