"""Replanning (DistServe §4.3 "Replanning"): a workload monitor over a sliding window of
arrivals and lengths detects a pattern shift, the placement is searched again for the recent
window, and the new placement takes over.

:class:`ShiftDetector` is sans-IO: feed it each arrival (time, prompt length, output length);
it compares the window's arrival rate and mean prompt / output lengths against the reference
the current plan was made for and reports a :class:`Shift` when any moves by more than its
threshold (relative), after which the window becomes the new reference.

:func:`simulate_replanning` applies a new placement in the simulator: requests that arrive
before the switch run to completion on the old deployment (it drains; nothing is dropped),
later ones on the new one — a blue-green switch, each deployment simulated through
:func:`pdserve.sim.target.simulate`. The switch happens ``reload_s`` after the detection
(DistServe: re-running the search takes seconds, reloading weights minutes).

:class:`LiveReplanner` replans the live runtime: the same detector watches its arrivals, and a
new placement's instance counts are applied by adding and removing instances while serving
(:meth:`pdserve.cluster.runtime.ClusterRuntime.add_instance` / ``remove_instance``; a removed
instance drains first) — no blue-green switch, no reload of the instances that stay.
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pdserve.bench.metrics import SLO, RequestRecord, attains
from pdserve.bench.steady import CONFIRM
from pdserve.bench.workloads import WorkloadRequest
from pdserve.config import ClusterConfig
from pdserve.flags import nonnegative_int, positive, positive_int
from pdserve.planner.problem import SERVING_PATH, Problem, available_tps
from pdserve.planner.search import plan
from pdserve.planner.units import Unit, confirm, evaluate_unit, unit_probe
from pdserve.sim.hardware import get_device
from pdserve.sim.model_catalogue import get_model_config
from pdserve.sim.target import add_serving_path_flags, build_simulator, to_records, to_sim_requests
from pdserve.sim.target import simulate as simulate_config


@dataclass(frozen=True)
class WindowStats:
    rate: float
    mean_prompt: float
    mean_output: float
    num_requests: int

    @classmethod
    def of(cls, times: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
           window_s: float) -> WindowStats:
        n = len(times)
        if n == 0:
            return cls(0.0, 0.0, 0.0, 0)
        return cls(n / window_s, sum(prompts) / n, sum(outputs) / n, n)


@dataclass(frozen=True)
class Shift:
    time: float
    reasons: tuple[str, ...]
    before: WindowStats
    after: WindowStats


class ShiftDetector:
    """Sliding window of the last ``window_s`` seconds of arrivals (module docstring).

    ``reference``: the stats the current plan assumed (``None``: the first full window).
    A shift needs at least ``min_requests`` in the window; the rate and each mean length are
    compared as ``|window / reference − 1| > threshold``. A window that deviates starts a fresh
    window, and the shift is reported when that one — the new pattern alone — still deviates
    (at most two windows after the change); it becomes the reference.
    """

    def __init__(self, window_s: float, reference: WindowStats | None = None,
                 rate_threshold: float = 0.3, length_threshold: float = 0.3,
                 min_requests: int = 20) -> None:
        if window_s <= 0:
            raise ValueError(f"window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self.reference = reference
        self.rate_threshold, self.length_threshold = rate_threshold, length_threshold
        self.min_requests = min_requests
        self._win: deque[tuple[float, int, int]] = deque()
        self._start: float | None = None
        self._pending = False
        self.shifts: list[Shift] = []

    def window(self) -> WindowStats:
        ts = [t for t, _, _ in self._win]
        return WindowStats.of(ts, [p for _, p, _ in self._win], [o for _, _, o in self._win],
                              self.window_s)

    def observe(self, t: float, prompt_len: int, output_len: int) -> Shift | None:
        """One arrival at ``t`` (non-decreasing). Returns the shift it reveals, if any."""
        if self._start is None:
            self._start = t
        self._win.append((t, prompt_len, output_len))
        while self._win and self._win[0][0] <= t - self.window_s:
            self._win.popleft()
        if t - self._start < self.window_s or len(self._win) < self.min_requests:
            return None  # the window is not full yet
        cur = self.window()
        if self.reference is None:
            self.reference = cur
            return None
        reasons = self._deviations(cur, self.reference)
        if not reasons:
            self._pending = False  # a blip: the pattern came back
            return None
        if not self._pending:
            # the window straddles the change: confirm on a window of the new pattern alone,
            # which is also what the search should be re-run on
            self._pending = True
            self._restart(t)
            return None
        shift = Shift(t, tuple(reasons), self.reference, cur)
        self.shifts.append(shift)
        self.reference = cur
        self._pending = False
        self._restart(t)
        return shift

    def _restart(self, t: float) -> None:
        self._start = t
        self._win.clear()

    def _deviations(self, cur: WindowStats, ref: WindowStats) -> list[str]:
        out = []
        for name, a, b, th in (("rate", cur.rate, ref.rate, self.rate_threshold),
                               ("prompt length", cur.mean_prompt, ref.mean_prompt,
                                self.length_threshold),
                               ("output length", cur.mean_output, ref.mean_output,
                                self.length_threshold)):
            if b > 0 and abs(a / b - 1) > th:
                out.append(f"{name} {b:.1f} -> {a:.1f}")
        return out


def detect(requests: Sequence[WorkloadRequest], detector: ShiftDetector) -> list[Shift]:
    """Run ``detector`` over a workload's arrivals."""
    for r in sorted(requests, key=lambda r: r.arrival_time):
        detector.observe(r.arrival_time, r.prompt_len, r.output_len)
    return detector.shifts


