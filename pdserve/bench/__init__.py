"""Benchmark and goodput toolkit: workloads (real traces and presets), arrival processes, an
open-loop streaming client, metrics from request timelines, goodput search and reports.

No torch here: everything runs on a laptop against any OpenAI-compatible server or the simulator.
"""

from pdserve.bench.goodput import (
    AttainmentResult,
    GoodputResult,
    Probe,
    ScaleSweep,
    search_goodput,
    slo_scale_sweep,
)
from pdserve.bench.metrics import SLO, RequestRecord, Summary, attainment, summarize
from pdserve.bench.targets import HttpTarget, Target, make_target, register_target
from pdserve.bench.workloads import Workload, WorkloadRequest, make_workload

__all__ = [
    "SLO", "AttainmentResult", "GoodputResult", "HttpTarget", "Probe", "RequestRecord",
    "ScaleSweep", "Summary", "Target", "Workload", "WorkloadRequest", "attainment",
    "make_target", "make_workload", "register_target", "search_goodput", "slo_scale_sweep",
    "summarize",
]
