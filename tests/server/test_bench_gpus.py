"""``pdserve bench`` against a pdserve server takes the deployment's GPU count from
``/v1/models`` (a 2-instance server is not reported as 1 GPU); against a server that does not
say, the count is marked as assumed; ``--num-gpus`` wins."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.bench.cli import main as bench_main
from tests.bench.fakes import FakeServer
from tests.server.fakes import FakeRuntime

ARGS = ["--workload", "fixed:input=4,output=3", "--rate", "50", "--num-requests", "4",
        "--no-progress", "--prompt-mode", "ids"]


def run(url: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "b.json"
    assert bench_main(["bench", "--target", url, *ARGS, "--output-json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_gpu_count_comes_from_the_server(live_server: Callable[..., str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    runtime = FakeRuntime(max_model_len=256, disaggregated=True)  # 1 prefill + 1 decode
    runtime.vocab_size = runtime.tokenizer.vocab_size  # type: ignore[attr-defined]
    url = live_server(runtime)
    data = run(url, tmp_path)
    assert data["num_gpus"] == 2 and data["summary"]["num_gpus"] == 2
    assert data["summary"]["num_gpus_note"] == "reported by the server"
    assert "(2 GPU(s), reported by the server)" in capsys.readouterr().out
    data = run(url, tmp_path, "--num-gpus", "8")  # the user's count wins
    assert data["summary"]["num_gpus"] == 8 and data["summary"]["num_gpus_note"] is None
    assert "(8 GPU(s))" in capsys.readouterr().out


def test_a_server_that_does_not_say_is_marked_assumed(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer().start()
    try:
        data = run(server.url, tmp_path)
    finally:
        server.stop()
    assert data["summary"]["num_gpus"] == 1
    assert data["summary"]["num_gpus_note"].startswith("assumed")
    assert "(1 GPU(s), assumed: the server does not report its GPU count; give --num-gpus)" \
        in capsys.readouterr().out
