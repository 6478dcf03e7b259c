"""DistServe's headline in simulation: chatbot on OPT-13B, disaggregated vs colocated (vLLM).

DistServe (§6.2, Fig. 8, Table 3) reports 2.0-4.6x the per-GPU goodput of vLLM on the ShareGPT
chatbot workload; for OPT-13B it chose prefill TP=2 + decode TP=1 (Appendix B). This script
replays that comparison in pdserve's simulator with DistServe's own A100-80GB OPT-13B profile.

    python benchmarks/distserve_headline.py [--num-requests 1000] [--seed 0] \
        [--output-json out/headline.json] [--plot out/headline]

**Workload** (DistServe's ShareGPT recipe applied to the traces we have). DistServe builds its
chatbot set from ``ShareGPT_V3_unfiltered_cleaned_split.json`` with the OPT tokenizer: a prompt is
the first k turns of a conversation (k uniform in [1, turns-1], conversations with >= 3 turns),
the completion is turn k; pairs with prompt and output both < 4 tokens, or with prompt + output
>= 2048 tokens (OPT's context), are dropped; a run samples its requests uniformly without
replacement and times them with Poisson arrivals. We have no ShareGPT text, only its length
table ``shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv`` (30,731 rows, Llama-2
tokenizer), so: the same two filters on that table (14,561 rows survive), a uniform sample of
``--num-requests`` rows without replacement (numpy ``default_rng([seed, 1])``), Poisson arrivals
from pdserve.bench (``Workload.retimed``; unit-rate gaps from ``default_rng([seed, 2])`` divided
by the rate, so every probed rate replays the same requests in the same pattern). Prompts are
distinct synthetic token ids (no prefix sharing). SLOs: TTFT 0.25 s, TPOT 0.1 s (Table 1);
target 90 %.

**Placements.** ``colocated``: one TP=1 instance, vLLM v0 as DistServe ran it — continuous
batching, a waiting prompt preempts decoding (prefill-only steps of whole prompts up to 2,048
tokens, no chunked prefill), at most 256 running sequences, preemption by recompute.
``disaggregated``: one prefill instance (TP=2, whole prompts batched up to L_m tokens, §4.3;
a longer prompt runs alone) and one decode instance (TP=1), on one node, the KV pulled over
NVLink (A100 NVLink 3, 300 GB/s per direction; DistServe-Low, §4.2). Every instance has block
size 16 and ``(tp * 80 GiB * 0.9 - fp16 weights) / KV bytes per token`` KV tokens (vLLM's
default memory share; DistServe's ``max_num_tokens.csv`` is printed beside it as a check).
Step times come from ``distserve_profiler-a100-80g.distserve.json`` (TP=1 or TP=2 entry).

**Search.** pdserve.bench's expanding bisection per placement and per attainment criterion:
``both`` (pdserve's: a request attains when it meets both SLOs) and ``distserve`` (P90 TTFT and
P90 TPOT checked separately, DistServe's way). Runs are cached per (placement, rate), so the
second criterion mostly reuses the first one's probes. Per-GPU goodput = goodput / GPUs.
The SLO-scale sweep (Fig. 8, bottom) is computed exactly from the records of one run per
placement at a common per-GPU rate.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.goodput import AttainmentResult, GoodputResult, search_goodput
from pdserve.bench.metrics import (
    SLO,
    RequestRecord,
    attainment,
    json_safe,
    summarize,
    tightest_slo_scale,
)
from pdserve.bench.presets import DISTSERVE_MAX_LEN, distserve_filter
from pdserve.bench.report import (
    plot_attainment_vs_rate,
    plot_attainment_vs_scale,
    plot_breakdown,
    write_json,
)
from pdserve.bench.traces import load_trace
from pdserve.bench.workloads import Workload, make_workload
from pdserve.config import ClusterConfig, ModelConfig, simulated_kv_blocks
from pdserve.sim.hardware import get_device
from pdserve.sim.latency import FittedProfile
from pdserve.sim.model_catalogue import get_model_config
from pdserve.sim.simulator import SimResult
from pdserve.sim.target import SimulationConfig, build_simulator, resolve_profile
from pdserve.sim.target import simulate as simulate_requests

DEFAULT_PROFILE = "distserve_profiler-a100-80g.distserve"  # shipped with pdserve
# DistServe's fit of vLLM's own engine (their simulator's vLLM baseline): sensitivity only
VLLM_PROFILE = "distserve_profiler-a100-80g.vllm"
DEFAULT_MAX_TOKENS_CSV = str(Path(__file__).resolve().parents[4] / "shared" / "profiles"
                             / "distserve_max_num_tokens.csv")  # ../shared beside the repo
MODEL = "opt-13b"
DEVICE = "A100-80GB"
SLO_CHATBOT = SLO(0.25, 0.1)  # DistServe Table 1, chatbot OPT-13B
TARGET = 0.9
MAX_MODEL_LEN = DISTSERVE_MAX_LEN  # OPT's max_position_embeddings
L_M = 512  # DistServe §3.1: "a single sequence of 512 tokens can fully engage an A100" (13B)
CRITERIA = ("both", "distserve")
# vLLM's defaults as DistServe ran it: block size 16, 256 sequences, 90 % of GPU memory
ENGINE = {"dtype": "float16", "block_size": 16, "max_num_seqs": 256,
          "gpu_memory_utilization": 0.9, "max_model_len": MAX_MODEL_LEN,
          "enable_prefix_caching": False}


# --------------------------------------------------------------------------------- workload
@dataclass
class Recipe:
    """What the chatbot workload was built from (recorded in the JSON)."""

    trace_file: str
    tokenizer: str
    rows: int
    rows_kept: int
    filters: list[str]
    num_requests: int
    seed: int
    output_scale: float
    sampling: str
    arrivals: str
    stats: dict[str, Any] = field(default_factory=dict)


def _stat(a: np.ndarray) -> dict[str, float]:
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "min": int(a.min()), "max": int(a.max())}


def chatbot_workload(num_requests: int, seed: int = 0, vocab_size: int = 50272,
                     traces_dir: str | None = None,
                     output_scale: float = 1.0) -> tuple[Workload, Recipe]:
    """The ``distserve-chatbot`` workload (pdserve.bench.presets) and its recipe. The returned
    workload has no arrival times yet: ``workload.retimed(rate)`` gives Poisson arrivals.
    ``output_scale`` (sensitivity only; 1 = the recipe) multiplies every output length."""
    wl = make_workload(f"distserve-chatbot:output_scale={output_scale:g}", num_requests,
                       seed=seed, rate=1.0, vocab_size=vocab_size, traces_dir=traces_dir,
                       prompt_mode="ids")
    trace = load_trace("sharegpt", traces_dir)
    keep = np.flatnonzero(distserve_filter(trace.input_lens, trace.output_lens))
    inp = np.array([r.prompt_len for r in wl.requests])
    out = np.array([r.output_len for r in wl.requests])
    recipe = Recipe(
        trace_file=trace.file, tokenizer=trace.tokenizer, rows=len(trace), rows_kept=len(keep),
        filters=["drop prompt_len < 4 and output_len < 4",
                 f"drop prompt_len + output_len >= {MAX_MODEL_LEN}"],
        num_requests=num_requests, seed=seed, output_scale=output_scale,
        sampling="uniform without replacement, numpy default_rng([seed, 1])",
        arrivals="Poisson (pdserve.bench.arrivals.Poisson), gaps default_rng([seed, 2]) / rate",
        stats={"prompt_len": _stat(inp), "output_len": _stat(out),
               "pool_prompt_len": _stat(trace.input_lens[keep]),
               "pool_output_len": _stat(trace.output_lens[keep])})
    return wl, recipe


# ------------------------------------------------------------------------------ placements
def kv_blocks(model: ModelConfig, tp: int) -> int:
    """KV blocks of a TP=``tp`` instance as the simulator sizes it
    (pdserve.config.simulated_kv_blocks): its GPUs' memory share minus the fp16 weights and what
    the engine reserves."""
    engine = ClusterConfig.from_dict({"model": MODEL, "engine": ENGINE}).engine_config(
        model_max_len=MAX_MODEL_LEN)
    return simulated_kv_blocks(model, engine, tp=tp,
                               device_memory_bytes=get_device(DEVICE).memory_bytes)


def distserve_kv_tokens(path: str, model: str, tp: int) -> int | None:
    """DistServe's own ``max_num_tokens`` for (model, tp, pp=1), if the CSV is there."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in lines[1:]:
        m, t, p, n = line.split(",")
        if m.endswith(model) and int(t) == tp and int(p) == 1:
            return int(n)
    return None


