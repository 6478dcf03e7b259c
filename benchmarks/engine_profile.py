"""Where one engine step's time goes: scheduling, metadata, matmuls, attention, sampling, waits.

Runs ``LLM.generate`` on the workload of ``benchmarks/offline_throughput.py`` (same model, same
seeded prompts; its flags apply) twice:

1. with wall-clock timers around the phases of a step (scheduler + update, attention metadata,
   model forward, logits, sampling), and process CPU time beside wall time: with ``T`` torch
   threads, ``T * wall - CPU`` is time threads spent waiting (descheduled, or idle in a
   serial op);
2. under ``torch.profiler`` (CPU), with the self time of every aten op summed into categories
   (dense matmuls, attention, KV write/gather, norms/RoPE/activations, logits, sampling, ...).

    python benchmarks/engine_profile.py --num-prompts 32 --threads 2

Results: docs/benchmarks.md, "Engine profile (issue 14)".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import pdserve  # noqa: E402,F401 - first: sets OpenMP's wait policy before torch loads

# isort: split
import torch  # noqa: E402
from offline_throughput import (  # noqa: E402 - beside this file
    make_workload,
    model_dir,
    parse_args,
    warm_llm,
)

from pdserve.config import ModelConfig  # noqa: E402
from pdserve.engine import model_executor  # noqa: E402
from pdserve.llm import LLM  # noqa: E402

# aten op name -> category (first matching prefix wins; everything else is "other ops")
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("dense matmuls (QKV, O, gate-up, down)", ("aten::addmm", "aten::mm", "aten::linear",
                                               "aten::matmul", "aten::_linear")),
    ("attention (SDPA)", ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product",
                          "aten::_flash_attention", "aten::bmm", "aten::baddbmm",
                          "aten::_softmax", "aten::softmax")),
    ("KV write + gather", ("aten::index_copy", "aten::index_select")),
    ("norms, RoPE, SiLU, residual adds", ("aten::mul", "aten::add", "aten::sub", "aten::pow",
                                          "aten::mean", "aten::rsqrt", "aten::silu",
                                          "aten::cat", "aten::neg", "aten::_to_copy",
                                          "aten::copy_", "aten::to")),
    ("sampling (argmax, ...)", ("aten::argmax", "aten::log_softmax", "aten::topk",
                                "aten::multinomial", "aten::sort")),
    ("allocation, views, other small ops", ("",)),
]


class Timers:
    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.wall[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed


def instrument(llm: LLM, timers: Timers) -> None:
    ex = llm.engine.executor
    model_executor.build_attention_metadata = timers.wrap(
        "attention metadata", model_executor.build_attention_metadata)
    ex.model.forward = timers.wrap("model forward", ex.model.forward)
    ex.model.compute_logits = timers.wrap("logits (lm_head)", ex.model.compute_logits)
    ex.sampler = timers.wrap("sampling", ex.sampler)
    ex.execute = timers.wrap("execute", ex.execute)
    llm.engine.step = timers.wrap("step", llm.engine.step)


def run(args: Any, path: str, wl: Any, profile: bool) -> tuple[Timers, float, float, Any]:
    llm, params = warm_llm(path, wl, args)
    timers = Timers()
    instrument(llm, timers)
    prof = None
    if profile:  # only steps [first, first + count): the profiler's own cost grows per event
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        step, first, count = llm.engine.step, args.profile_from, args.profile_steps

        def profiled(*a: Any, **k: Any) -> Any:
            i = timers.calls["profiled step"]
            timers.calls["profiled step"] += 1
            if i == first:
                prof.start()
            try:
                return step(*a, **k)
            finally:
                if i == first + count - 1:
                    prof.stop()
        llm.engine.step = profiled
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(wl.prompts, params)
    timers.thread_steps = dict(llm.engine.executor.thread_steps)  # type: ignore[attr-defined]
    return timers, time.perf_counter() - t0, time.process_time() - c0, prof


def categorize(prof: Any) -> dict[str, float]:
    """Self CPU time (seconds) per category, summed over top-level aten ops only."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if not ev.key.startswith("aten::"):
            continue
        for cat, prefixes in CATEGORIES:
            if any(ev.key.startswith(p) for p in prefixes):
                out[cat] += ev.self_cpu_time_total / 1e6
                break
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--profile-from", type=int, default=40, help="first profiled step")
    extra.add_argument("--profile-steps", type=int, default=20)
    known, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    args.profile_from, args.profile_steps = known.profile_from, known.profile_steps
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    path = model_dir(args)
    mcfg = ModelConfig.from_dir(path)
    wl = make_workload(args.num_prompts, args.seed, mcfg.vocab_size, args.input_len_min,
                       args.input_len_max, args.output_len_min, args.output_len_max)
    print(f"model {path}: {mcfg.num_params() / 1e6:.1f}M parameters, {args.num_prompts} prompts "
          f"({wl.input_tokens} prompt, {wl.output_tokens} output tokens), {threads} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"load average {os.getloadavg()[0]:.2f}")

    timers, wall, cpu, _ = run(args, path, wl, profile=False)
    steps = timers.calls["step"]
    w = timers.wall
    phases = [
        ("scheduler (schedule + update) and engine", w["step"] - w["execute"]),
        ("attention metadata", w["attention metadata"]),
        ("model forward", w["model forward"]),
        ("logits (lm_head)", w["logits (lm_head)"]),
        ("sampling", w["sampling"]),
        ("executor rest (sample rows, ...)", w["execute"] - w["attention metadata"]
         - w["model forward"] - w["logits (lm_head)"] - w["sampling"]),
    ]
    used = getattr(timers, "thread_steps", {}) or {threads: steps}
    mean_threads = sum(t * n for t, n in used.items()) / sum(used.values())
    print(f"\n1) phases: {steps} steps, {wall:.2f} s wall ({wl.output_tokens / wall:.1f} tok/s), "
          f"{cpu:.2f} s process CPU; steps per torch thread count {used}; thread waits ~ "
          f"threads x wall - CPU = {max(mean_threads * wall - cpu, 0):.2f} thread-seconds")
    print("| phase | share of wall | ms per step |\n|---|---:|---:|")
    for name, s in phases:
        print(f"| {name} | {s / wall:.1%} | {1e3 * s / steps:.2f} |")

    _, pwall, _, prof = run(args, path, wl, profile=True)
    cats = categorize(prof)
    total = sum(cats.values())
    steps = args.profile_steps
    print(f"\n2) aten ops under torch.profiler, steps {args.profile_from}.."
          f"{args.profile_from + steps - 1} ({total:.2f} s self CPU time in aten ops)")
    print("| category | share of op time | ms per step |\n|---|---:|---:|")
    for cat, _ in CATEGORIES:
        print(f"| {cat} | {cats[cat] / total:.1%} | {1e3 * cats[cat] / steps:.2f} |")
    print("\ntop ops by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                    max_name_column_width=40))
    return 0


if __name__ == "__main__":
    sys.exit(main())
