"""Offline throughput: pdserve ``LLM.generate`` versus ``transformers`` batched ``generate``.

Both run the same random tiny llama (written by :func:`pdserve.model.tiny.make_tiny_model`) on
the same prompts in the same process. Prompts are random token ids with seeded input lengths
(``--input-len-min``..``--input-len-max``) and requested output lengths
(``--output-len-min``..``--output-len-max``), forced with ``ignore_eos`` (pdserve) or
``min_new_tokens`` (transformers). Only each prompt's requested tokens are counted for both:
transformers generates ``max`` of its batch's requests for every prompt of the batch (left
padding, ``--hf-batch-size`` prompts per batch, in input order unless ``--hf-sort``), and the
extra tokens are work it does but not useful output.

    python benchmarks/offline_throughput.py --num-prompts 64 --output-json out/offline.json

Prints a table of useful output tokens/s (and prompt + output tokens/s) of both, and the ratio
by wall time and by process CPU time (steadier on a shared machine; ``--threads 1`` also is).
Results: docs/benchmarks.md, "Offline throughput (engine)".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pdserve  # noqa: F401 - first: sets OpenMP's wait policy before torch loads

# isort: split
import torch

from pdserve.bench.experiments.bench_models import bench_llama_dir
from pdserve.llm import LLM
from pdserve.request import SamplingParams

PAD_ID = 3  # the tiny tokenizer's <pad>


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class RunResult:
    name: str
    seconds: float
    useful_output_tokens: int
    input_tokens: int
    generated_tokens: int  # everything produced, padding-batch extras included
    cpu_seconds: float = 0.0  # process CPU time: steadier than wall time on a shared machine
    outputs: list[list[int]] = field(repr=False, default_factory=list)

    @property
    def output_tps(self) -> float:
        return self.useful_output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.useful_output_tokens + self.input_tokens) / self.seconds


def make_workload(n: int, seed: int, vocab: int, in_lo: int, in_hi: int, out_lo: int,
                  out_hi: int) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        length = rng.randint(in_lo, in_hi)
        prompts.append([rng.randrange(4, vocab) for _ in range(length)])
        outs.append(rng.randint(out_lo, out_hi))
    return Workload(prompts, outs)


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        from pdserve.checkpoints import resolve_model

        return resolve_model(args.model)  # a directory, a .gguf file or a built-in name
    return bench_llama_dir(args.seed, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                           intermediate_size=args.intermediate_size, num_layers=args.num_layers,
                           num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                           max_position_embeddings=args.max_position_embeddings)


def warm_llm(path: str, wl: Workload, args: argparse.Namespace) -> tuple[LLM, list]:
    """pdserve's engine with this benchmark's settings, warmed up (allocator, kernels) on a
    short slice of the workload, and the workload's sampling parameters (greedy, forced
    lengths)."""
    llm = LLM(path, device=args.device, dtype=args.dtype, seed=args.seed,
              max_model_len=args.input_len_max + args.output_len_max + 1,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, block_size=args.block_size,
              cpu_kv_gib=args.cpu_kv_gib)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in wl.output_lens]
    llm.generate([p[:32] for p in wl.prompts[:4]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    return llm, params


def run_pdserve(path: str, wl: Workload, args: argparse.Namespace) -> RunResult:
    llm, params = warm_llm(path, wl, args)
    _sync(args.device)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(wl.prompts, params)
    _sync(args.device)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    toks = [o.token_ids for o in outs]
    for t, n in zip(toks, wl.output_lens):
        assert len(t) == n, f"pdserve produced {len(t)} tokens, {n} requested"
    return RunResult("pdserve", seconds, wl.output_tokens, wl.input_tokens, wl.output_tokens,
                     cpu, toks)


def run_transformers(path: str, wl: Workload, args: argparse.Namespace) -> RunResult:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, args.dtype), attn_implementation=args.hf_attn
    ).to(args.device).eval()
    order = list(range(len(wl.prompts)))
    if args.hf_sort:
        order.sort(key=lambda i: len(wl.prompts[i]))
    batches = [order[i : i + args.hf_batch_size]
               for i in range(0, len(order), args.hf_batch_size)]

    def generate(idx: Sequence[int], prompts: list[list[int]], new: int) -> list[list[int]]:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            seq = model.generate(ids.to(args.device), attention_mask=mask.to(args.device),
                                 do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=PAD_ID)
        return seq[:, width:].tolist()

    generate(range(min(4, len(wl.prompts))), [p[:32] for p in wl.prompts], 4)  # warm-up
    _sync(args.device)
    outs: list[list[int]] = [[] for _ in wl.prompts]
    generated = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for idx in batches:
        new = max(wl.output_lens[i] for i in idx)
        for i, toks in zip(idx, generate(idx, wl.prompts, new)):
            outs[i] = toks[: wl.output_lens[i]]
            generated += len(toks)
    _sync(args.device)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return RunResult("transformers", seconds, wl.output_tokens, wl.input_tokens, generated, cpu,
                     outs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def agreement(a: list[list[int]], b: list[list[int]], k: int) -> float:
    """Share of prompts whose first ``k`` greedy tokens agree (a sanity check: same work)."""
    return sum(x[:k] == y[:k] for x, y in zip(a, b)) / max(len(a), 1)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len-min", type=int, default=8)
    p.add_argument("--output-len-max", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    m = p.add_argument_group("model (ignored with --model)")
    m.add_argument("--model", default=None,
                   help="an existing model directory, .gguf file or built-in name "
                        "(smollm2-135m-instruct)")
    m.add_argument("--vocab-size", type=int, default=32000)
    m.add_argument("--hidden-size", type=int, default=512)
    m.add_argument("--intermediate-size", type=int, default=1408)
    m.add_argument("--num-layers", type=int, default=8)
    m.add_argument("--num-heads", type=int, default=8)
    m.add_argument("--num-kv-heads", type=int, default=4)
    m.add_argument("--max-position-embeddings", type=int, default=1024)
    e = p.add_argument_group("pdserve engine")
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--cpu-kv-gib", type=float, default=1.0)
    h = p.add_argument_group("transformers reference")
    h.add_argument("--hf-batch-size", type=int, default=16)
    h.add_argument("--hf-sort", action="store_true",
                   help="batch prompts sorted by input length (less padding)")
    h.add_argument("--hf-attn", default="sdpa", help="attn_implementation (sdpa, eager)")
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    path = model_dir(args)
    from pdserve.config import ModelConfig

    mcfg = ModelConfig.from_dir(path)
    wl = make_workload(args.num_prompts, args.seed, mcfg.vocab_size, args.input_len_min,
                       args.input_len_max, args.output_len_min, args.output_len_max)
    results = [run_pdserve(path, wl, args)]
    if not args.skip_hf:
        results.append(run_transformers(path, wl, args))

    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"model {path}: {mcfg.num_params() / 1e6:.1f}M parameters, "
                  f"{args.num_prompts} prompts, {wl.input_tokens} prompt tokens, "
                  f"{wl.output_tokens} requested output tokens, device {args.device}, "
                  f"dtype {args.dtype}, {torch.get_num_threads()} threads")
    table = Table(title="Offline throughput (useful = requested output tokens)")
    for col in ("system", "seconds", "useful out tok/s", "prompt+out tok/s", "generated tokens",
                "CPU seconds"):
        table.add_column(col, justify="right" if col != "system" else "left")
    for r in results:
        table.add_row(r.name, f"{r.seconds:.2f}", f"{r.output_tps:.1f}", f"{r.total_tps:.1f}",
                      str(r.generated_tokens), f"{r.cpu_seconds:.1f}")
    console.print(table)
    report: dict[str, Any] = {
        "args": vars(args), "machine": machine(), "model_dir": path,
        "num_params": mcfg.num_params(), "input_tokens": wl.input_tokens,
        "output_tokens": wl.output_tokens,
        "results": [{k: v for k, v in asdict(r).items() if k != "outputs"}
                    | {"output_tps": r.output_tps, "total_tps": r.total_tps} for r in results],
    }
    if len(results) == 2:
        ratio = results[0].output_tps / results[1].output_tps
        agree = agreement(results[0].outputs, results[1].outputs, 8)
        report["speedup"] = ratio
        # credited with every token each system generated (transformers' padding-batch extras
        # included): the kernel-level comparison, beside the useful-token one above
        gen = [r.generated_tokens / r.seconds for r in results]
        report["generated_tokens_speedup"] = gen[0] / gen[1]
        report["cpu_time_speedup"] = results[1].cpu_seconds / results[0].cpu_seconds
        report["first8_agreement"] = agree
        console.print(f"pdserve / transformers: [bold]{ratio:.2f}x[/bold] useful tokens/s, "
                      f"{report['generated_tokens_speedup']:.2f}x generated tokens/s, "
                      f"{report['cpu_time_speedup']:.2f}x by CPU time (first 8 greedy tokens "
                      f"agree on {agree:.0%} of prompts)")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
