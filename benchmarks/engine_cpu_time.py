"""Process CPU time of pdserve on the offline workload, split into steps with prefill and pure
decode steps, and inside them the model forward and the logits (``lm_head``).

CPU seconds with one torch thread are far less sensitive to other jobs on a shared machine than
wall time, so this is the number to compare code changes by (docs/benchmarks.md, "Engine
profile (issue 14)"). Flags after the first two go to ``offline_throughput.py``'s parser.

    python benchmarks/engine_cpu_time.py 1 32      # torch threads, prompts
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pdserve  # noqa: F401 - first: sets OpenMP's wait policy before torch loads

# isort: split
import torch  # noqa: E402
from offline_throughput import make_workload, model_dir, parse_args, warm_llm  # noqa: E402


def main(argv: list[str]) -> None:
    threads, prompts = int(argv[0]), argv[1] if len(argv) > 1 else "32"
    args = parse_args(["--num-prompts", prompts, "--threads", str(threads), *argv[2:]])
    torch.set_num_threads(threads)
    path = model_dir(args)
    wl = make_workload(args.num_prompts, args.seed, args.vocab_size, args.input_len_min,
                       args.input_len_max, args.output_len_min, args.output_len_max)
    llm, params = warm_llm(path, wl, args)
    ex = llm.engine.executor
    model, run, rec = ex.model, ex.execute, []
    acc = {"fwd": 0.0, "log": 0.0}

    def timed(key: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.process_time() - t
        return wrapper

    model.forward = timed("fwd", model.forward)
    model.compute_logits = timed("log", model.compute_logits)

    def execute(batch: Any) -> Any:
        acc["fwd"] = acc["log"] = 0.0
        t = time.process_time()
        out = run(batch)
        dec = [s for s in batch.seqs if s.num_tokens == 1]
        pre = sum(s.num_tokens for s in batch.seqs if s.num_tokens > 1)
        rec.append((len(dec), pre, sum(s.start + 1 for s in dec), time.process_time() - t,
                    acc["fwd"], acc["log"]))
        return out

    ex.execute = execute
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(wl.prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    pre, dec = [r for r in rec if r[1] > 0], [r for r in rec if r[1] == 0]

    def total(rs: list, i: int) -> float:
        return sum(r[i] for r in rs)

    print(f"threads={threads} prompts={prompts} wall={wall:.1f}s cpu={cpu:.1f}s "
          f"out tok/s={wl.output_tokens / wall:.1f} steps={len(rec)}")
    print(f"prefill steps {len(pre)}: cpu {total(pre, 3):.2f}s forward {total(pre, 4):.2f} "
          f"logits {total(pre, 5):.2f} prompt tokens {total(pre, 1):.0f}")
    print(f"decode steps {len(dec)}: cpu {total(dec, 3):.2f}s forward {total(dec, 4):.2f} "
          f"logits {total(dec, 5):.2f} rows {total(dec, 0):.0f} mean context "
          f"{total(dec, 2) / max(1, total(dec, 0)):.0f}")


if __name__ == "__main__":
    if not sys.argv[1:2] or not sys.argv[1].isdigit():  # -h, --help, or no thread count
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    main(sys.argv[1:])
