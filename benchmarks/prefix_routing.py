"""Prefix-aware routing in simulation: Preble's E2 against the baseline routers.

Colocated OPT-13B instances (TP=1) with DistServe's A100-80GB profile
(``shared/profiles/distserve_profiler-a100-80g.distserve.json``), chunked prefill, block size
16, KV blocks from device memory; 2, 4 and 8 instances. Workloads:

* ``prefix`` — pdserve's Preble-style generator (Zipf popularity over shared prefixes plus a
  private suffix; ``--prefix-spec`` sets its parameters), Poisson arrivals at
  ``--rate-per-instance`` × instances;
* ``mooncake`` — the Mooncake (Kimi) conversation trace, its 512-token prefix blocks shared
  exactly; prompts longer than OPT's 2,048-token context lose their tail (a clipped prompt is
  still a prefix of the full one, so leading shared blocks stay shared); its own arrival times,
  compressed by ``--mooncake-speedup`` × instances / 2 (the trace's 3.4 req/s per 2 instances).

Routers: ``round_robin``, ``shortest_queue`` (fewest unfinished requests), ``kv_overlap``
(Dynamo's cost), ``sglang_cache_aware``, ``preble`` (E2, prefill time from the same profile),
and ``preble+local`` (E2 plus Preble's local priority-group queue on every instance).

    python benchmarks/prefix_routing.py [--instances 2,4,8] [--num-requests 2000]

Reports per run: mean / P99 end-to-end latency and TTFT, the prefix-cache hit rate (prompt
tokens served from cache / prompt tokens) and the load imbalance (max / mean prompt tokens
computed per instance).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import numpy as np

from pdserve.bench.report import plot_grouped_bars
from pdserve.bench.workloads import Workload, make_workload
from pdserve.config import ClusterConfig
from pdserve.sim.target import SimulationConfig, build_simulator, to_sim_requests

SHARED = os.environ.get("PDSERVE_SHARED",
                        os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
PROFILE = "distserve_profiler-a100-80g.distserve"  # shipped with pdserve
TRACES = os.path.join(SHARED, "traces")
ROUTERS = ["round_robin", "shortest_queue", "kv_overlap", "sglang_cache_aware", "preble",
           "preble+local"]
MAX_LEN = 2048


def build_deployment(num_instances: int, router: str) -> Any:
    """The simulated deployment: ``num_instances`` colocated OPT-13B on A100s (DistServe's
    profile) with ``router`` in front (the simulator gives Preble's E2 the profile's prefill
    time and turns on the instances' KV events); ``+local`` selects Preble's local policy."""
    name, _, local = router.partition("+")
    spec = ClusterConfig.from_dict({
        "model": "opt-13b", "num_instances": num_instances, "prefill_router": name,
        "engine": {"max_model_len": MAX_LEN, "policy": "preble" if local else "fcfs"}})
    return build_simulator(SimulationConfig(spec, profile=PROFILE)).simulator


def workload(name: str, n: int, num_instances: int, args: argparse.Namespace) -> Workload:
    if name == "prefix":
        return make_workload(args.prefix_spec, n, seed=args.seed,
                             rate=args.rate_per_instance * num_instances, max_model_len=MAX_LEN)
    w = make_workload("mooncake", n, seed=args.seed, max_model_len=MAX_LEN, traces_dir=TRACES)
    speedup = args.mooncake_speedup * num_instances / 2  # the trace's rate per 2 instances
    reqs = [dataclasses.replace(r, arrival_time=r.arrival_time / speedup) for r in w.requests]
    return dataclasses.replace(w, requests=reqs)


def summarize(sim: Any, res: Any) -> dict[str, float]:
    recs = [r for r in res.records if r.error is None]
    lat = np.array([r.timeline.finish - r.timeline.arrival for r in recs])
    ttft = np.array([r.timeline.token_times[0] - r.timeline.arrival for r in recs])
    prompt = sum(r.prompt_len for r in recs)
    cached = sum(r.num_cached_tokens for r in recs)
    computed: dict[str, int] = {i: 0 for i in sim.insts}
    for req in sim.controller.history.values():
        if req.instance is not None:
            computed[req.instance] += len(req.prompt_token_ids) - req.num_cached_tokens
    work = np.array(list(computed.values()), dtype=float)
    decisions = getattr(sim.controller.prefill_router, "decisions", None)
    return {"n": len(recs), "failed": len(res.records) - len(recs),
            "lat_mean": float(lat.mean()), "lat_p99": float(np.percentile(lat, 99)),
            "ttft_mean": float(ttft.mean()), "ttft_p99": float(np.percentile(ttft, 99)),
            "hit": cached / max(prompt, 1),
            "imbalance": float(work.max() / work.mean()) if work.mean() > 0 else 1.0,
            "decisions": decisions}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="2,4,8")
    ap.add_argument("--workloads", default="prefix,mooncake")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--prefix-spec", default="prefix:num_prefixes=64,shared_len=1536,"
                                             "unique_len=256,output_len=64")
    ap.add_argument("--rate-per-instance", type=float, default=3.0)
    ap.add_argument("--mooncake-speedup", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="DIR", help="write prefix_routing_<workload>.png here")
    a = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print("| workload | instances | router | mean lat (s) | P99 lat (s) | mean TTFT (s) | "
          "P99 TTFT (s) | cache hit | imbalance | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for wname in a.workloads.split(","):
        for n_inst in (int(x) for x in a.instances.split(",")):
            w = workload(wname, a.num_requests, n_inst, a)
            for router in a.routers.split(","):
                sim = build_deployment(n_inst, router)
                t0 = time.perf_counter()
                res = sim.run(to_sim_requests(w.requests, 50272))
                s = summarize(sim, res)
                rows.append({"workload": wname, "instances": n_inst, "router": router, **s})
                print(f"| {wname} | {n_inst} | {router} | {s['lat_mean']:.2f} | "
                      f"{s['lat_p99']:.2f} | {s['ttft_mean']:.3f} | {s['ttft_p99']:.2f} | "
                      f"{s['hit']:.1%} | {s['imbalance']:.2f} | "
                      f"{time.perf_counter() - t0:.0f} |"
                      + (f" {s['failed']} failed" if s["failed"] else ""), flush=True)
                if s["decisions"]:
                    print(f"<!-- {wname} {n_inst} {router}: {s['decisions']} -->",
                          file=sys.stderr)
    for wname in a.workloads.split(",") if a.plot else ():
        path = plot_grouped_bars(
            [r for r in rows if r["workload"] == wname], "instances", "router",
            (("lat_mean", "mean latency (s)"), ("lat_p99", "P99 latency (s)"),
             ("hit", "prefix-cache hit rate")),
            os.path.join(a.plot, f"prefix_routing_{wname}.png"),
            f"{wname} workload, simulated OPT-13B on A100 (DistServe's profile)")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
