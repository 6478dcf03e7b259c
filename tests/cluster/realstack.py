"""Helpers for tests of the real stack: tiny model, runtimes over real instances, a live
uvicorn server in the test's own event loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdserve.cluster.instances import InstanceClient
from pdserve.cluster.runtime import ClusterRuntime
from pdserve.config import ClusterConfig, EngineConfig, ModelConfig
from pdserve.server.app import serve_locally
from pdserve.tokenizer import load_tokenizer
from tests.deploy import role_counts

MAX_LEN = 256


def engine_config(model_dir: str, num_kv_blocks: int = 96, **kw: Any) -> EngineConfig:
    return EngineConfig.from_kwargs(model_dir, model_max_len=1024, max_model_len=MAX_LEN,
                                    num_kv_blocks=num_kv_blocks, max_num_batched_tokens=512,
                                    **kw)


def prompts(vocab: int = 512) -> list[list[int]]:
    """Prompts of different lengths; the 2nd, 3rd and 5th share a 40-token prefix (more than
    two 16-token blocks), the 4th repeats the 1st's start."""
    a = [(7 * i + 11) % (vocab - 4) + 4 for i in range(200)]
    b = [(13 * i + 5) % (vocab - 4) + 4 for i in range(200)]
    return [a[:5], a[:40], a[:40] + b[:30], a[:3] + b[50:150], a[:40] + b[100:160], b[:17]]


class Borrowed(InstanceClient):
    """An instance client a runtime may use but not close (instances shared across tests)."""

    def __init__(self, inner: InstanceClient) -> None:
        self.inner = inner
        self.instance_id, self.role = inner.instance_id, inner.role
        self.num_kv_blocks, self.block_size = inner.num_kv_blocks, inner.block_size

    async def open(self, clock: Any = time.time) -> None:
        await self.inner.open(clock)

    def submit(self, commands: Any) -> None:
        self.inner.submit(commands)

    async def reports(self) -> Any:
        return await self.inner.reports()

    async def loop_stats(self) -> dict[str, float]:
        return await self.inner.loop_stats()

    async def export_kv(self, request_id: str, first_block: int) -> Any:
        return await self.inner.export_kv(request_id, first_block)

    async def send_kv(self, request_id: str, first_block: int) -> tuple[Any, Any]:
        return await self.inner.send_kv(request_id, first_block)

    async def check_integrity(self) -> dict[str, int]:
        return await self.inner.check_integrity()

    def kill(self) -> None:
        self.inner.kill()  # type: ignore[attr-defined]


async def runtime_over(model_dir: str, clients: list[InstanceClient],
                       engine: EngineConfig) -> ClusterRuntime:
    """A started runtime over existing instance clients (borrowed: shutdown leaves them up)."""
    roles = [c.role for c in clients]
    disagg = "prefill" in roles
    cfg = ClusterConfig.from_dict({
        "engine": engine, "backend": "ray",
        **role_counts("disaggregated" if disagg else "colocated", len(clients),
                      max(roles.count("prefill"), 1), max(roles.count("decode"), 1))})
    rt = ClusterRuntime(cfg, [Borrowed(c) for c in clients], load_tokenizer(model_dir),
                        ModelConfig.from_dir(model_dir))
    await rt.start()
    return rt


def serving(runtime: Any) -> Any:
    """Serve ``runtime`` on a free local port in this event loop; yields the base URL. On exit
    the server stops and the runtime is shut down."""
    return serve_locally(runtime)


async def wait_until(cond: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def decoding_on(rt: ClusterRuntime, client: Any, instance_id: str, prompts: list[Any],
                      max_tokens: int, timeout: float = 20.0) -> list[asyncio.Task[str]]:
    """Send ``prompts`` as greedy completions through the server's ``client`` (httpx) and return
    their tasks (each the answer's text) once one of them is decoding on ``instance_id`` (two
    output tokens or more): the moment a failure test kills that instance's rank."""

    async def one(p: object) -> str:
        r = await client.post("/v1/completions", json={"prompt": p, "max_tokens": max_tokens,
                                                       "temperature": 0})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    tasks = [asyncio.create_task(one(p)) for p in prompts]
    await wait_until(lambda: any(q.instance == instance_id and len(q.output_token_ids) >= 2
                                 for q in rt.controller.requests.values()),
                     timeout, what=f"a request decoding on {instance_id}")
    return tasks


async def assert_pools_clean(runtime: ClusterRuntime) -> None:
    """Drain, then every live instance passes ``check_integrity`` with no block in use."""
    await runtime.drain(timeout=20)
    # the last Release/Abort commands reach the instances on their next call
    for _ in range(100):
        stats = await runtime.check_integrity()
        if all(s["used_blocks"] == 0 and s["num_requests"] == 0 for s in stats.values()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks still in use after drain: {stats}")


_MODELS: dict[str, str] = {}


def tiny_model(tmp_path_factory: Any) -> str:
    """One random tiny llama per test session (made with ``make_tiny_model`` in a tmp dir)."""
    from pdserve.model.tiny import make_tiny_model

    key = str(tmp_path_factory.getbasetemp())
    if key not in _MODELS:
        _MODELS[key] = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    return _MODELS[key]
