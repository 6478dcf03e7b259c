"""EcoServe mitosis scaling live on Ray (docs/benchmarks.md "Live scaling (add/remove, mitosis
on Ray)"): a load ramp served by temporal (PaDG) CPU instances, each a Ray actor with one torch
thread, with mitosis scaling on against static provisioning of every instance.

Both runs start the same actors (the tiny random llama). *Static*: every instance in one macro
instance from the start. *Mitosis*: one instance routed, the others parked (started, idle,
unrouted); every ``--interval`` s the macro router expands (a request was held or the window's
mean TTFT exceeded the SLO) or, after three calm windows, contracts (the instance drains and
parks); past N_u a macro instance splits, and each instance that changes macro instance travels
as its pickled Ray actor handle, rebuilt and adopted by the runtime (migration time recorded).
Reported: SLO attainment over arrival time, instance-seconds in use (routed or draining), the
migrations and their times, and that every request finished.

Small and noisy by necessity: a 2-core machine shared with other jobs.

    python benchmarks/ecoserve_live.py [--instances 3] [--rates 2 6 12 6 2] [--step-s 12]
        [--slo-ttft 0.1] [--slo-tpot 0.02] [--plot docs/img/ecoserve_live.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig
from pdserve.request import SamplingParams


def ramp(rates: list[float], step_s: float, seed: int, vocab: int) -> list[tuple[float, list[int],
                                                                              int]]:
    """Poisson arrivals at each rate for ``step_s`` seconds: ``(time, prompt ids, output len)``.
    """
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for rate in rates:
        t = t0
        while True:
            t += rng.expovariate(rate)
            if t >= t0 + step_s:
                break
            n = rng.randint(32, 256)
            out.append((t, [rng.randrange(4, vocab) for _ in range(n)], rng.randint(16, 48)))
        t0 += step_s
    return out


def used_seconds(scale_log: list[tuple[float, int, int]], start: float, end: float) -> float:
    """Instance-seconds in macro instances or draining, from the router's scale log
    (piecewise constant between decisions)."""
    total = 0.0
    pts = [(max(t, start), n + d) for t, n, d in scale_log] + [(end, 0)]
    for (t, n), (t2, _) in zip(pts, pts[1:]):
        if t2 > t:
            total += n * (min(t2, end) - t)
    return total


async def run(cfg: ClusterConfig, reqs: list[tuple[float, list[int], int]],
              slo: tuple[float, float]) -> dict[str, Any]:
    rt = await build_runtime(cfg)
    try:
        warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        async for _ in rt.generate("warm-up", list(range(10, 60)), warm):
            pass
        await rt.drain()
        router = rt.controller.prefill_router
        router.scale_log.clear()
        router.moves.clear()
        t0 = rt.clock()
        router.scale_log.append((t0, len(router.mitosis.members), 0))

        async def one(k: int, at: float, prompt: list[int], n: int) -> dict[str, Any]:
            await asyncio.sleep(max(t0 + at - rt.clock(), 0.0))
            p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            last = None
            async for out in rt.generate(f"r{k}", prompt, p):
                last = out
            assert last is not None
            tl = last.timeline
            ok = last.finish_reason == "length" and len(last.token_ids) == n
            ttft = tl.token_times[0] - tl.arrival if tl.token_times else float("inf")
            tpot = ((tl.token_times[-1] - tl.token_times[0]) / (n - 1) if n > 1 and ok
                    else 0.0)
            return {"arrival": tl.arrival - t0, "ttft": ttft, "tpot": tpot, "ok": ok,
                    "attains": ok and ttft <= slo[0] and tpot <= slo[1]}

        got = await asyncio.gather(*(one(k, *r) for k, r in enumerate(reqs)))
        end = rt.clock()
        await rt.drain()
        moves = [(t - t0, m) for t, m in router.moves]
        log = [(t - t0, n, d) for t, n, d in router.scale_log]
        pools = await rt.check_integrity()
    finally:
        await rt.shutdown()
    return {"requests": got, "duration": end - t0,
            "instance_seconds": used_seconds(log, 0.0, end - t0),
            "scale_log": log,
            "moves": [{"t": t, "instance": m.instance_id, "src": m.src, "dst": m.dst,
                       "ms": m.seconds * 1e3} for t, m in moves],
            "leaked_blocks": sum(p["used_blocks"] for p in pools.values())}


def bins(requests: list[dict[str, Any]], width: float) -> list[tuple[float, float, int]]:
    out: dict[int, list[bool]] = {}
    for r in requests:
        out.setdefault(int(r["arrival"] // width), []).append(r["attains"])
    return [(k * width, sum(v) / len(v), len(v)) for k, v in sorted(out.items())]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a HF directory (default: the tiny random llama)")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 6, 12, 6, 2])
    ap.add_argument("--step-s", type=float, default=12.0)
    ap.add_argument("--slo-ttft", type=float, default=0.1)
    ap.add_argument("--slo-tpot", type=float, default=0.02)
    ap.add_argument("--interval", type=float, default=2.0, help="mitosis decision period (s)")
    ap.add_argument("--lower", type=int, default=1, help="N_l")
    ap.add_argument("--upper", type=int, default=2, help="N_u")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("static", "mitosis"))
    ap.add_argument("--plot")
    ap.add_argument("--output-json", default="out/ecoserve_live.json")
    args = ap.parse_args(argv)

    from pdserve.cluster.instances import init_ray
    from pdserve.config import ModelConfig
    from pdserve.model.tiny import default_model_dir

    model = args.model or default_model_dir()
    vocab = ModelConfig.from_dir(model).vocab_size
    reqs = ramp(args.rates, args.step_s, args.seed, vocab)
    common = {"model": model, "backend": "ray", "strategy": "partial",
              "num_instances": args.instances, "slo_ttft": args.slo_ttft,
              "slo_tpot": args.slo_tpot, "max_model_len": 512, "num_kv_blocks": 256,
              "max_waiting_requests": 10_000}
    configs = {
        "static": ClusterConfig.from_dict({**common, "macro_instance_size": args.instances}),
        "mitosis": ClusterConfig.from_dict({
            **common, "mitosis": True, "mitosis_lower": args.lower,
            "mitosis_upper": args.upper, "mitosis_initial": args.lower,
            "mitosis_interval": args.interval}),
    }
    init_ray(None, args.instances)
    results: dict[str, Any] = {}
    for name, cfg in configs.items():
        if args.only and name != args.only:
            continue
        t = time.perf_counter()
        r = asyncio.run(run(cfg, reqs, (args.slo_ttft, args.slo_tpot)))
        reqs_ = r["requests"]
        r["attainment"] = sum(x["attains"] for x in reqs_) / len(reqs_)
        r["finished"] = sum(x["ok"] for x in reqs_)
        r["bins"] = bins(reqs_, args.step_s / 2)
        results[name] = r
        ms = [m["ms"] for m in r["moves"]]
        between = [m for m in r["moves"] if m["src"] is not None and m["dst"] is not None]
        print(f"{name}: {r['finished']}/{len(reqs_)} finished, attainment "
              f"{r['attainment']:.1%}, {r['instance_seconds']:.0f} instance-s over "
              f"{r['duration']:.0f} s, {len(ms)} handle moves ({len(between)} between macro "
              f"instances), migration max {max(ms, default=0):.2f} ms, leaked blocks "
              f"{r['leaked_blocks']} ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "num_requests": len(reqs),
                               "results": results}, indent=1, default=str))
    if args.plot:
        plot(results, args, Path(args.plot))


def plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for name, r in results.items():
        b = r["bins"]
        ax1.plot([x[0] + args.step_s / 4 for x in b], [x[1] for x in b], "o-",
                 label=f"{name} ({r['attainment']:.0%} overall)")
        log = r["scale_log"]
        ts = [t for t, _, _ in log] + [r["duration"]]
        ns = [n + d for _, n, d in log]
        ax2.step(ts, ns + ns[-1:], where="post",
                 label=f"{name}: {r['instance_seconds']:.0f} instance-s")
    for k, rate in enumerate(args.rates):
        ax1.text((k + 0.5) * args.step_s, 0.02, f"{rate:g}/s", ha="center", fontsize=8)
    ax1.set_ylabel("SLO attainment")
    ax1.set_ylim(0, 1.05)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("instances in use")
    ax2.set_xlabel("time (s)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"Mitosis live on Ray, tiny llama on CPU (TTFT {args.slo_ttft:g} s, "
                 f"TPOT {args.slo_tpot:g} s)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
