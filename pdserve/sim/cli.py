"""``pdserve simulate`` (one workload on a simulated deployment, the ``pdserve bench`` report)
and ``pdserve profile`` (measure the real executor, fit a latency profile).

The deployment flags are ``pdserve serve``'s (:func:`pdserve.flags.add_deployment_flags`, so a
``--config`` file runs live or simulated as it is) plus the latency source; workload, arrival,
SLO and output flags are the benchmark toolkit's. Bad values print one line naming the value and
exit with code 2.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pdserve.bench import report
from pdserve.bench.cli import (
    add_output_args,
    add_slo_args,
    add_workload_args,
    report_header,
    say,
    settings_from_args,
    write_plots,
    write_report,
)
from pdserve.bench.runner import build_workload, resolve_slo, run_workload
from pdserve.config import ModelConfig
from pdserve.flags import (
    nonnegative,
    output_file,
    positive,
    positive_int,
    positive_int_list,
    subcommand,
)
from pdserve.sim import instance_stats as ist
from pdserve.sim.profiler import profile_instance, saturation_chunk_size, save_profiles
from pdserve.sim.target import SimTarget, add_simulation_flags, simulation_from_args


def register(subparsers: Any) -> None:
    s = subcommand(subparsers, "simulate", cmd_simulate,
                   help="simulate a workload on a deployment (no GPU needed)")
    add_simulation_flags(s)
    add_workload_args(s, max_model_len=False)
    s.add_argument("--rate", type=positive,
                   help="mean arrival rate, req/s (timestamped traces: default their own)")
    add_slo_args(s)
    add_output_args(s)
    s.add_argument("--per-instance", nargs="?", const=0.0, type=nonnegative, metavar="SECONDS",
                   help="also report per instance its prefix-cache hit rate, prompt tokens "
                        "computed, mean prefill queue and busy share: over the whole run, and "
                        "with SECONDS (>= 1) over windows of that length too (in --output-json; "
                        "with --plot, instances.png)")

    p = subcommand(subparsers, "profile", cmd_profile,
                   help="measure the real executor and fit a latency profile")
    p.add_argument("--model", required=True, metavar="DIR", help="model directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on CPU, float16 on CUDA")
    p.add_argument("--out", required=True, type=output_file, metavar="FILE",
                   help="profile JSON to write")
    p.add_argument("--quick", action="store_true", help="small grid (seconds; for tests)")
    p.add_argument("--repeats", type=positive_int, help="timed runs per shape (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads while measuring (default 1, as a Ray instance "
                        "actor runs; 0 = torch's default)")
    p.add_argument("--max-tokens", type=positive_int,
                   help="largest prefill batch in tokens (default: from the grid)")
    p.add_argument("--tp", type=positive_int_list, default=[1], metavar="N[,N...]",
                   help="measure a tensor-parallel instance of this many ranks (gloo on CPU, "
                        "NCCL on CUDA; --threads per rank); the profile is for tp=N "
                        "instances only; several degrees (1,2) are measured one after the "
                        "other into one file, which prices each instance at its own tp "
                        "(prefill TP2 + decode TP1)")
    p.add_argument("--pp", type=positive_int_list, default=[1], metavar="N[,N...]",
                   help="measure a pipeline of this many stages (each of --tp ranks; every "
                        "--tp x --pp layout into one file): each shape as one micro-batch's "
                        "pass through all stages and as the stage time of a pipeline kept "
                        "full (4N micro-batches, N in flight), both fitted; simulate prices "
                        "pp=N instances with them")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run a benchmark workload through the discrete-event simulator: the real scheduler, block
    pool, controller and routers on a virtual clock, with a fitted profile, an analytic roofline
    model or aiconfigurator's measured kernel database in place of the GPU. The deployment flags
    and --config files are `pdserve serve`'s."""

    window = args.per_instance or None
    if window is not None and window < 1:
        raise ValueError(f"--per-instance window must be >= 1 second, got {window:g}")
    sim = simulation_from_args(args)
    target = SimTarget(sim, name=f"sim:{sim.deployment.strategy}", progress=not args.no_progress)
    say(f"latency source: {target.describe['latency_source']}")
    s = settings_from_args(args)
    w = build_workload(target, s, args.rate)
    s.slo = resolve_slo(s, w, args.slo_ttft, args.slo_tpot)
    if w.scaling.num_clipped:
        say(f"{w.scaling.num_clipped} of {len(w)} requests clipped to "
            f"max_model_len={w.scaling.max_model_len}")
    t0 = time.perf_counter()
    run = run_workload(target, w, s)
    wall = time.perf_counter() - t0
    res = target.last_result
    assert res is not None
    say(f"simulated {len(w)} requests, {res.duration:.1f} virtual s, {res.num_events} events "
        f"in {wall:.2f} s wall ({res.num_events / max(wall, 1e-9):,.0f} events/s)")
    md = report.summary_markdown(run.summary, f"{target.name} · {w.name} · {len(w)} requests")
    per: dict[str, Any] = {}
    if args.per_instance is not None:
        whole = ist.instance_windows(res)
        md += "\n" + ist.markdown(whole, "per instance, whole run")
        per["instances"] = {"whole": [r.to_dict() for r in whole]}
        if window is not None:
            timed = ist.instance_windows(res, window)
            md += "\n" + ist.markdown(timed, f"per instance, {window:g}-second windows")
            per["instances"]["window_s"] = window
            per["instances"]["windows"] = [r.to_dict() for r in timed]
            if args.plot:
                Path(args.plot).mkdir(parents=True, exist_ok=True)
                say("wrote " + ist.plot(timed, str(Path(args.plot) / "instances.png"),
                                        f"{target.name} · {w.name}: per instance, "
                                        f"{window:g}-s windows"))
    write_report(args, md, {"command": "simulate", "target": target.name,
                            "num_gpus": target.num_gpus, "deployment": target.describe,
                            "simulation": {"virtual_s": res.duration, "events": res.num_events,
                                           "wall_s": wall},
                            **report_header(s, w), **run.to_dict(args.save_records), **per})
    write_plots(args, s, {target.name: run})
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Time the model executor on a grid of prefill, decode and mixed batches (warm-up, repeats,
    median) and fit DistServe's step-time forms by relative least squares. The result loads with
    `pdserve simulate --profile FILE`."""

    from pdserve.model.parallel import check_live_layout  # lazy: torch

    model = ModelConfig.from_dir(args.model)
    layouts = [(tp, pp) for tp in args.tp for pp in args.pp]
    for tp, pp in layouts:  # every layout, before the first is measured
        check_live_layout(model, tp, pp, device=args.device)
    every = [profile_instance(args.model, device=args.device, dtype=args.dtype,
                              quick=args.quick, repeats=args.repeats,
                              max_tokens=args.max_tokens, log=say, progress=not args.quick,
                              threads=args.threads or None, tp=tp, pp=pp)
             for tp, pp in layouts]
    save_profiles(args.out, every)
    print(f"wrote {args.out} (tp={','.join(str(tp) for tp in args.tp)}"
          + (f", pp={','.join(str(pp) for pp in args.pp)})" if args.pp != [1] else ")"))
    for measured in every:
        prof = measured.profile
        name = f"tp={prof.tp}" + (f" pp={prof.pp}" if prof.pp > 1 else "")
        print(f"{name}: {'part':<14}{'samples':>8}{'max err':>10}{'mean err':>10}")
        stage = prof.stage.fit_error.items() if prof.stage is not None else ()
        for part, e in [*prof.fit_error.items(), *((f"stage {k}", e) for k, e in stage)]:
            print(f"      {part:<14}{e['n']:>8}{e['max_rel']:>10.1%}{e['mean_rel']:>10.1%}")
        if prof.tp > 1:
            print("      collectives (rank 0's all-reduce/all-gather, waits included): "
                  + ", ".join(f"{kind} {c['mean']:.0%} of a step (max {c['max']:.0%})"
                              for kind, c in measured.collectives.items()))
    prof = every[0].profile
    chunk, curve = saturation_chunk_size(prof, args.max_tokens or 4096)
    print(f"ChunkSize (TetriInfer 3.3.3, --prefill-chunk-size): {chunk} tokens, where prefill "
          f"throughput reaches 90% of its peak ("
          + ", ".join(f"{n}: {t:,.0f}" for n, t in curve) + " tok/s)")
    return 0
