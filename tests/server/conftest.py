"""Fixtures: a fake runtime, an in-process ASGI client and a live uvicorn server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from pdserve.server import build_app
from tests.server.fakes import FakeRuntime

MODEL = "fake-model"


@pytest.fixture
def runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture
async def client(runtime: FakeRuntime) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(runtime, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                 base_url="http://test") as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server() -> Iterator[Callable[..., str]]:
    """``live_server(runtime, **build_app_kwargs)`` starts uvicorn in a thread; returns its URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(runtime: FakeRuntime, **kwargs: Any) -> str:
        port = _free_port()
        app = build_app(runtime, kwargs.pop("served_model_name", MODEL), **kwargs)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
