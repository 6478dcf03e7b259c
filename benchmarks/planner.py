"""Placement planner benchmarks (DistServe §4, §6.5, Appendix B Table 3).

    python benchmarks/planner.py timing    [--output-json out/plan_timing.json]
    python benchmarks/planner.py scaling   [--plot out/plan_scaling.png]   # §6.5 Fig. 12
    python benchmarks/planner.py replan    [--plot out/replan.png]         # §4.3 replanning
    python benchmarks/planner.py table3    [--only "opt-66b code"]         # Appendix B Table 3

``timing`` plans OPT-13B on 1 node x 4 A100 and OPT-66B on 4 nodes x 8 A100 (high and low node
affinity) with DistServe's A100 profiles and Table 1 chatbot SLOs, and reports each plan's wall
and CPU time (this process and its workers) and the chosen TP/PP per phase (Table 3).
``scaling`` plans OPT-13B on growing clusters and plots planning time against GPUs.
``replan`` runs a trace whose pattern changes mid-run (Azure code, then Azure conversation) on
the plan for the first pattern, with and without replanning when the monitor detects the shift,
and plots attainment over time. Every plan is pdserve's own (``pdserve.planner.search.plan``),
the same code ``pdserve plan`` runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import SLO
from pdserve.planner.problem import STRATEGIES, Problem
from pdserve.planner.search import Plan, plan

PROFILE = "distserve_profiler-a100-80g.distserve"
SLO_13B = SLO(0.25, 0.1)  # DistServe Table 1, chatbot OPT-13B
SLO_66B = SLO(2.5, 0.15)  # chatbot OPT-66B


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed_plan(p: Problem, workers: int = 2, strategies: tuple[str, ...] = STRATEGIES,
               prune: bool = True, early_stop: bool = True) -> tuple[Plan, float, float]:
    from pdserve.planner import problem, units

    units.unit_model.cache_clear()
    problem.clear_workloads()
    c0, t0 = _cpu(), time.perf_counter()
    res = plan(p, workers, strategies=strategies, prune=prune, early_stop=early_stop)
    return res, time.perf_counter() - t0, _cpu() - c0


def _phase(res: Plan, kind: str) -> dict[str, Any] | None:
    units = [u for u in res.units if u.unit.kind == kind and u.goodput_rps > 0]
    if not units:
        return None
    b = max(units, key=lambda u: u.per_gpu_rps)
    return {"tp": b.unit.tp, "pp": b.unit.pp, "per_gpu_rps": b.per_gpu_rps}


def summary(name: str, res: Plan, wall: float, cpu: float) -> dict[str, Any]:
    import os

    d = {"case": name, "wall_s": wall, "cpu_s": cpu, "load_avg_1min": os.getloadavg()[0],
         "best": res.best.name,
         "best_per_gpu": res.best.per_gpu_rps,
         "best_colocated": res.best_colocated.name if res.best_colocated else None,
         "best_colocated_per_gpu": res.best_colocated.per_gpu_rps if res.best_colocated else None,
         "best_disaggregated": res.best_disaggregated.name if res.best_disaggregated else None,
         "best_disaggregated_per_gpu": (res.best_disaggregated.per_gpu_rps
                                        if res.best_disaggregated else None),
         "best_prefill_unit": _phase(res, "prefill"), "best_decode_unit": _phase(res, "decode"),
         "best_partial": res.best_partial.name if res.best_partial else None,
         "best_partial_per_gpu": res.best_partial.per_gpu_rps if res.best_partial else None,
         "units_simulated": sum(1 for u in res.units if u.probes and not u.stopped),
         "units_stopped": sum(1 for u in res.units if u.stopped),
         "units_pruned": sum(1 for u in res.units if u.pruned),
         "probes": sum(len(u.probes) for u in res.units),
         "simulated_requests": sum(q.get("num_requests", 0) for u in res.units
                                   for q in u.probes),
         "units": {u.unit.label: (round(u.per_gpu_rps, 6) if u.goodput_rps > 0 else
                                  "stopped" if u.stopped else "pruned" if u.pruned else 0.0)
                   for u in res.units}}
    print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU (load {d['load_avg_1min']:.1f}); "
          f"{d['units_simulated']} units searched, {d['units_stopped']} stopped early, "
          f"{d['units_pruned']} pruned, {d['probes']} probes; best {d['best']} "
          f"({d['best_per_gpu']:.3f}/GPU); prefill {d['best_prefill_unit']}, decode "
          f"{d['best_decode_unit']}", flush=True)
    return d


def cmd_timing(args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = [
        ("opt-13b 1x4 high", Problem(model="opt-13b", profile=PROFILE, slo=SLO_13B, rate=4.0,
                                     nodes=1, gpus_per_node=4, num_requests=args.num_requests)),
        ("opt-66b 4x8 high", Problem(model="opt-66b", profile=PROFILE, slo=SLO_66B, rate=4.0,
                                     nodes=4, gpus_per_node=8, num_requests=args.num_requests)),
        ("opt-66b 4x8 low", Problem(model="opt-66b", profile=PROFILE, slo=SLO_66B, rate=4.0,
                                    nodes=4, gpus_per_node=8, affinity="low",
                                    num_requests=args.num_requests)),
    ]
    return [summary(n, *timed_plan(replace(p, early_probes=not args.no_early_probes,
                                           joint=not args.no_joint),
                                   args.workers, _strats(args), not args.exhaustive,
                                   not args.no_early_stop))
            for n, p in cases if not args.only or args.only in n]


def _strats(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(x for x in args.strategies.split(",") if x)


# DistServe Appendix B Table 3: (model, workload, Table 1 SLO, paper's prefill TP/PP, decode)
TABLE3 = [("opt-13b", "distserve-chatbot", SLO_13B, (2, 1), (1, 1)),
          ("opt-66b", "distserve-chatbot", SLO_66B, (4, 1), (2, 2)),
          ("opt-66b", "summarization", SLO(15.0, 0.15), (4, 1), (2, 2)),
          ("opt-66b", "code", SLO(0.125, 0.2), (4, 1), (2, 2))]


def cmd_table3(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pdserve.planner import problem, units

    """Every prefill and decode unit searched to convergence (no pruning, no early stop) on
    one node of 8 A100 (Alg. 1's per-phase search; KV over NVLink): each phase's ranking by
    per-GPU goodput, and where the paper's choice stands in it."""
    out = []
    for model, workload, slo, pre, dec in TABLE3:
        name = f"{model} {workload}"
        if args.only and args.only not in name:
            continue
        p = Problem(model=model, profile=PROFILE, workload=workload, slo=slo, rate=4.0,
                    nodes=1, gpus_per_node=8, num_requests=args.num_requests)
        # the units alone (what `plan --exhaustive` searches first): the rankings do not need
        # a placement, and a workload whose best pair needs more than one node would make
        # plan() refuse the cluster before the rankings are out
        p = replace(p, early_probes=not args.no_early_probes)
        units.unit_model.cache_clear()
        problem.clear_workloads()
        c0, t0 = _cpu(), time.perf_counter()
        with units.UnitCache(p, args.workers) as cache:
            results = cache.get(units.candidate_units(p, ("disaggregated",)))
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        row: dict[str, Any] = {"case": name, "wall_s": wall, "cpu_s": cpu,
                               "paper_prefill": pre, "paper_decode": dec}
        for kind, paper in (("prefill", pre), ("decode", dec)):
            units = sorted((u for u in results if u.unit.kind == kind),
                           key=lambda u: -u.per_gpu_rps)
            best = units[0].per_gpu_rps if units else 0.0
            ranking = [{"tp": u.unit.tp, "pp": u.unit.pp, "per_gpu_rps": u.per_gpu_rps,
                        "goodput_rps": u.goodput_rps, "pruned": u.pruned} for u in units]
            mine = next((r for r in ranking if (r["tp"], r["pp"]) == paper), None)
            row[kind] = {"ranking": ranking, "ours": (units[0].unit.tp, units[0].unit.pp),
                         "paper_per_gpu": mine["per_gpu_rps"] if mine else None,
                         "paper_vs_ours": (mine["per_gpu_rps"] / best if mine and best
                                           else None)}
            print(f"{name} {kind}: ours TP{units[0].unit.tp} PP{units[0].unit.pp} "
                  f"{best:.3f}/GPU; paper TP{paper[0]} PP{paper[1]} "
                  f"{row[kind]['paper_per_gpu']} ({row[kind]['paper_vs_ours']}); "
                  + ", ".join(f"TP{r['tp']}PP{r['pp']}={r['per_gpu_rps']:.3f}"
                              + (" (pruned)" if r["pruned"] else "") for r in ranking),
                  flush=True)
        out.append(row)
    return out


def cmd_scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    slo = SLO_13B if args.model == "opt-13b" else SLO_66B
    sizes = ((1, 4), (1, 8), (2, 8), (4, 8)) if args.model == "opt-66b" else \
        ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8))
    for nodes, m in sizes:
        if args.only and args.only not in f"{nodes}x{m}":
            continue
        p = Problem(model=args.model, profile=PROFILE, slo=slo, rate=args.scaling_rate,
                    nodes=nodes, gpus_per_node=m, num_requests=args.num_requests)
        d = summary(f"{args.model} {nodes}x{m}", *timed_plan(p, args.workers, _strats(args),
                                                                not args.exhaustive))
        out.append({**d, "gpus": nodes * m})
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([d["gpus"] for d in out], [d["wall_s"] for d in out], "o-", label="wall")
        ax.plot([d["gpus"] for d in out], [d["cpu_s"] for d in out], "s--", label="CPU")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs in the cluster")
        ax.set_ylabel("planning time (s)")
        ax.set_title(f"pdserve plan, {args.model} chatbot (2 workers)")
        ax.legend()
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return out