def simulate_replanning(requests: Sequence[WorkloadRequest], old: Any, new: Any | None,
                        switch_at: float | None, vocab_size: int,
                        simulate: Callable[..., Any] | None = None) -> list[RequestRecord]:
    """Records of ``requests`` when ``old`` (a ``SimulationConfig``) serves until
    ``switch_at`` and ``new`` afterwards (``new=None`` or ``switch_at=None``: ``old`` alone)."""
    simulate = simulate or simulate_config
    if new is None or switch_at is None:
        return simulate(old, list(requests), None, vocab_size)[0]
    first = [r for r in requests if r.arrival_time < switch_at]
    rest = [r for r in requests if r.arrival_time >= switch_at]
    recs = simulate(old, first, None, vocab_size)[0] if first else []
    recs += simulate(new, rest, None, vocab_size)[0] if rest else []
    by_id = {r.request_id: r for r in recs}
    return [by_id[r.request_id] for r in requests]


def simulate_scaling(sim: Any, requests: Sequence[WorkloadRequest],
                     changes: Sequence[tuple[float, Mapping[str, int]]], vocab_size: int,
                     ) -> tuple[list[RequestRecord], Any]:
    """Replanning in place in the simulator, as :class:`LiveReplanner` does it live: ``sim``
    (a ``SimulationConfig``) serves ``requests`` while, at each ``(time, counts)`` of
    ``changes``, instances are added (copies of the role's first instance) or removed (the
    youngest first; each drains) through the simulator's scale events — the driver-core
    operations the live runtime uses. Returns the records and the simulator (its
    ``removals``: when each removed instance had drained, and its block pool then)."""
    from dataclasses import replace

    built = build_simulator(sim)
    s = built.simulator
    ids: dict[str, list[str]] = {}
    template: dict[str, Any] = {}
    for iid, inst in s.insts.items():
        if inst.pp > 1:
            raise ValueError("simulate_scaling: pipeline-parallel instances are not supported")
        role = inst.spec.engine.scheduler.role
        ids.setdefault(role, []).append(iid)
        template.setdefault(role, inst.spec)
    made = {role: len(v) for role, v in ids.items()}
    for t, counts in sorted(changes, key=lambda c: c[0]):
        for role, n in counts.items():
            if role not in ids:
                raise ValueError(f"the plan has role {role!r}; the deployment has "
                                 f"{', '.join(sorted(ids))}")
            mine = ids[role]
            while len(mine) < n:
                new = f"{role}-{made[role]}"
                made[role] += 1
                s.add_instance(t, replace(template[role], instance_id=new))
                mine.append(new)
            while len(mine) > max(n, 1):
                s.remove_instance(t, mine.pop())
    result = s.run(to_sim_requests(requests, vocab_size))
    return to_records(requests, result), s


