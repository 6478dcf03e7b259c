"""``pdserve plan`` (placement search, DistServe §4.1/§4.2) and ``pdserve advise`` (which
strategy wins where: best colocated vs best disaggregated per-GPU goodput over SLO scale and the
workload's output/input length ratio).

Bad values (an unknown model, profile or workload, a cluster too small for the model or the
rate, an SLO nothing can meet) print one line naming the value and exit with code 2
(:func:`pdserve.flags.guarded`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import CRITERIA, SLO
from pdserve.bench.report import confirmation
from pdserve.bench.workloads import make_workload
from pdserve.config import ClusterConfig, Link, load_data_file
from pdserve.flags import (
    AUTO_DTYPE,
    add_engine_flags,
    engine_kwargs_from_args,
    link_value,
    nonnegative_int,
    output_dir,
    output_file,
    positive,
    positive_int,
    say,
    subcommand,
)
from pdserve.planner.advise import advise, advise_markdown, plot_advice
from pdserve.planner.pareto import pareto_points, plot_pareto
from pdserve.planner.placements import measure_whole
from pdserve.planner.problem import (
    ENGINE_DEFAULTS,
    SERVING_PATH,
    STRATEGIES,
    Problem,
    base_workload,
)
from pdserve.planner.search import deployment_file, plan
from pdserve.planner.units import candidate_units
from pdserve.sim.hardware import get_link
from pdserve.sim.model_catalogue import get_model_config
from pdserve.sim.target import add_latency_source_flags, add_serving_path_flags, fp8_settings

_EXCLUDE = ("role", "prefill_token_target", "device", "seed")


def register(subparsers: Any) -> None:
    p = subcommand(subparsers, "plan", cmd_plan,
                   help="search the placement that serves the most requests per GPU")
    add_problem_flags(p)
    p.add_argument("--min-gpus", action="store_true",
                   help="with --rate: choose the placement on the fewest GPUs that serves the "
                        "rate (its goodput, simulated whole where it was, at least the rate) "
                        "instead of the most goodput per GPU; every unit is then searched in "
                        "full, as with --exhaustive")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=output_file, metavar="FILE.yaml",
                   help="write the chosen deployment here (ClusterConfig + simulation section; "
                        "runs with `pdserve serve|simulate --config`)")
    o.add_argument("--output-json", type=output_file, metavar="PATH",
                   help="the whole plan as JSON (with the Pareto points of --plot)")
    o.add_argument("--plot", type=output_dir, metavar="DIR",
                   help="write plots into this folder: per-GPU goodput of the placements and "
                        "their Pareto front, tokens/s/GPU against tokens/s/user (each "
                        "placement simulated whole, simulated once more at its goodput)")
    o.add_argument("--top", type=positive_int, default=8, help="alternatives shown (default 8)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--against", nargs="+", metavar="FILE.yaml",
                   help="deployment files (e.g. hand-picked placements) to simulate whole, "
                        "with the chosen placement, by the same rate search and probes "
                        "(workload, seed, requests per probe, precision, serving path) and "
                        "list beside it")

    a = subcommand(subparsers, "advise", cmd_advise,
                   help="where does disaggregation pay? (SLO scale x output/input ratio)")
    add_problem_flags(a)
    a.add_argument("--slo-scales", default="0.5,1,2", metavar="S1,S2,...",
                   help="multiply both SLOs by each (default 0.5,1,2)")
    a.add_argument("--output-scales", default="0.5,1,2", metavar="F1,F2,...",
                   help="multiply every output length by each (the output/input ratio; "
                        "default 0.5,1,2)")
    a.add_argument("--output-json", type=output_file, metavar="PATH")
    a.add_argument("--plot", type=output_dir, metavar="DIR")
    a.add_argument("--no-progress", action="store_true")


def add_problem_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and latency source")
    m.add_argument("--model", default=Problem.model, metavar="NAME|DIR",
                   help=f"catalogue model or a directory with config.json (default "
                        f"{Problem.model})")
    add_latency_source_flags(m)
    add_serving_path_flags(m)
    w = p.add_argument_group("workload and SLO")
    w.add_argument("--workload", default=Problem.workload, metavar="NAME[:k=v]|FILE.jsonl",
                   help=f"any bench workload or trace file (default {Problem.workload})")
    w.add_argument("--num-requests", type=positive_int, default=Problem.num_requests,
                   help=f"judged requests per simulated probe, at least (steady-state rule; "
                        f"default {Problem.num_requests})")
    w.add_argument("--horizon", type=positive, default=Problem.horizon, metavar="LIFETIMES",
                   help="steady-state rule: a probe warms up for half this many request "
                        "lifetimes (TTFT SLO + mean output x TPOT SLO), then judges at least "
                        f"as many (default {Problem.horizon:g})")
    w.add_argument("--seed", type=nonnegative_int, default=Problem.seed)
    w.add_argument("--traces-dir")
    w.add_argument("--slo-ttft", type=positive, metavar="SECONDS",
                   help="TTFT objective (default: the workload's)")
    w.add_argument("--slo-tpot", type=positive, metavar="SECONDS", help="TPOT objective")
    w.add_argument("--attainment", type=positive, default=Problem.target,
                   help=f"target share of requests meeting both SLOs (default "
                        f"{Problem.target:g})")
    w.add_argument("--criterion", choices=CRITERIA, default=Problem.criterion,
                   help="both = each request meets both SLOs (default); distserve = P90 TTFT "
                        "and P90 TPOT checked separately (DistServe's variant)")
    w.add_argument("--rate", type=positive,
                   help="traffic to serve, req/s: each placement is replicated to it, and one "
                        "whose goodput (simulated whole where it was) falls short of it ranks "
                        "after every one that serves it (default: none, each placement sized "
                        "to the cluster and the most goodput per GPU chosen, as "
                        "aiconfigurator's default mode)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=positive_int, default=Problem.nodes)
    c.add_argument("--gpus-per-node", type=positive_int, default=Problem.gpus_per_node)
    c.add_argument("--gpu-memory-gib", type=positive,
                   help="memory of one GPU (default: the latency source's device)")
    c.add_argument("--intra-node-link", type=link_value, metavar="GBps[:ms]|NAME",
                   help="KV link inside a node (default: the device's, e.g. NVLink)")
    c.add_argument("--inter-node-link", type=link_value, metavar="GBps[:ms]|NAME",
                   help="KV link between nodes (default: ib-hdr with high affinity, eth-25g "
                        "with low)")
    c.add_argument("--affinity", choices=("high", "low"), default=Problem.affinity,
                   help="node affinity: high = fast cross-node network (Alg. 1), low = KV must "
                        "stay on the intra-node link (Alg. 2) (default high)")
    s = p.add_argument_group("search")
    s.add_argument("--strategies", default="colocated,disaggregated,partial",
                   help="which strategies to search: colocated (NoDG), disaggregated (FuDG), "
                        "partial (EcoServe PaDG) (default all three)")
    s.add_argument("--macro-size", type=positive_int, default=Problem.macro_size,
                   help=f"temporal instances per PaDG macro instance (default "
                        f"{Problem.macro_size}, EcoServe's N_l)")
    s.add_argument("--exhaustive", action="store_true",
                   help="search every unit to convergence: no dominance pruning, no early "
                        "stop against the best unit of its kind (full per-phase rankings)")
    s.add_argument("--joint", action=argparse.BooleanOptionalAction, default=Problem.joint,
                   help="simulate the best --top-k fitting placements of each strategy whole "
                        "at their replica counts and choose among those simulations (default "
                        "on; --no-joint ranks by estimates from units simulated alone)")
    s.add_argument("--top-k", type=positive_int, default=Problem.top_k,
                   help=f"whole-deployment simulations per algorithm or, with --joint, per "
                        f"strategy, in rounds while a next estimate beats the best whole "
                        f"result (default {Problem.top_k})")
    s.add_argument("--confirm", type=nonnegative_int, default=Problem.confirm,
                   metavar="LENGTHS",
                   help="steady-state rule 7: the leading placement of each strategy is probed "
                        "whole once more at its goodput for this many probe lengths, and keeps "
                        "the goodput that holds there (a goodput that fails is searched again "
                        f"downwards with such probes) (default {Problem.confirm}; 0: off)")
    s.add_argument("--lm", type=positive_int, default=Problem.lm,
                   help=f"DistServe's L_m for prefill instances (default {Problem.lm})")
    s.add_argument("--precision", type=positive, default=Problem.precision,
                   help=f"relative width of each goodput bracket (default {Problem.precision:g})")
    s.add_argument("--max-probes", type=positive_int, default=Problem.max_probes,
                   help=f"probes per rate search (default {Problem.max_probes})")
    s.add_argument("--max-tp", type=positive_int)
    s.add_argument("--max-pp", type=positive_int)
    s.add_argument("--workers", type=positive_int, help="processes (default: up to 2 cores)")
    add_engine_flags(p, _EXCLUDE, {**ENGINE_DEFAULTS, "dtype": AUTO_DTYPE})


def problem_from_args(args: argparse.Namespace, **over: Any) -> Problem:
    model = get_model_config(args.model)  # unknown model: one clear error now
    name = args.model if not Path(args.model).is_dir() else args.model
    if args.attainment > 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment:g}")
    w = make_workload(args.workload, 1, seed=args.seed, rate=1.0, vocab_size=model.vocab_size,
                      traces_dir=args.traces_dir, prompt_mode="ids")
    d = w.default_slo
    if (args.slo_ttft is None or args.slo_tpot is None) and d is None:
        raise ValueError(f"workload {args.workload!r} has no default SLO: give --slo-ttft and "
                         "--slo-tpot")
    slo = SLO(args.slo_ttft if args.slo_ttft is not None else d.ttft,  # type: ignore[union-attr]
              args.slo_tpot if args.slo_tpot is not None else d.tpot)  # type: ignore[union-attr]

    def link(v: Any) -> Any:
        if v is None or isinstance(v, Link):
            return v
        return get_link(v)  # a catalogue link is a Link

    if args.aic_backend is not None and args.aic_system is None:
        raise ValueError(f"--aic-backend {args.aic_backend}: give --aic-system too")
    min_gpus = getattr(args, "min_gpus", False)  # (plan's; advise compares per GPU)
    if min_gpus and args.rate is None:
        raise ValueError("--min-gpus: give --rate, the traffic to serve on the fewest GPUs")
    aic = {"aic_system": args.aic_system, "aic_backend": args.aic_backend or "vllm",
           "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype or "auto"}
    kw = dict(model=name, profile=args.profile, hardware=args.hardware, **aic,
              workload=args.workload,
              num_requests=args.num_requests, seed=args.seed, slo=slo, target=args.attainment,
              rate=args.rate, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
              gpu_memory_gib=args.gpu_memory_gib, intra_node_link=link(args.intra_node_link),
              inter_node_link=link(args.inter_node_link), affinity=args.affinity,
              engine=tuple(engine_kwargs_from_args(args).items()), lm=args.lm,
              precision=args.precision, max_probes=args.max_probes, max_tp=args.max_tp,
              max_pp=args.max_pp, joint=args.joint, top_k=args.top_k,
              traces_dir=args.traces_dir, macro_size=args.macro_size, horizon=args.horizon,
              criterion=args.criterion, min_gpus=min_gpus, confirm=args.confirm,
              **{k: getattr(args, k) or 0.0 for k in SERVING_PATH})
    kw.update(over)
    return Problem(**kw)


def _strategies(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = set(out) - set(STRATEGIES)
    if bad or not out:
        raise ValueError(f"--strategies: expected some of {','.join(STRATEGIES)}, got {text!r}")
    return out


class _Progress:
    """Progress on stderr: a rich bar of phase units (and, for ``advise``, of grid cells with
    an ETA from the cells done) on a terminal; plain lines when stderr is not one; nothing
    with ``--no-progress``."""

    def __init__(self, enabled: bool, what: str, cells: int | None = None) -> None:
        import time

        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.enabled, self.what, self.cells = enabled, what, cells
        self.tty = enabled and sys.stderr.isatty()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            console=Console(stderr=True), disable=not self.tty,
                            transient=True)
        self.clock = time.perf_counter
        self.t0 = self.clock()
        self.started: dict[str, float] = {}  # cell label -> when it started
        self.done_units = self.done_cells = self.total_units = 0
        self.task: Any = None
        self.cell_task: Any = None

    def __enter__(self) -> _Progress:
        self.bar.__enter__()
        if self.cells is not None:
            self.cell_task = self.bar.add_task("cells", total=self.cells)
        self.task = self.bar.add_task(self.what, total=None)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def _line(self, text: str) -> None:
        if self.enabled and not self.tty:
            print(text, file=sys.stderr, flush=True)

    def start_cell(self, label: str, units: int) -> None:
        """A cell starts (``advise`` runs several at once: the units bar counts them all)."""
        self.started[label] = self.clock()
        self.total_units += units
        self.bar.update(self.task, total=self.total_units)
        cell = "" if self.cells is None else f"cell {len(self.started)}/{self.cells}: "
        self._line(f"{cell}{label}: {units} phase units")

    def end_cell(self, label: str, summary: str) -> None:
        self.done_cells += 1
        took = self.clock() - self.started[label]
        left = (self.clock() - self.t0) / self.done_cells * ((self.cells or 0) - self.done_cells)
        if self.cell_task is not None:
            self.bar.update(self.cell_task, advance=1, description=f"cells (~{left:.0f} s left)")
        self._line(f"cell {self.done_cells}/{self.cells} done in {took:.0f} s: {label}: "
                   f"{summary}; ETA {left:.0f} s")

    def stage(self, text: str) -> None:
        """A step after the units (whole-placement simulations, confirmations): the bar's
        description, or a plain line."""
        self.bar.update(self.task, description=f"{self.what}: {text[:70]}")
        self._line(f"  {text}")

    def __call__(self, r: Any) -> None:
        self.done_units += 1
        self.bar.update(self.task, advance=1, description=f"{self.what}: {r.unit.label}")
        how = r.pruned or r.stopped or f"{len(r.probes)} probes"
        self._line(f"  unit {self.done_units}: {r.unit.label}: {r.goodput_rps:.3f} req/s "
                   f"({how}; {r.wall_s:.1f} s)")


def cmd_plan(args: argparse.Namespace) -> int:
    """DistServe's placement search (§4): for a model, a latency source, a workload, SLOs, a
    traffic rate (or none: the most goodput per GPU on the cluster) and a cluster, simulate
    every parallelism (TP, PP) of each phase and of colocated instances, replicate to the rate
    (Alg. 1, high node affinity) or pack prefill and decode segments of one stage per node
    (Alg. 2, low affinity), and write the best deployment."""

    p = problem_from_args(args)

    strategies = _strategies(args.strategies)
    with _Progress(not args.no_progress, "simulating units") as bar:
        bar.start_cell("plan", len(candidate_units(p, strategies)))
        result = plan(p, args.workers, bar, strategies, prune=not args.exhaustive,
                      on_stage=bar.stage)
    print(plan_markdown(result, args.top))
    against = None
    if args.against:
        against = compare_whole(result, args.against, args.workers or 1)
        print("\n" + against_markdown(against))
    spec = deployment_file(result)
    points = None
    if args.plot or args.output_json:
        points = pareto_points(result, args.workers or 1)
    if args.out:
        write_yaml(args.out, spec, result)
        say(f"wrote {args.out}; run it with `{serve_command(result, args.out)}` or "
            f"`{simulate_command(result, args.out)}`")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps({**result.to_dict(), "deployment": spec,
                                                      "against": against, "pareto": points},
                                                     indent=2, default=str) + "\n")
        say(f"wrote {args.output_json}")
    if args.plot:
        assert points is not None
        for path in [*plot_plan(result, Path(args.plot), args.top),
                     plot_pareto(result, points, Path(args.plot))]:
            say(f"wrote {path}")
    return 0


def compare_whole(result: Any, files: list[str], workers: int) -> list[dict[str, Any]]:
    """The chosen placement and each deployment file simulated whole with the plan's probes
    (:func:`pdserve.planner.search.measure_whole`), on the plan's latency source and serving
    path. A file whose ``simulation:`` section names another latency source or other
    serving-path terms is refused: the comparison would not be like for like."""

    p = result.problem
    mine = p.source()
    deps: list[tuple[str, dict[str, Any]]] = [(f"chosen: {result.best.name}",
                                               result.best.deployment)]
    for f in files:
        d = load_data_file(f, "deployment file")
        if not isinstance(d, dict):
            raise ValueError(f"--against {f}: expected a deployment mapping")
        sim = d.pop("simulation", None) or {}
        theirs = {k: sim[k] for k in ("profile", "hardware", "aic_system") if sim.get(k)}
        if "aic_system" in theirs:
            theirs["aic_backend"] = sim.get("aic_backend") or "vllm"
            theirs.update(fp8_settings(sim.get("quantization"),
                                       sim.get("kv_cache_dtype") or "auto"))
        if theirs and theirs != mine:
            raise ValueError(f"--against {f}: latency source {theirs} is not the plan's {mine}")
        for k in SERVING_PATH:
            if sim.get(k) is not None and sim[k] != getattr(p, k):
                raise ValueError(f"--against {f}: {k} {sim[k]!r} is not the plan's "
                                 f"{getattr(p, k):g} (--{k.replace('_', '-')})")
        ClusterConfig.from_dict(d)  # validates
        deps.append((Path(f).stem, d))
    return measure_whole(p, deps, result.best.per_gpu_rps, workers)


def against_markdown(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["per_gpu_rps"]
    lines = ["| placement (simulated whole, same probes) | GPUs | goodput (req/s) | per GPU | "
             "chosen / this | over a long probe (rule 7) |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = f"{base / r['per_gpu_rps']:.2f}x" if r["per_gpu_rps"] > 0 else "–"
        c = r.get("confirmed")
        long = "–" if c is None else confirmation(c)
        lines.append(f"| {r['name']} | {r['num_gpus']} | {r['goodput_rps']:.3f} | "
                     f"{r['per_gpu_rps']:.3f} | {ratio} | {long} |")
    return "\n".join(lines)


def serve_command(result: Any, path: str) -> str:
    """The ``pdserve serve`` command line for the written deployment: a catalogue model
    (shapes only) needs ``--model DIR`` with its weights, which overrides the file's model."""
    q = shlex.quote
    model = "" if Path(result.problem.model).is_dir() else " --model CHECKPOINT_DIR"
    return f"pdserve serve --config {q(str(path))}{model}"


