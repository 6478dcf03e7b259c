"""Analytic roofline model vs DistServe's measured A100 profiles (docs/fidelity.md).

For OPT-13B (TP 1, 2, 4) and OPT-66B (TP 2, 4, 8) on A100-80GB, prints Markdown tables of the
step time predicted by DistServe's fitted coefficients (``simdistserve`` profile JSON, measured
on their engine) and by :class:`pdserve.sim.analytic.AnalyticModel` with its default efficiency
factors, with the relative error ``analytic / DistServe − 1`` per point, then the fitted
coefficients of both for OPT-13B TP 1.

    python benchmarks/analytic_vs_distserve.py \
        [--profile /work/shared/profiles/distserve_profiler-a100-80g.distserve.json]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from pdserve.sim.analytic import AnalyticModel
from pdserve.sim.latency import FittedProfile
from pdserve.sim.model_catalogue import get_model_config

DEFAULT_PROFILE = os.path.join(os.path.dirname(__file__), "..", "pdserve", "data", "profiles",
                               "distserve_profiler-a100-80g.distserve.json")  # shipped
CONFIGS = (("opt-13b", (1, 2, 4)), ("opt-66b", (2, 4, 8)))
PREFILL = ((1, 128), (1, 512), (1, 2048), (4, 512))  # (batch, prompt length)
DECODE = ((1, 512), (16, 512), (64, 1024), (128, 1024))  # (batch, context length)


def compare(profile_path: str, device: str = "A100-80GB") -> list[str]:
    lines: list[str] = []
    summary: list[str] = []
    for name, tps in CONFIGS:
        model = get_model_config(name)
        pairs = [(tp, FittedProfile.from_distserve_json(profile_path, model, tp),
                  AnalyticModel(model, device, tp)) for tp in tps]
        lines += [f"**{name.upper()}** — DistServe / analytic (ms), error", "",
                  "| step | " + " | ".join(f"TP {tp}" for tp in tps) + " |",
                  "|---|" + "---:|" * len(tps)]
        errs: dict[int, list[float]] = {tp: [] for tp in tps}
        shapes: list[tuple[str, list[tuple[int, int]], list[int]]] = (
            [(f"prefill {b}×{n}", [(0, n)] * b, []) for b, n in PREFILL]
            + [(f"decode {b}×{c}", [], [c] * b) for b, c in DECODE])
        for label, chunks, ctx in shapes:
            cells = []
            for tp, ds, an in pairs:
                t_ds, t_an = ds.step_time(chunks, ctx), an.step_time(chunks, ctx)
                err = t_an / t_ds - 1
                errs[tp].append(err)
                cells.append(f"{t_ds * 1e3:.1f} / {t_an * 1e3:.1f} ({err:+.0%})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        for tp in tps:
            e = [abs(x) for x in errs[tp]]
            summary.append(f"| {name.upper()} | {tp} | {max(e):.0%} | {sum(e) / len(e):.0%} |")
    lines += ["| model | TP | max \\|error\\| | mean \\|error\\| |", "|---|---:|---:|---:|",
              *summary, ""]
    lines += coefficients(profile_path, device)
    return lines


def _ms(c: Sequence[float]) -> str:
    return " | ".join(f"{x * 1e3:.4g}" for x in c)


def coefficients(profile_path: str, device: str) -> list[str]:
    model = get_model_config("opt-13b")
    ds = FittedProfile.from_distserve_json(profile_path, model, 1)
    an = AnalyticModel(model, device, 1).to_fitted_profile()
    out = ["**OPT-13B TP 1 coefficients** (ms; prefill a + b·Σl + c·Σl², decode a + b·Σctx + "
           "c·batch; analytic = its own predictions on `profile_grid()` refitted)", "",
           "| source | part | a | b | c |", "|---|---|---:|---:|---:|"]
    for src, p in (("DistServe", ds), ("analytic", an)):
        for part in ("prefill", "decode_small", "decode_large"):
            out.append(f"| {src} | {part} | {_ms(getattr(p, part))} |")
    fe = an.fit_error
    out += ["", "Analytic refit error (max / mean relative): "
            + ", ".join(f"{k} {v['max_rel']:.1%} / {v['mean_rel']:.1%}" for k, v in fe.items())]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="simdistserve profile JSON")
    ap.add_argument("--device", default="A100-80GB")
    args = ap.parse_args(argv)
    print("\n".join(compare(args.profile, args.device)))


if __name__ == "__main__":
    main()