@dataclass
class Placement:
    name: str
    label: str
    sim: SimulationConfig
    num_gpus: int

    def describe(self) -> dict[str, Any]:
        return build_simulator(self.sim).describe


def make_placements(profile: str, lm: int = L_M, num_colocated: int = 1, num_prefill: int = 1,
                    num_decode: int = 1,
                    colocated_profile: str | None = None) -> dict[str, Placement]:
    """``colocated``: ``num_colocated`` x TP1, vLLM v0 (no chunked prefill: a waiting prompt
    preempts decoding); ``disaggregated``: ``num_prefill`` x TP2 prefill (whole prompts up to
    L_m) + ``num_decode`` x TP1 decode on one node (KV over the A100's NVLink, the simulator's
    default link). ``colocated_profile`` (default ``profile``) prices the colocated steps."""
    colo = ClusterConfig.from_dict({
        "model": MODEL, "engine": {**ENGINE, "enable_chunked_prefill": False},
        "strategy": "colocated", "num_instances": num_colocated})
    dis = ClusterConfig.from_dict({
        "model": MODEL, "engine": ENGINE, "strategy": "disaggregated",
        "num_prefill": num_prefill, "num_decode": num_decode, "prefill_tp": 2, "decode_tp": 1,
        "prefill_token_target": lm})
    return {
        "colocated": Placement("colocated", f"colocated {num_colocated}xTP1 (vLLM)",
                               SimulationConfig(colo, profile=colocated_profile or profile),
                               colo.num_gpus),
        "disaggregated": Placement(
            "disaggregated", f"disaggregated {num_prefill}xP(TP2) + {num_decode}xD(TP1)",
            SimulationConfig(dis, profile=profile), dis.num_gpus),
    }


