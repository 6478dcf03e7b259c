"""Simulator speed: 10,000 chatbot requests on 2 prefill + 2 decode instances (OPT-13B, DistServe's
A100 profile), in events per CPU second (docs/benchmarks.md "Simulator speed").

    python benchmarks/sim_speed.py [--num-requests 10000] [--rate 4] [--profile FILE]
                                   [--step-by-step]

``--step-by-step`` turns the simulator's exact decode fast path off (every step scheduled), the
"before" of docs/benchmarks.md "Simulator speed"; both give the same records.

Prints the wall and CPU time (user + sys) of the simulation (the workload is built before the
clock starts), the number of events and events per CPU second (wall time is noisy on a shared
machine), and the SLO attainment as a sanity check.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pdserve.bench.metrics import summarize
from pdserve.bench.workloads import make_workload
from pdserve.config import ClusterConfig
from pdserve.sim.target import SimulationConfig, build_simulator, to_records, to_sim_requests

DEFAULT_PROFILE = "distserve_profiler-a100-80g.distserve"  # shipped with pdserve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=4.0, help="req/s (default 4)")
    ap.add_argument("--profile", default=os.environ.get("PDSERVE_DISTSERVE_PROFILE",
                                                        DEFAULT_PROFILE))
    ap.add_argument("--step-by-step", action="store_true",
                    help="no decode fast path: schedule every step")
    ap.add_argument("--output-json")
    args = ap.parse_args()

    setup = SimulationConfig(ClusterConfig.from_dict(
        {"model": "opt-13b", "strategy": "disaggregated", "num_prefill": 2, "num_decode": 2}),
        profile=args.profile)
    t0 = time.perf_counter()
    w = make_workload("chatbot", args.num_requests, rate=args.rate, seed=0, max_model_len=2048)
    built = build_simulator(setup)
    reqs = to_sim_requests(w.requests, built.model.vocab_size)
    built.simulator.fast_forward = not args.step_by_step
    t_build = time.perf_counter() - t0

    wall0, cpu0 = time.perf_counter(), time.process_time()
    res = built.simulator.run(reqs)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0

    s = summarize(to_records(w.requests, res), w.default_slo, 0.9, built.simulator.num_gpus)
    out = {"num_requests": len(reqs), "rate": args.rate, "setup": built.describe,
           "workload_build_s": t_build, "wall_s": wall, "cpu_s": cpu, "events": res.num_events,
           "events_per_s": res.num_events / wall, "events_per_cpu_s": res.num_events / cpu,
           "folded_steps": built.simulator.num_folded,
           "quiet_step_ends": built.simulator.num_quiet_ends, "virtual_s": res.duration,
           "output_tokens": sum(r.output_len for r in w.requests), "num_failed": s.num_failed,
           "attainment": s.attainment, "p90_ttft_s": s.ttft.p90, "p90_tpot_s": s.tpot.p90}
    print(f"{len(reqs)} chatbot requests at {args.rate} req/s on 2P+2D "
          f"(OPT-13B, DistServe A100 profile), {res.duration:.0f} virtual s")
    print(f"simulation: {wall:.2f} s wall, {cpu:.2f} s CPU, {res.num_events} events, "
          f"{res.num_events / cpu:,.0f} events per CPU second ({out['output_tokens'] / cpu:,.0f} "
          f"output tokens); workload build {t_build:.2f} s; "
          f"{built.simulator.num_folded} steps on the decode fast path, "
          f"{built.simulator.num_quiet_ends} quiet step ends")
    print(f"failed {s.num_failed}, attainment {s.attainment:.1%}, P90 TTFT {s.ttft.p90:.3f} s, "
          f"P90 TPOT {s.tpot.p90:.4f} s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
