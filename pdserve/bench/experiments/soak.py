"""Soak with client chaos: many mixed requests against the HTTP server over a live in-process
deployment (colocated, and disaggregated 1 prefill + 1 decode), a random share of them
cancelled by the client at a random moment (docs/benchmarks.md, "Serving API: soak").

Every request must end in exactly one of: a complete result (every choice with a finish reason;
a stream ending in ``[DONE]``), an explicit OpenAI error object (4xx; a 5xx is a failure), or
the client's own cancel. Afterwards the runtime must drain, every instance's block pool must
pass ``check_integrity`` with no block in use, and ``/health`` must answer 200.

Requests mix completions and chat, streaming and not, ``n`` up to 3, prompts sharing prefixes,
greedy and seeded sampling, penalties, ``logit_bias``, structured output (choice, regex, JSON
schema), and a few invalid bodies (which must get a 400). Traffic goes to 127.0.0.1 only; the
run is bounded by ``--requests`` and ``--time-limit``.

    python benchmarks/soak.py [--requests 300] [--concurrency 24] [--cancel 0.3]
        [--strategies colocated,disaggregated] [--time-limit 300] [--model DIR] [--seed 0]
        [--kills N --kill-every SECONDS]

``--kills N`` adds chaos: the deployment gets N spare instances of the killed role (colocated,
or decode beside one prefill instance) and one of them crashes (in-process: it stops
answering, as a dead actor would) every ``--kill-every`` seconds; 5xx answers with an error
object then count as explicit errors, and the pools of the surviving instances are checked.
The server process's resident memory is sampled after the first tenth of the requests and at
the end (``rss_mb``): a leak shows as growth.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx

from pdserve.cluster.runtime import ClusterRuntime, build_runtime
from pdserve.config import ClusterConfig, EngineConfig
from pdserve.server.app import serve_locally

MAX_LEN = 256
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "kind": {"enum": ["cat", "dog"]}},
          "required": ["ok", "kind"]}


def make_body(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    """``(path, body, expect_400)`` of one random request."""
    stems = ["The capital of France is", "Once upon a time there was",
             "def fibonacci(n):", "Translate to French: good morning"]
    text = rng.choice(stems) + " " + " ".join(rng.choice(["a", "b", "cat", "dog", "x"])
                                              for _ in range(rng.randint(0, 30)))
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 24),
                            "stream": rng.random() < 0.5,
                            "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = 0.8
        if rng.random() < 0.5:
            body["seed"] = rng.randint(0, 1000)
    r = rng.random()
    if r < 0.1:
        body["guided_choice"] = ["yes", "no", "maybe"]
    elif r < 0.15:
        body["guided_regex"] = "[0-9]{2,4}"
    elif r < 0.2:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "s", "schema": SCHEMA}}
        body["max_tokens"] = 40
    elif r < 0.3:
        body.update(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                    logit_bias={"10": -100, "11": 5})
    expect_400 = rng.random() < 0.05
    if expect_400:
        body[rng.choice(["temperature", "n", "top_p", "presence_penalty"])] = -5
    if rng.random() < 0.5:
        if body.get("stream") and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return "/v1/completions", {"prompt": text, **body}, expect_400
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                    **body}, expect_400


async def one_request(c: httpx.AsyncClient, path: str, body: dict[str, Any],
                      expect_400: bool, allow_5xx: bool = False) -> str:
    """The request's outcome: ``ok``, ``error <code>`` or ``broken: <why>``. With
    ``allow_5xx`` (an instance was killed) a 5xx with an error object is an explicit error."""
    n = body.get("n", 1)
    if not body.get("stream"):
        r = await c.post(path, json=body)
        if r.status_code >= 400:
            err = r.json().get("error", {})
            if err.get("code") != r.status_code or not err.get("message"):
                return f"broken: error without an error object ({r.status_code})"
            if (r.status_code >= 500 and not allow_5xx) or (
                    expect_400 and r.status_code != 400):
                return f"broken: {r.status_code} {err.get('message')}"
            return f"error {r.status_code}"
        if expect_400:
            return "broken: an invalid body was served"
        choices = r.json()["choices"]
        if len(choices) != n or any(ch["finish_reason"] not in ("stop", "length")
                                    for ch in choices):
            return f"broken: incomplete result {choices}"
        return "ok"
    async with c.stream("POST", path, json=body) as r:
        if r.status_code >= 400:
            await r.aread()
            if (r.status_code >= 500 and not allow_5xx) or (
                    expect_400 and r.status_code != 400):
                return f"broken: {r.status_code}"
            return f"error {r.status_code}"
        finished: set[int] = set()
        done = False
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                if chunk["error"]["code"] >= 500 and not allow_5xx:
                    return f"broken: error chunk {chunk['error']}"
                return f"error {chunk['error']['code']} (in stream)"
            for ch in chunk["choices"]:
                if ch.get("finish_reason"):
                    finished.add(ch["index"])
        if not done or len(finished) != n:
            return f"broken: stream ended (done={done}) with {len(finished)}/{n} choices"
        return "ok"


async def soak(runtime: ClusterRuntime, requests: int, concurrency: int, cancel: float,
               time_limit: float, seed: int, kill_at: Sequence[float] = ()) -> dict[str, Any]:
    """``kill_at``: crash the last live instance at each of these times into the run (its
    requests are recomputed elsewhere or end with an explicit error)."""
    import psutil

    proc = psutil.Process()
    rss: list[float] = []
    rng = random.Random(seed)
    async with serve_locally(runtime, shutdown_runtime=False) as url:
        outcomes: collections.Counter[str] = collections.Counter()
        broken: list[str] = []
        sem = asyncio.Semaphore(concurrency)
        t0 = time.monotonic()
        limits = httpx.Limits(max_connections=concurrency + 4)

        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=limits) as c:

            async def run(i: int) -> None:
                path, body, bad = make_body(rng)
                cancel_after = rng.uniform(0.0, 0.4) if rng.random() < cancel else None
                async with sem:
                    if time.monotonic() - t0 > time_limit:
                        outcomes["not sent (time limit)"] += 1
                        return
                    task = asyncio.create_task(one_request(c, path, body, bad,
                                                           allow_5xx=bool(kill_at)))
                    try:
                        if cancel_after is None:
                            outcome = await task
                        else:
                            await asyncio.wait({task}, timeout=cancel_after)
                            if task.done():
                                outcome = task.result()
                            else:
                                task.cancel()
                                with contextlib.suppress(asyncio.CancelledError):
                                    await task
                                outcome = "cancelled by client"
                    except Exception as e:  # a transport error is a failure of the server
                        outcome = f"broken: {type(e).__name__}: {e}"
                if outcome.startswith("broken"):
                    broken.append(f"{path} {json.dumps(body)[:200]} -> {outcome}")
                    outcome = "broken"
                outcomes[outcome] += 1
                if sum(outcomes.values()) in (max(requests // 10, 1), requests):
                    rss.append(proc.memory_info().rss / 2**20)

            async def kill() -> list[str]:
                killed: list[str] = []
                for t in kill_at:
                    await asyncio.sleep(max(t - (time.monotonic() - t0), 0.0))
                    # not one already killed whose death the driver has not yet seen
                    victim = [iid for iid, i in runtime.instances.items()
                              if i.view.alive and iid not in killed][-1]
                    runtime.instances[victim].client.kill()
                    killed.append(victim)
                return killed

            killer = asyncio.create_task(kill())
            await asyncio.gather(*(run(i) for i in range(requests)))
            killed = await killer
            elapsed = time.monotonic() - t0
            health = (await c.get("/health")).status_code

        await runtime.drain(timeout=30)
        # self-healing: every killed instance is restarted in place; wait for the role to be
        # back at full strength
        deadline = time.monotonic() + 60
        while (any(not i.view.alive for i in runtime.instances.values())
               or len(runtime.restarts) < len(killed)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        full = all(i.view.alive for i in runtime.instances.values()) and \
            len(runtime.restarts) >= len(killed)
        recovery = [round(r.joined - r.failed, 2) for r in runtime.restarts]
        pools: dict[str, Any] = {}
        for _ in range(200):  # the last release/abort commands reach instances on their next call
            pools = await runtime.check_integrity()
            if all(s["used_blocks"] == 0 and s["num_requests"] == 0 for s in pools.values()):
                break
            await asyncio.sleep(0.02)
        leaked = {iid: s for iid, s in pools.items()
                  if s["used_blocks"] != 0 or s["num_requests"] != 0}
    return {"requests": requests, "elapsed_s": round(elapsed, 2), "outcomes": dict(outcomes),
            "broken": broken, "health_after": health, "leaked_blocks": leaked,
            "killed": killed, "recovery_s": recovery, "full_strength": full,
            "rss_mb": [round(x, 1) for x in rss],
            "pools": pools,
            "ok": not broken and not leaked and health == 200 and full}


async def run_strategies(model: str, strategies: list[str], kills: int = 0,
                         kill_every: float = 10.0, backend: str = "inproc",
                         **kw: Any) -> dict[str, Any]:
    """One soak per strategy; with ``kills`` the deployment has that many spare instances of
    the killed role (colocated; decode beside one prefill instance), one crashing every
    ``kill_every`` seconds (``backend="ray"``: its Ray actor is killed), each restarted in
    place by the runtime's supervisor."""
    results = {}
    spare = kills
    kill_at = [kill_every * (k + 1) for k in range(kills)]
    for strategy in strategies:
        engine = EngineConfig.from_kwargs(model, model_max_len=1024, max_model_len=MAX_LEN,
                                          num_kv_blocks=96, max_num_batched_tokens=512,
                                          max_num_seqs=16)
        counts = ({"num_decode": 1 + spare} if strategy == "disaggregated" else
                  {"num_instances": 1 + spare})
        rt = await build_runtime(ClusterConfig.from_dict({
            "engine": engine, "strategy": strategy, "backend": backend, **counts}))
        try:
            results[strategy] = await soak(rt, kill_at=kill_at, **kw)
        finally:
            await rt.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--cancel", type=float, default=0.3, help="share cancelled by the client")
    ap.add_argument("--strategies", default="colocated,disaggregated")
    ap.add_argument("--time-limit", type=float, default=300.0,
                    help="stop sending new requests after this many seconds (per strategy)")
    ap.add_argument("--model", default=None, help="model dir (default: a random tiny llama)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=0,
                    help="crash this many (spare) instances during the run (default: 0)")
    ap.add_argument("--kill-every", type=float, default=10.0,
                    help="seconds between crashes, the first one included (default: 10)")
    ap.add_argument("--backend", choices=["inproc", "ray"], default="inproc",
                    help="instances as threads or Ray actors (kills kill the actor)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model
    if model is None:
        from pdserve.model.tiny import make_tiny_model  # lazy: torch

        model = make_tiny_model(tempfile.mkdtemp(prefix="pdserve-soak-") + "/llama")
    results = asyncio.run(run_strategies(
        model, args.strategies.split(","), requests=args.requests,
        concurrency=args.concurrency, cancel=args.cancel, time_limit=args.time_limit,
        seed=args.seed, kills=args.kills, kill_every=args.kill_every, backend=args.backend))
    for strategy, r in results.items():
        killed = f"killed {', '.join(r['killed'])}; " if r["killed"] else ""
        print(f"{strategy}: {killed}{r['requests']} requests in {r['elapsed_s']} s; "
              f"outcomes {r['outcomes']}; health after {r['health_after']}; "
              f"leaked blocks {r['leaked_blocks'] or 'none'}; server RSS {r['rss_mb']} MiB; "
              f"recovery per kill {r['recovery_s']} s; full strength {r['full_strength']}; "
              f"{'OK' if r['ok'] else 'FAILED'}")
        for b in r["broken"][:20]:
            print("   ", b)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