def simulate_command(result: Any, path: str) -> str:
    """The ``pdserve simulate`` command line that replays the planned workload, rate and SLO
    on the written deployment (the file holds the deployment and its latency source; the
    workload is the command's, as for ``serve``). Without a planned rate, the rate is the
    chosen placement's goodput."""
    p = result.problem
    q = shlex.quote
    rate = p.rate if p.rate is not None else result.best.goodput_rps
    return (f"pdserve simulate --config {q(str(path))} --workload {q(p.workload)} "
            f"--rate {rate:.4g} --num-requests {p.num_requests} --seed {p.seed} "
            f"--slo-ttft {p.slo.ttft:g} --slo-tpot {p.slo.tpot:g}")


def _how(pl: Any, units: str) -> str:
    """Where a placement's goodput comes from: phase units, a whole simulation, or a whole
    simulation confirmed over a long probe (steady-state rule 7)."""
    if pl.confirmed is not None:
        return confirmation(pl.confirmed)
    return "simulated whole" if pl.simulated else units


def write_yaml(path: str, spec: dict[str, Any], result: Any) -> None:
    import yaml

    best = result.best
    how = _how(best, "from phase units")
    head = [f"# pdserve plan: {best.name}",
            f"# predicted goodput {best.goodput_rps:.3f} req/s on {best.num_gpus} GPUs = "
            f"{best.per_gpu_rps:.3f} req/s per GPU ({how})",
            "# node layout:"] + [f"#   {line}" for line in best.layout]
    head.append(f"# serve it live: {serve_command(result, path)}")
    head.append(f"# simulate what was planned: {simulate_command(result, path)}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(head) + "\n" + yaml.safe_dump(spec, sort_keys=False))


_CRITERION_TEXT = {"both": "both SLOs per request",
                   "distserve": "DistServe's criterion: P90 TTFT and P90 TPOT separately"}


def plan_markdown(result: Any, top: int = 8) -> str:
    p = result.problem
    rate = "no rate" if p.rate is None else f"{p.rate:g} req/s"
    lines = [f"## pdserve plan: {p.model} · {p.workload} · {rate} · "
             f"{p.nodes}x{p.gpus_per_node} GPUs · {p.affinity} node affinity",
             "",
             f"Objective: {p.objective()}.",
             "",
             f"SLO TTFT {p.slo.ttft:g} s, TPOT {p.slo.tpot:g} s, target {p.target:.0%} "
             f"({_CRITERION_TEXT[p.criterion]}); "
             f"steady-state probes (warm-up {p.horizon / 2:g} request lifetimes, then at least "
             f"{p.num_requests} judged requests over as long); latency source "
             f"{p.latency_source()}; planned in "
             f"{result.wall_s:.1f} s",
             "",
             "| rank | placement | algorithm | GPUs | goodput (req/s) | per GPU | output tok/s "
             "per GPU | how |",
             "|---|---|---|---|---|---|---|---|"]

    w = base_workload(p)
    mean_out = sum(r.output_len for r in w.requests) / len(w.requests)
    for i, pl in enumerate([result.best, *result.alternatives][:top]):
        how = _how(pl, "phase units")
        lines.append(f"| {i + 1} | {pl.name} | {pl.algorithm} | {pl.num_gpus} | "
                     f"{pl.goodput_rps:.3f} | {pl.per_gpu_rps:.3f} | "
                     f"{pl.per_gpu_rps * mean_out:.0f} | {how} |")
    lines += ["", f"**Chosen:** {result.best.name} — {result.best.per_gpu_rps:.3f} req/s per GPU.",
              "", "| strategy | best placement | per GPU | vs chosen |", "|---|---|---|---|"]
    for strat in ("colocated", "disaggregated", "partial"):
        b = result.best_of(strat)
        if b is not None:
            lines.append(f"| {strat} | {b.name} | {b.per_gpu_rps:.3f} | "
                         f"{b.per_gpu_rps / result.best.per_gpu_rps:.2f}x |")
        elif strat in result.strategies:
            lines.append(f"| {strat} | none: {result.why_none(strat)} | – | – |")
    if result.advantage is not None:
        lines.append(f"Best disaggregated / best colocated per-GPU goodput: "
                     f"{result.best_disaggregated.per_gpu_rps:.3f} / "
                     f"{result.best_colocated.per_gpu_rps:.3f} = {result.advantage:.2f}x "
                     f"({'disaggregation pays' if result.advantage > 1 else 'colocation wins'}).")
    lines += ["", "Node layout:", *[f"- {x}" for x in result.best.layout], "",
              "| phase unit | goodput (req/s) | per GPU | probes | note |", "|---|---|---|---|---|"]
    for u in result.units:
        g = f"< {u.bound_rps:.3f}" if u.stopped else f"{u.goodput_rps:.3f}"
        pg = f"< {u.bound_rps / u.unit.num_gpus:.3f}" if u.stopped else f"{u.per_gpu_rps:.3f}"
        lines.append(f"| {u.unit.label} | {g} | {pg} | {len(u.probes)} | "
                     f"{u.pruned or u.stopped or ''} |")
    lines += [f"- {n}" for n in result.notes]
    return "\n".join(lines)


def plot_plan(result: Any, folder: Path, top: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    pls = [result.best, *result.alternatives][:top]
    for extra in (result.best_colocated, result.best_disaggregated, result.best_partial):
        if extra is not None and extra not in pls:
            pls.append(extra)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(pls) + 1.5))
    palette = {"colocated": "tab:blue", "disaggregated": "tab:orange", "partial": "tab:green"}
    colors = [palette[x.strategy] for x in pls]
    ax.barh([x.name for x in pls][::-1], [x.per_gpu_rps for x in pls][::-1], color=colors[::-1])
    ax.set_xlabel("per-GPU goodput (req/s)")
    rate = result.problem.rate
    ax.set_title(f"{result.problem.model} · {result.problem.workload} · "
                 f"{'no rate' if rate is None else f'{rate:g} req/s'}\n"
                 "(blue colocated, orange disaggregated, green partial)")
    fig.tight_layout()
    path = folder / "placements.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _floats(text: str, name: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected numbers separated by commas, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"{name}: expected positive numbers, got {text!r}")
    return vals


