"""``pdserve bench`` (one rate), ``pdserve goodput`` (search) and ``pdserve compare`` (several
targets, one table and one plot).

``register(subparsers)`` adds the three subcommands to an argparse subparsers object; each sets
``func``, which takes the parsed namespace and returns the exit code (0 ok, 1 the run failed,
2 a bad flag or value — reported in one line, without a traceback). ``python -m pdserve.bench``
runs them standalone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from pdserve.bench import report
from pdserve.bench.arrivals import ARRIVALS
from pdserve.bench.goodput import Probe
from pdserve.bench.metrics import CRITERIA
from pdserve.bench.runner import (
    DEFAULT_SCALES,
    Run,
    SearchRun,
    Settings,
    build_workload,
    find_goodput,
    prepare,
    rate_grid,
    resolve_slo,
    run_workload,
)
from pdserve.bench.steady import CONFIRM
from pdserve.bench.steady import DEFAULT as DEFAULT_STEADY
from pdserve.bench.targets import Target, make_target, target_names
from pdserve.bench.workloads import Workload, workload_help
from pdserve.config import load_data_file
from pdserve.flags import (
    UsageError,
    nonnegative_int,
    output_dir,
    output_file,
    positive,
    positive_int,
    subcommand,
)
from pdserve.tokenizer import load_tokenizer

_err = Console(stderr=True, highlight=False, soft_wrap=True)


def say(msg: str) -> None:
    _err.print(msg, markup=False)


# ------------------------------------------------------------------------------- value types
def fraction(text: str) -> float:
    """0.9 or 90 (percent) → 0.9."""
    v = positive(text)
    v = v / 100 if 1 < v <= 100 else v
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1] or a percentage, "
                                         f"got {text!r}")
    return v


def share_or_zero(text: str) -> float:
    v = float(_number_or_fail(text))
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], got {text!r}")
    return v


def _number_or_fail(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def scale_arg(text: str) -> float | str:
    return "fit" if text == "fit" else positive(text)


def rate_list(text: str) -> list[float]:
    return [positive(t) for t in text.split(",") if t.strip()]


def key_value(text: str) -> tuple[str, str]:
    key, eq, val = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), val.strip()


# ------------------------------------------------------------------------------------ flags
def add_workload_args(p: argparse.ArgumentParser, max_model_len: bool = True) -> None:
    """The workload and arrival flags (shared with ``pdserve simulate``, whose engine flags
    hold ``--max-model-len``: ``max_model_len=False``)."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="chatbot", metavar="NAME[:k=v,...]|FILE.jsonl",
                   help=f"{workload_help()} (default: %(default)s)")
    w.add_argument("--num-requests", type=positive_int, default=200,
                   help="requests per run; a goodput probe's judged requests at least "
                        "(default: %(default)s)")
    w.add_argument("--seed", type=nonnegative_int, default=0,
                   help="workload seed: which requests, their arrival pattern "
                        "(default: %(default)s)")
    w.add_argument("--arrival", choices=ARRIVALS,
                   help="arrival process (default: trace for timestamped traces, else poisson)")
    w.add_argument("--cv", type=positive,
                   help="coefficient of variation for --arrival gamma (default: 1)")
    w.add_argument("--vocab-size", type=positive_int,
                   help="synthetic token ids are drawn below this (default: the target's "
                        "vocabulary as /v1/models or the simulated model reports it, else "
                        "--tokenizer's, else 32000)")
    if max_model_len:
        w.add_argument("--max-model-len", type=positive_int,
                       help="clip requests to this context (default: what the server reports)")
    w.add_argument("--length-scale", type=scale_arg, default=1.0,
                   help="multiply prompt and output lengths (or 'fit': P99 fits the context) "
                        "(default: %(default)s)")
    w.add_argument("--prompt-mode", choices=("auto", "ids"), default="auto",
                   help="auto: send text where the trace has text; ids: always token ids "
                        "(default: %(default)s)")
    w.add_argument("--tokenizer", metavar="MODEL_DIR",
                   help="tokenize text prompts with this model's tokenizer (exact lengths)")
    w.add_argument("--traces-dir", help="folder of trace files (default: $PDSERVE_TRACES or "
                                        "../shared/traces)")


