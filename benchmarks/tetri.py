"""TetriInfer (§5.1) against the colocated vLLM-style baseline, in simulation (docs/benchmarks.md).

For each of the paper's five workloads (``lpld``, ``lphd``, ``hpld``, ``hphd``, ``mixed``: ShareGPT
classes, heavy prompt > 512, heavy output > 128 tokens; 128 requests) this runs, on OPT-13B with
DistServe's A100 profile:

- **vLLM**: one colocated instance, continuous batching with prefill-first steps (vLLM v0, no
  chunking), FCFS, greedy admission, at most ``--vllm-max-seqs`` requests per batch (16, the
  paper's §5.2.1 setting; 256 is vLLM's default);
- **TetriInfer**: one prefill + one decode instance (twice the GPUs, as in the paper): SJF with
  PrefillSchedBatch 16, fixed prefill chunks of ChunkSize tokens (profiled: where prefill
  throughput reaches 90 % of its peak), an oracle length predictor at the paper's accuracy
  (74.9 % at granularity 200), power-of-two length-aware dispatch, reserve-dynamic admission,
  flip after one idle minute; the KV link emulated at each ``--links`` bandwidth (GB/s).

It prints average TTFT, average JCT, resource usage time (the instances' busy seconds: the sum
of their step times) and perf/$ (requests per busy second), the paper's numbers beside them,
writes a JSON with everything and bar plots.

    python benchmarks/tetri.py [--arrival burst|poisson] [--rate R] [--links 25 200 300]
        [--num-requests 128] [--out-dir DIR] [--ablations]
    python benchmarks/tetri.py --part prefill admission dispatch   # the policy grids
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.workloads import make_workload
from pdserve.config import ClusterConfig, Link
from pdserve.sim.latency import FittedProfile
from pdserve.sim.profiler import saturation_chunk_size
from pdserve.sim.target import SimulationConfig, resolve_profile, simulate

PROFILE = "distserve_profiler-a100-80g.distserve"
WORKLOADS = ("lpld", "lphd", "hpld", "hphd", "mixed")
# TetriInfer §5.1 (Figures 11-15): relative change of TetriInfer vs vLLM (TTFT, JCT, resource
# usage) and perf/$ ratio; None where the paper gives no number.
PAPER = {"lpld": (-0.44, -0.40, None, 1.4), "lphd": (-0.97, -0.47, -0.38, 2.4),
         "hpld": (-0.09, -0.23, +0.43, 1 / 1.14), "hphd": (None, -0.19, +0.07, 1.1),
         "mixed": (-0.85, -0.50, -0.21, 1.9)}


def chunk_size() -> int:
    prof = FittedProfile.load(resolve_profile(PROFILE), "opt-13b", 1)
    return saturation_chunk_size(prof)[0]


def vllm(max_seqs: int) -> ClusterConfig:
    return ClusterConfig.from_dict({"model": "opt-13b", "strategy": "colocated",
                                    "enable_chunked_prefill": False, "max_num_seqs": max_seqs})


def tetri(link_gbs: float, chunk: int, **over: Any) -> ClusterConfig:
    prefill = {"policy": over.pop("policy", "sjf"),
               "prefill_sched_batch": over.pop("sched_batch", 16),
               "prefill_chunk_size": over.pop("chunk_size", chunk)}
    decode = {"admission": over.pop("admission", "reserve-dynamic"),
              "num_kv_blocks": over.pop("decode_kv_blocks", None)}
    d = {"model": "opt-13b", "kv_link": Link(link_gbs),
         "roles": [{"role": "prefill", "count": over.pop("num_prefill", 1), "engine": prefill},
                   {"role": "decode", "count": over.pop("num_decode", 1), "engine": decode}],
         "decode_router": "power_of_two_length", "length_predictor": "oracle",
         "predictor_granularity": 200, "predictor_accuracy": 0.749, "flip": "idle:60"}
    d.update(over)
    if d["length_predictor"] == "none":  # (its settings would be refused as ignored)
        del d["predictor_granularity"], d["predictor_accuracy"]
    return ClusterConfig.from_dict(d)


def run(dep: ClusterConfig, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    rate = 1e6 if args.arrival == "burst" else args.rate
    w = make_workload(workload, args.num_requests, seed=args.seed, rate=rate,
                      arrival="constant" if args.arrival == "burst" else "poisson",
                      max_model_len=2048)
    sim = SimulationConfig(dep, profile=PROFILE)
    records, res, built = simulate(sim, w.requests)
    ok = [r for r in records if r.ok]
    ttft = np.array([r.timeline.token_times[0] - r.timeline.arrival for r in ok])
    jct = np.array([r.timeline.finish - r.timeline.arrival for r in ok])
    wait = np.array([r.timeline.prefill_start - r.timeline.arrival for r in ok
                     if r.timeline.prefill_start is not None])
    # decode phase: from the first token to the last (TetriInfer Figure 19's decoding time)
    dec = [(r.timeline.token_times[0], r.timeline.finish) for r in ok
           if len(r.timeline.token_times) > 1]
    busy = {iid: s.busy_time for iid, s in res.instance_stats.items()}
    resource = sum(busy.values())
    flips = built.simulator.controller.flips
    # heavy (> 128 output tokens, §5.1) and light decodes each decode instance served
    hist = built.simulator.controller.history or {}
    mix: dict[str, list[int]] = {}
    for r in ok:
        h = hist.get(r.request_id)
        if h is not None and h.decode_instance is not None:
            mix.setdefault(h.decode_instance, [0, 0])[r.output_len <= 128] += 1
    return {"n": len(ok), "failed": len(records) - len(ok), "ttft": float(ttft.mean()),
            "jct": float(jct.mean()), "resource_s": resource,
            "perf_per_dollar": len(ok) / resource, "makespan": res.duration, "busy": busy,
            "flips": [vars(f) for f in flips.records] if flips is not None else [],
            "preemptions": sum(s.num_preemptions for s in res.instance_stats.values()),
            "preemptions_by_instance": {iid: s.num_preemptions
                                        for iid, s in res.instance_stats.items()},
            "prefill_wait": float(wait.mean()) if len(wait) else float("nan"),
            "decode_span": (max(e for _, e in dec) - min(b for b, _ in dec)) if dec else 0.0,
            "decode_time": float(np.mean([e - b for b, e in dec])) if dec else 0.0,
            "decode_busy": {iid: b for iid, b in busy.items() if "decode" in iid},
            "decode_mix": mix}


def pct(new: float, old: float) -> str:
    return f"{new / old - 1:+.0%}"


def paper_cell(v: float | None, ratio: bool = False) -> str:
    if v is None:
        return "—"
    return f"{v:.1f}×" if ratio else f"{v:+.0%}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arrival", choices=("burst", "poisson"), default="burst")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson rate, req/s")
    p.add_argument("--links", type=float, nargs="+", default=[25.0, 200.0, 300.0])
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--out-dir", default="out/tetri", help="JSON and plots")
    p.add_argument("--ablations", action="store_true")
    p.add_argument("--part", nargs="+", default=["main"],
                   choices=("main", "prefill", "admission", "dispatch"),
                   help="main: TetriInfer vs vLLM per workload (with --ablations); prefill: "
                        "FCFS/SJF/LJF x PrefillSchedBatch 16-128 (Figure 16); admission: "
                        "greedy/reserve-static/reserve-dynamic x predictor accuracy (Figure "
                        "18); dispatch: decode routers x 2-8 decode instances (Figure 19)")
    p.add_argument("--vllm-max-seqs", type=int, default=16,
                   help="the baseline's batch size (TetriInfer §5.2.1 sets vLLM's to 16; "
                        "vLLM's default is 256)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chunk = chunk_size()
    print(f"ChunkSize from {PROFILE} (OPT-13B TP 1): {chunk} tokens; arrival {args.arrival}"
          + (f" {args.rate} req/s" if args.arrival == "poisson" else " (all at t = 0)"),
          file=sys.stderr)
    results: dict[str, Any] = {"chunk_size": chunk, "arrival": args.arrival, "rate": args.rate,
                               "num_requests": args.num_requests, "runs": {}}
    lines = ["| workload | link GB/s | vLLM TTFT s | Tetri TTFT s | ΔTTFT (paper) | vLLM JCT s "
             "| Tetri JCT s | ΔJCT (paper) | vLLM busy s | Tetri busy s | Δresource (paper) "
             "| perf/$ × (paper) | flips |", "|---" * 13 + "|"]
    t0 = time.perf_counter()
    grids = [g for g in ("prefill", "admission", "dispatch") if g in args.part]
    if grids:
        for g in grids:
            res: dict[str, Any] = {"chunk_size": chunk, "rows": []}
            table = GRIDS[g](args, chunk, res)
            print("\n".join(table))
            (out / f"tetri_{g}_grid.json").write_text(json.dumps(res, indent=1))
            PLOTS[g](res, out / f"tetri_{g}_grid.png")
        print(f"{time.perf_counter() - t0:.0f} s wall", file=sys.stderr)
        if "main" not in args.part:
            return
    for wl in args.workloads:
        base = run(vllm(args.vllm_max_seqs), wl, args)
        results["runs"][f"{wl}/vllm"] = base
        for gbs in args.links:
            t = run(tetri(gbs, chunk), wl, args)
            results["runs"][f"{wl}/tetri/{gbs:g}"] = t
            pp = PAPER[wl]
            lines.append(
                f"| {wl} | {gbs:g} | {base['ttft']:.2f} | {t['ttft']:.2f} | "
                f"{pct(t['ttft'], base['ttft'])} ({paper_cell(pp[0])}) | {base['jct']:.1f} | "
                f"{t['jct']:.1f} | {pct(t['jct'], base['jct'])} ({paper_cell(pp[1])}) | "
                f"{base['resource_s']:.1f} | {t['resource_s']:.1f} | "
                f"{pct(t['resource_s'], base['resource_s'])} ({paper_cell(pp[2])}) | "
                f"{t['perf_per_dollar'] / base['perf_per_dollar']:.2f} "
                f"({paper_cell(pp[3], True)}) | {len(t['flips'])} |")
            print(lines[-1], file=sys.stderr)
    if args.ablations:
        lines += ["", *ablations(args, chunk, results), "", *flip_scenario(chunk, results)]
    print(f"{time.perf_counter() - t0:.0f} s wall", file=sys.stderr)
    print("\n".join(lines))
    results["vllm_max_seqs"] = args.vllm_max_seqs
    name = f"tetri_{args.arrival}_bs{args.vllm_max_seqs}.json"
    (out / name).write_text(json.dumps(results, indent=1))
    plot(results, args, out)


def ablations(args: argparse.Namespace, chunk: int, results: dict[str, Any]) -> list[str]:
    """One knob at a time from TetriInfer's setting, on ``mixed`` and ``lphd`` at 300 GB/s."""
    d3 = {"num_decode": 3}
    variants = {
        "TetriInfer": {},
        "FCFS prefill": {"policy": "fcfs"},
        "LJF prefill": {"policy": "ljf"},
        "ChunkSize 512 (paper's)": {"chunk_size": 512},
        "ChunkSize 2048": {"chunk_size": 2048},
        "whole prompts (no chunks)": {"chunk_size": None},
        "greedy admission": {"admission": "greedy"},
        "reserve-static": {"admission": "reserve-static"},
        "oracle 100 %": {"predictor_accuracy": 1.0},
        "exact lengths (no predictor: max_tokens)": {"length_predictor": "none"},
        "1P+3D power_of_two_length": d3,
        "1P+3D least_load": {**d3, "decode_router": "least_load"},
        "1P+3D random": {**d3, "decode_router": "random"},
        "1P+3D imbalanced": {**d3, "decode_router": "imbalanced"},
        "2P+2D no flip": {"num_prefill": 2, "num_decode": 2, "flip": "none"},
        "2P+2D flip idle:60": {"num_prefill": 2, "num_decode": 2},
        "2P+2D flip idle:5": {"num_prefill": 2, "num_decode": 2, "flip": "idle:5"},
    }
    lines = ["| workload | variant | TTFT s | JCT s | busy s | perf/$ (req per busy s) | "
             "preemptions | flips |", "|---|---|---|---|---|---|---|---|"]
    for wl in ("lphd", "mixed"):
        for name, over in variants.items():
            r = run(tetri(300.0, chunk, **dict(over)), wl, args)
            results["runs"][f"{wl}/ablation/{name}"] = r
            lines.append(f"| {wl} | {name} | {r['ttft']:.2f} | {r['jct']:.1f} | "
                         f"{r['resource_s']:.1f} | {r['perf_per_dollar']:.2f} | "
                         f"{r['preemptions']} | {len(r['flips'])} |")
            print(lines[-1], file=sys.stderr)
    return lines


