"""Simulator fidelity: the live pdserve server on this machine vs the simulator driven by a profile
fitted on this machine, for the same workload at several rates (DESIGN.md "Simulator";
DistServe Table 2 does the same for its simulator).

For each deployment (colocated: 1 instance; disaggregated: 1 prefill + 1 decode; a ``-tpN``
suffix makes every instance tensor-parallel over N ranks, e.g. ``colocated-tp2``, and ``-ppN``
a pipeline of N stages, e.g. ``colocated-pp2``) the script
starts ``pdserve serve`` with explicit engine settings (Ray actors, one torch thread per rank),
replays the workload over HTTP at every rate, and runs the same requests through ``--target sim``
with the same engine settings and the profile fitted at the deployment's layout (``pdserve
profile --tp N --pp M``: the sharded executor's own steps, and a pipeline's pass and stage
times). Per rate it reports SLO attainment of both
(and the difference in points) and the relative error of mean and P90 TTFT and TPOT.

    python benchmarks/fidelity.py --output-json out/fidelity.json --plot out/fidelity

Steps: (1) make the tiny model (unless ``--model``), (2) ``pdserve profile`` it at each
deployment's TP degree (unless ``--profile`` is of that degree), (3) per deployment: serve, warm
up, replay each rate live and in simulation.
Run it on a quiet machine: the live side measures wall-clock time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from pdserve.bench.metrics import SLO
from pdserve.bench.runner import Settings, build_workload, run_workload
from pdserve.bench.targets import HttpTarget
from pdserve.config import STRATEGIES, ClusterConfig, Link, ModelConfig
from pdserve.sim.calibrate import calibrate, relative_errors
from pdserve.sim.hardware import device_for_cuda_name, get_device, save_hardware
from pdserve.sim.measurements import from_step_log
from pdserve.sim.serving_path import handoff_link, overhead_from_step_log, request_overhead
from pdserve.sim.target import SimTarget, SimulationConfig, resolve_profile, step_model

con = Console(stderr=True)

MODEL_SIZE = {"hidden_size": 384, "intermediate_size": 1024, "num_layers": 6, "num_heads": 6,
              "num_kv_heads": 2, "vocab_size": 4096, "max_position_embeddings": 1024}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(path: Path, seed: int) -> str:
    from pdserve.model.tiny import make_tiny_model  # lazy: torch

    if not (path / "config.json").exists():
        make_tiny_model(str(path), "llama", seed, **MODEL_SIZE)
    return str(path)


def make_profile(model: str, out: Path, quick: bool, tp: int = 1, pp: int = 1) -> str:
    if not out.exists():
        cmd = [sys.executable, "-m", "pdserve.cli", "profile", "--model", model, "--out",
               str(out), "--threads", "1", "--tp", str(tp), "--pp", str(pp)] + (
                   ["--quick"] if quick else [])
        con.print(f"[bold]profiling[/] {' '.join(cmd[2:])}")
        subprocess.run(cmd, check=True)
    return str(out)


class Server:
    """``pdserve serve --config SPEC`` in a subprocess; stopped with SIGINT (graceful shutdown).
    The simulator runs the same spec file."""

    def __init__(self, spec: Path, log: Path) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--config", str(spec),
               "--port", str(self.port), "--log-level", "warning"]
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {self.proc.returncode}; see {log}")
            if "serving" in Path(log).read_text():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"pdserve serve did not start within 180 s; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def rel(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or not live:
        return None
    return sim / live - 1.0


def compare(live: Any, sim: Any) -> dict[str, Any]:
    """Per-rate comparison row from two runs' summaries."""
    ls, ss = live.summary, sim.summary
    row: dict[str, Any] = {
        "attainment_live": ls.attainment, "attainment_sim": ss.attainment,
        "attainment_diff_points": 100 * ((ss.attainment or 0) - (ls.attainment or 0)),
        "failed_live": ls.num_failed, "failed_sim": ss.num_failed,
    }
    for metric in ("ttft", "tpot", "e2e"):
        for stat in ("mean", "p90"):
            a, b = getattr(getattr(ls, metric), stat), getattr(getattr(ss, metric), stat)
            row[f"{metric}_{stat}_live"] = a
            row[f"{metric}_{stat}_sim"] = b
            row[f"{metric}_{stat}_rel_err"] = rel(b, a)
    return row


