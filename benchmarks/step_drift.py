"""How steady is this machine's step time? (docs/fidelity.md, "Step drift".)

Times the same two steps of a model's real executor — one decode step of one sequence and one
prefill of a short prompt — over and over for a few minutes, in one process with one torch
thread and nothing else asked of it, and reports the median of each per window. A calibrated
step model can only be as right as the machine is steady: when the same step takes 20 % longer
in one minute than in another, a model fitted in the first minute is 20 % off in the second.

    python benchmarks/step_drift.py --model out/fidA/model --minutes 4 \
        [--window 10] [--output-json out/drift.json] [--plot out/drift.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (e.g. the fidelity model)")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--window", type=float, default=10.0, help="seconds per reported median")
    ap.add_argument("--context", type=int, default=128, help="decode context / prompt length")
    ap.add_argument("--output-json")
    ap.add_argument("--plot", help="PNG of both steps' window medians over time")
    args = ap.parse_args(argv)

    import torch

    from pdserve.config import ModelConfig
    from pdserve.sim.latency import ProfileSample
    from pdserve.sim.profiler import measure, profiling_engine

    torch.set_num_threads(1)
    cfg = ModelConfig.from_dir(args.model)
    n = args.context
    shapes = {"decode": ProfileSample((), (n,), 0.0),
              "prefill": ProfileSample(((0, n),), (), 0.0)}
    engine = profiling_engine(args.model, "cpu", "float32", 4 * (n // 16 + 2), 16,
                     min(cfg.max_position_embeddings, 4096))
    for sh in shapes.values():  # warm up
        measure(engine, sh, 5, "median")
    t0 = time.time()
    windows = []
    while time.time() - t0 < 60 * args.minutes:
        w0, got = time.time(), {k: [] for k in shapes}
        while time.time() - w0 < args.window:
            for k, sh in shapes.items():
                got[k].append(measure(engine, sh, 1, "median"))
        row = {"t_s": round(w0 - t0, 1), "load": os.getloadavg()[0],
               **{f"{k}_ms": 1000 * float(np.median(v)) for k, v in got.items()},
               **{f"{k}_n": len(v) for k, v in got.items()}}
        windows.append(row)
        print(f"t={row['t_s']:6.1f}s  decode {row['decode_ms']:.2f} ms  prefill "
              f"{row['prefill_ms']:.2f} ms  (load {row['load']:.2f})", flush=True)
    summary = {}
    for k in shapes:
        v = np.array([w[f"{k}_ms"] for w in windows])
        summary[k] = {"median_ms": float(np.median(v)), "min_ms": float(v.min()),
                      "max_ms": float(v.max()), "max_over_min": float(v.max() / v.min())}
        print(f"{k}: window medians {v.min():.2f}–{v.max():.2f} ms "
              f"(max/min {v.max() / v.min():.2f}) over {len(v)} windows")
    rep = {"command": "python benchmarks/step_drift.py " + " ".join(argv or sys.argv[1:]),
           "model": args.model, "context": n, "window_s": args.window, "windows": windows,
           "summary": summary}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(rep, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ts = [w["t_s"] for w in windows]
        for k in shapes:
            v = np.array([w[f"{k}_ms"] for w in windows])
            ax.plot(ts, v / np.median(v), "o-", label=f"{k} (median {np.median(v):.2f} ms)")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(f"step time / its median ({args.window:g} s windows)")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("The same step, timed over and over on an otherwise idle machine")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        plt.close(fig)
    return rep


if __name__ == "__main__":
    main()
