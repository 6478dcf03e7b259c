"""Strategy advisor: where does disaggregation pay? (DistServe §3, §6.2 "SLO scale".)

For each SLO scale (both objectives multiplied) and each output-length scale (the workload's
output/input ratio), :func:`advise` plans colocated (NoDG), disaggregated (FuDG, DistServe) and
partially disaggregated (PaDG, EcoServe §4.2) placements in one
:func:`pdserve.planner.search.plan` and keeps the best per-GPU goodput of each strategy.
Disaggregation pays where its best beats colocation's: typically tight TTFT with long outputs
(prefill–decode interference hurts colocation most), while loose SLOs and short outputs favour
colocated batching; PaDG needs no KV link between instances, so it gains where that link is
slow.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.planner.problem import STRATEGIES, Problem
from pdserve.planner.search import plan
from pdserve.planner.units import UnitResult


@dataclass
class AdvicePoint:
    """The best per-GPU goodput of each strategy at one (SLO scale, output scale); 0 and a
    name starting ``none`` where no placement of that strategy meets the SLO (or it was not
    searched)."""

    slo_scale: float
    output_scale: float
    colocated_per_gpu: float
    disaggregated_per_gpu: float
    colocated: str
    disaggregated: str
    partial_per_gpu: float = 0.0
    partial: str = "none (not searched)"

    @property
    def ratio(self) -> float | None:
        """Best disaggregated over best colocated per-GPU goodput."""
        if self.colocated_per_gpu <= 0:
            return None if self.disaggregated_per_gpu <= 0 else float("inf")
        return self.disaggregated_per_gpu / self.colocated_per_gpu

    @property
    def winner(self) -> str:
        """The strategy with the highest per-GPU goodput (ties: the simpler one — colocated,
        then disaggregated — wins)."""
        vals = {"colocated": self.colocated_per_gpu,
                "disaggregated": self.disaggregated_per_gpu, "partial": self.partial_per_gpu}
        best = max(vals, key=lambda k: (vals[k], -STRATEGIES.index(k)))
        return "neither" if vals[best] <= 0 else best

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ratio": self.ratio, "winner": self.winner}


def advise_point(p: Problem, strategies: Sequence[str] = STRATEGIES,
                 workers: int | None = None,
                 on_unit: Callable[[UnitResult], None] | None = None,
                 on_stage: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One plan over ``strategies``: the best per-GPU goodput and placement of each."""
    out: dict[str, Any] = {}
    try:
        res = plan(p, workers, on_unit, tuple(strategies), on_stage=on_stage)
    except ValueError as e:  # nothing meets the SLO at this point
        for s in STRATEGIES:
            out[f"{s}_per_gpu"], out[s] = 0.0, f"none ({str(e)[:80]})"
        return out
    for s in STRATEGIES:
        b = res.best_of(s) if s in strategies else None
        out[f"{s}_per_gpu"] = b.per_gpu_rps if b else 0.0
        out[s] = b.name if b else ("none (not searched)" if s not in strategies else
                                   "none (none meets the SLO at this rate within the "
                                   "cluster)")
    return out