def cmd_advise(args: argparse.Namespace) -> int:
    """Plan colocated, disaggregated and partial placements over a grid of SLO scales and
    output-length scales and report (and plot) the best per-GPU goodput of each strategy at
    every point."""

    base = problem_from_args(args)
    scales = _floats(args.slo_scales, "--slo-scales")
    outs = _floats(args.output_scales, "--output-scales")

    strategies = _strategies(args.strategies)
    units = len(candidate_units(base, strategies))
    with _Progress(not args.no_progress, "simulating units", len(scales) * len(outs)) as bar:
        def cell(slo_scale: float, output_scale: float, point: Any) -> None:
            label = f"SLO x{slo_scale:g}, output x{output_scale:g}"
            if point is None:
                bar.start_cell(label, units)
            else:
                bar.end_cell(label, f"best colocated {point.colocated_per_gpu:.3f}, "
                                    f"disaggregated {point.disaggregated_per_gpu:.3f}, "
                                    f"partial {point.partial_per_gpu:.3f} req/s per GPU "
                                    f"({point.winner} wins)")

        grid = advise(base, scales, outs, args.workers, bar, strategies, on_cell=cell,
                      on_stage=bar.stage)
    print(advise_markdown(base, grid))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps([g.to_dict() for g in grid], indent=2,
                                                     default=str) + "\n")
        say(f"wrote {args.output_json}")
    if args.plot:
        say(f"wrote {plot_advice(base, grid, Path(args.plot))}")
    return 0
