"""The serving path around the engine steps, for the simulator (torch-free): what a step costs
besides its executor (:func:`overhead_from_step_log`), the front end's cost per request
(:func:`request_overhead`) and a disaggregated server's KV hand-off as a link
(:func:`handoff_link`), from the step logs and ``pdserve bench --save-records`` files that
:mod:`pdserve.sim.measurements` loads steps from (:func:`serving_path` reads both of the
latter from one file)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.bench.metrics import RequestRecord
from pdserve.config import ModelConfig, read_text
from pdserve.sim.measurements import model_config, records_of


def overhead_from_step_log(path: str | os.PathLike[str], max_gap_s: float = 0.25
                           ) -> dict[str, Any]:
    """The serving path's own cost, from the same step log the step model is fitted on: each
    instance's loop starts a step as soon as the previous one leaves it with work
    (:class:`~pdserve.cluster.instances.StepLoop`), and the log dates every step's start
    (``now``) and times its executor (``elapsed``), so the gap from one step's end to the next
    one's start is what a step costs besides the executor (scheduling, detokenizing and
    reporting the tokens, taking the commands). Per number of sequences ``n`` of the earlier
    step (whose tokens the gap reports), the median gap — robust to the few gaps where the
    instance waited for work; gaps over ``max_gap_s`` are idle time, not cost — then a
    least-squares line ``a + b·n`` through those medians weighted by their counts; both
    clipped at 0 (:class:`~pdserve.sim.latency.DriverOverhead`)."""
    by_inst: dict[str, list[dict[str, Any]]] = {}
    for line in read_text(os.fspath(path), "step log").splitlines():
        if line.strip():
            r = json.loads(line)
            if "now" in r:  # a log without step start times has no gaps to tell
                by_inst.setdefault(str(r.get("instance_id", "log")), []).append(r)
    gaps: dict[int, list[float]] = {}
    for steps in by_inst.values():
        steps.sort(key=lambda r: r["now"])
        for a, b in zip(steps, steps[1:]):
            gap = b["now"] - (a["now"] + a["elapsed"])
            if 0.0 <= gap <= max_gap_s:
                n = len(a["prefill_chunks"]) + len(a["decode_context_lens"])
                gaps.setdefault(n, []).append(gap)
    pts = [(n, float(np.median(g)), len(g)) for n, g in sorted(gaps.items()) if len(g) >= 5]
    if not pts:
        raise ValueError(f"{path}: too few consecutive steps to measure the serving overhead")
    ns, meds, counts = (np.array(x, dtype=float) for x in zip(*pts))
    if len(pts) == 1:
        step, seq = float(meds[0]), 0.0
    else:
        w = np.sqrt(counts)
        seq, step = np.polyfit(ns, meds, 1, w=w)
        seq = max(float(seq), 0.0)
        step = max(float(np.average(meds - seq * ns, weights=counts)), 0.0)
    return {"step_s": step, "seq_s": seq, "gaps": int(counts.sum()),
            "median_gap_by_seqs_ms": {int(n): 1000 * m for n, m, _ in pts}}


def request_overhead(records: Sequence[Any]) -> dict[str, float]:
    """The front end's fixed cost per request (``SimulationConfig.request_overhead_ms``) from
    :class:`~pdserve.bench.metrics.RequestRecord` s that carry the server's timeline (pdserve
    sends it with every response): what the client waited for its first token beyond the
    server's own time from queueing the request at an instance to its first token
    (``prefill_end − prefill_queued``; the simulator models that part, waiting for a running
    step included). What is left is the HTTP request, tokenizing and routing before the
    instance's queue, and the report, detokenizing and streaming after it. The median over
    the requests, robust to the few a busy machine delays.

    Measure it on requests that ran alone: under load the front end also waits behind other
    streams' tokens where it shares cores with them, which a constant per request cannot follow
    (on the 2-core VM of docs/fidelity.md: 11.8–13.5 ms under load against 6.9–8.6 ms alone)."""
    extra = []
    for rec in records:
        st, ttft = rec.server_timeline, rec.ttft
        if (rec.ok and st is not None and ttft is not None and st.prefill_queued is not None
                and st.prefill_end is not None):
            extra.append(ttft - (st.prefill_end - st.prefill_queued))
    if not extra:
        raise ValueError("no request with a server timeline to measure the front end's cost")
    q = np.percentile(extra, [10, 50, 90])
    return {"median_ms": 1000 * float(q[1]), "p10_ms": 1000 * float(q[0]),
            "p90_ms": 1000 * float(q[2]), "requests": len(extra)}


def handoff_link(records: Sequence[Any], kv_bytes_per_token: int) -> dict[str, Any] | None:
    """A disaggregated server's KV hand-off as a simulated ``kv_link``, from records with the
    server's timeline (``None`` when none was handed off): the copy (``transfer_end −
    transfer_start``) fitted as ``latency + bytes / bandwidth`` over the prompts' KV bytes, plus
    what the hand-off waits for besides the copy — the prefill's report reaching the driver and
    the pull reaching the decode instance (``prefill_end → transfer_start``), the decode
    instance taking the request in (``transfer_end → decode_admitted``) — as medians added to
    the latency. Without it the simulator prices a hand-off at the link's cost alone (nothing
    on CPU), while pdserve's Ray runtime on the 2-core VM takes ~11 ms (docs/fidelity.md)."""
    rows = []
    for rec in records:
        st = rec.server_timeline
        if not rec.ok or st is None or None in (st.prefill_end, st.transfer_start,
                                                st.transfer_end, st.decode_admitted):
            continue
        rows.append((rec.prompt_len * kv_bytes_per_token, st.transfer_end - st.transfer_start,
                     st.transfer_start - st.prefill_end, st.decode_admitted - st.transfer_end))
    if not rows:
        return None
    nbytes, copy, before, after = (np.array(x, dtype=float) for x in zip(*rows))
    slope = max(float(np.polyfit(nbytes, copy, 1)[0]), 0.0) if len(set(nbytes)) > 1 else 0.0
    icpt = max(float(np.median(copy - slope * nbytes)), 0.0)  # robust to a few slow copies
    latency = icpt + max(float(np.median(before)), 0.0) + max(float(np.median(after)), 0.0)
    return {"latency_s": latency,
            "bandwidth_gb_per_s": (1e-9 / slope) if slope > 0 else None,
            "copy_median_s": float(np.median(copy)), "before_median_s": float(np.median(before)),
            "after_median_s": float(np.median(after)), "requests": len(rows)}


