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

* ``agent`` — a tool-use / agent mix (our stand-in for Preble's Tool Use and Embodied Agent
  workloads): 24 long system + tool prompts (1,792 tokens, Zipf 0.8) each followed by a short
  unique query (64 tokens) and a short answer (40 tokens);
* ``noshare`` (1,792 unique tokens per prompt) and ``hot`` (every prompt shares one 1,536-token
  prefix): the two cases where prefix-aware routing has nothing to gain.

Routers: ``round_robin``, ``shortest_queue`` (fewest unfinished requests), ``kv_overlap``
(Dynamo's cost), ``sglang_cache_aware``, ``preble`` (E2, prefill time from the same profile),
and ``preble+local`` (E2 plus Preble's local priority-group queue on every instance).

    python benchmarks/prefix_routing.py [--instances 2,4,8] [--num-requests 2000]

reports per run: mean / P99 end-to-end latency and TTFT, the prefix-cache hit rate (prompt
tokens served from cache / prompt tokens) and the load imbalance (max / mean prompt tokens
computed per instance); E2's decision counts (exploit, explore, rebalance, replicate, ...) go
to stderr. ``--window H`` sets E2's window (Preble's 180 s by default; its replication trigger
compares the two halves of it, so a run must last more than H / 2 for it to fire).

    python benchmarks/prefix_routing.py --goodput [--requests-per-instance 100]

reports per-GPU goodput instead (DESIGN.md "Goodput definitions": the highest rate at which
90 % of requests meet both SLOs, found by the toolkit's expanding bisection,
:func:`pdserve.bench.goodput.search_goodput`, each probe a fresh simulation of the same
requests retimed to Poisson arrivals at the probed rate — Mooncake's own timestamps are not
used here: its requests arrive in same-instant bursts that stretching time does not separate,
so attainment stays below 90 % at any rate). The SLOs are set per workload from its zero-load
latency as DistServe does (its chatbot SLOs for OPT-13B, 0.25 s TTFT and 0.1 s TPOT, are ~3–4× the
model's unloaded latency): ``--slo-scale`` (5) × the workload's mean cold-cache prefill time of
a prompt alone (TTFT) and × the mean decode-step time of a request alone at half its output
(TPOT), both from the same A100 profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from pdserve.bench.goodput import AttainmentResult, search_goodput
from pdserve.bench.metrics import SLO, attainment
from pdserve.bench.report import plot_grouped_bars
from pdserve.bench.workloads import Workload, make_workload
from pdserve.config import ClusterConfig
from pdserve.sim.latency import FittedProfile
from pdserve.sim.target import (
    SimulationConfig,
    build_simulator,
    resolve_profile,
    to_records,
    to_sim_requests,
)

SHARED = os.environ.get("PDSERVE_SHARED",
                        os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
PROFILE = "distserve_profiler-a100-80g.distserve"  # shipped with pdserve
TRACES = os.path.join(SHARED, "traces")
ROUTERS = ["round_robin", "shortest_queue", "kv_overlap", "sglang_cache_aware", "preble",
           "preble+local"]
MAX_LEN = 2048
TARGET = 0.9  # attainment target of the goodput search (DESIGN.md)
VOCAB = 50272  # OPT's
WORKLOADS = {  # name -> (workload spec, starting rate per instance of the goodput search)
    "prefix": ("prefix:num_prefixes=64,shared_len=1536,unique_len=256,output_len=64", 3.0),
    "agent": ("prefix:num_prefixes=24,zipf=0.8,shared_len=1792,unique_len=64,output_len=40",
              4.0),
    "noshare": ("prefix:num_prefixes=1,shared_len=0,unique_len=1792,output_len=64", 2.0),
    "hot": ("prefix:num_prefixes=1,shared_len=1536,unique_len=256,output_len=64", 3.0),
    "mooncake": ("mooncake", 1.0),
}


def build_deployment(num_instances: int, router: str, window: float | None = None) -> Any:
    """The simulated deployment: ``num_instances`` colocated OPT-13B on A100s (DistServe's
    profile) with ``router`` in front (the simulator gives Preble's E2 the profile's prefill
    time and turns on the instances' KV events); ``+local`` selects Preble's local policy;
    ``window``: E2's window H in seconds (default Preble's 180)."""
    name, _, local = router.partition("+")
    spec = ClusterConfig.from_dict({
        "model": "opt-13b", "num_instances": num_instances, "prefill_router": name,
        "engine": {"max_model_len": MAX_LEN, "policy": "preble" if local else "fcfs"}})
    sim = build_simulator(SimulationConfig(spec, profile=PROFILE)).simulator
    if window is not None and hasattr(sim.controller.prefill_router, "window"):
        sim.controller.prefill_router.window = window
    return sim


def base_workload(name: str, n: int, seed: int, prefix_spec: str | None = None) -> Workload:
    """Workload ``name`` (:data:`WORKLOADS`; ``prefix_spec`` overrides ``prefix``'s spec):
    synthetic ones with Poisson arrivals at 1 req/s, Mooncake with its own arrival times
    (:meth:`Workload.retimed` sets the rate)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    spec = prefix_spec if name == "prefix" and prefix_spec else WORKLOADS[name][0]
    if spec == "mooncake":
        return make_workload(spec, n, seed=seed, max_model_len=MAX_LEN, traces_dir=TRACES)
    return make_workload(spec, n, seed=seed, rate=1.0, max_model_len=MAX_LEN)


def workload(name: str, n: int, num_instances: int, args: argparse.Namespace) -> Workload:
    w = base_workload(name, n, args.seed, args.prefix_spec)
    if name != "mooncake":
        return w.retimed(args.rate_per_instance * num_instances)
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


# ------------------------------------------------------------------------------ goodput
def zero_load_slo(w: Workload, scale: float) -> tuple[SLO, float, float]:
    """``scale`` × the workload's zero-load latency on one instance of the deployment (module
    docstring): mean cold prefill of a prompt alone (TTFT), mean decode step of a request
    alone at half its output (TPOT). Returns the SLO and the two zero-load means."""
    lat = FittedProfile.load(resolve_profile(PROFILE), "opt-13b", 1)
    ttft0 = float(np.mean([lat.prefill_time([r.prompt_len]) for r in w.requests]))
    tpot0 = float(np.mean([lat.decode_time([r.prompt_len + r.output_len // 2])
                           for r in w.requests]))
    return SLO(scale * ttft0, scale * tpot0), ttft0, tpot0


def goodput_case(case: tuple[str, int, str, int, float, float, int, int]) -> dict[str, Any]:
    """Per-GPU goodput of one router on one workload at one size (a picklable job)."""
    wname, n_inst, router, per_inst, scale, precision, max_probes, seed = case
    base = base_workload(wname, per_inst * n_inst, seed)
    slo, ttft0, tpot0 = zero_load_slo(base, scale)
    start = WORKLOADS[wname][1] * n_inst
    t0 = time.perf_counter()

    def at_rate(rate: float) -> AttainmentResult:
        w = base.retimed(rate, "poisson")
        res = build_deployment(n_inst, router).run(to_sim_requests(w.requests, VOCAB))
        a = attainment(to_records(w.requests, res), slo)
        return AttainmentResult(rate, a, a >= TARGET)

    g = search_goodput(at_rate, hi=start, precision=precision * start, max_probes=max_probes,
                       num_gpus=n_inst)
    return {"workload": wname, "instances": n_inst, "router": router,
            "per_gpu_goodput": g.per_gpu_goodput_rps, "goodput": g.goodput_rps,
            "converged": g.converged, "bracket": [g.lo, g.hi],
            "probes": [(p.rate, round(p.attainment, 3)) for p in g.probes],
            "slo_ttft": slo.ttft, "slo_tpot": slo.tpot, "ttft0": ttft0, "tpot0": tpot0,
            "requests": per_inst * n_inst, "wall_s": time.perf_counter() - t0}


def run_goodput(a: argparse.Namespace) -> None:
    cases = [(w, int(n), r, a.requests_per_instance, a.slo_scale, a.precision, a.max_probes,
              a.seed) for w in a.workloads.split(",") for n in a.instances.split(",")
             for r in a.routers.split(",")]
    with ProcessPoolExecutor(a.jobs) as ex:
        rows = []
        for row in ex.map(goodput_case, cases):
            rows.append(row)
            print(f"<!-- {row['workload']} {row['instances']} {row['router']}: "
                  f"{row['per_gpu_goodput']:.3f} req/s/GPU, probes {row['probes']}, "
                  f"{row['wall_s']:.0f} s -->", file=sys.stderr, flush=True)
    routers = list(dict.fromkeys(r["router"] for r in rows))
    for wname in dict.fromkeys(r["workload"] for r in rows):
        sel = [r for r in rows if r["workload"] == wname]
        print(f"\n{wname}: SLO TTFT {sel[0]['slo_ttft']:.3f} s, TPOT {sel[0]['slo_tpot'] * 1e3:.1f}"
              f" ms ({a.slo_scale:g} × zero-load {sel[0]['ttft0']:.3f} s / "
              f"{sel[0]['tpot0'] * 1e3:.1f} ms); per-GPU goodput (req/s/GPU), {TARGET:.0%} "
              "attainment\n")
        print("| instances | " + " | ".join(routers) + " | preble / round_robin |")
        print("|---|" + "---:|" * (len(routers) + 1))
        for n in dict.fromkeys(r["instances"] for r in sel):
            g = {r["router"]: r for r in sel if r["instances"] == n}
            cells = [f"{g[x]['per_gpu_goodput']:.2f}" + ("" if g[x]["converged"] else "*")
                     if x in g else "–" for x in routers]
            ratio = (f"{g['preble']['per_gpu_goodput'] / g['round_robin']['per_gpu_goodput']:.2f}×"
                     if "preble" in g and "round_robin" in g
                     and g["round_robin"]["per_gpu_goodput"] > 0 else "n/a")
            print(f"| {n} | " + " | ".join(cells) + f" | {ratio} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.plot:
        path = plot_goodput(rows, os.path.join(a.plot, "prefix_routing_goodput.png"),
                            a.slo_scale)
        print(f"wrote {path}", file=sys.stderr)


def plot_goodput(rows: list[dict[str, Any]], path: str, slo_scale: float) -> Any:
    """One panel per workload: per-GPU goodput of each router at each size."""
    pivot: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        pivot.setdefault((r["instances"], r["router"]), {
            "instances": r["instances"], "router": r["router"]})[r["workload"]] = \
            r["per_gpu_goodput"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    return plot_grouped_bars(
        list(pivot.values()), "instances", "router",
        [(w, f"{w}: per-GPU goodput (req/s)") for w in workloads], path,
        f"Per-GPU goodput ({TARGET:.0%} attain {slo_scale:g}× zero-load TTFT and TPOT), "
        "simulated OPT-13B on A100")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="2,4,8")
    ap.add_argument("--workloads", help=f"of {', '.join(WORKLOADS)} (default: prefix,mooncake;"
                    " with --goodput prefix,agent,mooncake)")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--prefix-spec", default="prefix:num_prefixes=64,shared_len=1536,"
                                             "unique_len=256,output_len=64")
    ap.add_argument("--rate-per-instance", type=float, default=3.0)
    ap.add_argument("--mooncake-speedup", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=float, help="E2's window H in seconds (default 180)")
    ap.add_argument("--plot", metavar="DIR", help="write prefix_routing_<workload>.png here")
    ap.add_argument("--goodput", action="store_true",
                    help="per-GPU goodput per router instead of the latency table")
    ap.add_argument("--requests-per-instance", type=int, default=100,
                    help="--goodput: requests per probe = this × instances")
    ap.add_argument("--slo-scale", type=float, default=5.0,
                    help="--goodput: SLOs = this × the workload's zero-load TTFT and TPOT")
    ap.add_argument("--precision", type=float, default=0.05,
                    help="--goodput: bracket width, a share of the starting rate")
    ap.add_argument("--max-probes", type=int, default=7)
    ap.add_argument("--jobs", type=int, default=1, help="--goodput: searches in parallel")
    ap.add_argument("--json", metavar="FILE", help="--goodput: write every search here")
    a = ap.parse_args(argv)
    if a.window is not None and a.window <= 0:
        ap.error(f"--window must be > 0 seconds, got {a.window}")
    a.workloads = a.workloads or ("prefix,agent,mooncake" if a.goodput else "prefix,mooncake")
    for name in a.workloads.split(","):
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if a.goodput:
        if a.routers == ",".join(ROUTERS):
            a.routers = ",".join(r for r in ROUTERS if r != "preble+local")
        return run_goodput(a)
    rows: list[dict[str, Any]] = []
    print("| workload | instances | router | mean lat (s) | P99 lat (s) | mean TTFT (s) | "
          "P99 TTFT (s) | cache hit | imbalance | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for wname in a.workloads.split(","):
        for n_inst in (int(x) for x in a.instances.split(",")):
            w = workload(wname, a.num_requests, n_inst, a)
            for router in a.routers.split(","):
                sim = build_deployment(n_inst, router, a.window)
                t0 = time.perf_counter()
                res = sim.run(to_sim_requests(w.requests, VOCAB))
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