def add_slo_args(p: argparse.ArgumentParser) -> None:
    """The SLO flags (shared with ``pdserve simulate``)."""
    s = p.add_argument_group("SLO")
    # `pdserve simulate` already has them from the deployment flags (EcoServe's router admits
    # against the same objectives): one flag sets both
    if "--slo-ttft" not in p._option_string_actions:
        s.add_argument("--slo-ttft", type=positive, metavar="SECONDS",
                       help="TTFT objective (default: the workload's, e.g. DistServe Table 1)")
        s.add_argument("--slo-tpot", type=positive, metavar="SECONDS",
                       help="TPOT objective (default: the workload's)")
    s.add_argument("--attainment", type=fraction, default=0.9,
                   help="target share of requests meeting both SLOs (default 0.9)")
    s.add_argument("--criterion", choices=CRITERIA, default="both",
                   help="both: both SLOs per request (default); distserve: P-target TTFT and "
                        "TPOT checked separately")
    s.add_argument("--slo-scales", type=rate_list, default=list(DEFAULT_SCALES),
                   metavar="S1,S2,...",
                   help="SLO scales for the attainment-vs-scale sweep (default: 0.2 to 3 in "
                        "steps of 0.2)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """The output flags (shared with ``pdserve simulate``)."""
    o = p.add_argument_group("output")
    o.add_argument("--output-json", type=output_file, metavar="PATH")
    o.add_argument("--output-md", type=output_file, metavar="PATH",
                   help="write the markdown report here too")
    o.add_argument("--plot", type=output_dir, metavar="DIR",
                   help="write PNG plots into this folder")
    o.add_argument("--save-records", action="store_true",
                   help="include every request's timeline in the JSON")
    o.add_argument("--no-progress", action="store_true")


def _add_common(p: argparse.ArgumentParser, multi: bool = False) -> None:
    if multi:
        p.add_argument("--target", action="append", default=[], metavar="NAME=TARGET",
                       help="a target to compare (repeat): NAME=URL or NAME=sim")
        p.add_argument("--targets-config", metavar="FILE",
                       help="JSON/YAML list of {name, target, num_gpus, model, options}")
        p.add_argument("--num-gpus", action="append", default=[], metavar="[NAME=]N",
                       help="GPUs per target for per-GPU numbers (N for all, or NAME=N; "
                            "default: what a pdserve server reports, else 1)")
    else:
        p.add_argument("--target", required=True, metavar="URL|NAME",
                       help=f"server URL (http://host:port) or one of: {', '.join(target_names())}")
        p.add_argument("--num-gpus", type=positive_int, default=None,
                       help="GPUs the target uses (per-GPU numbers divide by it) (default: "
                            "what a pdserve server reports, else 1, marked as assumed)")
    add_workload_args(p)
    add_slo_args(p)
    c = p.add_argument_group("client")
    c.add_argument("--model", help="model name to request (default: the server's first)")
    c.add_argument("--api-key")
    c.add_argument("--max-concurrency", type=positive_int, default=1024,
                   help="safety cap on open requests (arrivals stay open-loop) "
                        "(default: %(default)s)")
    c.add_argument("--timeout", type=positive, default=300.0,
                   help="seconds a request may wait for data before it fails "
                        "(default: %(default)s)")
    c.add_argument("--no-timeline", action="store_true",
                   help="do not ask the server for request timelines")
    c.add_argument("--scrape-metrics", metavar="FILE", type=output_file,
                   help="append the server's Prometheus /metrics, scraped during every run, to "
                        "FILE as JSON lines (pdserve's or vLLM's; `pdserve calibrate "
                        "--metrics-log FILE` fits a device to them)")
    c.add_argument("--scrape-interval", type=positive, default=None, metavar="SECONDS",
                   help="seconds between scrapes with --scrape-metrics (default: 0.5)")
    c.add_argument("--max-failed", type=share_or_zero, default=0.0, metavar="SHARE",
                   help="exit 1 when more than this share of a run's requests fail (an HTTP "
                        "error, a dropped stream; not an SLO miss) (default: %(default)s)")
    c.add_argument("--target-option", type=key_value, action="append", default=[],
                   metavar="KEY=VALUE", help="passed to registered targets (e.g. sim)")
    add_output_args(p)


def _add_search(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search")
    g.add_argument("--rate-lo", type=positive, help="first lower rate (default: --rate / 2)")
    g.add_argument("--precision", type=positive, default=0.1,
                   help="stop when the bracket is this narrow (req/s, default 0.1)")
    g.add_argument("--max-probes", type=positive_int, default=16,
                   help="cap on runs per search (default 16)")
    g.add_argument("--horizon", type=positive, default=DEFAULT_STEADY.horizon,
                   metavar="LIFETIMES",
                   help="steady-state rule: a probe's arrivals span this many request "
                        "lifetimes (TTFT SLO + mean output x TPOT SLO), the second half judged "
                        f"(at least --num-requests of them) (default {DEFAULT_STEADY.horizon:g})")
    g.add_argument("--confirm", type=nonnegative_int, default=CONFIRM, metavar="LENGTHS",
                   help="steady-state rule 7: the goodput found is probed once more for this "
                        "many probe lengths and, if it does not hold there, searched downwards "
                        f"with such probes; the goodput reported is the one that held (default "
                        f"{CONFIRM}; 0: off)")


def register(subparsers: Any) -> None:
    b = subcommand(subparsers, "bench", cmd_bench,
                   help="run a workload at one rate and report latency/SLO",
                   description="Run a workload against a target at one rate.")
    _add_common(b)
    b.add_argument("--rate", type=positive,
                   help="mean arrival rate, req/s (timestamped traces: default their own)")

    g = subcommand(subparsers, "goodput", cmd_goodput,
                   help="find the highest rate meeting the SLO target",
                   description="Goodput search by expanding bisection on the rate.")
    _add_common(g)
    g.add_argument("--rate", type=positive, help="first upper rate to probe (default 1)")
    _add_search(g)

    c = subcommand(subparsers, "compare", cmd_compare,
                   help="goodput of several targets on one workload",
                   description="Run the same workload against several targets.")
    _add_common(c, multi=True)
    c.add_argument("--rate", type=positive, help="first upper rate of each search (default 1)")
    c.add_argument("--rates", type=rate_list, metavar="R1,R2,...",
                   help="probe this grid of rates instead of searching")
    _add_search(c)


# ---------------------------------------------------------------------------------- helpers
def settings_from_args(args: argparse.Namespace) -> Settings:
    tok = None
    if args.tokenizer:
        hf = load_tokenizer(args.tokenizer)
        tok = lambda text: hf.encode(text)
    vocab = args.vocab_size or (len(hf) if args.tokenizer else None)
    return Settings(workload=args.workload, num_requests=args.num_requests, seed=args.seed,
                    arrival=args.arrival, cv=args.cv, vocab_size=vocab,
                    max_model_len=args.max_model_len, length_scale=args.length_scale,
                    prompt_mode=args.prompt_mode, tokenizer=tok, traces_dir=args.traces_dir,
                    target=args.attainment, criterion=args.criterion, scales=args.slo_scales,
                    horizon=getattr(args, "horizon", DEFAULT_STEADY.horizon))


def _setup(args: argparse.Namespace, target: Target, rate: float | None,
           need_slo: bool) -> tuple[Settings, Workload]:
    s = settings_from_args(args)
    prepare(target)
    w = build_workload(target, s, rate)
    s.slo = resolve_slo(s, w, args.slo_ttft, args.slo_tpot)
    if need_slo and s.slo is None:
        raise UsageError(f"workload {w.name!r} has no default SLO: give --slo-ttft and "
                         "--slo-tpot")
    if w.scaling.num_clipped:
        say(f"{w.scaling.num_clipped} of {len(w)} requests clipped to "
                   f"max_model_len={w.scaling.max_model_len}")
    return s, w


def _target(args: argparse.Namespace, spec: str, name: str | None = None) -> Target:
    args.target_options = dict(getattr(args, "target_option", []))
    return make_target(spec, args, name)


def report_header(s: Settings, w: Workload) -> dict[str, Any]:
    return {"workload": w.describe(), "slo": None if s.slo is None else vars(s.slo),
            "target_attainment": s.target, "criterion": s.criterion}


def write_report(args: argparse.Namespace, md: str, data: dict[str, Any]) -> None:
    print(md)
    if args.output_md:
        Path(args.output_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_md).write_text(md)
    if args.output_json:
        report.write_json(args.output_json, data)
        say(f"wrote {args.output_json}")


def write_plots(args: argparse.Namespace, s: Settings, runs: dict[str, Run | None],
           searches: dict[str, SearchRun] | None = None,
           gpus: dict[str, int] | None = None) -> None:
    if not args.plot:
        return
    d = Path(args.plot)
    done = [r for r in runs.values() if r is not None]
    named = {k: r for k, r in runs.items() if r is not None}
    paths = []
    if searches:
        curves = {k: [(p.rate, p.attainment) for p in sr.result.probes]
                  for k, sr in searches.items()}
        paths.append(report.plot_attainment_vs_rate(
            curves, s.target, d / "attainment_vs_rate.png", gpus,
            {k: sr.result.goodput_rps for k, sr in searches.items()}))
    if done and s.slo is not None:
        paths.append(report.plot_attainment_vs_scale(
            {k: [(p.rate, p.attainment) for p in r.sweep.points]
             for k, r in named.items() if r.sweep}, s.target, d / "attainment_vs_slo_scale.png"))
    if done:
        paths.append(report.plot_latency_cdfs({k: r.records for k, r in named.items()},
                                              d / "latency_cdf.png", s.slo))
    bds = {k: r.summary.breakdown for k, r in named.items() if r.summary.breakdown}
    if bds:
        paths.append(report.plot_breakdown(bds, d / "breakdown.png"))
    for p in paths:
        say(f"wrote {p}")


def _judged(p: Probe) -> str:
    d = p.details
    if "judged" not in d:
        return ""
    return (f" (judged {d['judged']} of {d['num_requests']} requests, "
            f"confidence {d['confidence']:.0%})")


def _log_probe(name: str) -> Any:
    def log(p: Probe) -> None:
        mark = "[green]pass[/]" if p.passed else "[red]fail[/]"
        what = (f"confirmation probe {p.index} (rule 7)" if p.phase == "confirm" else
                f"probe {p.index} ({p.phase})")
        _err.print(f"{name} {what}: rate {p.rate:.4g} req/s → "
                   f"attainment {p.attainment:.1%} {mark}{_judged(p)}")
    return log


# --------------------------------------------------------------------------------- commands
def cmd_bench(args: argparse.Namespace) -> int:
    target = _target(args, args.target)
    s, w = _setup(args, target, args.rate, need_slo=False)
    run = run_workload(target, w, s)
    md = report.summary_markdown(run.summary, f"{target.name} · {w.name} · {len(w)} requests")
    write_report(args, md, {"command": "bench", "target": target.name, "num_gpus": target.num_gpus,
                      **report_header(s, w), **run.to_dict(args.save_records)})
    write_plots(args, s, {target.name: run})
    return check_failures(args, {target.name: run})


def check_failures(args: argparse.Namespace, runs: dict[str, Run | None]) -> int:
    """1 (and one line per target) when a run's failed share is above ``--max-failed``."""
    code = 0
    for name, run in runs.items():
        if run is None:
            continue
        s = run.summary
        if s.num_requests and s.num_failed / s.num_requests > args.max_failed:
            kinds = "; ".join(f"{n}x {k}" for k, n in sorted(s.errors.items(),
                                                             key=lambda kv: -kv[1])[:3])
            say(f"{name}: {s.num_failed} of {s.num_requests} requests failed "
                f"(--max-failed {args.max_failed:g}): {kinds}")
            code = 1
    return code


def _search(args: argparse.Namespace, target: Target, s: Settings, w: Workload) -> SearchRun:
    if getattr(args, "rates", None):
        return rate_grid(target, s, args.rates, _log_probe(target.name), base=w,
                         confirm=args.confirm, precision=args.precision,
                         max_probes=args.max_probes)
    return find_goodput(target, s, args.rate or 1.0, args.rate_lo, args.precision,
                        args.max_probes, _log_probe(target.name), base=w, confirm=args.confirm)


def _search_dict(sr: SearchRun, save_records: bool) -> dict[str, Any]:
    r = sr.result
    return {"goodput_rps": r.goodput_rps, "per_gpu_goodput_rps": r.per_gpu_goodput_rps,
            "num_gpus": r.num_gpus, "converged": r.converged, "note": r.note,
            "bracket": {"lo": r.lo, "hi": r.hi}, "precision": r.precision,
            "probes": [vars(p) for p in r.probes], "confirmed": sr.confirmed,
            "at_goodput": sr.best.to_dict(save_records) if sr.best else None}


def cmd_goodput(args: argparse.Namespace) -> int:
    target = _target(args, args.target)
    s, w = _setup(args, target, args.rate or 1.0, need_slo=True)
    sr = _search(args, target, s, w)
    md = report.probes_markdown(sr.result, sr.confirmed)
    if sr.best:
        md += "\n" + report.summary_markdown(
            sr.best.summary, f"at the goodput rate ({sr.best.judged} judged requests, after the "
                             "warm-up)")
    write_report(args, md, {"command": "goodput", "target": target.name, **report_header(s, w),
                      **_search_dict(sr, args.save_records)})
    write_plots(args, s, {target.name: sr.best}, {target.name: sr}, {target.name: target.num_gpus})
    return check_failures(args, {target.name: sr.best})


def _compare_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = []
    if args.targets_config:
        specs += _read_config(args.targets_config)
    for t in args.target:
        name, eq, spec = t.partition("=")
        if not eq or name.startswith(("http://", "https://")):
            name, spec = t, t
        specs.append({"name": name, "target": spec})
    if not specs:
        raise UsageError("compare needs targets: --target NAME=URL (repeat) or --targets-config")
    names = [sp["name"] for sp in specs]
    if not all(isinstance(n, str) and n.strip() for n in names):
        raise UsageError(f"every target needs a name (NAME=URL), got {names}")
    if len(set(names)) != len(names):
        raise UsageError(f"target names must be unique, got {names}")
    default_gpus = None
    for g in args.num_gpus:
        name, eq, n = g.rpartition("=")
        try:
            count = positive_int(n)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"--num-gpus {g!r}: {e}") from None
        if not eq:
            default_gpus = count
        elif name not in names:
            raise UsageError(f"--num-gpus {g!r} names an unknown target (targets: {names})")
        else:
            next(sp for sp in specs if sp["name"] == name)["num_gpus"] = count
    for sp in specs:
        sp.setdefault("num_gpus", default_gpus)  # None: what the server reports
    return specs


