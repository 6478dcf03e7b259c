"""Prompt-sharing-aware routing in simulation: ``prefix_aware`` and Preble's E2 as written
(``preble-paper``) against round robin, shortest queue, SGLang's cache-aware router and Dynamo's
KV-overlap cost (issue 27's evaluation).

Deployment: N colocated Llama-3.1-8B instances (TP 1, chunked prefill, block size 16, KV pools
from device memory, ``max_model_len`` 32,768), each on an A100-80GB or an H100 priced by the
analytic roofline (``--hardware``'s catalogue entries); N = 2, 4, 8. Workloads
(``WORKLOADS``):

* ``mooncake`` — the Mooncake (Kimi) conversation trace, its 512-token ``hash_ids`` blocks shared
  exactly, prompts clipped to 32 k tokens (a clipped prompt is still a prefix of the full one);
  the first requests of the trace, Poisson arrivals at the probed rate (its own timestamps put
  many requests at one instant, which stretching time does not separate);
* ``prefix`` — Zipf 1.1 over 64 shared 1,536-token prefixes + 256 unique tokens, 64 out;
* ``agent`` — 24 long system + tool prompts (1,792 tokens, Zipf 0.8) + a 64-token query,
  40 out (a stand-in for Preble's tool-use / agent workloads);
* ``hot`` — one 1,536-token prefix shared by every prompt (+ 256 unique), 64 out;
* ``noshare`` — 1,792 unique tokens per prompt, 64 out.

For each (GPU, workload, N): every router's **per-GPU goodput** (DESIGN.md: the highest Poisson
rate at which 90 % of requests meet both SLOs; the toolkit's expanding bisection,
:func:`pdserve.bench.goodput.search_goodput`, each probe a fresh simulation of the same
``--goodput-requests`` × N requests retimed to the probed rate), SLOs ``--slo-scale`` (5) × the
workload's zero-load latency on that GPU (mean cold prefill of a prompt alone; mean decode step
of a request alone at half its output), then **latency** (mean / P99 TTFT and end-to-end, the
prefix-cache hit rate) of every router on ``--latency-requests`` × N requests at
``--load`` (0.8) × the best baseline's goodput (the same rate for all routers).

    python benchmarks/prefix_routing.py [--gpus A100,H100] [--workloads ...] [--instances 2,4,8]
        [--jobs 2] [--json out.json] [--plot DIR]

prints one markdown table (a row per case and router) and a verdict per case against the best
baseline; ``--plot DIR`` writes ``prefix_routing_<gpu>.png`` (goodput and P99 E2E per workload).
The simulation is deterministic: a rerun gives the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.goodput import AttainmentResult, search_goodput
from pdserve.bench.metrics import SLO, attainment
from pdserve.bench.report import plot_grouped_bars
from pdserve.bench.workloads import Workload, make_workload
from pdserve.config import ClusterConfig
from pdserve.sim.target import SimulationConfig, build_simulator, to_records, to_sim_requests

MODEL, MAX_LEN, VOCAB = "llama-3.1-8b", 32768, 128256
GPUS = {"A100": "A100-80GB", "H100": "H100"}
BASELINES = ["round_robin", "shortest_queue", "sglang_cache_aware", "kv_overlap"]
ROUTERS = [*BASELINES, "preble-paper", "prefix_aware"]
TARGET = 0.9  # attainment of the goodput search (DESIGN.md)
WORKLOADS = {  # name -> (workload spec, goodput search's starting rate per H100 instance)
    "mooncake": ("mooncake", 0.5),
    "prefix": ("prefix:num_prefixes=64,shared_len=1536,unique_len=256,output_len=64", 10.0),
    "agent": ("prefix:num_prefixes=24,zipf=0.8,shared_len=1792,unique_len=64,output_len=40",
              15.0),
    "hot": ("prefix:num_prefixes=1,shared_len=1536,unique_len=256,output_len=64", 12.0),
    "noshare": ("prefix:num_prefixes=1,shared_len=0,unique_len=1792,output_len=64", 8.0),
}
A100_SPEED = 0.5  # starting rates on an A100: this share of the H100's


def deployment(gpu: str, n: int, router: str) -> Any:
    spec = ClusterConfig.from_dict({"model": MODEL, "num_instances": n, "prefill_router": router,
                                    "engine": {"max_model_len": MAX_LEN}})
    return build_simulator(SimulationConfig(spec, hardware=GPUS[gpu]))


def base_workload(name: str, n: int, seed: int = 0) -> Workload:
    spec = WORKLOADS[name][0]
    # (traces: $PDSERVE_TRACES or the first shared/traces walking up, as make_workload finds)
    return make_workload(spec, n, seed=seed, rate=1.0, max_model_len=MAX_LEN)


def zero_load_slo(gpu: str, w: Workload, scale: float) -> SLO:
    """``scale`` × the zero-load latency on one instance: mean cold prefill of a prompt alone
    (TTFT) and mean decode step of a request alone at half its output (TPOT)."""
    lat = deployment(gpu, 1, "round_robin").simulator.insts["colocated-0"].spec.latency
    ttft0 = float(np.mean([lat.prefill_time([r.prompt_len]) for r in w.requests]))
    tpot0 = float(np.mean([lat.decode_time([r.prompt_len + r.output_len // 2])
                           for r in w.requests]))
    return SLO(scale * ttft0, scale * tpot0)


def run_once(gpu: str, n: int, router: str, w: Workload, rate: float) -> tuple[Any, Any]:
    wr = w.retimed(rate, "poisson")
    built = deployment(gpu, n, router)
    res = built.simulator.run(to_sim_requests(wr.requests, VOCAB))
    return wr, res


def latency(res: Any) -> dict[str, float]:
    recs = [r for r in res.records if r.error is None]
    e2e = np.array([r.timeline.finish - r.timeline.arrival for r in recs])
    ttft = np.array([r.timeline.token_times[0] - r.timeline.arrival for r in recs])
    return {"ttft_mean": float(ttft.mean()), "ttft_p99": float(np.percentile(ttft, 99)),
            "e2e_mean": float(e2e.mean()), "e2e_p99": float(np.percentile(e2e, 99)),
            "hit": sum(r.num_cached_tokens for r in recs) / max(sum(r.prompt_len for r in recs),
                                                                1),
            "failed": len(res.records) - len(recs)}


def run_case(case: tuple[str, str, int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every router's goodput, then latency at ``load`` × the best baseline's goodput."""
    gpu, wname, n, o = case
    t0 = time.perf_counter()
    w = base_workload(wname, o["goodput_requests"] * n, o["seed"])
    slo = zero_load_slo(gpu, w, o["slo_scale"])
    start = WORKLOADS[wname][1] * n * (A100_SPEED if gpu == "A100" else 1.0)
    rows: dict[str, dict[str, Any]] = {
        r["router"]: r for r in o["previous"]
        if (r["gpu"], r["workload"], r["instances"]) == (gpu, wname, n)
        and r["router"] not in o["routers"]}
    for router in o["routers"]:
        def at_rate(rate: float, router: str = router) -> AttainmentResult:
            wr, res = run_once(gpu, n, router, w, rate)
            a = attainment(to_records(wr.requests, res), slo)
            return AttainmentResult(rate, a, a >= TARGET)

        g = search_goodput(at_rate, hi=start, precision=o["precision"] * start,
                           max_probes=o["max_probes"], num_gpus=n)
        rows[router] = {"gpu": gpu, "workload": wname, "instances": n, "router": router,
                        "goodput": g.per_gpu_goodput_rps, "converged": g.converged,
                        "bracket": [None if x is None else x / n for x in (g.lo, g.hi)],
                        "slo_ttft": slo.ttft, "slo_tpot": slo.tpot}
    base = [rows[r]["goodput"] for r in BASELINES if r in rows]
    rate = o["load"] * max(base or [rows[r]["goodput"] for r in rows]) * n
    wl = base_workload(wname, o["latency_requests"] * n, o["seed"] + 1)
    for router in o["routers"]:
        if "rate_per_gpu" in rows.get(router, {}) and rows[router]["rate_per_gpu"] != rate / n:
            raise ValueError(f"{router}: the previous run's latency rate differs")
        _, res = run_once(gpu, n, router, wl, rate) if rate > 0 else (None, None)
        rows[router].update(latency(res) if res is not None else {}, rate_per_gpu=rate / n)
    order = {r: k for k, r in enumerate(ROUTERS)}
    out = sorted(rows.values(), key=lambda r: order.get(r["router"], len(order)))
    print(f"<!-- {gpu} {wname} {n}: {time.perf_counter() - t0:.0f} s -->", file=sys.stderr,
          flush=True)
    return out