def flip_scenario(chunk: int, results: dict[str, Any]) -> list[str]:
    """Instance flips where they can help: LPHD at 6 req/s (Poisson, 600 requests) on 2 prefill
    + 2 decode instances — the prefill instances are mostly idle, the decode ones saturated."""
    a = argparse.Namespace(arrival="poisson", rate=6.0, num_requests=600, seed=0)
    lines = ["| flip policy (LPHD, Poisson 6 req/s, 600 requests, 2P+2D) | TTFT s | JCT s | "
             "busy s | req / busy s | flips (instance, decided at s) |", "|---" * 6 + "|"]
    for flip in ("none", "idle:60", "idle:10", "load:0.1:10", "load:0.1:60"):
        r = run(tetri(300.0, chunk, num_prefill=2, num_decode=2, flip=flip), "lphd", a)
        results["runs"][f"lphd/flip-scenario/{flip}"] = r
        done = ", ".join(f"{f['instance_id']} → {f['to_role']} at {f['decided']:.1f}"
                         for f in r["flips"]) or "—"
        lines.append(f"| {flip} | {r['ttft']:.2f} | {r['jct']:.1f} | {r['resource_s']:.1f} | "
                     f"{r['perf_per_dollar']:.2f} | {done} |")
        print(lines[-1], file=sys.stderr)
    return lines


