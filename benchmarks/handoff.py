"""KV hand-off cost of prefill/decode disaggregation on this machine (docs/benchmarks.md,
"KV hand-off (cluster)").

For a random tiny llama (2 layers, 2 KV heads × 16 dims, fp32: 512 B of KV per token) served by
the live cluster runtime, sends sequential requests (low load: one in flight) of prompt lengths
16..1024 tokens to a colocated instance and to a disaggregated 1 prefill + 1 decode pair, for
each transport: in-process (the exported blocks are a tensor handed between threads) and Ray
(the prefill actor's export is an object in the object store that the decode actor pulls).
Every prompt is fresh (no prefix-cache hit), so the whole prompt's KV moves.

Reported per prompt length, median over ``--repeats`` requests:

- **hand-off**: ``transfer_end − transfer_start`` of the request's timeline: from the decode
  instance reserving blocks and asking for the KV to the KV being imported (export, transport,
  import, and the control-plane hops between them);
- **TTFT** colocated vs disaggregated (the first token comes from the prefill instance, so the
  hand-off is not in it; the difference is the routing overhead) and the **second-token gap**
  (first → second token), which on the disaggregated path contains the hand-off.

    python benchmarks/handoff.py [--backends inproc,ray] [--lengths 16,32,...,1024]
        [--repeats 5] [--output-json out/handoff.json] [--plot out/handoff.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from pdserve.cluster.instances import init_ray
from pdserve.cluster.runtime import ClusterRuntime, build_runtime
from pdserve.config import ClusterConfig, EngineConfig, ModelConfig, cdiv
from pdserve.request import SamplingParams

LENGTHS = (16, 32, 64, 128, 256, 512, 1024)


async def one(rt: ClusterRuntime, rid: str, prompt: list[int]) -> Any:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    final = None
    async for out in rt.generate(rid, prompt, params):
        final = out
    assert final is not None and final.finish_reason == "length", final
    return final.timeline


async def measure(backend: str, model: str, lengths: list[int], repeats: int,
                  seed: int) -> dict[str, Any]:
    mc = ModelConfig.from_dir(model)
    engine = EngineConfig.from_kwargs(model, model_max_len=mc.max_position_embeddings,
                                      max_model_len=max(lengths) + 8, num_kv_blocks=256,
                                      max_num_batched_tokens=max(2048, max(lengths) + 8))
    coloc = await build_runtime(ClusterConfig.from_dict({"engine": engine, "backend": backend}))
    disagg = await build_runtime(ClusterConfig.from_dict(
        {"engine": engine, "strategy": "disaggregated", "backend": backend}))
    rng = np.random.default_rng(seed)
    fresh = lambda n: rng.integers(4, mc.vocab_size, n).tolist()  # noqa: E731
    rows = []
    try:
        for i in range(3):  # warm-up: first steps and first object-store puts are slow
            await one(coloc, f"w{i}", fresh(64))
            await one(disagg, f"w{i}", fresh(64))
        for n in lengths:
            samples: dict[str, list[float]] = {"handoff": [], "ttft_coloc": [],
                                               "ttft_disagg": [], "gap2_coloc": [],
                                               "gap2_disagg": []}
            for r in range(repeats):
                tc = await one(coloc, f"c{n}-{r}", fresh(n))
                td = await one(disagg, f"d{n}-{r}", fresh(n))
                samples["handoff"].append(td.transfer_end - td.transfer_start)
                samples["ttft_coloc"].append(tc.token_times[0] - tc.arrival)
                samples["ttft_disagg"].append(td.token_times[0] - td.arrival)
                samples["gap2_coloc"].append(tc.token_times[1] - tc.token_times[0])
                samples["gap2_disagg"].append(td.token_times[1] - td.token_times[0])
            row = {"prompt_len": n,
                   "kv_bytes": cdiv(n, engine.cache.block_size) * engine.cache.block_size
                   * mc.kv_bytes_per_token(engine.dtype)}
            row.update({f"{k}_ms": 1000 * statistics.median(v) for k, v in samples.items()})
            row["handoff_p90_ms"] = 1000 * float(np.percentile(samples["handoff"], 90))
            rows.append(row)
            print(f"  {backend:6s} {n:5d} tokens: hand-off {row['handoff_ms']:.2f} ms",
                  flush=True)
        for rt in (coloc, disagg):
            await rt.drain()
            for s in (await rt.check_integrity()).values():
                assert s["used_blocks"] == 0, s
    finally:
        await coloc.shutdown()
        await disagg.shutdown()
    return {"backend": backend, "rows": rows}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| transport | prompt tokens | KV (KiB) | hand-off median (ms) | hand-off P90 (ms) "
             "| TTFT coloc (ms) | TTFT disagg (ms) | 2nd-token gap coloc (ms) "
             "| 2nd-token gap disagg (ms) |", "|---|" + "---:|" * 8]
    for res in results:
        name = "in-process" if res["backend"] == "inproc" else "Ray object store"
        for r in res["rows"]:
            lines.append(
                f"| {name} | {r['prompt_len']} | {r['kv_bytes'] / 1024:.0f} | "
                f"{r['handoff_ms']:.2f} | {r['handoff_p90_ms']:.2f} | {r['ttft_coloc_ms']:.2f} "
                f"| {r['ttft_disagg_ms']:.2f} | {r['gap2_coloc_ms']:.2f} | "
                f"{r['gap2_disagg_ms']:.2f} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for res in results:
        x = [r["prompt_len"] for r in res["rows"]]
        label = "in-process" if res["backend"] == "inproc" else "Ray"
        a.plot(x, [r["handoff_ms"] for r in res["rows"]], "o-", label=label)
        b.plot(x, [r["ttft_coloc_ms"] for r in res["rows"]], "o--",
               label=f"{label}: colocated")
        b.plot(x, [r["ttft_disagg_ms"] for r in res["rows"]], "o-",
               label=f"{label}: disaggregated")
    for ax, title in ((a, "KV hand-off per request"), (b, "TTFT at low load")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms (median)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="inproc,ray")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="model dir (default: a tiny llama with 2048 positions, "
                                    "made in a temporary directory)")
    ap.add_argument("--output-json", default="handoff.json")
    ap.add_argument("--plot", metavar="PNG", help="also write a plot")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    backends = args.backends.split(",")
    logging.getLogger("pdserve").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from pdserve.model.tiny import make_tiny_model

            model = make_tiny_model(f"{tmp}/tiny", max_position_embeddings=2048)
        results = []
        t0 = time.monotonic()
        for backend in backends:
            if backend == "ray":
                init_ray(None, 3)
            try:
                results.append(asyncio.run(measure(backend, model, lengths, args.repeats,
                                                   args.seed)))
            finally:
                if backend == "ray":
                    import ray

                    ray.shutdown()
    print(table(results))
    print(f"({time.monotonic() - t0:.0f} s)")
    with open(args.output_json, "w") as f:
        json.dump({"repeats": args.repeats, "results": results}, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
