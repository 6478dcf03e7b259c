"""A third-party benchmark client against ``pdserve serve --demo``: guidellm, offline, with the
one flag the README gives (the tokenizer as a local path; without it guidellm looks the served
name up on the Hugging Face hub and fails offline).

guidellm is not in the ``test`` extra: 0.8.1 pins ``click~=8.4.0`` (a downgrade of the click
that Ray, uvicorn and schemathesis share), brings uvloop and httptools, which uvicorn then picks
on its own for the test servers (another event loop and HTTP parser under the server tests),
and some thirty more packages (pandas, pyarrow, datasets, sanic, ...). Install it in its own
virtual environment: ``$PDSERVE_GUIDELLM`` (its executable) or ``guidellm`` on the PATH when
given; otherwise the test makes one itself, once, under ``~/.cache/pdserve/peers/`` (pip
install of the pinned version from the package index, a few minutes the first time) and skips
only when that install cannot be done (no package index)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDELLM_VERSION = "0.8.1"
PEERS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "peers"


def guidellm() -> str:
    """The guidellm executable: the given one, or one in its own cached virtual environment
    (made here on first use); skips when neither can be had."""
    given = os.environ.get("PDSERVE_GUIDELLM") or shutil.which("guidellm")
    if given:
        return given
    venv = PEERS / f"guidellm-{GUIDELLM_VERSION}"
    exe, done = venv / "bin" / "guidellm", venv / "pdserve-installed"
    if done.exists():
        return str(exe)
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
    for cmd in ([sys.executable, "-m", "venv", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", f"guidellm=={GUIDELLM_VERSION}"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            last = ((r.stderr or r.stdout).strip().splitlines() or ["(no output)"])[-1]
            pytest.skip(f"could not install guidellm {GUIDELLM_VERSION} in its own venv: {last}")
    done.touch()
    return str(exe)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run installs guidellm into its venv (minutes)
def test_guidellm_against_the_demo_server(tmp_path: Path) -> None:
    from pdserve.model.tiny import default_model_dir

    tokenizer = default_model_dir()  # the demo's model directory holds its tokenizer
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--demo", "--backend", "inproc",
         "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # until it serves (or dies); a liveness guard, not a timing check
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        out = tmp_path / "guidellm.json"
        r = subprocess.run(
            [guidellm(), "run", "--backend", f"kind=openai_http,target={url}",
             "--tokenizer", f"kind=hf_auto,model={tokenizer}",
             "--profile", "kind=constant,rate=4", "--constraint", "kind=max_requests,count=8",
             "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
             "--disable-progress", "--output", f"kind=json,path={out}"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        bench = json.loads(out.read_text())["benchmarks"][0]
        assert bench["metrics"]["request_totals"] == {"successful": 8, "errored": 0,
                                                      "incomplete": 0, "total": 8}
        assert bench["metrics"]["output_token_count"]["successful"]["mean"] == 8
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