def serving_path(path: str | os.PathLike[str], model: str | ModelConfig,
                 dtype: str = "float16") -> dict[str, Any]:
    """What a ``pdserve bench --save-records`` JSON says of the serving path around the engine
    steps, for ``pdserve simulate``: ``request_overhead`` (:func:`request_overhead`, over the
    requests that ran alone when any did, else all of them) and ``kv_link``
    (:func:`handoff_link`); ``None`` where the records cannot tell (a server that sends no
    timelines, such as vLLM; a colocated one has no hand-off)."""

    runs = [[RequestRecord.from_dict(r) for r in run] for run in records_of(path)]
    recs = [r for run in runs for r in run]
    lone = [r for run in runs for r in _alone(run)]
    try:
        over: dict[str, Any] | None = request_overhead(lone or recs)
        over["alone"] = bool(lone)
    except ValueError:
        over = None
    return {"request_overhead": over,
            "kv_link": handoff_link(recs, model_config(model).kv_bytes_per_token(dtype))}


def _alone(recs: Sequence[Any]) -> list[Any]:
    """The records of one run whose request had the server to itself from arrival to end."""
    spans = [(r.timeline.arrival, r.timeline.finish or (r.timeline.token_times or [None])[-1])
             for r in recs]
    out = []
    for i, (rec, (a, b)) in enumerate(zip(recs, spans)):
        if a is None or b is None:
            continue
        if all(j == i or sb is None or sa is None or sb <= a or sa >= b
               for j, (sa, sb) in enumerate(spans)):
            out.append(rec)
    return out