# ------------------------------------------------------------------------------ grids
SCHED_BATCHES = (16, 32, 64, 128)
ACCURACIES = (0.5, 0.749, 0.9, 1.0)
ADMISSIONS = ("greedy", "reserve-static", "reserve-dynamic")
ROUTERS = ("power_of_two_length", "random", "least_load", "imbalanced")


def _burst(n: int) -> argparse.Namespace:
    return argparse.Namespace(arrival="burst", rate=1.0, num_requests=n, seed=0)


def prefill_grid(args: argparse.Namespace, chunk: int, res: dict[str, Any]) -> list[str]:
    """TetriInfer §3.3.1 / Figure 16: FCFS, SJF and LJF prefill order x PrefillSchedBatch 16
    to 128, 1 prefill + 1 decode instance, all of ``--num-requests`` at once (mixed, lphd)."""
    lines = ["| workload | PrefillSchedBatch | policy | prefill wait s | TTFT s | vs FCFS "
             "| JCT s |", "|---" * 7 + "|"]
    for wl in ("mixed", "lphd"):
        for b in SCHED_BATCHES:
            fcfs = None
            for pol in ("fcfs", "sjf", "ljf"):
                r = run(tetri(300.0, chunk, policy=pol, sched_batch=b), wl, args)
                fcfs = fcfs or r
                res["rows"].append({"workload": wl, "batch": b, "policy": pol, **r})
                lines.append(f"| {wl} | {b} | {pol.upper()} | {r['prefill_wait']:.2f} | "
                             f"{r['ttft']:.2f} | {pct(r['ttft'], fcfs['ttft'])} | "
                             f"{r['jct']:.1f} |")
                print(lines[-1], file=sys.stderr)
    return lines