def advise(base: Problem, slo_scales: Sequence[float], output_scales: Sequence[float],
           workers: int | None = None,
           on_unit: Callable[[UnitResult], None] | None = None,
           strategies: Sequence[str] = STRATEGIES,
           on_cell: Callable[[float, float, AdvicePoint | None], None] | None = None,
           cells_at_once: int | None = None,
           on_stage: Callable[[str], None] | None = None) -> list[AdvicePoint]:
    """One :func:`advise_point` per (output scale, SLO scale), in that order; ``on_cell(
    slo_scale, output_scale, None)`` before each cell and ``on_cell(..., point)`` after it;
    ``on_stage`` hears each cell's whole-placement simulations and confirmations, prefixed
    with the cell (callbacks are serialised).

    Cells are independent plans. With ``workers`` > 1, ``cells_at_once`` of them (default:
    the cores over ``workers``, plus one) run side by side, each on its own process pool of
    ``workers``: one cell's plan leaves cores idle while its last units or whole-placement
    simulations run, and the next cell fills them. The grid does not depend on it (a plan's
    results do not depend on its workers, :meth:`UnitCache.get_bounded`)."""
    cells = [(k, f) for f in output_scales for k in slo_scales]
    workers = workers or min(2, os.cpu_count() or 1)
    if cells_at_once is None:
        cells_at_once = 1 if workers == 1 else (os.cpu_count() or 1) // workers + 1
    lock = threading.Lock()

    def unit_done(r: UnitResult) -> None:
        if on_unit is not None:
            with lock:
                on_unit(r)

    def one(cell: tuple[float, float]) -> AdvicePoint:
        k, f = cell
        if on_cell is not None:
            with lock:
                on_cell(k, f, None)

        def stage(text: str) -> None:
            if on_stage is not None:
                with lock:
                    on_stage(f"SLO x{k:g}, output x{f:g}: {text}")

        p = replace(base, slo=base.slo.scaled(k), output_scale=f)
        point = AdvicePoint(k, f, **advise_point(p, strategies, workers, unit_done, stage))
        if on_cell is not None:
            with lock:
                on_cell(k, f, point)
        return point

    if min(cells_at_once, len(cells)) <= 1:
        return [one(c) for c in cells]
    with ThreadPoolExecutor(min(cells_at_once, len(cells))) as pool:
        return list(pool.map(one, cells))


def advise_markdown(base: Problem, grid: Sequence[AdvicePoint]) -> str:
    lines = [f"## pdserve advise: {base.model} · {base.workload} · SLO TTFT {base.slo.ttft:g} s "
             f"/ TPOT {base.slo.tpot:g} s (x scale) · {base.nodes}x{base.gpus_per_node} GPUs",
             "", f"latency source {base.latency_source()}; {base.objective()}",
             "", "| output scale | SLO scale | best colocated (per GPU) | best disaggregated "
             "(per GPU) | best partial (per GPU) | disagg / colo | winner |",
             "|---|---|---|---|---|---|---|"]
    for g in grid:
        r = g.ratio
        lines.append(f"| {g.output_scale:g} | {g.slo_scale:g} | {g.colocated_per_gpu:.3f} "
                     f"({g.colocated}) | {g.disaggregated_per_gpu:.3f} ({g.disaggregated}) | "
                     f"{g.partial_per_gpu:.3f} ({g.partial}) | "
                     f"{'–' if r is None else f'{r:.2f}x'} | {g.winner} |")
    return "\n".join(lines)


def plot_advice(base: Problem, grid: Sequence[AdvicePoint], folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    outs = sorted({g.output_scale for g in grid})
    fig, axes = plt.subplots(1, len(outs), figsize=(4.2 * len(outs), 3.6), squeeze=False,
                             sharey=True)
    for ax, f in zip(axes[0], outs):
        pts = sorted((g for g in grid if g.output_scale == f), key=lambda g: g.slo_scale)
        xs = [g.slo_scale for g in pts]
        c = [g.colocated_per_gpu for g in pts]
        d = [g.disaggregated_per_gpu for g in pts]
        q = [g.partial_per_gpu for g in pts]
        ax.plot(xs, c, "o-", color="tab:blue", label="best colocated")
        ax.plot(xs, d, "s-", color="tab:orange", label="best disaggregated")
        if any(v > 0 for v in q):
            ax.plot(xs, q, "^-", color="tab:green", label="best partial (PaDG)")
        ax.fill_between(xs, c, d, where=[b > a for a, b in zip(c, d)], alpha=0.2,
                        color="tab:orange", label="disaggregation pays")
        ax.set_xscale("log")
        ax.set_xlabel("SLO scale")
        ax.set_title(f"output length x{f:g}")
    axes[0][0].set_ylabel("per-GPU goodput (req/s)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{base.model} · {base.workload}")
    fig.tight_layout()
    path = folder / "advise.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