def cmd_replan(args: argparse.Namespace) -> dict[str, Any]:
    """Azure code then Azure conversation on OPT-13B (1 node x 8, TP and PP up to 2): the plan
    for code serves the whole trace, or the monitor detects the shift and the plan for the
    recent window takes over ``--reload-s`` later (the old deployment drains what it
    accepted)."""
    from pdserve.bench.workloads import make_workload
    from pdserve.planner.replan import (
        ShiftDetector,
        attainment_over_time,
        detect,
        simulate_replanning,
    )
    from pdserve.planner.search import deployment_file
    from pdserve.sim.target import SimulationConfig

    rate, n = args.rate, args.num_requests
    base = Problem(model="opt-13b", profile=PROFILE, slo=SLO(1.0, 0.1), rate=rate, nodes=1,
                   gpus_per_node=8, num_requests=args.plan_requests, max_tp=2, max_pp=2)
    code = make_workload("azure-code", n, seed=0, rate=rate, arrival="poisson",
                         max_model_len=2048, prompt_mode="ids", vocab_size=50272)
    conv = make_workload("azure-conv", n, seed=0, rate=rate, arrival="poisson",
                         max_model_len=2048, prompt_mode="ids", vocab_size=50272)
    shift_t = code.requests[-1].arrival_time
    reqs = list(code.requests) + [replace(r, request_id=f"conv-{r.request_id}",
                                          arrival_time=shift_t + r.arrival_time)
                                  for r in conv.requests]
    shifts = detect(reqs, ShiftDetector(args.window_s))
    plan_a = plan(replace(base, workload="azure-code"), args.workers)
    # re-run on the recent window: its pattern (conversation) at its observed rate (§4.3)
    seen = shifts[0].after.rate if shifts else rate
    plan_b = plan(replace(base, workload="azure-conv", rate=seen), args.workers)
    sim_a = SimulationConfig.from_dict(deployment_file(plan_a))
    sim_b = SimulationConfig.from_dict(deployment_file(plan_b))
    switch = shifts[0].time + args.reload_s if shifts else None
    without = simulate_replanning(reqs, sim_a, None, None, 50272)
    with_ = simulate_replanning(reqs, sim_a, sim_b, switch, 50272)
    bins = {k: attainment_over_time(reqs, r, base.slo, args.bin_s)
            for k, r in (("without replanning", without), ("with replanning", with_))}
    out = {"pattern_change_s": shift_t, "detected_s": shifts[0].time if shifts else None,
           "reasons": shifts[0].reasons if shifts else None, "switch_s": switch,
           "plan_code": plan_a.best.name, "plan_conv": plan_b.best.name,
           "gpus_code": plan_a.best.num_gpus, "gpus_conv": plan_b.best.num_gpus,
           "bins": bins}
    print(json.dumps({k: v for k, v in out.items() if k != "bins"}, indent=1, default=str))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for k, b in bins.items():
            ax.plot([x[0] for x in b], [x[1] for x in b], "o-", label=k)
        ax.axvline(shift_t, color="gray", ls=":", label="code -> conversation")
        if switch is not None:
            ax.axvline(switch, color="tab:green", ls="--", label="new placement")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("SLO attainment")
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("timing", "scaling", "replan", "table3"))
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--plan-requests", type=int, default=200, help="replan: per probe")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", help="timing: run the cases whose name contains this")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="timing/scaling: strategies searched (default all three)")
    ap.add_argument("--exhaustive", action="store_true",
                    help="timing/scaling: no pruning, no early stop (full rankings)")
    ap.add_argument("--model", default="opt-66b", help="scaling: opt-13b or opt-66b")
    ap.add_argument("--scaling-rate", type=float, default=1.0,
                    help="scaling: req/s to serve (units do not depend on it; 1 fits 1x4)")
    ap.add_argument("--no-early-stop", action="store_true",
                    help="timing: dominance pruning only (the search before early stops)")
    ap.add_argument("--no-joint", action="store_true",
                    help="timing: rank by unit estimates (pdserve plan --no-joint)")
    ap.add_argument("--no-early-probes", action="store_true",
                    help="timing/table3: simulate every probe to the end (no exact early "
                         "verdict, Problem.early_probes)")
    ap.add_argument("--rate", type=float, default=2.0, help="replan: req/s")
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--reload-s", type=float, default=30.0)
    ap.add_argument("--bin-s", type=float, default=30.0)
    ap.add_argument("--output-json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    out = {"timing": cmd_timing, "scaling": cmd_scaling, "replan": cmd_replan,
           "table3": cmd_table3}[args.what](args)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
