"""TetriInfer against the colocated vLLM-style baseline on the live runtime, CPU instances
(docs/benchmarks.md). Small and noisy by necessity: a 2-core machine shared with other jobs.

The same two deployments as ``benchmarks/tetri.py`` (vLLM: one colocated prefill-first
instance, batch size 16; TetriInfer: 1 prefill + 1 decode, SJF / PrefillSchedBatch 16, fixed
prefill chunks, oracle predictor at 74.9 %, power-of-two dispatch, reserve-dynamic, flip after
an idle minute), served in-process (one torch thread per instance step) on a real model, with
each TetriInfer workload's lengths scaled by ``--length-scale`` and all requests sent at once.
Reports average TTFT, average JCT, resource usage (the instances' busy seconds from their own
step timings) and perf/$.

    python benchmarks/tetri_live.py [--model smollm2-135m-instruct] [--num-requests 24]
        [--length-scale 0.25] [--chunk 256] [--workloads lpld lphd]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.workloads import make_workload
from pdserve.checkpoints import resolve_model
from pdserve.cluster.runtime import build_runtime
from pdserve.config import ClusterConfig, ModelConfig
from pdserve.request import SamplingParams


def deployments(model: str, chunk: int, max_len: int) -> dict[str, ClusterConfig]:
    common = {"model": model, "backend": "inproc", "max_model_len": max_len,
              "num_kv_blocks": 512}
    return {
        "vLLM": ClusterConfig.from_dict({**common, "strategy": "colocated",
                                         "enable_chunked_prefill": False, "max_num_seqs": 16}),
        "TetriInfer": ClusterConfig.from_dict({
            **common, "decode_router": "power_of_two_length", "length_predictor": "oracle",
            "predictor_granularity": 200, "predictor_accuracy": 0.749, "flip": "idle:60",
            "roles": [{"role": "prefill", "engine": {"policy": "sjf", "prefill_sched_batch": 16,
                                                     "prefill_chunk_size": chunk}},
                      {"role": "decode", "engine": {"admission": "reserve-dynamic"}}]}),
    }


async def run(cfg: ClusterConfig, reqs: list[Any]) -> dict[str, Any]:
    rt = await build_runtime(cfg)
    try:
        warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        async for _ in rt.generate("warm-up", list(range(10, 40)), warm):
            pass  # first steps pay torch's warm-up; not counted
        await rt.drain()
        base = {s.instance_id: s.stats.busy_time for s in rt.instance_status() if s.stats}
        t0 = rt.clock()

        async def one(r: Any) -> tuple[float, float]:
            p = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
            last = None
            async for out in rt.generate(r.request_id, r.prompt_token_ids, p):
                last = out
            assert last is not None and last.finish_reason == "length", last
            tl = last.timeline
            return tl.token_times[0] - tl.arrival, tl.token_times[-1] - tl.arrival

        got = await asyncio.gather(*(one(r) for r in reqs))
        wall = rt.clock() - t0
        await rt.drain()
        busy = {s.instance_id: s.stats.busy_time - base.get(s.instance_id, 0.0)
                for s in rt.instance_status() if s.stats}
    finally:
        await rt.shutdown()
    ttft, jct = np.array(got).T
    resource = sum(busy.values())
    return {"ttft": float(ttft.mean()), "jct": float(jct.mean()), "wall": wall,
            "resource_s": resource, "perf_per_dollar": len(reqs) / resource, "busy": busy}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--workloads", nargs="+", default=["lpld", "lphd"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="out/tetri/tetri_live.json")
    args = p.parse_args(argv)
    model = resolve_model(args.model)
    vocab = ModelConfig.from_dir(model).vocab_size
    results: dict[str, Any] = {}
    lines = ["| workload | system | avg TTFT s | avg JCT s | busy s | perf/$ (req / busy s) "
             "| wall s |", "|---|---|---|---|---|---|---|"]
    for wl in args.workloads:
        w = make_workload(wl, args.num_requests, seed=args.seed, rate=1e6, arrival="constant",
                          vocab_size=vocab, max_model_len=args.max_model_len,
                          length_scale=args.length_scale, prompt_mode="ids")
        for name, cfg in deployments(model, args.chunk, args.max_model_len).items():
            t = time.perf_counter()
            r = asyncio.run(run(cfg, w.requests))
            results[f"{wl}/{name}"] = r
            lines.append(f"| {wl} | {name} | {r['ttft']:.2f} | {r['jct']:.2f} | "
                         f"{r['resource_s']:.1f} | {r['perf_per_dollar']:.2f} | {r['wall']:.1f} |")
            print(lines[-1], f"({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    print("\n".join(lines))
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
