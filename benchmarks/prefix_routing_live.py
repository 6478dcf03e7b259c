"""Prefix-aware routing live on CPU instances: the same deployment served with each router over
real HTTP, the `prefix` workload (Preble-style shared prompts) replayed by the benchmark client.

    python benchmarks/prefix_routing_live.py [--instances 2,4] [--num-requests 200] \
        [--routers round_robin,shortest_queue,kv_overlap,preble-paper,prefix_aware] [--rate 8] \
        [--output-json out/prefix_live.json] [--plot out/prefix_live]

Each run builds the deployment from the one spec (`ClusterConfig.from_dict`: N colocated
instances of a random tiny llama, in-process, with `prefill_router` set), serves it with uvicorn
on 127.0.0.1, and reports mean / P99 latency and TTFT, the prefix-cache hit rate (the engines'
own counters) and the load imbalance (max / mean prompt tokens computed per instance). Traffic
stays on loopback; every run is bounded by its request count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.report import plot_grouped_bars
from pdserve.bench.targets import HttpTarget
from pdserve.bench.workloads import make_workload
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.server.app import serve_locally

MAX_LEN = 1024
METRICS = (("lat_mean", "mean latency (s)"), ("ttft_mean", "mean TTFT (s)"),
           ("hit", "prefix-cache hit rate"))
WORKLOAD = "prefix:num_prefixes=8,shared_len=512,unique_len=48,output_len=16,block_size=16"


async def one_run(model: str, n: int, router: str, num_requests: int, rate: float,
                  seed: int) -> dict[str, Any]:
    spec = ClusterConfig.from_dict({
        "model": model, "num_instances": n, "prefill_router": router, "backend": "inproc",
        "engine": {"max_model_len": MAX_LEN, "num_kv_blocks": 256, "max_num_seqs": 32}})
    rt = await build_runtime(spec)
    async with serve_locally(rt) as url:
        target = HttpTarget(url, timeout=120.0, name=router, progress=False)
        await target.prepare()
        w = make_workload(WORKLOAD, num_requests, seed=seed, rate=rate, vocab_size=rt.vocab_size,
                          max_model_len=MAX_LEN, prompt_mode="ids")
        records = await target.run(w.requests)
        await rt.drain(timeout=60)
        stats = {s.instance_id: s.stats for s in rt.instance_status()}
    ok = [r for r in records if r.ok]
    lat = np.array([r.e2e for r in ok])
    ttft = np.array([r.ttft for r in ok])
    queries = sum(s.prefix_queries for s in stats.values() if s)
    hits = sum(s.prefix_hits for s in stats.values() if s)
    computed = [s.prefix_queries - s.prefix_hits for s in stats.values() if s]
    return {"instances": n, "router": router, "ok": len(ok), "failed": len(records) - len(ok),
            "lat_mean": float(lat.mean()), "lat_p99": float(np.percentile(lat, 99)),
            "ttft_mean": float(ttft.mean()), "ttft_p99": float(np.percentile(ttft, 99)),
            "hit": hits / max(queries, 1),
            "imbalance": float(max(computed) / np.mean(computed)) if np.mean(computed) else 1.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="2,4")
    ap.add_argument("--routers",
                    default="round_robin,shortest_queue,kv_overlap,preble-paper,prefix_aware")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=8.0, help="req/s (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model dir (default: a random tiny llama)")
    ap.add_argument("--output-json")
    ap.add_argument("--plot", metavar="DIR")
    a = ap.parse_args(argv)
    model = a.model
    if model is None:
        from pdserve.model.tiny import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(prefix="pdserve-prefix-") + "/llama")
    print("| instances | router | mean lat (s) | P99 lat (s) | mean TTFT (s) | P99 TTFT (s) | "
          "cache hit | imbalance | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in (int(x) for x in a.instances.split(",")):
        for router in a.routers.split(","):
            r = asyncio.run(one_run(model, n, router, a.num_requests, a.rate, a.seed))
            rows.append(r)
            print(f"| {n} | {router} | {r['lat_mean']:.2f} | {r['lat_p99']:.2f} | "
                  f"{r['ttft_mean']:.3f} | {r['ttft_p99']:.2f} | {r['hit']:.1%} | "
                  f"{r['imbalance']:.2f} | {r['failed']} |", flush=True)
    if a.output_json:
        Path(a.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output_json).write_text(json.dumps(rows, indent=1))
    if a.plot:
        path = plot_grouped_bars(rows, "instances", "router", METRICS,
                                 Path(a.plot) / "prefix_routing_live.png",
                                 "prefix workload, live CPU instances (tiny llama)")
        print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