def warm_up(target: HttpTarget, s: Settings) -> None:
    """A few requests so that the first measured run does not pay for lazy initialisation."""
    w = build_workload(target, replace(s, num_requests=8), 4.0)
    asyncio.run(target.run(list(w.requests)))


CAL_PROMPT, CAL_OUTPUT = 64, 48  # calibration requests: prompt and forced output tokens


def _probe(target: HttpTarget, s: Settings, n: int, seed: int) -> list[Any]:
    """The records of ``n`` calibration requests sent together."""
    spec = f"fixed:input={CAL_PROMPT},output={CAL_OUTPUT}"
    w = build_workload(target, replace(s, workload=spec, num_requests=n, seed=seed), 1000.0)
    return asyncio.run(target.run(list(w.requests)))


def _gaps(records: list[Any]) -> list[float]:
    return [float(g) for rec in records for g in np.diff(rec.timeline.token_times)]


def calibrate_overhead(target: HttpTarget, s: Settings, prof: Any,
                       batch: int = 8) -> dict[str, float]:
    """The serving path's cost that an executor-only latency model (``prof``: the fitted
    profile or the calibrated roofline) does not see
    (:class:`~pdserve.sim.latency.DriverOverhead`): ``a`` per step + ``b`` per sequence.
    Lone requests decode in steps of one sequence, ``batch`` requests sent together in steps of
    ``batch``; the median token gap of each minus the model's predicted decode step gives
    ``a + b`` and ``a + batch·b``. Measured on requests outside the fidelity workload."""
    lone_records = [r for i in range(4) for r in _probe(target, s, 1, 1000 + i)]
    lone, together = _gaps(lone_records), _gaps(_probe(target, s, batch, 2000))
    ctx = [CAL_PROMPT + k for k in range(1, CAL_OUTPUT)]
    pred1 = float(np.median([prof.decode_time([c]) for c in ctx]))
    predb = float(np.median([prof.decode_time([c] * batch) for c in ctx]))
    extra1 = float(np.median(lone)) - pred1
    extrab = float(np.median(together)) - predb
    per_seq = max((extrab - extra1) / (batch - 1), 0.0)
    per_step = max(extra1 - per_seq, 0.0)
    return {"live_itl_1_s": float(np.median(lone)), "profile_decode_1_s": pred1,
            f"live_itl_{batch}_s": float(np.median(together)),
            f"profile_decode_{batch}_s": predb, "step_s": per_step, "seq_s": per_seq,
            "request": request_overhead(lone_records)}


def latency_of(setup: SimulationConfig, model: str, dtype: str = "float32", tp: int = 1,
               pp: int = 1) -> Any:
    """The simulator's executor-only step-time model of a ``tp × pp`` instance of ``setup``."""

    return step_model(replace(setup, step_overhead_ms=0.0, seq_overhead_ms=0.0),
                      ModelConfig.from_dir(model), tp, pp, dtype)


def deployment(name: str) -> tuple[dict[str, Any], tuple[int, int]]:
    """A deployment's spec entries and layout ``(tp, pp)`` from its name: ``colocated``,
    ``disaggregated``, ``partial``, each optionally with ``-tpN`` and/or ``-ppN`` (every
    instance N ranks / N pipeline stages; one profile prices one layout)."""

    strategy, *suffixes = name.split("-")
    layout = {"tp": 1, "pp": 1}
    for suffix in suffixes:
        key, n = suffix[:2], suffix[2:]
        if key not in layout or not (n.isdigit() and int(n) >= 1):
            strategy = ""  # refused below
            break
        layout[key] = int(n)
    if strategy not in STRATEGIES:
        raise SystemExit(f"unknown deployment {name!r}: one of {', '.join(STRATEGIES)}, "
                         f"optionally with -tpN and -ppN (e.g. colocated-tp2, colocated-pp2)")
    entries = {"strategy": strategy, **{k: v for k, v in layout.items() if v > 1}}
    return entries, (layout["tp"], layout["pp"])