# ------------------------------------------------------------------------------------- runs
def simulate(placement: Placement, model: ModelConfig, workload: Workload, rate: float,
             progress: Callable[[int], None] | None = None) -> tuple[list[RequestRecord],
                                                                     SimResult]:
    wl = workload.retimed(rate, "poisson")
    recs, res, _ = simulate_requests(placement.sim, wl.requests, progress, model.vocab_size)
    return recs, res


@dataclass
class Run:
    """One simulated run and what the search needs from it."""

    placement: str
    rate: float
    summary: dict[str, Any]
    attainment: dict[str, float]
    wall_s: float
    num_preemptions: int
    records: list[RequestRecord] | None = None


class Runner:
    """Cached runs per (placement, rate); one progress line per run."""

    def __init__(self, model: ModelConfig, workload: Workload, placements: dict[str, Placement],
                 slo: SLO, target: float, show_progress: bool = True) -> None:
        self.model, self.workload, self.placements = model, workload, placements
        self.slo, self.target = slo, target
        self.cache: dict[tuple[str, float], Run] = {}
        self.show_progress = show_progress and sys.stderr.isatty()

    def run(self, name: str, rate: float, keep_records: bool = False) -> Run:
        key = (name, round(rate, 9))
        hit = self.cache.get(key)
        if hit is not None and (hit.records is not None or not keep_records):
            return hit
        p = self.placements[name]
        t0 = time.perf_counter()
        if self.show_progress:
            from rich.progress import Progress

            with Progress(transient=True) as prog:
                task = prog.add_task(f"{name} @ {rate:.3f} req/s", total=len(self.workload))
                recs, res = simulate(p, self.model, self.workload, rate,
                                     lambda n: prog.advance(task, n))
        else:
            recs, res = simulate(p, self.model, self.workload, rate)
        wall = time.perf_counter() - t0
        s = summarize(recs, self.slo, self.target, p.num_gpus)
        att = {c: attainment(recs, self.slo, c) for c in CRITERIA}
        pre = sum(getattr(st, "num_preemptions", 0) or 0 for st in res.instance_stats.values())
        run = Run(name, rate, s.to_dict(), att, wall, pre, recs if keep_records else None)
        self.cache[key] = run
        print(f"  {name:14s} rate {rate:7.3f} req/s ({rate / p.num_gpus:6.3f}/GPU): "
              f"attainment both {att['both']:6.1%}  distserve {att['distserve']:6.1%}  "
              f"P90 TTFT {_ms(s.ttft.p90)} ms  P90 TPOT {_ms(s.tpot.p90)} ms  "
              f"preempt {pre}  [{wall:.1f} s]", file=sys.stderr, flush=True)
        return run

    def search(self, name: str, criterion: str, hi: float, precision: float,
               max_probes: int) -> GoodputResult:
        p = self.placements[name]

        def at_rate(rate: float) -> AttainmentResult:
            r = self.run(name, rate)
            a = r.attainment[criterion]
            return AttainmentResult(rate, a, a >= self.target,
                                    {"p90_ttft_s": r.summary["ttft"]["p90"],
                                     "p90_tpot_s": r.summary["tpot"]["p90"]})

        return search_goodput(at_rate, hi=hi, precision=precision, max_probes=max_probes,
                              num_gpus=p.num_gpus)