def verdict(rows: list[dict[str, Any]]) -> str:
    """prefix_aware against the best baseline of its case: goodput, mean and P99 E2E."""
    by = {r["router"]: r for r in rows}
    ours = by.get("prefix_aware")
    base = [by[b] for b in BASELINES if b in by]
    if ours is None or not base or "e2e_mean" not in ours:
        return "n/a"
    g = max(b["goodput"] for b in base)
    m = min(b["e2e_mean"] for b in base)
    p = min(b["e2e_p99"] for b in base)
    return (f"goodput {ours['goodput'] / g:.2f}×, mean E2E {ours['e2e_mean'] / m:.2f}×, "
            f"P99 E2E {ours['e2e_p99'] / p:.2f}× of the best baseline")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| GPU | workload | N | router | goodput (req/s/GPU) | rate (req/s/GPU) | "
             "mean TTFT (s) | P99 TTFT (s) | mean E2E (s) | P99 E2E (s) | cache hit |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        star = "" if r["converged"] else "*"
        lines.append(
            f"| {r['gpu']} | {r['workload']} | {r['instances']} | {r['router']} | "
            f"{r['goodput']:.2f}{star} | {r.get('rate_per_gpu', 0):.2f} | "
            f"{r.get('ttft_mean', float('nan')):.3f} | {r.get('ttft_p99', float('nan')):.3f} | "
            f"{r.get('e2e_mean', float('nan')):.3f} | {r.get('e2e_p99', float('nan')):.3f} | "
            f"{r.get('hit', 0):.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], gpu: str, path: str) -> str:
    mine = [r for r in rows if r["gpu"] == gpu]
    pivot: dict[tuple[int, str], dict[str, Any]] = {}
    workloads = list(dict.fromkeys(r["workload"] for r in mine))
    for r in mine:
        d = pivot.setdefault((r["instances"], r["router"]),
                             {"instances": r["instances"], "router": r["router"]})
        d[f"{r['workload']}:goodput"] = r["goodput"]
        d[f"{r['workload']}:p99"] = r.get("e2e_p99", float("nan"))
    panels = [(f"{w}:goodput", f"{w}: goodput (req/s/GPU)") for w in workloads] + \
             [(f"{w}:p99", f"{w}: P99 E2E (s)") for w in workloads]
    return plot_grouped_bars(list(pivot.values()), "instances", "router", panels, path,
                             f"Prefix-aware routing, simulated {MODEL} on {GPUS[gpu]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="A100,H100", help=f"of {', '.join(GPUS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--instances", default="2,4,8")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--goodput-requests", type=int, default=60,
                    help="requests per instance in each goodput probe")
    ap.add_argument("--latency-requests", type=int, default=100,
                    help="requests per instance in the latency run")
    ap.add_argument("--load", type=float, default=0.8,
                    help="latency run's rate: this × the best baseline's goodput")
    ap.add_argument("--slo-scale", type=float, default=5.0)
    ap.add_argument("--precision", type=float, default=0.1,
                    help="goodput bracket width, a share of the starting rate")
    ap.add_argument("--max-probes", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="cases in parallel")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--previous", metavar="FILE", action="append", default=[],
                    help="rows of an earlier run (--json) with the same settings: the routers "
                         "not in --routers are taken from it, not simulated again (the "
                         "simulation is deterministic)")
    ap.add_argument("--plot", metavar="DIR")
    a = ap.parse_args(argv)
    for name, known, what in ((a.gpus, GPUS, "GPU"), (a.workloads, WORKLOADS, "workload")):
        for x in name.split(","):
            if x not in known:
                ap.error(f"unknown {what} {x!r}; choose from {', '.join(known)}")
    for x in a.routers.split(","):
        if x not in ROUTERS:
            ap.error(f"unknown router {x!r}; choose from {', '.join(ROUTERS)}")
    if not 0 < a.load <= 1.5:
        ap.error(f"--load must be in (0, 1.5], got {a.load}")
    opts = {"routers": a.routers.split(","), "goodput_requests": a.goodput_requests,
            "latency_requests": a.latency_requests, "load": a.load, "slo_scale": a.slo_scale,
            "precision": a.precision, "max_probes": a.max_probes, "seed": a.seed,
            "previous": [r for f in a.previous for r in json.loads(Path(f).read_text())]}
    cases = [(g, w, int(n), opts) for g in a.gpus.split(",") for w in a.workloads.split(",")
             for n in a.instances.split(",")]
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for case, out in zip(cases, ex.map(run_case, cases)):
            rows += out
            print(f"<!-- {case[0]} {case[1]} {case[2]}: {verdict(out)} -->", file=sys.stderr,
                  flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(table(rows))
    print()
    for g, w, n, _ in cases:
        sel = [r for r in rows if (r["gpu"], r["workload"], r["instances"]) == (g, w, n)]
        print(f"- {g} {w} N={n}: {verdict(sel)}")
    if a.plot:
        os.makedirs(a.plot, exist_ok=True)
        for g in a.gpus.split(","):
            print(f"wrote {plot(rows, g, os.path.join(a.plot, f'prefix_routing_{g}.png'))}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