def calibrate_from_run(target: HttpTarget, s: Settings, rates: list[float], model: str,
                       step_log: Path, out: Path, base: str = "cpu", dtype: str = "float32"
                       ) -> tuple[str, dict[str, Any], list[Any]]:
    """Serve a calibration run (the workload with another seed, so none of the measured
    requests), ``s.num_requests`` requests split over ``rates`` so that its steps cover the
    batch sizes (and the server's own CPU use) of every measured rate, then fit the ``base``
    device's efficiency factors to the steps the live instances logged so far (warm-up
    included); writes ``out`` and returns its path, the fit's summary and the run's records."""

    per = max(1, -(-s.num_requests // len(rates)))
    records = []
    for k, rate in enumerate(rates):
        w = build_workload(target, replace(s, seed=s.seed + 1000 + k, num_requests=per), rate)
        con.print(f"  calibration run: {len(w.requests)} other requests at {rate:g} req/s")
        recs = asyncio.run(target.run(list(w.requests)))
        failed = [r.error for r in recs if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(recs)} calibration requests failed: "
                               f"{failed[0]}")
        records += recs
    snapshot = step_log.with_suffix(".calibration.jsonl")
    snapshot.write_text(step_log.read_text())
    ms = from_step_log(snapshot, model, 1, dtype)
    cal = calibrate(get_device(base), ms)
    save_hardware(out, cal.device, header=f"calibrated by benchmarks/fidelity.py on {snapshot}")
    fit = {**cal.summary(), "steps": len(ms), "file": str(out), "step_log": str(snapshot),
           "rates": rates,
           # for the record: under load the front end queues too (not what the simulator adds)
           "request_overhead_under_load": request_overhead(records)}
    con.print(f"  calibrated the {base} device on {len(ms)} logged steps: fit mean "
              f"{fit['fit']['mean']:.1%}, P90 {fit['fit']['p90']:.1%}")
    return str(out), fit, records


def step_error(hardware: str, step_log: Path, model: str, window: tuple[float, float],
               dtype: str = "float32") -> dict[str, float] | None:
    """How the calibrated step model did on the steps one measured run logged (held out from
    its fit): mean |error|, median error (bias) and the live executor's busy seconds. Separates
    a step-time error (the device ran faster or slower than when it was calibrated) from an
    error in what the simulator makes of correct step times."""

    try:
        ms = from_step_log(step_log, model, 1, dtype, window=window)
    except ValueError:
        return None
    err = np.array(relative_errors(get_device(hardware), ms))
    busy = np.array([m.seconds for m in ms])
    out = {"steps": len(ms), "mean_abs": float(np.mean(np.abs(err))),
           "median": float(np.median(err)), "busy_s": float(busy.sum()),
           # time-weighted: predicted over measured busy time, what queueing responds to
           "weighted": float((busy * (1 + err)).sum() / busy.sum() - 1),
           "window": list(window)}
    for kind in ("prefill", "decode", "mixed"):
        k = np.array([m.sample.kind == kind for m in ms])
        if k.any():
            out[kind] = {"steps": int(k.sum()), "median": float(np.median(err[k])),
                         "busy_s": float(sum(m.seconds for m, x in zip(ms, k) if x)),
                         "predicted_s": float(sum(m.seconds * (1 + e)
                                                  for m, e, x in zip(ms, err, k) if x))}
    return out


def at_speed(hardware: str, factor: float, out: Path) -> str:
    """``hardware`` running ``factor`` times as fast — every step of its roofline takes
    ``1/factor`` the time (peaks and bandwidth × factor, fixed costs ÷ factor); written to
    ``out``. With ``factor`` = 1 + a run's step-model bias (:func:`step_error`) the simulation
    runs at the speed the device had during that run: what remains is the simulator's error."""

    dev = get_device(hardware)
    e = dev.efficiency
    eff = replace(e, step_overhead_s=e.step_overhead_s / factor,
                  layer_overhead_s=e.layer_overhead_s / factor,
                  seq_overhead_s=e.seq_overhead_s / factor,
                  comm_latency_s=None if e.comm_latency_s is None else e.comm_latency_s / factor)
    save_hardware(out, replace(dev, peak_tflops=dev.peak_tflops * factor,
                               fp32_tflops=dev.fp32_tflops * factor,
                               fp8_tflops=dev.fp8_tflops * factor,
                               memory_bw_gbs=dev.memory_bw_gbs * factor, efficiency=eff),
                  header=f"{hardware} at {factor:.4f}x its speed (benchmarks/fidelity.py)")
    return str(out)


def e2e_elasticity(setup: SimulationConfig, w: Any, s: Settings, base: Any,
                   out: Path, step: float = 0.05) -> float | None:
    """How much the simulated mean E2E moves per unit of step-time error at this rate: the
    workload simulated with the device ``1 ± step`` times as fast, ``−ΔE2E/E2E ÷ Δspeed``.
    About 1 while requests rarely queue; it grows toward saturation, where a step-model error
    of ``x`` becomes an E2E error of about ``elasticity·x``."""
    e2e = base.summary.e2e.mean
    if not e2e or setup.hardware is None:
        return None
    ends = []
    for f in (1 - step, 1 + step):
        hw = at_speed(setup.hardware, f, out)
        ends.append(run_workload(SimTarget(replace(setup, hardware=hw), progress=False), w,
                                 s).summary.e2e.mean)
    if None in ends:
        return None
    return float((ends[0] - ends[1]) / e2e / (2 * step))


def summarize_repeats(rate: float, reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per rate from its repeats: the live means averaged over the repeats against the
    (deterministic) simulation, and each mean error's range over the repeats."""
    if len(reps) == 1:
        return {"rate": rate, **reps[0], "repeats": reps}
    row: dict[str, Any] = {"rate": rate, "repeats": reps}
    for key in reps[0]:
        vals = [r[key] for r in reps]
        if key.endswith("_sim") or not all(isinstance(v, (int, float)) for v in vals):
            row[key] = vals[0]
        elif key.endswith("_live"):
            row[key] = float(np.mean(vals))
    row["attainment_diff_points"] = 100 * (row["attainment_sim"] - row["attainment_live"])
    for metric in ("ttft", "tpot", "e2e"):
        for stat in ("mean", "p90"):
            row[f"{metric}_{stat}_rel_err"] = rel(row[f"{metric}_{stat}_sim"],
                                                  row[f"{metric}_{stat}_live"])
        errs = [e for r in reps if (e := r[f"{metric}_mean_rel_err"]) is not None]
        row[f"{metric}_mean_err_range"] = [min(errs), max(errs)] if errs else None
    speed = [r["at_run_speed"] for r in reps if r.get("at_run_speed")]
    if speed:
        row["at_run_speed"] = {k: float(np.mean([x[k] for x in speed])) for k in speed[0]}
    steps = [r["step_error"] for r in reps if r.get("step_error")]
    row["step_error"] = ({"median": float(np.mean([x["median"] for x in steps])),
                          "weighted": float(np.mean([x["weighted"] for x in steps])),
                          "range": [min(x["weighted"] for x in steps),
                                    max(x["weighted"] for x in steps)]} if steps else None)
    return row


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


COLUMNS = ("rate (req/s)", "attainment live / sim", "diff (points)", "mean TTFT live / sim (ms)",
           "err", "P90 TTFT err", "mean TPOT live / sim (ms)", "err", "P90 TPOT err",
           "mean E2E live / sim (s)", "err", "step-model bias (time-weighted)",
           "at the run's step speed: TTFT / TPOT / E2E err", "E2E elasticity")


def cells(r: dict[str, Any]) -> list[str]:
    """One comparison row as table cells (:data:`COLUMNS`), for the console and markdown."""
    return [f"{r['rate']:g}",
            f"{100 * r['attainment_live']:.1f} / {100 * r['attainment_sim']:.1f} %",
            f"{r['attainment_diff_points']:+.1f}",
            f"{ms(r['ttft_mean_live'])} / {ms(r['ttft_mean_sim'])}",
            pct(r["ttft_mean_rel_err"]) + _range(r.get("ttft_mean_err_range")),
            pct(r["ttft_p90_rel_err"]),
            f"{ms(r['tpot_mean_live'])} / {ms(r['tpot_mean_sim'])}",
            pct(r["tpot_mean_rel_err"]) + _range(r.get("tpot_mean_err_range")),
            pct(r["tpot_p90_rel_err"]),
            f"{r['e2e_mean_live']:.2f} / {r['e2e_mean_sim']:.2f}" if r.get("e2e_mean_sim")
            is not None and r.get("e2e_mean_live") is not None else "-",
            pct(r.get("e2e_mean_rel_err")) + _range(r.get("e2e_mean_err_range")),
            pct((r.get("step_error") or {}).get("weighted")),
            " / ".join(pct(r["at_run_speed"][f"{m}_mean_rel_err"]) for m in ("ttft", "tpot", "e2e"))
            if r.get("at_run_speed") else "-",
            "-" if r.get("e2e_elasticity") is None else f"{r['e2e_elasticity']:.1f}"]


def _range(xs: list[float] | None) -> str:
    return "" if not xs else f" ({pct(xs[0])}..{pct(xs[1])})"


def print_table(strategy: str, rows: list[dict[str, Any]]) -> None:
    t = Table(title=f"live vs simulator: {strategy}")
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*cells(r))
    Console().print(t)


def markdown(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| strategy | " + " | ".join(COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for strategy, rows in results.items():
        lines += [f"| {strategy} | " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for (strategy, rows), color in zip(results.items(), ("tab:blue", "tab:orange",
                                                         "tab:green", "tab:red", "tab:purple")):
        rates = [r["rate"] for r in rows]
        for ax, key, scale, label in ((axes[0], "attainment", 100, "SLO attainment (%)"),
                                      (axes[1], "ttft_mean", 1000, "mean TTFT (ms)"),
                                      (axes[2], "tpot_mean", 1000, "mean TPOT (ms)")):
            for side, style in (("live", "o-"), ("sim", "s--")):
                ys = [np.nan if r[f"{key}_{side}"] is None else scale * r[f"{key}_{side}"]
                      for r in rows]
                ax.plot(rates, ys, style, color=color,
                        label=f"{strategy} {'live' if side == 'live' else 'simulator'}")
            ax.set_xlabel("rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("pdserve simulator fidelity: live runtime vs simulator")
    fig.tight_layout()
    fig.savefig(out / "fidelity.png", dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", default="out/fidelity", help="model, profile and logs")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the live instances run (cuda: float16, one GPU per instance, "
                         "--latency calibrated; the simulator's device is the GPU's catalogue "
                         "entry, calibrated on the step log)")
    ap.add_argument("--hardware", help="with --device cuda: the catalogue device of the GPU "
                                       "(default: from its CUDA name)")
    ap.add_argument("--model", help="model directory (default: a tiny llama made in work-dir)")
    ap.add_argument("--latency", default="profile", choices=("profile", "calibrated"),
                    help="the simulator's step-time model: profile (pdserve profile's fit of "
                         "the executor, measured before serving) or calibrated (the analytic "
                         "roofline of the `cpu` device, calibrated on the live server's own "
                         "--step-log from a calibration run of other requests, DESIGN.md "
                         "'Latency models')")
    ap.add_argument("--calibration-rates", default=None,
                    help="with --latency calibrated: comma-separated rates of the calibration "
                         "run, --num-requests other requests split over them (default: --rates, "
                         "so its steps cover every measured rate's batch sizes)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="live runs per rate (the same requests); rows report the mean and "
                         "each error's range")
    ap.add_argument("--profile", help="fitted profile for the deployments of its TP/PP layout "
                                      "(default, and for the others: profile the model now)")
    ap.add_argument("--quick-profile", action="store_true")
    ap.add_argument("--strategies", default="colocated,disaggregated",
                    help="comma-separated deployments: colocated, disaggregated, partial, each "
                         "optionally -tpN and -ppN (colocated-tp2: one instance of two TP "
                         "ranks; colocated-pp2: one of two pipeline stages)")
    ap.add_argument("--backend", default="ray", choices=("ray", "inproc"),
                    help="ray (default): one actor and one torch thread per instance, as the "
                         "profile is measured; inproc instances share the server process and "
                         "torch's default threads, so they are not comparable with the profile")
    ap.add_argument("--workload", default="chatbot")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--length-scale", type=float, default=0.25,
                    help="multiplies the trace's prompt and output lengths")
    ap.add_argument("--rates", default="1,2,3,4,6")
    ap.add_argument("--slo-ttft", type=float, default=0.5)
    ap.add_argument("--slo-tpot", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--step-overhead-ms", type=float, default=None,
                    help="per-step serving overhead given to the simulator (default: measure "
                         "it from lone requests against each live server; 0 = executor only)")
    ap.add_argument("--request-overhead-ms", type=float, default=None,
                    help="the front end's fixed cost per request given to the simulator "
                         "(default: measure it from lone requests outside the workload; "
                         "0 = none)")
    ap.add_argument("--overhead", choices=("steplog", "probe"), default=None,
                    help="how to measure the serving overhead when --step-overhead-ms is not "
                         "given: steplog (with --latency calibrated, the default: the gaps "
                         "between consecutive steps in the calibration run's step log, fitted "
                         "with the step model from the same log) or probe (the default "
                         "otherwise: lone and 8-together requests' token gaps minus the model's "
                         "decode step)")
    ap.add_argument("--output-json")
    ap.add_argument("--output-md")
    ap.add_argument("--plot", metavar="DIR")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or make_model(work / "model", args.seed)
    calibrated = args.latency == "calibrated"
    dtype, device = "float32", "cpu"
    if args.device != "cpu":  # a GPU: its catalogue entry is calibrated on the step log
        import torch  # lazy: torch

        if not calibrated:
            raise SystemExit("--device cuda needs --latency calibrated")
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
        dtype = "float16"
        device = args.hardware or device_for_cuda_name(torch.cuda.get_device_name(0))
        if device is None:
            raise SystemExit(f"no catalogue device for {torch.cuda.get_device_name(0)!r}: "
                             f"pass --hardware")
    rates = [float(x) for x in args.rates.split(",")]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    layouts = {name: deployment(name) for name in strategies}
    profiles: dict[tuple[int, int], str] = {}  # (tp, pp) -> fitted profile (--latency profile)
    if args.profile and not calibrated:  # ours records its layout (DistServe's counts as TP1)
        path = resolve_profile(args.profile)
        doc = json.loads(Path(path).read_text())
        profiles[(int(doc.get("tp", 1)), int(doc.get("pp", 1)))] = path
    for name, (_, (tp, pp)) in layouts.items():
        if calibrated and tp * pp > 1:
            raise SystemExit(f"{name}: --latency calibrated fits a TP-1 roofline to the step "
                             f"log; a TP/PP deployment needs --latency profile")
        if not calibrated and (tp, pp) not in profiles:
            suffix = "".join(f"-{k}{n}" for k, n in (("tp", tp), ("pp", pp)) if n > 1)
            profiles[(tp, pp)] = make_profile(model, work / f"profile{suffix}.json",
                                              args.quick_profile, tp, pp)
    engine = {"device": args.device, "dtype": dtype, "block_size": args.block_size,
              "num_kv_blocks": args.num_kv_blocks,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
              "enable_chunked_prefill": args.chunked_prefill,
              # every rate (and repeat) replays the same prompts: with prefix caching the live
              # server would find them cached from the previous run while each simulation starts
              # cold (the workloads share no prefixes, so nothing else changes)
              "enable_prefix_caching": False}
    vocab = ModelConfig.from_dir(model).vocab_size
    s = Settings(workload=args.workload, num_requests=args.num_requests, seed=args.seed,
                 vocab_size=vocab, max_model_len=args.max_model_len,
                 length_scale=args.length_scale, prompt_mode="ids",
                 slo=SLO(args.slo_ttft, args.slo_tpot))
    results: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    overheads: dict[str, dict[str, Any]] = {}
    request_overheads: dict[str, dict[str, Any]] = {}
    links: dict[str, dict[str, Any]] = {}
    fits: dict[str, dict[str, Any]] = {}
    for strategy in strategies:
        # one deployment spec, served live and simulated
        entries, (tp, pp) = layouts[strategy]
        profile = profiles.get((tp, pp))
        spec = ClusterConfig.from_dict({"model": model, "engine": engine, **entries,
                                        "backend": args.backend})
        step_log = work / f"steps-{strategy}.jsonl"
        live_spec = spec
        if calibrated:  # the live instances log their steps; the simulated ones do not
            step_log.unlink(missing_ok=True)
            live_spec = replace(spec, engine={**spec.engine, "step_log": str(step_log)})
        spec_file = work / f"deployment-{strategy}.json"
        spec_file.write_text(json.dumps(live_spec.to_dict(), indent=1))
        setup = SimulationConfig(spec, profile=profile, hardware=device if calibrated else None)
        con.print(f"[bold]{strategy}[/]: starting pdserve serve --config {spec_file}")
        server = Server(spec_file, work / f"serve-{strategy}.log")
        try:
            live = HttpTarget(server.url, name=f"live {strategy}", num_gpus=1, progress=False)
            asyncio.run(live.prepare())
            warm_up(live, s)
            if calibrated:
                cal_rates = ([float(x) for x in args.calibration_rates.split(",")]
                             if args.calibration_rates else rates)
                hw, fit, cal_records = calibrate_from_run(
                    live, s, cal_rates, model, step_log,
                    work / f"{device.lower()}-calibrated-{strategy}.yaml", device, dtype)
                fits[strategy] = fit
                setup = replace(setup, hardware=hw)
            if args.step_overhead_ms is None:
                how = args.overhead or ("steplog" if calibrated else "probe")
                if how == "steplog":
                    if not calibrated:
                        raise SystemExit("--overhead steplog needs --latency calibrated")
                    cal = overhead_from_step_log(Path(fits[strategy]["step_log"]))
                else:
                    cal = calibrate_overhead(live, s, latency_of(setup, model, dtype, tp, pp))
                cal["method"] = how
                overheads[strategy] = cal
                con.print(f"  serving overhead: {1000 * cal['step_s']:.2f} ms per step + "
                          f"{1000 * cal['seq_s']:.2f} ms per sequence ({cal})")
                setup = replace(setup, step_overhead_ms=1000 * cal["step_s"],
                                seq_overhead_ms=1000 * cal["seq_s"])
            else:
                setup = replace(setup, step_overhead_ms=args.step_overhead_ms)
            if args.request_overhead_ms is not None:
                req = {"median_ms": args.request_overhead_ms, "method": "given"}
            elif "request" in overheads.get(strategy, {}):
                req = overheads[strategy]["request"]
            else:  # lone requests: the front end's own cost, not its queueing under load
                req = request_overhead([r for i in range(8) for r in _probe(live, s, 1, 3000 + i)])
            request_overheads[strategy] = req
            con.print(f"  front end: {req['median_ms']:.2f} ms per request ({req})")
            setup = replace(setup, request_overhead_ms=max(req["median_ms"], 0.0))
            if not strategy.startswith("colocated"):  # the live hand-off as the KV link
                link = handoff_link(
                    cal_records if calibrated else _probe(live, s, 4, 4000),
                    ModelConfig.from_dir(model).kv_bytes_per_token(dtype))
                if link is not None:
                    links[strategy] = link
                    con.print(f"  KV hand-off: {1000 * link['latency_s']:.2f} ms + bytes at "
                              f"{link['bandwidth_gb_per_s'] or float('inf'):.2f} GB/s ({link})")
                    setup = replace(setup, deployment=replace(setup.deployment, kv_link=Link(
                        link["bandwidth_gb_per_s"], link["latency_s"])))
            sim = SimTarget(setup, name=f"sim {strategy}", progress=False)
            live.num_gpus = sim.num_gpus
            base = build_workload(live, s, rates[0])
            rows = []
            for rate in rates:
                w = base.retimed(rate)
                sim_run = run_workload(sim, w, s)
                elasticity = (e2e_elasticity(setup, w, s, sim_run,
                                             work / f"{device.lower()}-pm5-{strategy}.yaml")
                              if calibrated else None)
                reps = []
                for _ in range(args.repeats):
                    t_start = time.time()
                    live_run = run_workload(live, w, s)
                    rep = compare(live_run, sim_run)
                    if calibrated:  # the step model on this run's own steps, held out
                        err = step_error(setup.hardware, step_log, model, (t_start, time.time()),
                                         dtype)
                        rep["step_error"] = err
                        if err is not None:  # and the simulator given this run's step speed
                            hw = at_speed(setup.hardware, 1 + err["weighted"],
                                          work / f"{device.lower()}-at-run-speed-{strategy}.yaml")
                            again = compare(live_run, run_workload(
                                SimTarget(replace(setup, hardware=hw), progress=False), w, s))
                            rep["at_run_speed"] = {
                                "attainment_diff_points": again["attainment_diff_points"],
                                **{f"{m}_mean_rel_err": again[f"{m}_mean_rel_err"]
                                   for m in ("ttft", "tpot", "e2e")}}
                    reps.append(rep)
                row = summarize_repeats(rate, reps)
                row["e2e_elasticity"] = elasticity
                rows.append(row)
                con.print(f"  rate {rate:g}: attainment live {100 * row['attainment_live']:.1f}%"
                          f" sim {100 * row['attainment_sim']:.1f}% "
                          f"({row['attainment_diff_points']:+.1f} pts); mean TTFT err "
                          f"{pct(row['ttft_mean_rel_err'])}, mean TPOT err "
                          f"{pct(row['tpot_mean_rel_err'])}")
        finally:
            server.stop()
        results[strategy] = rows
        print_table(strategy, rows)
    md = markdown(results)
    print(md)
    rep = {"command": "python benchmarks/fidelity.py " + " ".join(argv or sys.argv[1:]),
           "model": model, "profiles": {str(k): v for k, v in profiles.items()},
           "engine": engine, "backend": args.backend,
           "workload": {"name": args.workload, "num_requests": args.num_requests,
                        "length_scale": args.length_scale, "seed": args.seed},
           "slo": {"ttft": args.slo_ttft, "tpot": args.slo_tpot}, "rates": rates,
           "latency": args.latency, "calibration": fits, "step_overhead": overheads,
           "request_overhead": request_overheads, "kv_link": links,
           "results": results, "wall_s": time.perf_counter() - t0}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(rep, indent=1, default=float))
    if args.output_md:
        Path(args.output_md).write_text(md + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return rep


if __name__ == "__main__":
    main()
