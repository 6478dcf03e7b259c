"""Why a prefix-aware router loses: its decisions seen through ``prefix_aware``'s cost model.

Runs one simulated deployment (colocated Llama-3.1-8B, as ``prefix_routing.py``) with
``--router`` (default Preble's E2 as written, ``preble-paper``) and, beside it, a
``prefix_aware`` router that routes nothing: it hears the same KV events and, for each of the
router's decisions, prices the request on every instance as it would (the queue in front, the
prefill each would compute) and then records the request where the router sent it
(:meth:`PrefixAwareRouter.assess`). Reports per decision kind (a hit = the chosen instance
caches some of the prompt, or will when its prefill in flight ends) how often the request was
sent where it would **start later than it would have finished its prefill elsewhere**, by
how much, and how long those prompts were; then the per-instance statistics of the run
(``pdserve.sim.instance_stats``: hit rate, prompt tokens computed, mean prefill queue, busy
share) and the latency.

    python benchmarks/prefix_routing_diagnosis.py [--router preble-paper] [--workload mooncake]
        [--gpu H100] [--instances 8] [--num-requests 1000] [--rate R] [--window 60]

Mooncake keeps its own timestamps unless ``--rate`` (req/s per GPU, Poisson) is given; the
synthetic workloads need ``--rate``. The router must take KV events (``preble-paper``,
``prefix_aware``, ``kv_overlap``): the simulator turns them on only for such a router.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefix_routing as pr  # noqa: E402

from pdserve.sim.instance_stats import instance_windows, markdown  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", default="preble-paper")
    ap.add_argument("--workload", default="mooncake", choices=list(pr.WORKLOADS))
    ap.add_argument("--gpu", default="H100", choices=list(pr.GPUS))
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, help="req/s per GPU, Poisson (default for mooncake: "
                                               "its own timestamps)")
    ap.add_argument("--window", type=float, default=60.0, help="per-instance table's window")
    a = ap.parse_args(argv)
    if a.rate is None and a.workload != "mooncake":
        ap.error(f"--rate is needed for {a.workload}")
    built = pr.deployment(a.gpu, a.instances, a.router)
    sim = built.simulator
    router = sim.controller.prefill_router
    if not getattr(router, "wants_kv_events", False):
        ap.error(f"router {a.router!r} takes no KV events: the shadow would see no cache")
    shadow = pr.deployment(a.gpu, a.instances, "prefix_aware").simulator.controller \
        .prefill_router
    seen: list[dict[str, Any]] = []
    select, on_events = router.select, router.on_kv_events

    def shadowed_select(request: Any, candidates: list[Any]) -> Any:
        before = dict(getattr(router, "decisions", {}) or {})
        inst = select(request, candidates)
        kind = next((k for k, v in (getattr(router, "decisions", {}) or {}).items()
                     if v != before.get(k)), "")
        seen.append({**shadow.assess(request, candidates, inst), "kind": kind,
                     "prompt": len(request.prompt_token_ids)})
        return inst

    def both_events(instance_id: str, events: Any) -> None:
        events = list(events)
        on_events(instance_id, events)
        shadow.on_kv_events(instance_id, events)

    router.select, router.on_kv_events = shadowed_select, both_events
    if a.rate is not None:
        w = pr.base_workload(a.workload, a.num_requests).retimed(a.rate * a.instances,
                                                                  "poisson")
    else:  # the trace at its own timestamps
        w = pr.make_workload(pr.WORKLOADS[a.workload][0], a.num_requests,
                             max_model_len=pr.MAX_LEN)
    res = sim.run(pr.to_sim_requests(w.requests, pr.VOCAB))
    print(f"## {a.router} · {a.workload} · {a.instances} × {a.gpu} · {len(w)} requests"
          + (f" at {a.rate:g} req/s/GPU" if a.rate else " at the trace's timestamps") + "\n")
    print(f"decisions: {getattr(router, 'decisions', None)}\n")
    print("| decision | requests | mean prompt | late start (start > earliest finish "
          "elsewhere) | mean lateness (s) | mean prompt of the late | chosen = cheapest |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in ["all", *sorted({s["kind"] for s in seen})]:
        sel = [s for s in seen if kind == "all" or s["kind"] == kind]
        late = [s for s in sel if s["start"] > s["best_ttft"] + 1e-9]
        print(f"| {kind or '-'} | {len(sel)} | {np.mean([s['prompt'] for s in sel]):,.0f} | "
              f"{len(late) / max(len(sel), 1):.1%} | "
              f"{np.mean([s['start'] - s['best_ttft'] for s in late]) if late else 0:.2f} | "
              f"{np.mean([s['prompt'] for s in late]) if late else 0:,.0f} | "
              f"{np.mean([s['cheapest'] for s in sel]):.1%} |")
    lat = pr.latency(res)
    print(f"\nmean / P99 TTFT {lat['ttft_mean']:.2f} / {lat['ttft_p99']:.2f} s, E2E "
          f"{lat['e2e_mean']:.2f} / {lat['e2e_p99']:.2f} s, prefix-cache hit {lat['hit']:.1%}\n")
    whole = instance_windows(res)
    comp = np.array([r.computed for r in whole], dtype=float)
    queue = np.array([r.queue for r in whole])
    print(f"prompt tokens computed per instance: max / mean {comp.max() / comp.mean():.2f}; "
          f"mean prefill queue per instance: max {queue.max():.2f}, mean {queue.mean():.2f}\n")
    print(markdown(whole, "per instance, whole run"))
    print(markdown(instance_windows(res, a.window), f"per instance, {a.window:g}-s windows"))


if __name__ == "__main__":
    main()
