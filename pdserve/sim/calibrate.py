"""Fit a device's efficiency factors to measurements (``pdserve calibrate``; torch-free).

The analytic roofline (:class:`~pdserve.sim.analytic.AnalyticModel`) has a handful of named
factors per device (:class:`~pdserve.sim.hardware.Efficiency`: GEMM and attention MFU, weight
and KV bandwidth utilisation, collective efficiency and latency, per-step and per-sequence
overhead). :func:`calibrate` fits them by bounded nonlinear least squares on **relative** error
(``scipy.optimize.least_squares``; fractions on a log scale) to :class:`Measurement` s, and
reports the fit error and the leave-one-out error. Factors the measurements cannot see (no
TP > 1 sample: ``comm``; no decode: ``mbu_kv`` …) keep the base device's values. When every
measurement has the same depth, the per-step and per-layer fixed costs cannot be told apart;
the fit then puts the whole fixed cost on the layers (per-step cost 0): kernel launches, which
scale with depth, are what a GPU engine's fixed cost mostly is, and a cost that scales with
depth carries over to a model of another size, where a per-step constant would not.

The measurements and their sources (our profiler's raw samples, our or DistServe's fitted
profiles, SplitwiseSim's and Vidur's published profiles) are in
:mod:`pdserve.sim.measurements`. aiconfigurator's measured kernel databases are one more
source (:func:`kernel_measurements` over :data:`KERNEL_GRID`, ``--aic-system``): a kernel sum
has no host-side serving work, so that fit holds the per-step and per-sequence costs at 0
(:data:`SERVING_TERMS`) and fits the kernels' factors only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdserve.config import ModelConfig
from pdserve.flags import nonnegative, output_file, positive_int, subcommand
from pdserve.sim.aic_latency import AicModel, aic_version, allreduce_table, database_version
from pdserve.sim.analytic import AnalyticModel
from pdserve.sim.hardware import DeviceSpec, Efficiency, load_hardware, save_hardware
from pdserve.sim.latency import FittedProfile, LatencyModel, ProfileSample
from pdserve.sim.measurements import (
    Measurement,
    from_distserve_json,
    from_metrics_log,
    from_profile,
    from_request_timelines,
    from_splitwise,
    from_step_log,
    from_vidur_allreduce,
    from_vidur_mlp,
    load_samples,
    model_config,
    save_samples,
)
from pdserve.sim.profiler import FULL_GRID, QUICK_GRID, measure_samples
from pdserve.sim.serving_path import overhead_from_step_log, serving_path
from pdserve.sim.target import resolve_profile

FRACTIONS = ("mfu_gemm", "mfu_attention", "mbu_weights", "mbu_kv", "comm", "overlap")
SECONDS = ("comm_latency_s", "step_overhead_s", "layer_overhead_s", "seq_overhead_s")
FACTORS = FRACTIONS + SECONDS
RIDGE = 0.0  # penalty toward the base factors (log scale); see docs/fidelity.md


@dataclass
class Calibration:
    """The fitted device, which factors were fitted, and its errors (relative, fractions)."""

    device: DeviceSpec
    fitted: tuple[str, ...]
    fit_errors: list[float]
    loo_errors: list[float] | None = None
    n: int = 0

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": self.n, "fitted": list(self.fitted),
                               "fit": error_stats(self.fit_errors)}
        if self.loo_errors is not None:
            out["loo"] = error_stats(self.loo_errors)
        out["efficiency"] = {k: getattr(self.device.efficiency, k) for k in FACTORS}
        return out


def error_stats(errors: Sequence[float]) -> dict[str, float]:
    """``mean``, ``p90`` and ``max`` of absolute relative errors, and the signed ``bias``."""
    a = np.abs(np.asarray(errors, dtype=float))
    if not len(a):
        return {"mean": float("nan"), "p90": float("nan"), "max": float("nan"),
                "bias": float("nan"), "n": 0}
    return {"mean": float(a.mean()), "p90": float(np.percentile(a, 90)), "max": float(a.max()),
            "bias": float(np.mean(errors)), "n": int(len(a))}


# ------------------------------------------------------------------------------ predicting
class _Predictor:
    """Analytic models for a set of measurements, built once; factors swapped per evaluation."""

    def __init__(self, device: DeviceSpec, ms: Sequence[Measurement]) -> None:
        self.ms = list(ms)
        self.models: dict[tuple[int, int, int, str], AnalyticModel] = {}
        self.keys = []
        for m in self.ms:
            key = (id(m.model), m.tp, m.ep, m.dtype)
            if key not in self.models:
                self.models[key] = AnalyticModel(m.model, device, m.tp, dtype=m.dtype, ep=m.ep)
            self.keys.append(key)

    def __call__(self, eff: Efficiency) -> np.ndarray:
        for am in self.models.values():
            am.eff = eff
        out = np.empty(len(self.ms))
        for i, (m, key) in enumerate(zip(self.ms, self.keys)):
            am = self.models[key]
            if m.allreduce_bytes:
                out[i] = am.allreduce_time(m.allreduce_bytes)
                continue
            parts = am.breakdown(m.sample.prefill_chunks, m.sample.decode_context_lens)
            out[i] = sum(parts.get(c, 0.0) for c in m.components) if m.components \
                else sum(parts.values())
        return out


def predict(device: DeviceSpec, ms: Sequence[Measurement]) -> np.ndarray:
    """Seconds the analytic model of ``device`` (its own factors) predicts for ``ms``."""
    return _Predictor(device, ms)(device.efficiency)


def relative_errors(device: DeviceSpec, ms: Sequence[Measurement]) -> list[float]:
    """``predicted / measured − 1`` per measurement."""
    y = np.array([m.seconds for m in ms])
    return list(predict(device, ms) / y - 1)


# ------------------------------------------------------------------------------ fitting
_UPPER = {"comm": 2.0}  # see Efficiency.comm


def _pack(eff: Efficiency, names: Sequence[str]) -> np.ndarray:
    out = []
    for n in names:
        v = getattr(eff, n)
        if n == "comm_latency_s" and v is None:
            v = 5e-6
        out.append(math.log(v) if n in FRACTIONS else v * 1e6)  # seconds fitted in µs
    return np.array(out, dtype=float)


def _unpack(x: np.ndarray, base: Efficiency, names: Sequence[str]) -> Efficiency:
    kw: dict[str, float] = {}
    for n, v in zip(names, x):
        kw[n] = math.exp(v) if n in FRACTIONS else max(float(v), 0.0) * 1e-6
    return replace(base, **kw)


def _bounds(names: Sequence[str]) -> tuple[list[float], list[float]]:
    lo = [math.log(1e-4) if n in FRACTIONS else 0.0 for n in names]
    hi = [math.log(_UPPER.get(n, 1.0)) if n in FRACTIONS else 1e6 for n in names]
    return lo, hi


def identifiable(device: DeviceSpec, ms: Sequence[Measurement],
                 names: Sequence[str] = FACTORS) -> tuple[str, ...]:
    """The factors in ``names`` that move some prediction of ``ms`` (others cannot be fitted)."""
    pred = _Predictor(device, ms)
    base_eff = device.efficiency
    probes = [base_eff, replace(base_eff, mfu_gemm=0.05, mbu_weights=0.05, mfu_attention=0.05,
                                mbu_kv=0.05, comm=0.05),
              replace(base_eff, mfu_gemm=1.0, mbu_weights=1.0, mfu_attention=1.0, mbu_kv=1.0)]
    out = []
    for n in names:
        moved = False
        for eff in probes:
            x = _pack(eff, FACTORS)
            y0 = pred(_unpack(x, eff, FACTORS))
            x2 = x.copy()
            i = FACTORS.index(n)
            x2[i] = x2[i] + (-0.3 if n in FRACTIONS else 1000.0)
            if np.max(np.abs(pred(_unpack(x2, eff, FACTORS)) / y0 - 1)) > 1e-6:
                moved = True
                break
        if moved:
            out.append(n)
    return tuple(out)


def _fixed_costs_collinear(device: DeviceSpec, ms: Sequence[Measurement],
                           names: Sequence[str]) -> bool:
    """Whether the per-step and per-layer fixed costs move every prediction of ``ms`` in the
    same proportion (one depth in the data: the two cannot be told apart)."""
    if not {"step_overhead_s", "layer_overhead_s"} <= set(names):
        return False
    pred = _Predictor(device, ms)
    base = replace(device.efficiency, step_overhead_s=0.0, layer_overhead_s=0.0)
    y0 = pred(base)
    d_step = pred(replace(base, step_overhead_s=1e-3)) - y0
    d_layer = pred(replace(base, layer_overhead_s=1e-3)) - y0
    if not np.any(d_step) or not np.any(d_layer):
        return False
    ratio = d_layer / np.where(d_step == 0, np.nan, d_step)
    return bool(np.all(np.isfinite(ratio)) and np.ptp(ratio) <= 1e-9 * np.abs(ratio).max())


def fit_efficiency(device: DeviceSpec, ms: Sequence[Measurement],
                   names: Sequence[str] | None = None, starts: int = 6,
                   x0: np.ndarray | None = None, ridge: float = RIDGE
                   ) -> tuple[Efficiency, tuple[str, ...]]:
    """Least-squares factors for ``ms`` (relative residuals), starting from the device's own
    and ``starts − 1`` other points (the roofline's ``max`` makes the objective non-smooth).
    With ``names`` left ``None`` the identifiable factors are fitted, and fixed costs that one
    depth cannot separate go to the layers (module docstring).
    Returns the fitted :class:`Efficiency` and the names fitted."""
    from scipy.optimize import least_squares

    if not ms:
        raise ValueError("no measurements to calibrate on")
    if any(m.seconds <= 0 for m in ms):
        raise ValueError("measured times must be > 0")
    base = device.efficiency
    if names is None:
        names = identifiable(device, ms)
        if _fixed_costs_collinear(device, ms, names):
            base = replace(base, step_overhead_s=0.0)
            names = tuple(n for n in names if n != "step_overhead_s")
    names = tuple(names)
    if not names:
        return base, ()
    pred = _Predictor(device, ms)
    y = np.array([m.seconds for m in ms])

    prior = _pack(base, names)
    frac = np.array([n in FRACTIONS for n in names])
    w = math.sqrt(len(ms)) * ridge

    def resid(x: np.ndarray) -> np.ndarray:
        r = pred(_unpack(x, base, names)) / y - 1
        if not ridge:
            return r
        return np.concatenate([r, w * (x - prior)[frac]])

    lo, hi = _bounds(names)
    if x0 is not None:
        inits = [x0]
    else:  # the device's own factors plus the best of a log-uniform random search
        rng = np.random.default_rng(0)
        cand = []
        for _ in range(96):
            x = np.array([rng.uniform(math.log(0.02), h) if n in FRACTIONS
                          else math.exp(rng.uniform(math.log(0.1), math.log(5e4)))
                          for n, h in zip(names, hi)])
            cand.append((float(np.sum(resid(x) ** 2)), x))
        cand.sort(key=lambda c: c[0])
        inits = [_pack(base, names)] + [x for _, x in cand[: max(starts - 1, 0)]]
    best = None
    for x in inits:
        x = np.clip(x, lo, hi)
        r = least_squares(resid, x, bounds=(lo, hi), x_scale="jac", max_nfev=400)
        if best is None or r.cost < best.cost:
            best = r
    return _unpack(best.x, base, names), names


def calibrate(device: DeviceSpec, ms: Sequence[Measurement], names: Sequence[str] | None = None,
              loo: bool = False, name: str | None = None,
              log: Callable[[str], None] | None = None) -> Calibration:
    """Fit ``device``'s factors to ``ms``; ``loo`` also refits once per left-out measurement
    (warm-started from the full fit) and records its error on the one left out."""
    eff, fitted = fit_efficiency(device, ms, names)
    dev = replace(device, efficiency=eff, name=name or device.name)
    cal = Calibration(dev, fitted, relative_errors(dev, ms), n=len(ms))
    if loo and len(ms) > 1:
        x_full = _pack(eff, fitted)
        errs = []
        for i in range(len(ms)):
            rest = [m for j, m in enumerate(ms) if j != i]
            e_i, _ = fit_efficiency(replace(device, efficiency=eff), rest, fitted, x0=x_full)
            errs.append(relative_errors(replace(device, efficiency=e_i), [ms[i]])[0])
            if log and (i + 1) % 50 == 0:
                log(f"leave-one-out {i + 1}/{len(ms)}")
        cal.loo_errors = errs
    return cal


# ------------------------------------------------------------------------------ sources
def drop_unphysical(device: DeviceSpec, ms: Sequence[Measurement]) -> list[Measurement]:
    """Measurements not faster than the roofline at 100 % of every peak with no overheads."""
    ideal = Efficiency(mfu_gemm=1.0, mfu_attention=1.0, mbu_weights=1.0, mbu_kv=1.0, comm=2.0,
                       comm_latency_s=0.0, step_overhead_s=0.0, seq_overhead_s=0.0)
    floor = _Predictor(device, ms)(ideal)
    return [m for m, f in zip(ms, floor) if m.seconds >= f]


# ------------------------------------------------------------------------------ kernel data
SERVING_TERMS = ("step_overhead_s", "seq_overhead_s")
"""Host-side serving costs a kernel sum leaves out: held at 0 in a fit to kernel sums."""

KERNEL_GRID: dict[str, Any] = {
    "prefill": {"batch": (1, 2, 8), "length": (128, 512, 1024, 2048, 4096, 8192),
                "max_tokens": 16384},
    "decode": {"batch": (1, 8, 32, 128, 256), "context": (256, 1024, 4096, 16384),
               "max_tokens": 1 << 20},
    "tp": (1, 2, 4),
}
"""The steps a kernel-database fit prices per model and TP: prefill batch × length (equal
prompts, no cached prefix) and decode batch × context, each up to ``max_tokens`` in all."""


def kernel_shapes(max_len: int, grid: dict[str, Any] = KERNEL_GRID) -> list[ProfileSample]:
    """:data:`KERNEL_GRID`'s prefill and decode steps (seconds 0) up to ``max_len`` tokens per
    sequence."""
    pre, dec = grid["prefill"], grid["decode"]
    out = [ProfileSample.prefill([n] * b, 0.0) for b in pre["batch"] for n in pre["length"]
           if n <= max_len and b * n <= pre["max_tokens"]]
    out += [ProfileSample.decode([c] * b, 0.0) for b in dec["batch"] for c in dec["context"]
            if c <= max_len and b * c <= dec["max_tokens"]]
    return out


def fits_in_memory(model: ModelConfig, device: DeviceSpec, tp: int,
                   dtype: str = "float16") -> bool:
    """Whether ``model``'s weights take at most 90 % of each of ``tp`` GPUs' memory."""
    am = AnalyticModel(model, device, tp, dtype=dtype)
    weights = am.bytes_el * (am.linear_params + 2 * am.head_params)
    return weights <= 0.9 * device.memory_bytes


def kernel_measurements(source: Callable[[ModelConfig, int], LatencyModel],
                        models: Sequence[ModelConfig], device: DeviceSpec,
                        tps: Sequence[int] = KERNEL_GRID["tp"],
                        grid: dict[str, Any] = KERNEL_GRID, label: str = "kernels",
                        log: Callable[[str], None] | None = None) -> list[Measurement]:
    """:func:`kernel_shapes` priced by ``source(model, tp)`` (an :class:`AicModel`, or any
    latency model) for every model and TP whose weights fit ``device``
    (:func:`fits_in_memory`) and whose heads divide by the TP; grouped ``model tpN``."""
    out = []
    for cfg in models:
        for tp in tps:
            if cfg.num_heads % tp or not fits_in_memory(cfg, device, tp):
                if log:
                    log(f"  {cfg.name} tp{tp}: skipped (weights do not fit or heads do not "
                        f"divide)")
                continue
            lat = source(cfg, tp)
            shapes = kernel_shapes(min(cfg.max_position_embeddings, 1 << 20), grid)
            for sh in shapes:
                t = lat.step_time(sh.prefill_chunks, sh.decode_context_lens)
                out.append(Measurement(replace(sh, seconds=float(t)), cfg, tp,
                                       group=f"{label} {cfg.name} tp{tp}"))
            if log:
                log(f"  {cfg.name} tp{tp}: {len(shapes)} steps from {label}")
    return out


def kernel_device(device: DeviceSpec) -> DeviceSpec:
    """``device`` with the serving terms (:data:`SERVING_TERMS`) at 0: what a kernel sum
    measures."""
    return replace(device, efficiency=replace(device.efficiency,
                                              **{n: 0.0 for n in SERVING_TERMS}))


def calibrate_kernels(device: DeviceSpec, ms: Sequence[Measurement],
                      names: Sequence[str] | None = None, loo: bool = False,
                      name: str | None = None,
                      log: Callable[[str], None] | None = None) -> Calibration:
    """:func:`calibrate` on kernel sums: the serving terms held at 0 (``names``, default the
    identifiable factors, may not include them)."""
    dev = kernel_device(device)
    if names is None:
        names = tuple(n for n in identifiable(dev, ms) if n not in SERVING_TERMS)
    elif set(names) & set(SERVING_TERMS):
        raise ValueError(f"--fit: {' and '.join(SERVING_TERMS)} are serving costs a kernel sum "
                         f"does not contain; fit them on a --step-log")
    return calibrate(dev, ms, names, loo=loo, name=name, log=log)


def allreduce_measurements(table: dict[str, Any], model: ModelConfig, tps: Sequence[int],
                           kind: str, max_tokens: int = 16384) -> list[Measurement]:
    """Rows of :func:`~pdserve.sim.aic_latency.allreduce_table` of ``kind`` as all-reduce
    measurements, at the TPs in ``tps`` and the sizes a step of ``model`` sends (one token's
    hidden state to ``max_tokens`` of them, 2 bytes per element)."""
    lo, hi = 2 * model.hidden_size, 2 * model.hidden_size * max_tokens
    return [Measurement(ProfileSample((), (), s), model, g, allreduce_bytes=float(b),
                        group=f"allreduce {k} tp{g}")
            for k, g, b, s in table["rows"] if k == kind and g in tps and lo <= b <= hi]


# ------------------------------------------------------------------------------ CLI
def _measure(args: argparse.Namespace) -> list[Measurement]:
    grid = QUICK_GRID if args.quick else FULL_GRID
    samples = measure_samples(args.measure, args.device, None, grid, threads=args.threads,
                              log=print)
    dtype = "float32" if args.device == "cpu" else "float16"
    if args.save_samples:
        save_samples(args.save_samples, samples, model=os.path.basename(args.measure),
                     model_dir=os.path.abspath(args.measure), hardware=args.device,
                     dtype=dtype, tp=1, source=f"pdserve calibrate --measure {args.measure}")
    cfg = model_config(args.measure)
    return [Measurement(s, cfg, 1, 1, dtype, group="measured") for s in samples]


def _gather(args: argparse.Namespace, device: DeviceSpec) -> list[Measurement]:
    ms: list[Measurement] = []
    for p in args.samples or []:
        ms += load_samples(p, args.model)
    for p in args.profile or []:
        p = resolve_profile(p)  # a name as simulate and plan take it, or a path
        with open(p) as f:
            is_ours = json.load(f).get("format") == "pdserve-latency-profile"
        if is_ours:
            if not args.model:
                raise ValueError(f"--profile {p}: pass --model (catalogue name or directory)")

            prof, cfg = FittedProfile.load(p), model_config(args.model)
            shapes = FULL_GRID.shapes(min(cfg.max_position_embeddings, 4096))
            ms += from_profile(prof, cfg, [s for s in shapes if s.kind != "mixed"])
        else:
            ms += from_distserve_json(p, [args.model] if args.model else None)
    # serving logs of one instance: step log, client timelines, Prometheus scrapes; with a step
    # log, the timelines of the same server only give the serving path around its steps (their
    # steps, reconstructed from the client's side, are rougher copies of what the log has)
    timelines = None if args.step_log else args.timelines
    if args.step_log and args.timelines:
        print("  --timelines with --step-log: the timelines give the front end's cost and the KV "
              "hand-off; the steps are fitted on the step log alone")
    for flag, paths, read in (("--step-log", args.step_log, from_step_log),
                              ("--timelines", timelines, from_request_timelines),
                              ("--metrics-log", args.metrics_log, from_metrics_log)):
        for p in paths or []:
            if not args.model:
                raise ValueError(f"{flag} {p}: pass --model (catalogue name or directory)")
            ms += read(p, args.model, args.tp, args.dtype)
    if args.splitwise:
        ms += drop_unphysical(device, from_splitwise(args.splitwise, args.splitwise_hardware))
    if args.vidur:
        ms += from_vidur_mlp(os.path.join(args.vidur, "Llama-2-7b-hf_mlp.csv.gz"))
        ms += from_vidur_allreduce(os.path.join(args.vidur, "h100_dgx_all_reduce.csv.gz"),
                                   min_bytes=args.vidur_min_bytes)
    if args.measure:
        ms += _measure(args)
    if not ms:
        raise ValueError("no measurements: give --samples, --profile, --step-log, --timelines, "
                         "--metrics-log, --splitwise, --vidur or --measure")
    return ms


def _tps(text: str) -> tuple[int, ...]:
    try:
        tps = tuple(int(x) for x in text.split(","))
    except ValueError:
        tps = ()
    if not tps or min(tps) < 1:
        raise ValueError(f"--aic-tp: expected a comma list of TP degrees >= 1, got {text!r}")
    return tps


_OTHER_SOURCES = ("samples", "profile", "step_log", "timelines", "metrics_log", "splitwise",
                  "vidur", "measure")


def _gather_aic(args: argparse.Namespace, device: DeviceSpec
                ) -> tuple[list[Measurement], dict[str, Any]]:
    """Kernel-sum steps of ``--model`` (repeatable) on ``--aic-system`` over
    :data:`KERNEL_GRID`, and the database's all-reduces for the check of the comm term."""

    others = [f"--{k.replace('_', '-')}" for k in _OTHER_SOURCES if getattr(args, k, None)]
    if others:
        raise ValueError(f"--aic-system fits kernel sums, which leave out the serving path: "
                         f"give it without {', '.join(others)}")
    if not args.models:
        raise ValueError("--aic-system: pass --model (catalogue name; repeatable)")
    aic_version()
    tps = _tps(args.aic_tp)
    models = [model_config(m) for m in args.models]
    print(f"pricing {', '.join(m.name for m in models)} on {args.aic_system}/"
          f"{args.aic_backend} (TP {', '.join(map(str, tps))}) ...")
    ms = kernel_measurements(
        lambda cfg, tp: AicModel(cfg, args.aic_system, args.aic_backend, tp),
        models, device, tps, label=f"{args.aic_system}/{args.aic_backend}", log=print)
    if not ms:
        raise ValueError(f"--aic-system: no model and TP of {tps} fits {device.name}")
    table = allreduce_table(args.aic_system, args.aic_backend)
    # the backend's own all-reduce kernels pin the comm term directly (in a step it shares the
    # per-layer fixed cost with the launches); NCCL's stay a check (_allreduce_check)
    big = max(models, key=lambda c: c.hidden_size)
    ms += allreduce_measurements(table, big, [t for t in sorted({m.tp for m in ms}) if t > 1],
                                 "backend")
    pre, dec = KERNEL_GRID["prefill"], KERNEL_GRID["decode"]
    info = {"system": args.aic_system, "backend": args.aic_backend,
            "package": f"aiconfigurator-core {aic_version()}",
            "database": f"{args.aic_backend} {database_version(args.aic_system, args.aic_backend)}",
            "models": [m.name for m in models], "tp": sorted({m.tp for m in ms}),
            "grid": f"prefill batch {pre['batch']} x length {pre['length']} "
                    f"(<= {pre['max_tokens']} tokens), decode batch {dec['batch']} x context "
                    f"{dec['context']} (<= {dec['max_tokens']} tokens)",
            "allreduce": table}
    return ms, info


def _allreduce_check(dev: DeviceSpec, ms: Sequence[Measurement], info: dict[str, Any]
                     ) -> dict[str, Any]:
    """The fitted all-reduce term against the database's measured all-reduces, per table
    (the backend's are among the fitted measurements, NCCL's are not)."""
    tps = [t for t in info["tp"] if t > 1]
    big = max((m.model for m in ms), key=lambda c: c.hidden_size)
    out: dict[str, Any] = {"source": info["allreduce"]["source"]}
    for kind in ("backend", "nccl"):
        ar = allreduce_measurements(info["allreduce"], big, tps, kind)
        if ar:
            out[kind] = error_stats(relative_errors(dev, ar))
    return out


def _step_errors(cal: Calibration, ms: Sequence[Measurement]) -> dict[str, Any]:
    """Fit (and leave-one-out) error of the whole steps alone, without the all-reduces."""
    keep = [i for i, m in enumerate(ms) if not m.allreduce_bytes]
    out = {"fit": error_stats([cal.fit_errors[i] for i in keep])}
    if cal.loo_errors is not None:
        out["loo"] = error_stats([cal.loo_errors[i] for i in keep])
    return out


_LOGS = ("step_log", "timelines", "metrics_log")
# flags that only act beside others: (flag, the flags it needs, its value without them)
_DEPENDENT = (("tp", _LOGS, 1), ("dtype", _LOGS, "float16"),
              ("splitwise_hardware", ("splitwise",), "a100-80gb"),
              ("vidur_min_bytes", ("vidur",), 0.0), ("device", ("measure",), "cpu"),
              ("threads", ("measure",), 1), ("quick", ("measure",), False),
              ("save_samples", ("measure",), None))


def _resolve_dependent(args: argparse.Namespace) -> None:
    """Refuse a flag given without the flags it acts with (it would be ignored); fill in the
    defaults of the others."""
    for name, needs, default in _DEPENDENT:
        v = getattr(args, name, None)
        if v is None or v is False:
            setattr(args, name, default)
        elif not any(getattr(args, n, None) for n in needs):
            flags = " or ".join(f"--{n.replace('_', '-')}" for n in needs)
            raise ValueError(f"--{name.replace('_', '-')} acts with {flags}; give one")


def run(args: argparse.Namespace) -> int:
    _resolve_dependent(args)
    base = load_hardware(args.hardware)
    models = args.model if isinstance(args.model, list) else [args.model] if args.model else []
    args.models, args.model = models, models[-1] if models else None
    if len(models) > 1 and not args.aic_system:
        raise ValueError("--model: give it once (repeat it only with --aic-system)")
    aic = None
    if args.aic_system:
        ms, aic = _gather_aic(args, base.device)
    else:
        ms = _gather(args, base.device)
    names = args.fit.split(",") if args.fit else None
    if names:
        bad = sorted(set(names) - set(FACTORS))
        if bad:
            raise ValueError(f"--fit: unknown factor(s) {bad}; choose from {list(FACTORS)}")
    if aic:
        cal = calibrate_kernels(base.device, ms, names, loo=args.loo, name=args.name, log=print)
    else:
        cal = calibrate(base.device, ms, names, loo=args.loo, name=args.name, log=print)
    s = cal.summary()
    print(f"calibrated {base.device.name} on {cal.n} measurements; fitted {', '.join(cal.fitted)}")
    for k, v in s["efficiency"].items():
        print(f"  {k:16s} {v}")
    for part in ("fit", "loo"):
        if part in s:
            e = s[part]
            print(f"  {part:4s} error: mean {e['mean']:.1%}  P90 {e['p90']:.1%}  "
                  f"max {e['max']:.1%}  bias {e['bias']:+.1%}")
    if aic:
        s["aic"] = {k: v for k, v in aic.items() if k != "allreduce"}
        s["steps"] = steps = _step_errors(cal, ms)
        for part in ("fit", "loo"):
            if part in steps:
                e = steps[part]
                print(f"  steps alone, {part:3s} error ({e['n']}): mean {e['mean']:.1%}  P90 "
                      f"{e['p90']:.1%}  max {e['max']:.1%}  bias {e['bias']:+.1%}")
        s["allreduce_check"] = check = _allreduce_check(cal.device, ms, aic)
        for kind in ("backend", "nccl"):
            if kind in check:
                e = check[kind]
                print(f"  all-reduce vs the database's {kind} kernels ({e['n']} sizes): mean "
                      f"{e['mean']:.1%}  bias {e['bias']:+.1%}")
        print(f"  kernel sums leave out the serving path: {' and '.join(SERVING_TERMS)} are 0 "
              f"here; simulate with --step-overhead-ms / --seq-overhead-ms (calibrate "
              f"--step-log measures them)")
    paths = {p: serving_path(p, args.model, args.dtype) for p in args.timelines or []}
    for p in args.step_log or []:
        try:
            paths[p] = {"step_overhead": overhead_from_step_log(p)}
        except ValueError as e:
            paths[p] = {"step_overhead": None, "why": str(e)}
    for p, sp in paths.items():
        _say_serving_path(p, sp)
    if paths:
        s["serving_path"] = paths
    if args.output:
        errs = f"fit mean {s['fit']['mean']:.1%}" + (
            f", leave-one-out mean {s['loo']['mean']:.1%}" if "loo" in s else "")
        if aic:
            a, n_ar = s["aic"], sum(1 for m in ms if m.allreduce_bytes)
            what = (f"efficiency: pdserve calibrate --aic-system {a['system']} --aic-backend "
                    f"{a['backend']} on {cal.n - n_ar} kernel-sum steps and {n_ar} all-reduces "
                    f"of {a['package']} ({a['database']} database; {', '.join(a['models'])}; "
                    f"TP {', '.join(map(str, a['tp']))}; {a['grid']}); {errs}; serving terms "
                    f"0")
        else:
            what = (f"efficiency: pdserve calibrate on {cal.n} measurements "
                    f"({', '.join(sorted({m.group for m in ms}))}); {errs}")
        sources = [*(x for x in base.device.sources if not _about_efficiency(x)), what]
        dev = replace(cal.device, sources=tuple(sources))
        save_hardware(args.output, dev, replace(base, device=dev),
                      header=f"written by pdserve calibrate; base spec {args.hardware}")
        print(f"wrote {args.output}")
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(s, f, indent=2)
            f.write("\n")
    return 0


def _about_efficiency(source: str) -> bool:
    """Whether a ``sources`` line of a base spec describes its efficiency factors (a catalogue
    entry's ``efficiency: ...``, ``kernel fit ...`` or ``<factor> <value>: ...`` lines): those no
    longer apply to a calibrated copy."""
    head = source.split(":", 1)[0].split()
    return bool(head) and (head[0] in ("efficiency", "kernel") or head[0] in FACTORS)


def _say_serving_path(path: str, sp: dict[str, Any]) -> None:
    """What ``pdserve simulate`` should add around the calibrated steps, as flags and spec keys."""
    if "step_overhead" in sp:  # a step log: the gaps between steps
        so = sp["step_overhead"]
        if so is None:
            print(f"  {path}: no serving overhead per step ({sp['why']})")
        else:
            print(f"  serving overhead: {1000 * so['step_s']:.3f} ms per step + "
                  f"{1000 * so['seq_s']:.3f} ms per sequence (from {so['gaps']} gaps between "
                  f"steps); simulate with --step-overhead-ms {1000 * so['step_s']:.3f} "
                  f"--seq-overhead-ms {1000 * so['seq_s']:.3f}")
        return
    ro, link = sp["request_overhead"], sp["kv_link"]
    if ro is None:
        print(f"  {path}: no server timelines (pdserve sends them; vLLM does not), so the front "
              f"end's cost per request is unknown")
    else:
        print(f"  front end: {ro['median_ms']:.2f} ms per request (median of {ro['requests']} "
              f"{'lone ' if ro['alone'] else ''}requests, P10 {ro['p10_ms']:.2f}, P90 "
              f"{ro['p90_ms']:.2f}); simulate with --request-overhead-ms {ro['median_ms']:.2f}")
    if link is not None:
        bw, ms = link["bandwidth_gb_per_s"], 1000 * link["latency_s"]
        flag = f"{'inf' if bw is None else f'{bw:.3g}'}:{ms:.3g}"
        print(f"  KV hand-off: {ms:.2f} ms + bytes at "
              f"{'no limit' if bw is None else f'{bw:.3g} GB/s'} ({link['requests']} hand-offs);"
              f" simulate with --kv-link {flag}")


def register(subparsers: Any) -> None:
    p = subcommand(
        subparsers, "calibrate", run,
        help="fit a device's efficiency factors to measurements, write a spec",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", required=True,
                   help="base device: catalogue name or hardware file (its peaks are kept)")
    p.add_argument("--samples", action="append", help="pdserve-step-samples JSON (repeatable)")
    p.add_argument("--profile", action="append",
                   help="pdserve profile JSON (needs --model) or DistServe profile JSON")
    p.add_argument("--model", action="append",
                   help="model for --samples/--profile: catalogue name or directory "
                        "(repeatable with --aic-system)")
    p.add_argument("--step-log", action="append",
                   help="serving log: JSON lines of per-step elapsed + batch shape (needs "
                        "--model; repeatable)")
    p.add_argument("--timelines", action="append",
                   help="per-request timelines a client saw of a one-instance server (`pdserve "
                        "bench --save-records` JSON, any OpenAI server; needs --model; "
                        "repeatable): steps reconstructed from arrivals and token times; "
                        "against pdserve also the front end's cost and the KV hand-off (with "
                        "--step-log only those)")
    p.add_argument("--metrics-log", action="append",
                   help="Prometheus scrapes of a one-instance server, pdserve's or vLLM's "
                        "(`pdserve bench --scrape-metrics` JSON lines; needs --model; "
                        "repeatable): decode steps from steady intervals, the mean prefill")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="with --step-log/--timelines/--metrics-log: the instance's TP "
                        "(default: 1)")
    p.add_argument("--dtype", default=None,
                   help="with --step-log/--timelines/--metrics-log: the model's dtype "
                        "(default: float16)")
    p.add_argument("--splitwise", help="SplitwiseSim perf_model.csv")
    p.add_argument("--splitwise-hardware", default=None,
                   help="its hardware column (a100-80gb, h100-80gb, h100-80gb-pcap; default: "
                        "a100-80gb)")
    p.add_argument("--vidur", help="directory with Vidur's H100 profiles")
    p.add_argument("--vidur-min-bytes", type=nonnegative, default=None,
                   help="with --vidur: skip its samples under this many bytes (default: 0)")
    p.add_argument("--measure", metavar="MODEL_DIR",
                   help="measure this model's executor here (pdserve profile's grid)")
    p.add_argument("--device", default=None,
                   help="with --measure: cpu or cuda[:N] (default: cpu)")
    p.add_argument("--quick", action="store_true", help="with --measure: the quick grid")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="with --measure on CPU (default: 1)")
    p.add_argument("--save-samples", help="with --measure: also write the raw samples here")
    p.add_argument("--aic-system", metavar="SYSTEM",
                   help="fit to aiconfigurator's kernel-sum steps on this system (h100_sxm, "
                        "h200_sxm, b200_sxm, a100_sxm, l40s, rtx_pro_6000_server, ...; needs "
                        "pdserve[aic] and --model): prefill and decode over a fixed grid, "
                        "serving terms held at 0")
    p.add_argument("--aic-backend", default="vllm", choices=("vllm", "sglang", "trtllm"),
                   help="with --aic-system: the backend whose kernels were measured")
    p.add_argument("--aic-tp", default=",".join(map(str, KERNEL_GRID["tp"])),
                   help="with --aic-system: comma list of TP degrees")
    p.add_argument("--fit", help=f"comma list of factors to fit (default: all the data "
                                 f"constrains, of {','.join(FACTORS)})")
    p.add_argument("--loo", action="store_true", help="also report leave-one-out error")
    p.add_argument("--name", help="name of the calibrated device (default: the base's)")
    p.add_argument("--output", "-o", type=output_file,
                   help="write the calibrated spec (.yaml or .json)")
    p.add_argument("--report-json", help="write the fit summary as JSON")