def admission_grid(args: argparse.Namespace, chunk: int, res: dict[str, Any]) -> list[str]:
    """TetriInfer §3.4 / Figure 18: greedy, reserve-static and reserve-dynamic decode admission
    against the oracle predictor's accuracy (and exact lengths: no predictor, the admission
    reads ``max_tokens``), 256 ShareGPT (mixed) requests at once, 1 prefill + 1 decode."""
    a = _burst(256)
    lines = ["| decode KV | admission | accuracy | JCT s | vs greedy | TTFT s | "
             "decode s / request | preemptions |", "|---" * 8 + "|"]
    greedy: dict[Any, dict[str, Any]] = {}
    # the A100's memory (~63k tokens of OPT-13B KV), and a tight 1,024 blocks (16k tokens)
    for blocks in (None, 1024):
        for acc in (*ACCURACIES, "exact"):
            for adm in ADMISSIONS:
                over: dict[str, Any] = ({"length_predictor": "none"} if acc == "exact"
                                        else {"predictor_accuracy": acc})
                r = run(tetri(300.0, chunk, admission=adm, decode_kv_blocks=blocks, **over),
                        "mixed", a)
                greedy.setdefault((blocks, acc), r)
                res["rows"].append({"admission": adm, "accuracy": acc, "kv_blocks": blocks,
                                    **r})
                label = "exact lengths" if acc == "exact" else f"{acc:.1%}"
                lines.append(f"| {blocks or 'A100'} | {adm} | {label} | {r['jct']:.1f} | "
                             f"{pct(r['jct'], greedy[(blocks, acc)]['jct'])} | "
                             f"{r['ttft']:.2f} | {r['decode_time']:.1f} | "
                             f"{r['preemptions']} |")
                print(lines[-1], file=sys.stderr)
    return lines


