from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.bench.traces import TraceNotFoundError, find_traces_dir
from tests.bench.fakes import FakeServer


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sharegpt_dir() -> str | None:
    """The traces folder, or ``None`` where it is missing: ShareGPT-based workloads (chatbot,
    TetriInfer's classes, mixed) then draw from the sample bundled with pdserve."""
    try:
        return str(find_traces_dir())
    except TraceNotFoundError:
        return None


@pytest.fixture(scope="session")
def traces_dir() -> str:
    try:
        return str(find_traces_dir())
    except TraceNotFoundError as e:
        pytest.skip(f"trace files not available: {e}")
