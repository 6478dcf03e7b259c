"""How long a refused request (429, queue full) takes under a burst, against a trivial
``GET /health`` burst of the same size in the same run (docs/benchmarks.md, "Serving API: the
event loop under load").

Starts ``pdserve serve --demo --backend inproc`` on 127.0.0.1 with ``--max-waiting-requests``
small, then, ``--repeats`` times: ``--burst`` concurrent ``GET /health`` (the HTTP floor: one
connection each), then ``--burst`` concurrent 64-token completions (a few admitted, the rest
refused with 429). Prints median and max latency per status. Bounded in count; loopback only.

    python benchmarks/burst_429.py [--burst 300] [--repeats 3] [--max-waiting 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _burst(url: str, n: int, completions: bool) -> dict[int, list[float]]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        async def one(i: int) -> tuple[int, float]:
            t0 = time.perf_counter()
            if completions:
                r = await c.post("/v1/completions", json={
                    "prompt": f"hello {i}", "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True})
            else:
                r = await c.get("/health")
            return r.status_code, time.perf_counter() - t0

        by: dict[int, list[float]] = defaultdict(list)
        for status, t in await asyncio.gather(*(one(i) for i in range(n))):
            by[status].append(t)
    return by


def _line(what: str, by: dict[int, list[float]]) -> str:
    return "; ".join(f"{what} {s}: {len(ts)}, median {statistics.median(ts) * 1e3:.0f} ms, "
                     f"max {max(ts) * 1e3:.0f} ms" for s, ts in sorted(by.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--burst", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-waiting", type=int, default=8)
    args = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--demo", "--backend", "inproc",
         "--port", str(port), "--max-waiting-requests", str(args.max_waiting)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if server.poll() is not None:
                sys.exit("the server exited before serving")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for k in range(args.repeats):
            health = asyncio.run(_burst(url, args.burst, completions=False))
            gen = asyncio.run(_burst(url, args.burst, completions=True))
            print(f"run {k + 1}: {_line('/health', health)} | {_line('completions', gen)}",
                  flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
