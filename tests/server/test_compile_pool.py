"""Structured output cannot be weaponised: output constraints compile in worker processes with
a time limit, so a pathological expression neither blocks the trivial one beside it nor outlives
its client. ``[ab]*a[ab]{n}`` determinises to 2**n states: n = 18 compiles in ~7 s on a quiet
2-core machine (so a fast one can beat a 4 s limit), each +2 multiplies that by ~5; n = 24 takes
~15 minutes, far past any limit a test sets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from pdserve.server import build_app
from tests.server.fakes import FakeRuntime

COMPL = "/v1/completions"
EVIL = "[ab]*a[ab]{24}"


def _body(regex: str) -> dict[str, Any]:
    return {"prompt": "abc", "max_tokens": 3, "guided_regex": regex}


async def test_a_pathological_regex_neither_blocks_a_trivial_one_nor_passes() -> None:
    app = build_app(FakeRuntime(), "m", grammar_timeout=4.0, grammar_workers=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t",
                                 timeout=120) as c:
        # both workers started (their start is not an expression's time)
        warm = await asyncio.gather(*(c.post(COMPL, json=_body(r)) for r in ("x+", "y+")))
        assert [r.status_code for r in warm] == [200, 200]
        evil = asyncio.create_task(c.post(COMPL, json=_body(EVIL)))
        pool = app.state.server.compile_pool
        while not pool.busy:
            await asyncio.sleep(0.001)
        r = await c.post(COMPL, json=_body("(ab)+"))  # the other worker answers it
        assert r.status_code == 200 and not evil.done(), r.text
        r = await evil
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "guided_regex" and "longer than 4 s" in err["message"]
        assert pool.killed == 1
        again = await c.post(COMPL, json=_body(EVIL))  # the verdict is cached
        assert again.status_code == 400 and pool.killed == 1
        assert (await c.post(COMPL, json=_body("a|b"))).status_code == 200


async def test_a_compile_is_cancelled_when_its_client_leaves() -> None:
    app = build_app(FakeRuntime(), "m", grammar_timeout=600.0, grammar_workers=1)
    data = json.dumps(_body(EVIL)).encode()
    leave = asyncio.Event()
    sent: list[dict[str, Any]] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": data, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": COMPL, "raw_path": COMPL.encode(),
             "root_path": "", "query_string": b"", "server": ("t", 80),
             "client": ("c", 1), "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(data)).encode())]}
    task = asyncio.create_task(app(scope, receive, send))
    while app.state.server.compile_pool is None or not app.state.server.compile_pool.busy:
        await asyncio.sleep(0.001)
    pool = app.state.server.compile_pool
    [worker] = pool.busy
    leave.set()
    await task
    assert pool.killed == 1 and not worker.proc.is_alive()
    assert sent[0]["status"] == 499
    assert f"regex\0{EVIL}" not in pool._cache  # not a verdict: compiled again if asked
    pool.close()
