"""Slow clients are closed: a connection that does not finish its request headers within the
header timeout is closed by the server (uvicorn alone keeps it open forever), while one that
sends its request in time is answered, and kept alive only as long again."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from pdserve.server import build_app
from pdserve.server.http import timed_h11
from tests.server.conftest import _free_port
from tests.server.fakes import FakeRuntime


@pytest.fixture
def server_port() -> Iterator[int]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(FakeRuntime(), "m"), host="127.0.0.1",
                                           port=port, log_level="warning",
                                           http=timed_h11(0.5), timeout_keep_alive=600))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):  # b"": the server closed the connection
        data += chunk
    return data


def test_a_client_that_never_finishes_its_headers_is_closed(server_port: int) -> None:
    with socket.create_connection(("127.0.0.1", server_port)) as s:
        s.settimeout(60)  # a safety net: the server closes long before
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        assert _read_all(s) == b""


def test_a_request_in_time_is_answered_then_the_idle_connection_closed(server_port: int
                                                                       ) -> None:
    with socket.create_connection(("127.0.0.1", server_port)) as s:
        s.settimeout(60)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = _read_all(s)  # keep-alive is 600 s: only the header timeout closes it
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"{}")