def _read_config(path: str) -> list[dict[str, Any]]:
    try:
        data = load_data_file(path, "targets config")
    except ValueError as e:
        raise UsageError(str(e)) from None
    items = data.get("targets") if isinstance(data, dict) else data
    if not isinstance(items, list) or not all(isinstance(i, dict) and "target" in i
                                              for i in items):
        raise UsageError(f"targets config {path!r} must be a list of objects with 'target'")
    return [{"name": str(i.get("name", i["target"])), **i} for i in items]


def cmd_compare(args: argparse.Namespace) -> int:
    specs = _compare_specs(args)
    targets = []
    for sp in specs:
        ns = argparse.Namespace(**vars(args))
        ns.num_gpus = None if sp["num_gpus"] is None else int(sp["num_gpus"])
        ns.model = sp.get("model", args.model)
        ns.target_option = list(args.target_option) + list((sp.get("options") or {}).items())
        targets.append(_target(ns, str(sp["target"]), sp["name"]))
    s, searches, rows, entries = None, {}, [], []
    for t in targets:
        s_t, w = _setup(args, t, args.rate or 1.0, need_slo=True)
        s = s or s_t
        sr = searches[t.name] = _search(args, t, s_t, w)
        best = sr.best.summary if sr.best else None
        rows.append({"name": t.name, "num_gpus": t.num_gpus,
                     "goodput_rps": sr.result.goodput_rps,
                     "per_gpu_goodput_rps": sr.result.per_gpu_goodput_rps,
                     "tightest_slo_scale": best.tightest_slo_scale if best else None,
                     "p90_ttft_s": best.ttft.p90 if best else None,
                     "p90_tpot_s": best.tpot.p90 if best else None,
                     "converged": sr.result.converged, "confirmed": sr.confirmed})
        entries.append({"name": t.name, "workload": w.describe(),
                        **_search_dict(sr, args.save_records)})
    assert s is not None
    md = report.compare_markdown(rows)
    write_report(args, md, {"command": "compare", **report_header(s, w), "targets": entries})
    write_plots(args, s, {k: sr.best for k, sr in searches.items()}, searches,
           {t.name: t.num_gpus for t in targets})
    return check_failures(args, {k: sr.best for k, sr in searches.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve benchmark toolkit")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
