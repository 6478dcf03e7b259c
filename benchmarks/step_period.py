"""The step period that overlapping HTTP streams see vs the executor's own step time, and how busy
the instance actor is (docs/fidelity.md, "Live runtime vs simulator").

Starts ``pdserve serve`` (one colocated Ray instance, the fidelity study's tiny llama and engine
settings) with a step log, then sends ``K`` streaming requests together (64 prompt tokens, 48
forced output tokens) for each ``K`` in ``--streams``, ``--rounds`` times, and reports per ``K``:

- ``client_gap_ms``: median gap between consecutive tokens of a stream, as the client receives
  them (what TPOT measures);
- ``step_ms``: median executor time of the decode steps with ``K`` sequences (the step log's
  ``elapsed``: what the profile and the simulator model);
- ``period_ms``: median time from one step's start to the next one's (the step log's ``now``);
- ``busy``: the executor's share of the wall time from the first step's start to the last
  step's end (Σ elapsed / span).

With ``--poisson RATE`` it also serves requests with Poisson arrivals and compares the TPOT of
requests that ran alone with that of requests that overlapped another one, against the decode
steps of one and of several sequences (``--streams ''`` skips the streams part).

    python benchmarks/step_period.py --work-dir out/period --output-json out/period/after.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.metrics import SLO
from pdserve.bench.runner import Settings, build_workload
from pdserve.bench.targets import HttpTarget
from pdserve.config import ClusterConfig

HERE = Path(__file__).resolve().parent


def _fidelity() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fidelity", HERE / "fidelity.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def steps_between(log: Path, t0: float, t1: float) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        s = json.loads(line)
        if t0 <= s["now"] <= t1:
            out.append(s)
    return out


def measure(target: HttpTarget, s: Settings, log: Path, k: int, rounds: int) -> dict[str, Any]:
    gaps: list[float] = []
    steps: list[dict[str, Any]] = []
    busy: list[float] = []
    for r in range(rounds):
        w = build_workload(target, replace(s, workload="fixed:input=64,output=48", length_scale=1.0,
                                           num_requests=k, seed=100 * k + r), 1000.0)
        t0 = time.time()
        recs = asyncio.run(target.run(list(w.requests)))
        t1 = time.time()
        assert all(rec.ok for rec in recs), [rec.error for rec in recs if not rec.ok]
        for rec in recs:
            gaps += list(np.diff(rec.timeline.token_times))
        time.sleep(0.3)  # the log is line-buffered; let the last lines land
        st = steps_between(log, t0, t1)
        steps += st
        if st:
            span = st[-1]["now"] + st[-1]["elapsed"] - st[0]["now"]
            busy.append(sum(x["elapsed"] for x in st) / span)
        time.sleep(0.5)
    decode_k = [x["elapsed"] for x in steps
                if not x["prefill_chunks"] and len(x["decode_context_lens"]) == k]
    starts = sorted(x["now"] for x in steps)
    periods = [b - a for a, b in zip(starts, starts[1:]) if b - a < 1.0]
    return {"streams": k, "rounds": rounds, "tokens": len(gaps),
            "client_gap_ms": 1000 * float(np.median(gaps)),
            "client_gap_mean_ms": 1000 * float(np.mean(gaps)),
            "step_ms": 1000 * float(np.median(decode_k)) if decode_k else None,
            "decode_steps": len(decode_k),
            "period_ms": 1000 * float(np.median(periods)) if periods else None,
            "busy": float(np.mean(busy)) if busy else None}


def poisson(target: HttpTarget, s: Settings, log: Path, rate: float, n: int) -> dict[str, Any]:
    """``n`` requests (64 prompt tokens, 48 forced output tokens) with Poisson arrivals at
    ``rate``: the TPOT of requests that ran alone vs those that overlapped another one, against
    the executor's decode steps of one and of several sequences in the same run."""
    w = build_workload(target, replace(s, workload="fixed:input=64,output=48", length_scale=1.0,
                                       num_requests=n, seed=77), rate)
    t0 = time.time()
    recs = asyncio.run(target.run(list(w.requests)))
    t1 = time.time()
    assert all(rec.ok for rec in recs), [rec.error for rec in recs if not rec.ok]
    spans = [(r.timeline.arrival, r.timeline.token_times[-1]) for r in recs]
    lone, overlapped = [], []
    for i, r in enumerate(recs):
        a, b = r.timeline.token_times[0], spans[i][1]
        other = any(s0 < b and s1 > a for j, (s0, s1) in enumerate(spans) if j != i)
        (overlapped if other else lone).append(r.tpot)
    time.sleep(0.3)
    st = steps_between(log, t0, t1)
    one = [x["elapsed"] for x in st if not x["prefill_chunks"]
           and len(x["decode_context_lens"]) == 1]
    many = [x["elapsed"] for x in st if not x["prefill_chunks"]
            and len(x["decode_context_lens"]) >= 2]
    pairs = [(a, b) for a, b in zip(st, st[1:]) if b["now"] - a["now"] < 1.0]
    period_many = [b["now"] - a["now"] for a, b in pairs
                   if len(a["decode_context_lens"]) + len(a["prefill_chunks"]) >= 2]

    def med(xs: list[float]) -> float | None:
        return 1000 * float(np.median(xs)) if xs else None

    return {"rate": rate, "requests": n, "lone": len(lone), "overlapped": len(overlapped),
            "tpot_lone_ms": med(lone), "tpot_overlapped_ms": med(overlapped),
            "step_1_ms": med(one), "step_many_ms": med(many),
            "period_after_many_ms": med(period_many)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", default="out/period")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--poisson", type=float, default=None, metavar="RATE",
                    help="also serve --poisson-requests requests with Poisson arrivals at RATE "
                         "and compare lone and overlapping requests' TPOT")
    ap.add_argument("--poisson-requests", type=int, default=60)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    fid = _fidelity()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = fid.make_model(work / "model", 0)
    log = work / "steps.jsonl"
    log.unlink(missing_ok=True)
    engine = {"dtype": "float32", "block_size": 16, "num_kv_blocks": 512,
              "max_num_batched_tokens": 512, "max_model_len": 1024, "max_num_seqs": 64,
              "enable_chunked_prefill": True, "step_log": str(log)}
    spec = ClusterConfig.from_dict({"model": model, "engine": engine,
                                    "strategy": "colocated", "backend": "ray"})
    spec_file = work / "deployment.json"
    spec_file.write_text(json.dumps(spec.to_dict(), indent=1))
    from pdserve.config import ModelConfig

    s = Settings(workload="chatbot", num_requests=8, seed=0,
                 vocab_size=ModelConfig.from_dir(model).vocab_size, max_model_len=1024,
                 length_scale=0.1, prompt_mode="ids", slo=SLO(0.5, 0.06))
    server = fid.Server(spec_file, work / "serve.log")
    rows = []
    try:
        target = HttpTarget(server.url, progress=False)
        asyncio.run(target.prepare())
        fid.warm_up(target, s)
        for k in (int(x) for x in args.streams.split(",") if x):
            row = measure(target, s, log, k, args.rounds)
            rows.append(row)
            print(json.dumps(row))
        if args.poisson:
            prow = poisson(target, s, log, args.poisson, args.poisson_requests)
            rows.append(prow)
            print(json.dumps(prow))
    finally:
        server.stop()
    import pdserve

    rep = {"pdserve": os.path.dirname(pdserve.__file__), "loadavg_after":
           Path("/proc/loadavg").read_text().split()[:3], "rows": rows}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rep, indent=1))
    return rep


if __name__ == "__main__":
    main()
