"""``/health`` latency while the server is under hostile and bursty load (docs/benchmarks.md,
"Serving API: the event loop under load").

Starts a server in a child process on 127.0.0.1 (a random tiny llama on an in-process
colocated runtime (``--backend inproc``, or ``ray`` for an engine in its own process), or
``--model DIR``), then probes ``GET /health`` from another child process
every ``--probe-ms`` milliseconds for ``--phase-s`` seconds in each of four phases (the burst of
streams is waited for to its end):

1. **idle**;
2. **5 MB bodies**: ``--big-senders`` clients post 5 MB prompts back to back (each must get a
   4xx: too long for ``max_model_len``, or over the body limit when set below 5 MB);
3. **200 streams**: a burst of ``--streams`` concurrent streaming completions;
4. **both** at once.

Reported per phase: p50 / p99 / max ``/health`` latency, the number of probes, how long a 5 MB
request took to get its answer, and how many streams completed. Bounded in time and count;
loopback only.

    python benchmarks/server_health.py [--phase-s 5] [--streams 200] [--big-senders 2]
        [--max-model-len 2048] [--backend inproc|ray] [--model DIR] [--server-pythonpath PATH]

``--server-pythonpath`` runs the server from another checkout (to compare with an older
version of pdserve).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

SERVER_CODE = """
import asyncio, sys, uvicorn
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig, EngineConfig
from pdserve.server.app import build_app

async def main(model, port, max_len, backend):
    engine = EngineConfig.from_kwargs(model, model_max_len=max(max_len, 1024),
                                      max_model_len=max_len, num_kv_blocks=2048,
                                      max_num_batched_tokens=2048, max_num_seqs=256)
    rt = await build_runtime(ClusterConfig.from_dict({"engine": engine, "backend": backend}))
    cfg = uvicorn.Config(build_app(rt), host="127.0.0.1", port=port, log_level="warning",
                         lifespan="off", timeout_graceful_shutdown=2)
    await uvicorn.Server(cfg).serve()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
"""


# The prober is a process of its own, so that the load generator's event loop (200 streams)
# does not delay the probes: the latencies are the server's.
PROBE_CODE = """
import json, sys, time, httpx
url, every, seconds, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
lat, end = [], time.monotonic() + seconds
with httpx.Client(base_url=url, timeout=120) as c:
    while time.monotonic() < end:
        t0 = time.perf_counter()
        assert c.get("/health").status_code == 200
        lat.append(time.perf_counter() - t0)
        time.sleep(every)
json.dump(lat, open(out, "w"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def big_sender(url: str, body: bytes, stop: asyncio.Event, out: list[float],
                     statuses: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", content=body,
                             headers={"content-type": "application/json"})
            out.append(time.perf_counter() - t0)
            statuses.append(r.status_code)


async def one_stream(c: httpx.AsyncClient, i: int, max_tokens: int) -> bool:
    body = {"prompt": f"Stream number {i} says", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.8, "seed": i}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return False
        done = False
        async for line in r.aiter_lines():
            done = done or line == "data: [DONE]"
        return done


async def phase(url: str, name: str, seconds: float, probe_every: float, big: int,
                streams: int, body: bytes, max_tokens: int) -> dict[str, Any]:
    stop = asyncio.Event()
    big_lat: list[float] = []
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    out = tempfile.mktemp(suffix=".json")
    prober = subprocess.Popen([sys.executable, "-c", PROBE_CODE, url, str(probe_every),
                               str(seconds), out])
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as sc:
        tasks = [asyncio.create_task(big_sender(url, body, stop, big_lat, statuses))
                 for _ in range(big)]
        stream_tasks = [asyncio.create_task(one_stream(sc, i, max_tokens))
                        for i in range(streams)]
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        while prober.poll() is None:
            await asyncio.sleep(0.05)
        if stream_tasks:  # the burst is bounded: wait for it (up to a minute more)
            await asyncio.wait(stream_tasks, timeout=60)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.perf_counter() - t0
        completed = sum(1 for t in stream_tasks if t.done() and not t.exception() and t.result())
        for t in stream_tasks:
            t.cancel()
    with open(out) as f:
        lat = json.load(f)
    os.unlink(out)
    return {"phase": name, "seconds": round(elapsed, 1), "probes": len(lat),
            "health_p50_ms": round(1e3 * pct(lat, 0.5), 1),
            "health_p99_ms": round(1e3 * pct(lat, 0.99), 1),
            "health_max_ms": round(1e3 * max(lat), 1) if lat else None,
            "big_requests": len(big_lat),
            "big_median_s": round(statistics.median(big_lat), 3) if big_lat else None,
            "big_statuses": sorted(set(statuses)),
            "streams_completed": f"{completed}/{streams}" if streams else None}


async def run(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)  # distinct random words: no tokenizer cache helps
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    words = ["".join(rng.choices(alphabet, k=rng.randint(2, 12))) for _ in range(200_000)]
    text = " ".join(rng.choices(words, k=900_000))[:5_000_000]
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    plan = [("idle", 0, 0), ("5 MB bodies", args.big_senders, 0),
            (f"{args.streams} streams", 0, args.streams),
            ("both", args.big_senders, args.streams)]
    rows = []
    for name, big, streams in plan:
        row = await phase(url, name, args.phase_s, args.probe_ms / 1e3, big, streams, body,
                          args.max_tokens)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-s", type=float, default=5.0)
    ap.add_argument("--probe-ms", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--big-senders", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--model", default=None, help="model dir (default: a random tiny llama)")
    ap.add_argument("--backend", default="inproc", choices=["inproc", "ray"],
                    help="inproc: the engine steps on a thread of the server's process (they "
                         "share the GIL); ray: in an actor process")
    ap.add_argument("--server-pythonpath", default=None)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from pdserve.model.tiny import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(prefix="pdserve-health-") + "/llama")
    port = _free_port()
    env = dict(os.environ)
    if args.server_pythonpath:
        env["PYTHONPATH"] = args.server_pythonpath
    # cwd elsewhere: ``python -c`` puts the working directory first on sys.path
    proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, model, str(port),
                             str(args.max_model_len), args.backend], env=env,
                            cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        rows = asyncio.run(run(url, args))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    print()
    print("| phase | /health p50 ms | p99 ms | max ms | probes | 5 MB requests (median s, "
          "status) | streams done |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        big = (f"{r['big_requests']} ({r['big_median_s']} s, {r['big_statuses']})"
               if r["big_requests"] else "–")
        print(f"| {r['phase']} | {r['health_p50_ms']} | {r['health_p99_ms']} | "
              f"{r['health_max_ms']} | {r['probes']} | {big} | {r['streams_completed'] or '–'} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