def attainment_over_time(requests: Sequence[WorkloadRequest], records: Sequence[RequestRecord],
                         slo: SLO, bin_s: float) -> list[tuple[float, float, int]]:
    """``(bin start, attainment, requests)`` per ``bin_s`` of arrival time."""
    bins: dict[int, list[bool]] = {}
    for w, r in zip(requests, records):
        bins.setdefault(int(w.arrival_time // bin_s), []).append(attains(r, slo))
    return [(k * bin_s, sum(v) / len(v), len(v)) for k, v in sorted(bins.items())]


# --------------------------------------------------------------------------- live replanning
def placement_counts(deployment: Mapping[str, Any]) -> dict[str, int]:
    """Instances per role of a planned deployment (a ``ClusterConfig.from_dict`` mapping, e.g.
    ``Placement.deployment``)."""
    return {r.role: r.count for r in ClusterConfig.from_dict(deployment).roles}


def search_planner(problem: Any, strategy: str) -> Callable[[WindowStats], dict[str, int]]:
    """A live replanner's planner: the placement search (:func:`pdserve.planner.search.plan`)
    of ``problem`` re-run at the window's observed rate, restricted to the deployment's
    ``strategy`` (a live deployment changes instance counts, not strategy), as counts per role.
    """
    from dataclasses import replace

    def planner(window: WindowStats) -> dict[str, int]:
        p = replace(problem, rate=max(window.rate, 1e-3))
        return placement_counts(plan(p, strategies=(strategy,)).best.deployment)

    return planner


def deployed_planner(problem: Any, config: Any) -> Callable[[WindowStats], dict[str, int]]:
    """A live replanner's planner for a running deployment ``config`` (a
    :class:`~pdserve.config.ClusterConfig`): the TP × PP of its instances stays what runs (a
    live runtime adds instances of the roles it has), so the search is Algorithm 1's last step
    at those units — each role's unit (colocated, or prefill and decode) is searched for its
    goodput (:func:`pdserve.planner.search.evaluate_unit`) on the window's pattern (its mean
    prompt and output lengths as a fixed-length workload, ``problem``'s SLOs and latency
    source), confirmed over ``problem.confirm`` probe lengths (steady-state rule 7:
    :func:`pdserve.planner.units.confirm`) and replicated to the window's rate,
    ``n = ⌈R / g⌉``. The units take the
    deployment's TP, PP and chunked prefill; its other engine settings are ``problem``'s (the
    search prices the latency source's device, not the live instances'). A role whose unit
    reaches no goodput keeps one instance."""
    from dataclasses import replace

    if config.strategy not in ("colocated", "disaggregated"):
        raise ValueError(f"live replanning supports colocated and disaggregated deployments, "
                         f"not {config.strategy!r}")
    units = {r.role: Unit(r.role, r.tp, r.pp, chunked=r.role == "colocated" and bool(
                 config.engine_config(r, model_max_len=2048).scheduler.enable_chunked_prefill))
             for r in config.roles}

    def planner(window: WindowStats) -> dict[str, int]:
        rate = max(window.rate, 1e-3)
        wl = (f"fixed:input={max(1, round(window.mean_prompt))},"
              f"output={max(1, round(window.mean_output))}")
        p = replace(problem, rate=rate, workload=wl)
        out = {}
        for role, u in units.items():
            g = evaluate_unit(p, u).goodput_rps
            if g > 0 and p.confirm:  # rule 7, as a plan's goodputs are
                g = confirm(p, partial(unit_probe, p, u), g, u.num_gpus)[0]
            out[role] = max(1, math.ceil(rate / g - 1e-9)) if g > 0 else 1
        return out

    return planner


@dataclass
class Replan:
    """One live replanning: the shift, the counts before, the planned counts and when the
    new counts were in place (every removed instance drained)."""

    shift: Shift
    before: dict[str, int]
    planned: dict[str, int]
    applied: float | None = None


class LiveReplanner:
    """Replanning in the live runtime (DistServe §4.4): every arrival feeds a
    :class:`ShiftDetector` (prompt length and ``max_tokens`` as the output length); on a shift,
    ``planner(window)`` — e.g. :func:`search_planner`, run off the event loop — gives the
    instance count per role for the new pattern, and the difference is applied with
    ``runtime.add_instance`` / ``runtime.remove_instance`` (a removed instance drains first:
    nothing is dropped). Replannings run one at a time; a shift during one is planned after it.
    ``replans`` records each."""

    def __init__(self, runtime: Any, detector: ShiftDetector,
                 planner: Callable[[WindowStats], Mapping[str, int]]) -> None:
        self.runtime, self.detector, self.planner = runtime, detector, planner
        self.replans: list[Replan] = []
        self._task: Any = None
        self._next: Shift | None = None
        runtime.arrival_hooks.append(self.observe)

    def counts(self) -> dict[str, int]:
        """Instances per role now (not counting those draining for removal)."""
        out: dict[str, int] = {}
        for s in self.runtime.instance_status():
            if s.alive and s.instance_id not in self.runtime.controller.removing:
                out[s.role] = out.get(s.role, 0) + 1
        return out

    def observe(self, prompt_len: int, max_tokens: int, now: float) -> None:
        shift = self.detector.observe(now, prompt_len, max_tokens)
        if shift is None:
            return
        if self._task is not None and not self._task.done():
            self._next = shift
            return
        self._start(shift)

    def _start(self, shift: Shift) -> None:
        import asyncio

        self._task = asyncio.get_running_loop().create_task(self._replan(shift))

    async def _replan(self, shift: Shift) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        planned = dict(await loop.run_in_executor(None, self.planner, shift.after))
        rec = Replan(shift, self.counts(), planned)
        self.replans.append(rec)
        await self.apply(planned)
        rec.applied = self.runtime.clock()
        if self._next is not None:
            nxt, self._next = self._next, None
            self._start(nxt)

    async def apply(self, planned: Mapping[str, int]) -> None:
        """Add the missing instances (concurrently), then remove the surplus (each drains;
        the youngest instances go first)."""
        import asyncio

        have = self.counts()
        for role in planned:
            if role not in have:
                raise ValueError(f"the plan has role {role!r}; the deployment has "
                                 f"{', '.join(sorted(have))}")
        adds = [self.runtime.add_instance(role) for role, n in planned.items()
                for _ in range(n - have[role])]
        await asyncio.gather(*adds)
        removes = []
        for role, n in planned.items():
            mine = [s.instance_id for s in self.runtime.instance_status()
                    if s.role == role and s.alive
                    and s.instance_id not in self.runtime.controller.removing]
            removes += mine[::-1][:max(len(mine) - max(n, 1), 0)]
        await asyncio.gather(*(self.runtime.remove_instance(i) for i in removes))

    async def wait(self) -> None:
        """Until no replanning is under way."""
        while self._task is not None and not self._task.done():
            await self._task


# ------------------------------------------------------------- `pdserve serve --replan`
def add_replan_flags(parser: argparse.ArgumentParser) -> None:
    """``--replan`` and its settings (DistServe section 4.4; ``pdserve serve``):
    :func:`replanner_from_args` builds the live replanner they describe."""
    r = parser.add_argument_group("live replanning (DistServe section 4.4)")
    r.add_argument("--replan", action="store_true",
                   help="watch the arrivals; when the arrival rate or the mean prompt or output "
                        "length over a window moves by more than --replan-threshold, search each "
                        "role's goodput for the new pattern at the deployed TP x PP and add or "
                        "remove instances while serving (a removed instance drains first) "
                        "(default: off)")
    r.add_argument("--replan-window", type=positive, default=60.0, metavar="SECONDS",
                   help="the monitor's sliding window (default: %(default)s)")
    r.add_argument("--replan-threshold", type=positive, default=0.3, metavar="SHARE",
                   help="relative change of the rate or a mean length that counts as a shift "
                        "(default: %(default)s)")
    r.add_argument("--replan-min-requests", type=positive_int, default=20, metavar="N",
                   help="arrivals a window needs before it can report a shift "
                        "(default: %(default)s)")
    for flag, metavar, what in (
            ("--replan-profile", "NAME|FILE", "latency profile the replanning search simulates "
                                              "with (default: --replan-hardware)"),
            ("--replan-hardware", "NAME", "hardware spec for the search's roofline model when "
                                          "no profile is given (default: A100-80GB)"),
            ("--replan-model", "NAME|DIR", "the model the search prices (default: the served "
                                           "model)")):
        r.add_argument(flag, metavar=metavar, help=what)
    add_serving_path_flags(r, prefix="replan-")  # price the steps as the plan did
    r.add_argument("--replan-slo-ttft", type=positive, default=0.25, metavar="SECONDS",
                   help="TTFT SLO the search plans for (default: %(default)s)")
    r.add_argument("--replan-slo-tpot", type=positive, default=0.1, metavar="SECONDS",
                   help="TPOT SLO the search plans for (default: %(default)s)")
    r.add_argument("--replan-num-requests", type=positive_int, default=100, metavar="N",
                   help="requests per probe of the search (default: %(default)s)")
    r.add_argument("--replan-confirm", type=nonnegative_int, default=CONFIRM, metavar="LENGTHS",
                   help="steady-state rule 7: each role's goodput is confirmed over this many "
                        "probe lengths (lowered if it does not hold there) before instances "
                        "are counted (default: %(default)s; 0: off)")


def replanner_from_args(args: argparse.Namespace, config: ClusterConfig
                        ) -> Callable[[Any], Any] | None:
    """``None`` without ``--replan``; else a function that attaches a
    :class:`~pdserve.planner.replan.LiveReplanner` to a runtime (and returns it). Bad settings
    raise ``ValueError`` now, before any model loads."""
    if not getattr(args, "replan", False):
        parser = argparse.ArgumentParser()
        add_replan_flags(parser)
        given = [f"--{k.replace('_', '-')}" for k, v in vars(parser.parse_args([])).items()
                 if k != "replan" and getattr(args, k, v) != v]
        if given:  # they would be ignored
            raise ValueError(f"{', '.join(given)}: settings of live replanning; add --replan")
        return None

    if args.replan_profile and args.replan_hardware:
        raise ValueError("give --replan-profile or --replan-hardware, not both")
    if args.replan_hardware:
        get_device(args.replan_hardware)  # an unknown device fails now, not at the first shift
    problem = Problem(model=args.replan_model or config.model, profile=args.replan_profile,
                      hardware=None if args.replan_profile else
                      (args.replan_hardware or "A100-80GB"),
                      slo=SLO(args.replan_slo_ttft, args.replan_slo_tpot),
                      num_requests=args.replan_num_requests,
                      confirm=args.replan_confirm, nodes=1,
                      gpus_per_node=max(r.tp * r.pp for r in config.roles),
                      **{k: getattr(args, f"replan_{k}", None) or 0.0 for k in SERVING_PATH})

    available_tps(problem, get_model_config(problem.model))  # an unknown model/profile fails now
    planner = deployed_planner(problem, config)
    window, thr, least = args.replan_window, args.replan_threshold, args.replan_min_requests

    def attach(runtime: Any) -> LiveReplanner:
        return LiveReplanner(runtime, ShiftDetector(window, None, thr, thr, least), planner)

    return attach
