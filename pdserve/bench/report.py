"""Reports: JSON files, markdown tables and PNG plots (matplotlib's Agg canvas, no display).

Plots follow DistServe's figures: SLO attainment against the per-GPU rate with the target line
and each strategy's goodput (Fig. 8, top), attainment against the SLO scale (Fig. 8, bottom),
latency CDFs and the latency breakdown bars (§6.3, Fig. 10).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.goodput import GoodputResult
from pdserve.bench.metrics import SLO, STAGES, RequestRecord, Summary, json_safe


def write_json(path: str | Path, data: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(json_safe(data), indent=2) + "\n")
    return p


def _ms(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = "{:.3g}") -> str:
    return "–" if x is None or not math.isfinite(x) else fmt.format(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f} %"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def summary_markdown(s: Summary, title: str = "") -> str:
    """Latency table (ms) and the run's counts, rates and attainment."""
    rows = [[name, str(st.count), _ms(st.mean), _ms(st.median), _ms(st.p90), _ms(st.p99)]
            for name, st in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl),
                             ("E2E", s.e2e))]
    out = [f"### {title}\n" if title else "",
           _table(["metric (ms)", "n", "mean", "median", "P90", "P99"], rows), ""]
    facts = [
        ("requests (ok / failed)", f"{s.num_ok} / {s.num_failed}"),
        ("offered rate", f"{_num(s.offered_rate_rps)} req/s"),
        ("throughput", f"{_num(s.throughput_rps)} req/s, {_num(s.output_tokens_per_s)} tok/s"),
        ("per GPU", f"{_num(s.per_gpu_throughput_rps)} req/s ({s.num_gpus} GPU(s)"
                    + (f", {s.num_gpus_note})" if s.num_gpus_note else ")")),
    ]
    if s.slo is not None:
        pct = round((s.target or 0) * 100)
        facts += [
            ("SLO", f"TTFT {_ms(s.slo['ttft'])} ms, TPOT {_ms(s.slo['tpot'])} ms, "
                    f"target {pct} %"),
            ("attainment (both SLOs per request)", _pct(s.attainment)),
            (f"DistServe variant (P{pct} TTFT and P{pct} TPOT separately)",
             f"{_pct(s.attainment_distserve)}: P{pct} TTFT {_ms(s.ttft_percentile)} ms, "
             f"P{pct} TPOT {_ms(s.tpot_percentile)} ms"),
            ("tightest SLO scale", _num(s.tightest_slo_scale)),
        ]
    if s.breakdown is not None:
        b = s.breakdown
        facts.append(("latency breakdown (mean ms)", ", ".join(
            f"{k} {_ms(b['mean_s'][k])}" for k in STAGES)))
        if b.get("switch_wait_mean_s") is not None:
            facts.append(("phase-switch wait (first token → decoding; mean ms)",
                          _ms(b["switch_wait_mean_s"])))
    out.append(_table(["", "value"], [[k, v] for k, v in facts]))
    if s.errors:
        out += ["", _table(["error", "count"], [[k.replace("|", "/"), str(v)]
                                                for k, v in s.errors.items()])]
    return "\n".join(out).lstrip("\n") + "\n"


def confirmation(c: Mapping[str, Any]) -> str:
    """What a goodput's confirmation (steady-state rule 7, ``confirm_goodput``'s details with
    its ``factor``) did to it, in a few words."""
    return (f"held over {c['factor']} x the probe length" if c["held"] else
            f"lowered to hold over {c['factor']} x the probe length")


def probes_markdown(result: GoodputResult, confirmed: Mapping[str, Any] | None = None) -> str:
    """The search's probes, and its confirmation when there was one (rule 7)."""
    rows = [[str(p.index), p.phase, _num(p.rate, "{:.4g}"), _pct(p.attainment),
             "pass" if p.passed else "fail", _pct(p.details.get("confidence")),
             f"{p.details['judged']} of {p.details['num_requests']}"
             if "judged" in p.details else "–"] for p in result.probes]
    head = (f"goodput **{_num(result.goodput_rps, '{:.4g}')} req/s** "
            f"({_num(result.per_gpu_goodput_rps, '{:.4g}')} req/s per GPU, "
            f"{result.num_gpus} GPUs); converged: {result.converged}"
            + (f" ({result.note})" if result.note else ""))
    if confirmed is not None:
        tried = ", ".join(f"{r:.4g} {'pass' if ok else 'fail'} ({_pct(a)})"
                          for r, a, ok in confirmed["probes"])
        head += (f"\n\nconfirmed (steady-state rule 7): {confirmation(confirmed)} — the "
                 f"search's {_num(confirmed['rate'], '{:.4g}')} req/s attained "
                 f"{_pct(confirmed['attainment'])} of {confirmed['judged']} judged requests "
                 f"(confidence {_pct(confirmed['confidence'])}); probes: {tried}")
    return head + "\n\n" + _table(["probe", "phase", "rate (req/s)", "attainment", "",
                                   "confidence", "judged requests"], rows) + "\n"


