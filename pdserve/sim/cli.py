"""``pdserve simulate`` (one workload on a simulated deployment, the ``pdserve bench`` report)
and ``pdserve profile`` (measure the real executor, fit a latency profile).

Workload, arrival, SLO and output flags are the benchmark toolkit's own
(:func:`pdserve.bench.cli.add_workload_args` and friends). Bad values print one line naming the
value and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from typing import Any, NoReturn

from pdserve.bench.cli import (
    _say,
    _settings,
    _write,
    add_output_args,
    add_slo_args,
    add_workload_args,
    positive,
    positive_int,
)


def _one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse prints the usage and the message; these commands print only the message."""

    def error(self: argparse.ArgumentParser, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    p.error = types.MethodType(error, p)  # type: ignore[method-assign]
    return p


def _nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return v


def _share(text: str) -> float:
    v = positive(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def register(subparsers: Any) -> None:
    s = _one_line_errors(subparsers.add_parser(
        "simulate", help="simulate a workload on a deployment (no GPU needed)",
        description="Run a benchmark workload through the discrete-event simulator: the real "
                    "scheduler, block pool, controller and routers on a virtual clock, with a "
                    "fitted profile or an analytic roofline model in place of the GPU."))
    add_deployment_args(s)
    add_workload_args(s)
    s.add_argument("--rate", type=positive,
                   help="mean arrival rate, req/s (timestamped traces: default their own)")
    add_slo_args(s)
    add_output_args(s)
    s.set_defaults(func=lambda a: _guarded("simulate", cmd_simulate, a))

    p = _one_line_errors(subparsers.add_parser(
        "profile", help="measure the real executor and fit a latency profile",
        description="Time the model executor on a grid of prefill, decode and mixed batches "
                    "(warm-up, repeats, median) and fit DistServe's step-time forms by relative "
                    "least squares. The result loads with `pdserve simulate --profile FILE`."))
    p.add_argument("--model", required=True, metavar="DIR", help="model directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on CPU, float16 on CUDA")
    p.add_argument("--out", required=True, metavar="FILE", help="profile JSON to write")
    p.add_argument("--quick", action="store_true", help="small grid (seconds; for tests)")
    p.add_argument("--repeats", type=positive_int, help="timed runs per shape (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads while measuring (default 1, as a Ray instance "
                        "actor runs; 0 = torch's default)")
    p.add_argument("--max-tokens", type=positive_int,
                   help="largest prefill batch in tokens (default: from the grid)")
    p.set_defaults(func=lambda a: _guarded("profile", cmd_profile, a))


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("deployment")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--profile", metavar="FILE",
                     help="fitted profile: ours (pdserve profile) or DistServe's JSON")
    src.add_argument("--hardware", metavar="NAME",
                     help="analytic roofline on this device (A100-80GB, H100, ...; default "
                          "A100-80GB when no --profile)")
    d.add_argument("--model", default="opt-13b", metavar="NAME|DIR",
                   help="catalogue model (opt-13b, llama-2-7b, ...) or a model directory")
    d.add_argument("--strategy", choices=("colocated", "disaggregated"), default="colocated")
    d.add_argument("--num-instances", type=positive_int, default=1,
                   help="colocated instances")
    d.add_argument("--num-prefill", type=positive_int, default=1)
    d.add_argument("--num-decode", type=positive_int, default=1)
    for flag, what in (("tp", "tensor"), ("pp", "pipeline")):
        d.add_argument(f"--{flag}", type=positive_int, default=1,
                       help=f"{what}-parallel degree of every instance (default 1)")
        for role in ("prefill", "decode"):
            d.add_argument(f"--{role}-{flag}", type=positive_int,
                           help=f"{what}-parallel degree of {role} instances (default --{flag})")
    d.add_argument("--block-size", type=positive_int, default=16)
    d.add_argument("--num-kv-blocks", type=positive_int,
                   help="KV blocks per instance (default: device memory minus weights)")
    d.add_argument("--memory-utilization", type=_share, default=0.9)
    d.add_argument("--max-num-batched-tokens", type=positive_int)
    d.add_argument("--max-num-seqs", type=positive_int, default=256)
    # --max-model-len (workload group) is also the simulated context limit (default: the
    # model's, at most 4096); the workload is clipped to it either way.
    d.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="chunked prefill on colocated/decode instances (default on)")
    d.add_argument("--prefill-token-target", type=positive_int, metavar="L_M",
                   help="DistServe's L_m: prefill batches up to this many tokens")
    d.add_argument("--prefill-router", default="shortest_queue")
    d.add_argument("--decode-router", default="least_load")
    d.add_argument("--link", metavar="NAME",
                   help="KV link between instances (default: the device's intra-node link)")
    d.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    d.add_argument("--step-overhead-ms", type=_nonneg, default=0.0, metavar="MS",
                   help="serving-path cost added to every step (see benchmarks/fidelity.py; "
                        "default 0)")
    d.add_argument("--seq-overhead-ms", type=_nonneg, default=0.0, metavar="MS",
                   help="serving-path cost per sequence in a step (default 0)")