def _ms(x: float | None) -> str:
    return "   –" if x is None or not math.isfinite(x) else f"{x * 1e3:6.1f}"


# ------------------------------------------------------------------------- sanity checks
def sanity(profile: str, model: ModelConfig, recipe: Recipe, lm: int) -> dict[str, Any]:
    """Profile step times and the capacity bounds they imply for this workload."""
    tp1 = FittedProfile.from_distserve_json(resolve_profile(profile), model, tp=1)
    tp2 = FittedProfile.from_distserve_json(resolve_profile(profile), model, tp=2)
    steps = {}
    for n in (128, 512, 1024, 2000):
        steps[f"prefill 1x{n}"] = {"tp1": tp1.prefill_time([n]), "tp2": tp2.prefill_time([n])}
    steps[f"prefill 4x{lm // 4} (one L_m batch)"] = {"tp1": tp1.prefill_time([lm // 4] * 4),
                                                     "tp2": tp2.prefill_time([lm // 4] * 4)}
    for b in (1, 32, 64, 94, 95, 128):
        steps[f"decode {b}x800"] = {"tp1": tp1.decode_time([800] * b),
                                    "tp2": tp2.decode_time([800] * b)}
    st = recipe.stats
    p_mean, o_mean = st["prompt_len"]["mean"], st["output_len"]["mean"]
    ctx = p_mean + o_mean / 2  # mean context of a decoding request
    kv1 = kv_blocks(model, 1) * ENGINE["block_size"]
    max_seqs = min(ENGINE["max_num_seqs"], int(kv1 // ctx))
    dec_step = tp1.decode_time([int(ctx)] * max_seqs)
    # capacity bounds: one mean-length prompt at a time (no batching)
    return {
        "step_times_s": steps,
        "mean_prompt": p_mean, "mean_output": o_mean, "mean_decode_context": ctx,
        "kv_tokens": {"tp1": kv1, "tp2": kv_blocks(model, 2) * ENGINE["block_size"],
                      "distserve_csv_tp1": distserve_kv_tokens(DEFAULT_MAX_TOKENS_CSV, MODEL, 1),
                      "distserve_csv_tp2": distserve_kv_tokens(DEFAULT_MAX_TOKENS_CSV, MODEL, 2)},
        "decode_tp1_max_seqs_by_kv": max_seqs,
        "decode_tp1_step_at_max_seqs_s": dec_step,
        "decode_tp1_capacity_rps": max_seqs / dec_step / o_mean,
        "prefill_tp2_capacity_rps": 1.0 / tp2.prefill_time([int(p_mean)]),
        "prefill_tp1_capacity_rps": 1.0 / tp1.prefill_time([int(p_mean)]),
    }


# ------------------------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--traces-dir", default=None)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, metavar="S1,S2,...",
                    help="repeat the whole comparison for these workload seeds and report the "
                         "per-GPU goodputs and the ratio as mean and range (robustness)")
    ap.add_argument("--lm", type=int, default=L_M, help="prefill token target L_m (512)")
    ap.add_argument("--precision", type=float, default=0.1, help="req/s (total), 0.1")
    ap.add_argument("--max-probes", type=int, default=12)
    ap.add_argument("--colocated-rate", type=float, default=2.0, help="first probe (req/s)")
    ap.add_argument("--disaggregated-rate", type=float, default=4.0, help="first probe (req/s)")
    ap.add_argument("--scale-rate", type=float, default=None,
                    help="per-GPU rate of the SLO-scale sweep (default: the lower of the two "
                         "per-GPU goodputs)")
    ap.add_argument("--num-colocated", type=int, default=1, help="colocated TP1 replicas (1)")
    ap.add_argument("--num-prefill", type=int, default=1, help="prefill TP2 instances (1)")
    ap.add_argument("--num-decode", type=int, default=1, help="decode TP1 instances (1)")
    ap.add_argument("--output-scale", type=float, default=1.0,
                    help="sensitivity: multiply output lengths (1 = DistServe's recipe)")
    ap.add_argument("--colocated-profile", choices=("distserve", "vllm"), default="distserve",
                    help="sensitivity: price colocated steps with DistServe's fit of vLLM's "
                         "engine (vllm) instead of the DistServe engine profile")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--plot", default=None, metavar="DIR")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.seeds:
        return run_seed(args)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    reports = {}
    for seed in seeds:
        print(f"=== seed {seed}", file=sys.stderr, flush=True)
        one = argparse.Namespace(**{**vars(args), "seed": seed, "output_json": None,
                                    "plot": None})
        reports[seed] = run_seed(one, show=False, criteria=("both",))
    summary = seed_summary(reports)
    print_seed_summary(summary)
    if args.output_json:
        write_json(args.output_json, {"seeds": seeds, "summary": summary,
                                      "reports": {str(k): v for k, v in reports.items()}})
        print(f"wrote {args.output_json}", file=sys.stderr)
    return summary


def seed_summary(reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per seed and as mean [min, max]: each placement's per-GPU goodput and the ratio."""
    rows = {}
    for seed, rep in reports.items():
        g = rep["goodput"]
        rows[seed] = {"colocated": g["colocated"]["both"]["per_gpu_goodput_rps"],
                      "disaggregated": g["disaggregated"]["both"]["per_gpu_goodput_rps"],
                      "ratio": rep["ratio_disaggregated_over_colocated"]["both"]}
    agg = {}
    for key in ("colocated", "disaggregated", "ratio"):
        vals = [r[key] for r in rows.values() if r[key] is not None]
        agg[key] = {"mean": float(np.mean(vals)), "min": float(min(vals)),
                    "max": float(max(vals))} if vals else None
    return {"per_seed": rows, "aggregate": agg}


def print_seed_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="per-GPU goodput (req/s, criterion both) over workload seeds")
    for col in ("seed", "colocated", "disaggregated", "ratio"):
        t.add_column(col, justify="right")
    for seed, r in summary["per_seed"].items():
        t.add_row(str(seed), f"{r['colocated']:.3f}", f"{r['disaggregated']:.3f}",
                  "–" if r["ratio"] is None else f"{r['ratio']:.2f}x")
    agg = summary["aggregate"]
    cell = lambda a, f: "–" if a is None else f"{a['mean']:{f}} [{a['min']:{f}}, {a['max']:{f}}]"
    t.add_row("mean [range]", cell(agg["colocated"], ".3f"), cell(agg["disaggregated"], ".3f"),
              cell(agg["ratio"], ".2f"))
    Console(width=150).print(t)


def run_seed(args: argparse.Namespace, show: bool = True,
             criteria: Sequence[str] = CRITERIA) -> dict[str, Any]:
    """The whole comparison for ``args.seed`` (``show=False``: the goodput searches of
    ``criteria`` only, no SLO-scale sweep or breakdown — the seed study)."""
    t_start = time.perf_counter()
    model = get_model_config(MODEL)
    workload, recipe = chatbot_workload(args.num_requests, args.seed, model.vocab_size,
                                        args.traces_dir, args.output_scale)
    colo_profile = VLLM_PROFILE if args.colocated_profile == "vllm" else args.profile
    placements = make_placements(args.profile, args.lm, args.num_colocated,
                                 args.num_prefill, args.num_decode, colo_profile)
    runner = Runner(model, workload, placements, SLO_CHATBOT, TARGET, not args.no_progress)
    checks = sanity(args.profile, model, recipe, args.lm)
    first = {"colocated": args.colocated_rate * args.num_colocated,
             "disaggregated": args.disaggregated_rate * args.num_decode}

    results: dict[str, dict[str, GoodputResult]] = {}
    for crit in criteria:
        for name in placements:
            print(f"search {name} ({crit})", file=sys.stderr, flush=True)
            results.setdefault(name, {})[crit] = runner.search(
                name, crit, first[name], args.precision, args.max_probes)

    # SLO-scale sweep at one per-GPU rate (exact from the records of one run per placement)
    per_gpu = [r["both"].per_gpu_goodput_rps for r in results.values()]
    scale_rate = args.scale_rate or (min(g for g in per_gpu if g > 0) if any(per_gpu) else 0.5)
    scales = [round(0.25 * k, 2) for k in range(1, 13)]
    sweep: dict[str, Any] = {}
    breakdown: dict[str, Any] = {}
    for name, p in placements.items() if show else ():
        run = runner.run(name, scale_rate * p.num_gpus, keep_records=True)
        recs = run.records or []
        sweep[name] = {
            "per_gpu_rate": scale_rate,
            "points": [(s, attainment(recs, SLO_CHATBOT.scaled(s))) for s in scales],
            "tightest_scale": {c: tightest_slo_scale(recs, SLO_CHATBOT, TARGET, c)
                               for c in CRITERIA},
        }
        best = results[name]["both"].goodput_rps
        if best > 0:
            at = runner.run(name, best)
            breakdown[name] = at.summary.get("breakdown")

    report = build_report(args, recipe, placements, results, sweep, breakdown, checks, runner,
                          time.perf_counter() - t_start)
    if show:
        print_report(report)
    if args.output_json:
        write_json(args.output_json, report)
        print(f"wrote {args.output_json}", file=sys.stderr)
    if args.plot:
        make_plots(args.plot, report, placements, runner, breakdown)
    return report


def build_report(args: argparse.Namespace, recipe: Recipe, placements: dict[str, Placement],
                 results: dict[str, dict[str, GoodputResult]], sweep: dict[str, Any],
                 breakdown: dict[str, Any], checks: dict[str, Any], runner: Runner,
                 wall: float) -> dict[str, Any]:
    goodput = {name: {c: r.to_dict() for c, r in res.items()} for name, res in results.items()}
    ratio = {}
    for c in results["colocated"]:
        a = results["colocated"][c].per_gpu_goodput_rps
        b = results["disaggregated"][c].per_gpu_goodput_rps
        ratio[c] = b / a if a > 0 else None
    runs = [{"placement": r.placement, "rate": r.rate, "attainment": r.attainment,
             "p90_ttft_s": r.summary["ttft"]["p90"], "p90_tpot_s": r.summary["tpot"]["p90"],
             "mean_ttft_s": r.summary["ttft"]["mean"], "mean_tpot_s": r.summary["tpot"]["mean"],
             "preemptions": r.num_preemptions, "wall_s": r.wall_s}
            for r in sorted(runner.cache.values(), key=lambda r: (r.placement, r.rate))]
    return json_safe({
        "paper": "DistServe §6.2 chatbot OPT-13B: 2.0-4.6x per-GPU goodput over vLLM",
        "command": "python benchmarks/distserve_headline.py " + " ".join(sys.argv[1:]),
        "model": MODEL, "device": DEVICE, "profile": args.profile,
        "slo": {"ttft": SLO_CHATBOT.ttft, "tpot": SLO_CHATBOT.tpot}, "target": TARGET,
        "colocated_profile": args.colocated_profile,
        "lm": args.lm,
        "workload": recipe.__dict__,
        "placements": {n: {"label": p.label, "num_gpus": p.num_gpus,
                           "deployment": p.describe()} for n, p in placements.items()},
        "goodput": goodput, "ratio_disaggregated_over_colocated": ratio,
        "slo_scale_sweep": sweep, "breakdown_at_goodput": breakdown, "sanity": checks,
        "runs": runs, "num_runs": len(runs), "wall_s": wall,
    })


def print_report(rep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=150)
    w = rep["workload"]
    st = w["stats"]
    con.print(f"[bold]Workload[/]: {w['num_requests']} requests from {w['trace_file']} "
              f"({w['rows_kept']}/{w['rows']} rows pass DistServe's filters), seed {w['seed']}; "
              f"prompt mean {st['prompt_len']['mean']:.0f} / median "
              f"{st['prompt_len']['median']:.0f}, output mean {st['output_len']['mean']:.0f} / "
              f"median {st['output_len']['median']:.0f} tokens; Poisson arrivals")
    title = ("DistServe headline in simulation: OPT-13B chatbot, SLO TTFT 0.25 s / TPOT 0.1 s, "
             "90 % attainment")
    if rep["colocated_profile"] != "distserve":
        title += f" [colocated priced with the {rep['colocated_profile']} profile]"
    if rep["workload"]["output_scale"] != 1.0:
        title += f" [outputs x{rep['workload']['output_scale']:g}]"
    t = Table(title=title)
    for col in ("placement", "GPUs", "criterion", "goodput (req/s)", "per GPU", "bracket",
                "probes", "converged"):
        t.add_column(col, justify="left" if col in ("placement", "criterion") else "right")
    for name, res in rep["goodput"].items():
        label = rep["placements"][name]["label"]
        for crit, r in res.items():
            hi = "–" if r["hi"] is None else f"{r['hi']:.3f}"
            t.add_row(label, str(r["num_gpus"]), crit, f"{r['goodput_rps']:.3f}",
                      f"{r['per_gpu_goodput_rps']:.3f}", f"[{r['lo']:.3f}, {hi}]",
                      str(len(r["probes"])), str(r["converged"]))
    con.print(t)
    for crit, x in rep["ratio_disaggregated_over_colocated"].items():
        con.print(f"per-GPU goodput ratio disaggregated / colocated ({crit}): "
                  + ("–" if x is None else f"[bold]{x:.2f}x[/]") + "   (DistServe: 2.0-4.6x)")
    s = Table(title="Runs (cached per placement and rate)")
    for col in ("placement", "rate", "per GPU", "att. both", "att. distserve", "P90 TTFT ms",
                "P90 TPOT ms", "preempt", "wall s"):
        s.add_column(col, justify="left" if col == "placement" else "right")
    gpus = {n: p["num_gpus"] for n, p in rep["placements"].items()}
    for r in rep["runs"]:
        s.add_row(r["placement"], f"{r['rate']:.3f}", f"{r['rate'] / gpus[r['placement']]:.3f}",
                  f"{r['attainment']['both']:.1%}", f"{r['attainment']['distserve']:.1%}",
                  _ms(r["p90_ttft_s"]), _ms(r["p90_tpot_s"]), str(r["preemptions"]),
                  f"{r['wall_s']:.1f}")
    con.print(s)
    for name, sw in rep["slo_scale_sweep"].items():
        tight = ", ".join(f"{c} {v:.2f}" if v is not None else f"{c} –"
                          for c, v in sw["tightest_scale"].items())
        con.print(f"tightest SLO scale, {name} at {sw['per_gpu_rate']:.3f} req/s per GPU: {tight}")
    c = rep["sanity"]
    con.print(f"sanity: KV tokens TP1 {c['kv_tokens']['tp1']} (DistServe csv "
              f"{c['kv_tokens']['distserve_csv_tp1']}), TP2 {c['kv_tokens']['tp2']} "
              f"(csv {c['kv_tokens']['distserve_csv_tp2']}); decode TP1 holds "
              f"{c['decode_tp1_max_seqs_by_kv']} requests of mean context "
              f"{c['mean_decode_context']:.0f}, step {c['decode_tp1_step_at_max_seqs_s'] * 1e3:.1f}"
              f" ms -> <= {c['decode_tp1_capacity_rps']:.2f} req/s; prefill TP2 mean-prompt "
              f"capacity {c['prefill_tp2_capacity_rps']:.1f} req/s")
    con.print(f"{rep['num_runs']} simulated runs in {rep['wall_s']:.0f} s")


def make_plots(out: str, rep: dict[str, Any], placements: dict[str, Placement], runner: Runner,
               breakdown: dict[str, Any]) -> None:
    d = Path(out)
    gpus = {n: p.num_gpus for n, p in placements.items()}
    for crit in CRITERIA:
        curves = {placements[n].label: [(r.rate, r.attainment[crit]) for r in runner.cache.values()
                                        if r.placement == n] for n in placements}
        ng = {placements[n].label: gpus[n] for n in placements}
        gp = {placements[n].label: rep["goodput"][n][crit]["goodput_rps"] for n in placements}
        plot_attainment_vs_rate(curves, TARGET, d / f"attainment_vs_rate_{crit}.png", ng, gp)
    scale_curves = {placements[n].label: sw["points"]
                    for n, sw in rep["slo_scale_sweep"].items()}
    plot_attainment_vs_scale(scale_curves, TARGET, d / "attainment_vs_slo_scale.png")
    bd = {placements[n].label: b for n, b in breakdown.items() if b}
    if bd:
        plot_breakdown(bd, d / "breakdown_at_goodput.png")
    print(f"wrote plots to {d}/", file=sys.stderr)


if __name__ == "__main__":
    main()
