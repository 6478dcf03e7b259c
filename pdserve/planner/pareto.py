"""Throughput per GPU against speed per user, as aiconfigurator draws its Pareto front: one point
per placement the plan simulated whole, at its goodput.

A point's ``tok_s_gpu`` is the output tokens per second per GPU the placement serves at its
goodput (goodput × the workload's mean output length / GPUs, the plan table's column);
``tok_s_user`` is ``1 / mean TPOT`` of the judged requests (those after the warm-up, the
steady-state rule of :mod:`pdserve.bench.steady`) in one full simulation at that rate, on the
plan's workload, seed, latency source and serving path. A point is on the front when no other
point is at least as good on both axes and better on one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pdserve.bench.steady import SteadyState
from pdserve.planner.problem import Problem, base_workload, model_config
from pdserve.planner.units import _sim, probe_requests, probe_warmup
from pdserve.sim.simulator import gc_paused
from pdserve.sim.target import build_simulator, to_records, to_sim_requests

log = logging.getLogger(__name__)


def measure_point(args: tuple[Problem, str, str, dict[str, Any], float, int]
                  ) -> dict[str, Any]:
    """One placement ``(problem, name, strategy, deployment, goodput, GPUs)`` simulated in full
    at its goodput: its point (module docstring)."""

    p, name, strategy, dep, rate, gpus = args
    reqs = base_workload(p, probe_requests(p, rate)).retimed(rate).requests
    built = build_simulator(_sim(p, dep))
    with gc_paused():
        result = built.simulator.run(to_sim_requests(reqs, model_config(p.model).vocab_size))
    recs = sorted(to_records(reqs, result, p.request_overhead_ms / 1000),
                  key=lambda r: r.timeline.arrival or 0.0)
    judged = recs[SteadyState.first_judged(len(recs), probe_warmup(p, rate)):]
    tpots = [r.tpot for r in judged if r.ok and r.tpot is not None]
    w = base_workload(p)
    mean_out = sum(r.output_len for r in w.requests) / len(w.requests)  # (the plan table's)
    tpot = sum(tpots) / len(tpots) if tpots else None
    log.debug("pareto point %s at %.3f req/s: mean TPOT %s", name, rate, tpot)
    return {"name": name, "strategy": strategy, "num_gpus": gpus, "rate_rps": rate,
            "tok_s_gpu": rate * mean_out / gpus, "mean_tpot_s": tpot,
            "tok_s_user": 1 / tpot if tpot else None, "judged": len(judged)}


def on_front(points: Sequence[dict[str, Any]]) -> list[bool]:
    """Whether each point is on the Pareto front of (``tok_s_user``, ``tok_s_gpu``), both to
    maximise; a point without a TPOT is not."""
    def dominated(a: dict[str, Any]) -> bool:
        return any(b is not a and b["tok_s_user"] is not None
                   and b["tok_s_user"] >= a["tok_s_user"] and b["tok_s_gpu"] >= a["tok_s_gpu"]
                   and (b["tok_s_user"] > a["tok_s_user"] or b["tok_s_gpu"] > a["tok_s_gpu"])
                   for b in points)
    return [a["tok_s_user"] is not None and not dominated(a) for a in points]


def pareto_points(plan: Any, workers: int = 1) -> list[dict[str, Any]]:
    """The point of every placement of ``plan`` simulated whole (the chosen one first), each
    marked ``on_front``."""
    p = plan.problem
    pls = [pl for pl in [plan.best, *plan.alternatives] if pl.simulated and pl.goodput_rps > 0]
    jobs = [(p, pl.name, pl.strategy, pl.deployment, pl.goodput_rps, pl.num_gpus) for pl in pls]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as ex:
            points = list(ex.map(measure_point, jobs))
    else:
        points = [measure_point(j) for j in jobs]
    for pt, front in zip(points, on_front(points)):
        pt["on_front"] = front
    return points


def plot_pareto(plan: Any, points: Sequence[dict[str, Any]], folder: Path) -> Path:
    """``pareto.png``: every point coloured by strategy, the front joined, the chosen one
    ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    palette = {"colocated": "tab:blue", "disaggregated": "tab:orange", "partial": "tab:green"}
    fig, ax = plt.subplots(figsize=(7.5, 5))
    shown = [pt for pt in points if pt["tok_s_user"] is not None]
    for strat, color in palette.items():
        mine = [pt for pt in shown if pt["strategy"] == strat]
        if mine:
            ax.scatter([pt["tok_s_user"] for pt in mine], [pt["tok_s_gpu"] for pt in mine],
                       color=color, label=strat, zorder=3)
    front = sorted((pt for pt in shown if pt.get("on_front")), key=lambda pt: pt["tok_s_user"])
    if front:
        ax.plot([pt["tok_s_user"] for pt in front], [pt["tok_s_gpu"] for pt in front], "k--",
                lw=1, label="Pareto front", zorder=2)
        for pt in front:
            ax.annotate(pt["name"], (pt["tok_s_user"], pt["tok_s_gpu"]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
    best = next((pt for pt in shown if pt["name"] == plan.best.name), None)
    if best is not None:
        ax.scatter([best["tok_s_user"]], [best["tok_s_gpu"]], s=160, facecolors="none",
                   edgecolors="k", label="chosen", zorder=4)
    p = plan.problem
    ax.set_xlabel("tokens/s/user (1 / mean TPOT at the placement's goodput)")
    ax.set_ylabel("tokens/s/GPU (output, at its goodput)")
    ax.set_title(f"{p.model} · {p.workload} · {p.nodes}x{p.gpus_per_node} GPUs")
    ax.margins(0.15)  # room for the labels
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = folder / "pareto.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