def setup_from_args(args: argparse.Namespace) -> Any:
    from pdserve.cluster.routing import make_router
    from pdserve.sim.hardware import get_device, get_link
    from pdserve.sim.target import SimSetup

    for flag, name in (("--prefill-router", args.prefill_router),
                       ("--decode-router", args.decode_router)):
        try:
            make_router(name)
        except ValueError as e:
            raise ValueError(f"{flag} {name!r}: {e}") from None
    if args.hardware is not None:
        get_device(args.hardware)
    if args.link is not None:
        get_link(args.link)
    return SimSetup(
        model=args.model, profile=args.profile, hardware=args.hardware, strategy=args.strategy,
        num_instances=args.num_instances, num_prefill=args.num_prefill,
        num_decode=args.num_decode, tp=args.tp, pp=args.pp, prefill_tp=args.prefill_tp,
        prefill_pp=args.prefill_pp, decode_tp=args.decode_tp, decode_pp=args.decode_pp,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        memory_utilization=args.memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, chunked_prefill=args.chunked_prefill,
        prefill_token_target=args.prefill_token_target, prefill_router=args.prefill_router,
        decode_router=args.decode_router, link=args.link, dtype=args.dtype,
        step_overhead_ms=args.step_overhead_ms, seq_overhead_ms=args.seq_overhead_ms)


def _guarded(cmd: str, fn: Any, args: argparse.Namespace) -> int:
    from pdserve.bench.traces import TraceNotFoundError

    try:
        return fn(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError, TraceNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        _say(f"pdserve {cmd}: error: {msg}")
        return 2
    except RuntimeError as e:
        _say(f"pdserve {cmd}: failed: {e}")
        return 1


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.bench import report
    from pdserve.bench.cli import _header, _plots
    from pdserve.bench.runner import build_workload, resolve_slo, run_workload
    from pdserve.sim.target import SimTarget

    setup = setup_from_args(args)
    target = SimTarget(setup, name=f"sim:{setup.strategy}", progress=not args.no_progress)
    s = _settings(args)
    w = build_workload(target, s, args.rate)
    s.slo = resolve_slo(s, w, args.slo_ttft, args.slo_tpot)
    if w.scaling.num_clipped:
        _say(f"{w.scaling.num_clipped} of {len(w)} requests clipped to "
             f"max_model_len={w.scaling.max_model_len}")
    t0 = time.perf_counter()
    run = run_workload(target, w, s)
    wall = time.perf_counter() - t0
    res = target.last_result
    assert res is not None
    _say(f"simulated {len(w)} requests, {res.duration:.1f} virtual s, {res.num_events} events "
         f"in {wall:.2f} s wall ({res.num_events / max(wall, 1e-9):,.0f} events/s)")
    md = report.summary_markdown(run.summary, f"{target.name} · {w.name} · {len(w)} requests")
    _write(args, md, {"command": "simulate", "target": target.name,
                      "num_gpus": target.num_gpus, "deployment": target.describe,
                      "simulation": {"virtual_s": res.duration, "events": res.num_events,
                                     "wall_s": wall},
                      **_header(s, w), **run.to_dict(args.save_records)})
    _plots(args, s, {target.name: run})
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.sim.profiler import profile_executor

    prof = profile_executor(args.model, device=args.device, dtype=args.dtype, quick=args.quick,
                            repeats=args.repeats, max_tokens=args.max_tokens,
                            log=lambda m: _say(m), progress=not args.quick,
                            threads=args.threads or None)
    prof.save(args.out)
    print(f"wrote {args.out}")
    print(f"{'part':<14}{'samples':>8}{'max err':>10}{'mean err':>10}")
    for part, e in prof.fit_error.items():
        print(f"{part:<14}{e['n']:>8}{e['max_rel']:>10.1%}{e['mean_rel']:>10.1%}")
    return 0
