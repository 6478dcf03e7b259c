"""Strategy advisor: where does disaggregation pay? (DistServe §3, §6.2 "SLO scale".)

For each SLO scale (both objectives multiplied) and each output-length scale (the workload's
output/input ratio), :func:`advise` plans colocated and disaggregated placements
(:func:`pdserve.planner.search.plan`) and keeps the best per-GPU goodput of each strategy.
Disaggregation pays where its best beats colocation's: typically tight TTFT with long outputs
(prefill–decode interference hurts colocation most), while loose SLOs and short outputs favour
colocated batching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.planner.search import Problem, UnitResult, plan


@dataclass
class AdvicePoint:
    slo_scale: float
    output_scale: float
    colocated_per_gpu: float
    disaggregated_per_gpu: float
    colocated: str
    disaggregated: str

    @property
    def ratio(self) -> float | None:
        if self.colocated_per_gpu <= 0:
            return None if self.disaggregated_per_gpu <= 0 else float("inf")
        return self.disaggregated_per_gpu / self.colocated_per_gpu

    @property
    def winner(self) -> str:
        if self.colocated_per_gpu <= 0 and self.disaggregated_per_gpu <= 0:
            return "neither"
        return "disaggregated" if self.disaggregated_per_gpu > self.colocated_per_gpu \
            else "colocated"

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ratio": self.ratio, "winner": self.winner}


def _best(p: Problem, strategy: str, workers: int | None,
          on_unit: Callable[[UnitResult], None] | None) -> tuple[float, str]:
    try:
        res = plan(p, workers, on_unit, (strategy,))
    except ValueError as e:  # nothing meets the SLO at this point
        return 0.0, f"none ({str(e)[:80]})"
    return res.best.per_gpu_rps, res.best.name


def advise(base: Problem, slo_scales: Sequence[float], output_scales: Sequence[float],
           workers: int | None = None,
           on_unit: Callable[[UnitResult], None] | None = None) -> list[AdvicePoint]:
    out = []
    for f in output_scales:
        for k in slo_scales:
            p = replace(base, slo=base.slo.scaled(k), output_scale=f)
            c, cn = _best(p, "colocated", workers, on_unit)
            d, dn = _best(p, "disaggregated", workers, on_unit)
            out.append(AdvicePoint(k, f, c, d, cn, dn))
    return out


def advise_markdown(base: Problem, grid: Sequence[AdvicePoint]) -> str:
    lines = [f"## pdserve advise: {base.model} · {base.workload} · SLO TTFT {base.slo.ttft:g} s "
             f"/ TPOT {base.slo.tpot:g} s (x scale) · {base.nodes}x{base.gpus_per_node} GPUs",
             "", "| output scale | SLO scale | best colocated (per GPU) | best disaggregated "
             "(per GPU) | disagg / colo | winner |", "|---|---|---|---|---|---|"]
    for g in grid:
        r = g.ratio
        lines.append(f"| {g.output_scale:g} | {g.slo_scale:g} | {g.colocated_per_gpu:.3f} "
                     f"({g.colocated}) | {g.disaggregated_per_gpu:.3f} ({g.disaggregated}) | "
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
        ax.plot(xs, c, "o-", label="best colocated")
        ax.plot(xs, d, "s-", label="best disaggregated")
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