def compare_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """One row per target: goodput, per-GPU goodput, tightest SLO scale, latency at goodput,
    what its confirmation did (steady-state rule 7)."""
    body = [[str(r["name"]), str(r["num_gpus"]), _num(r.get("goodput_rps"), "{:.4g}"),
             _num(r.get("per_gpu_goodput_rps"), "{:.4g}"), _num(r.get("tightest_slo_scale")),
             _ms(r.get("p90_ttft_s")), _ms(r.get("p90_tpot_s")), str(r.get("converged", "–")),
             confirmation(r["confirmed"]) if r.get("confirmed") else "–"]
            for r in rows]
    return _table(["target", "GPUs", "goodput (req/s)", "per GPU", "tightest SLO scale",
                   "P90 TTFT (ms)", "P90 TPOT (ms)", "converged", "rule 7"], body) + "\n"


def figure(width: float, height: float) -> Any:
    """A figure on its own Agg canvas (no pyplot state; matplotlib imported on first plot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (parent folders made)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120, bbox_inches="tight")
    return p


def plot_attainment_vs_rate(curves: Mapping[str, Sequence[tuple[float, float]]], target: float,
                            path: str | Path, num_gpus: Mapping[str, int] | None = None,
                            goodput: Mapping[str, float] | None = None) -> Path:
    """Attainment against per-GPU rate, one line per strategy, the target as a dashed line and
    each goodput as a dotted vertical line."""
    fig = figure(6.4, 4.2)
    ax = fig.add_subplot()
    for name, pts in curves.items():
        g = (num_gpus or {}).get(name, 1)
        pts = sorted(pts)
        line, = ax.plot([r / g for r, _ in pts], [a * 100 for _, a in pts], "o-", label=name)
        if goodput and goodput.get(name):
            ax.axvline(goodput[name] / g, color=line.get_color(), ls=":", lw=1)
    ax.axhline(target * 100, color="grey", ls="--", lw=1, label=f"target {target * 100:g} %")
    ax.set_xlabel("rate per GPU (req/s)" if num_gpus else "rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_attainment_vs_scale(curves: Mapping[str, Sequence[tuple[float, float]]], target: float,
                             path: str | Path) -> Path:
    fig = figure(6.4, 4.2)
    ax = fig.add_subplot()
    for name, pts in curves.items():
        pts = sorted(pts)
        ax.plot([s for s, _ in pts], [a * 100 for _, a in pts], "o-", label=name)
    ax.axhline(target * 100, color="grey", ls="--", lw=1, label=f"target {target * 100:g} %")
    ax.set_xlabel("SLO scale (both SLOs multiplied)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_latency_cdfs(records: Mapping[str, Sequence[RequestRecord]], path: str | Path,
                      slo: SLO | None = None) -> Path:
    """CDFs of TTFT, TPOT, ITL and E2E latency over successful requests, one line per run."""
    fig = figure(10, 7)
    axes = fig.subplots(2, 2).ravel()
    metrics = (("TTFT", lambda r: [r.ttft], slo.ttft if slo else None),
               ("TPOT", lambda r: [r.tpot], slo.tpot if slo else None),
               ("ITL", lambda r: r.itls, None),
               ("E2E latency", lambda r: [r.e2e], None))
    for ax, (label, get, limit) in zip(axes, metrics):
        for name, recs in records.items():
            vals = np.sort([v for r in recs if r.ok for v in get(r) if v is not None])
            if len(vals):
                ax.step(vals * 1000, np.arange(1, len(vals) + 1) / len(vals), where="post",
                        label=name)
        if limit is not None:
            ax.axvline(limit * 1000, color="grey", ls="--", lw=1, label="SLO")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_breakdown(breakdowns: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Stacked bars of the mean time per stage (DistServe §6.3), one bar per run."""
    fig = figure(7, 1.2 + 0.6 * max(1, len(breakdowns)))
    ax = fig.add_subplot()
    names = list(breakdowns)
    left = np.zeros(len(names))
    for stage in STAGES:
        vals = np.array([breakdowns[n]["mean_s"][stage] * 1000 for n in names])
        ax.barh(names, vals, left=left, label=stage.replace("_", " "))
        left += vals
    ax.set_xlabel("mean time per request (ms)")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.grid(alpha=0.3, axis="x")
    return save_figure(fig, path)


def plot_grouped_bars(rows: Sequence[Mapping[str, Any]], group: str, series: str,
                      metrics: Sequence[tuple[str, str]], path: str | Path,
                      title: str = "") -> Path:
    """One panel per ``(key, label)`` in ``metrics``: a bar per ``series`` value (e.g. router)
    in each ``group`` (e.g. instance count), heights ``row[key]``."""
    import numpy as np

    groups = sorted({r[group] for r in rows})
    names = list(dict.fromkeys(r[series] for r in rows))
    fig = figure(4.3 * len(metrics), 3.6)
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    width = 0.8 / len(names)
    for ax, (key, label) in zip(axes, metrics):
        for k, name in enumerate(names):
            ys = [next((r[key] for r in rows if r[series] == name and r[group] == g), np.nan)
                  for g in groups]
            ax.bar(np.arange(len(groups)) + k * width, ys, width, label=name)
        ax.set_xticks(np.arange(len(groups)) + width * (len(names) - 1) / 2)
        ax.set_xticklabels([f"{g} {group}" for g in groups])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)