def dispatch_grid(args: argparse.Namespace, chunk: int, res: dict[str, Any]) -> list[str]:
    """TetriInfer §3.3.4 / Figure 19: decode dispatch policies, 32 ShareGPT (mixed) requests
    per decode instance at once, 2, 4 and 8 decode instances, as many prefill instances (so
    that prefill does not pace the decodes).
    Total decoding time: first decode token to last finish over the run; also the mean
    per-request decode time and the slowest decode instance's busy seconds."""
    lines = ["| decode instances | router | total decode time s | vs power-of-two | "
             "decode s / request | slowest instance busy s (heavy:light) | JCT s | "
             "preemptions |", "|---" * 8 + "|"]
    for n in (2, 4, 8):
        ref = None
        for router in ROUTERS:
            r = run(tetri(300.0, chunk, num_prefill=n, num_decode=n, decode_router=router),
                    "mixed", _burst(32 * n))
            ref = ref or r
            res["rows"].append({"num_decode": n, "router": router, **r})
            slow = max(r["decode_busy"], key=r["decode_busy"].get)
            hv, lt = r["decode_mix"].get(slow, (0, 0))
            lines.append(f"| {n} | {router} | {r['decode_span']:.1f} | "
                         f"{pct(r['decode_span'], ref['decode_span'])} | "
                         f"{r['decode_time']:.1f} | {r['decode_busy'][slow]:.1f} "
                         f"({hv}:{lt}) | "
                         f"{r['jct']:.1f} | {r['preemptions']} |")
            print(lines[-1], file=sys.stderr)
    return lines


def _plt() -> Any:
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_prefill(res: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, wl in zip(axes, ("mixed", "lphd")):
        for pol in ("fcfs", "sjf", "ljf"):
            rows = [r for r in res["rows"] if r["workload"] == wl and r["policy"] == pol]
            ax.plot([r["batch"] for r in rows], [r["ttft"] for r in rows], "o-",
                    label=pol.upper())
        ax.set_xscale("log", base=2)
        ax.set_xticks(SCHED_BATCHES, [str(b) for b in SCHED_BATCHES])
        ax.set_xlabel("PrefillSchedBatch")
        ax.set_ylabel("avg TTFT (s)")
        ax.set_title(f"{wl.upper()}, 128 requests at once")
        ax.legend()
    fig.suptitle("Prefill order x PrefillSchedBatch (OPT-13B, A100 profile, 1P+1D)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_admission(res: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    xs = [*ACCURACIES, "exact"]
    for row, blocks in zip(axes, (None, 1024)):
        for i, adm in enumerate(ADMISSIONS):
            rows = [next(r for r in res["rows"] if r["admission"] == adm and
                         r["accuracy"] == a and r.get("kv_blocks") == blocks) for a in xs]
            row[0].plot(range(len(xs)), [r["jct"] for r in rows], "o-", label=adm,
                        color=f"C{i}")
            row[1].plot(range(len(xs)), [r["preemptions"] for r in rows], "o-", label=adm,
                        color=f"C{i}")
        what = "A100 memory" if blocks is None else f"{blocks} KV blocks"
        for ax, y in zip(row, ("avg JCT (s)", "preemptions (recomputations)")):
            ax.set_xticks(range(len(xs)), [f"{a:.0%}" if a != "exact" else "exact"
                                           for a in xs])
            ax.set_xlabel("predictor accuracy (granularity 200)")
            ax.set_ylabel(y)
            ax.set_title(f"decode instance: {what}")
    axes[0][0].legend()
    fig.suptitle("Decode admission x predictor accuracy (MIXED, 256 requests at once, 1P+1D)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_dispatch(res: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ns = sorted({r["num_decode"] for r in res["rows"]})
    for router in ROUTERS:
        rows = [r for r in res["rows"] if r["router"] == router]
        ax.plot(ns, [r["decode_span"] for r in rows], "o-", label=router)
    ax.set_xticks(ns)
    ax.set_xlabel("decode instances (32 requests each)")
    ax.set_ylabel("total decode time (s)")
    ax.set_title("Decode dispatch (MIXED, n prefill + n decode)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


GRIDS = {"prefill": prefill_grid, "admission": admission_grid, "dispatch": dispatch_grid}
PLOTS = {"prefill": plot_prefill, "admission": plot_admission, "dispatch": plot_dispatch}


def plot(results: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    gbs = args.links[-1]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    x = np.arange(len(args.workloads))
    ax = axes[3]
    ours = [runs[f"{w}/tetri/{gbs:g}"]["perf_per_dollar"] / runs[f"{w}/vllm"]["perf_per_dollar"]
            for w in args.workloads]
    ax.bar(x - 0.2, ours, 0.4, label="ours", color="tab:orange")
    ax.bar(x + 0.2, [PAPER[w][3] for w in args.workloads], 0.4, label="paper", color="tab:gray")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [w.upper() for w in args.workloads])
    ax.set_title("perf/$, TetriInfer / vLLM")
    ax.legend()
    for ax, (key, label) in zip(axes, (("ttft", "avg TTFT (s)"), ("jct", "avg JCT (s)"),
                                       ("resource_s", "resource usage (busy s)"))):
        ax.bar(x - 0.2, [runs[f"{w}/vllm"][key] for w in args.workloads], 0.4,
               label=f"vLLM (batch {args.vllm_max_seqs})")
        ax.bar(x + 0.2, [runs[f"{w}/tetri/{gbs:g}"][key] for w in args.workloads], 0.4,
               label=f"TetriInfer ({gbs:g} GB/s)")
        ax.set_xticks(x, [w.upper() for w in args.workloads])
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"OPT-13B, DistServe A100 profile, {results['num_requests']} requests, "
                 f"{args.arrival} arrival")
    fig.tight_layout()
    fig.savefig(out / f"tetri_{args.arrival}_bs{args.vllm_max_seqs}.png", dpi=110)


if __name__ == "__main__":
    main()
