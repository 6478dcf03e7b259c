"""TetriInfer §3.5 instance flip: a transition watcher turns a prefill instance into a decode
instance or back, within fixed hardware, when a pluggable policy says so.

Mechanism (Figure 10): the controller stops routing to the chosen instance (``draining``),
waits until every request on it is gone (a prefill instance: its queue computed and its KV
pulled; a decode instance: its requests finished), then sends
:class:`~pdserve.cluster.worker.SetRole` with the other role's scheduler settings; the worker
changes its scheduler in place (no restart, no reload, the block pool kept) and its next report
carries the new role, at which point the controller routes to it in that role. Nothing is
dropped: requests are never moved, only no longer sent. Each flip's decision, drain end and
completion time are recorded (:class:`FlipRecord`).

The watcher runs on the controller's events (instance reports), at most every
``check_interval_s``: sans-IO, so the live runtime and the simulator flip identically. A role
always keeps at least one instance that is not draining, and an instance flips only towards a
role that needs one — work waiting for it (prefill: requests waiting for their first token;
decode: transfers waiting for memory) or all of its instances busy at least 90 % of the
policy's window — so an idle cluster does not flip back and forth.

Policies (``ClusterConfig.flip``, ``--flip``): ``none``; ``idle[:SECONDS]`` — flip an instance
idle for that long (default 60 s, the paper's evaluation); ``load[:SHARE[:SECONDS]]`` — flip an
instance busy less than SHARE (default 0.1) of the last SECONDS (default 60), §3.5's example.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.cluster.actions import Action, Send
from pdserve.cluster.routing import InstanceView
from pdserve.cluster.worker import SetRole, StepReport
from pdserve.config import FLIP_POLICIES as FLIP_NAMES
from pdserve.config import SchedulerConfig, flip_settings
from pdserve.registry import Registry

OTHER = {"prefill": "decode", "decode": "prefill"}


@dataclass
class Activity:
    """What the watcher knows of one instance's recent work."""

    since: float  # when the watcher first saw it (in its current role)
    last_busy: float  # end of its last step, or when it last had requests
    steps: deque[tuple[float, float]] = field(default_factory=deque)  # (end, duration)

    def busy_share(self, now: float, window: float) -> float:
        """Share of ``[now − window, now]`` spent computing steps."""
        busy = 0.0
        for end, dur in self.steps:
            busy += max(0.0, min(end, now) - max(end - dur, now - window))
        return busy / window


class FlipPolicy:
    name = ""
    window_s = 60.0
    needs_backlog = True  # flip only towards a role with work waiting (module docstring)

    def wants_flip(self, inst: InstanceView, act: Activity, now: float) -> bool:
        raise NotImplementedError


FLIP_POLICIES: Registry[FlipPolicy] = Registry("flip policy", names=FLIP_NAMES)
register = FLIP_POLICIES.register


@register
class NoFlip(FlipPolicy):
    name = "none"

    def wants_flip(self, inst: InstanceView, act: Activity, now: float) -> bool:
        return False


@register
class IdleFlip(FlipPolicy):
    """TetriInfer §5.1: "we flip an instance once it becomes idle for a minute"."""

    name = "idle"

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s

    def wants_flip(self, inst: InstanceView, act: Activity, now: float) -> bool:
        return inst.active == 0 and now - act.last_busy >= self.window_s


@register
class LowLoadFlip(FlipPolicy):
    """TetriInfer §3.5: flip an instance whose load has been under ``threshold`` (10 %) for
    the past ``window_s`` (a minute): its busy share of that window."""

    name = "load"

    def __init__(self, threshold: float = 0.1, window_s: float = 60.0) -> None:
        self.threshold, self.window_s = threshold, window_s

    def wants_flip(self, inst: InstanceView, act: Activity, now: float) -> bool:
        return (now - act.since >= self.window_s
                and act.busy_share(now, self.window_s) < self.threshold)


def parse_flip(spec: str) -> FlipPolicy:
    """``none`` | ``idle[:SECONDS]`` | ``load[:SHARE[:SECONDS]]`` → a policy (the values are
    checked by :func:`pdserve.config.flip_settings`, with clear errors)."""
    name, values = flip_settings(spec)
    return FLIP_POLICIES[name](*values)


@dataclass
class FlipRecord:
    instance_id: str
    from_role: str
    to_role: str
    decided: float
    drained: float | None = None  # SetRole sent
    done: float | None = None  # the instance reported its new role

    @property
    def flip_time(self) -> float | None:
        """Decision to completion, draining included (the paper reports 5-7 ms without it)."""
        return None if self.done is None else self.done - self.decided


class TransitionWatcher:
    """Watches reports, drains and flips instances (module docstring). ``schedulers``: each
    role's scheduler settings (``ClusterConfig.engine_config(role).scheduler``)."""

    def __init__(self, policy: FlipPolicy, schedulers: Mapping[str, SchedulerConfig],
                 check_interval_s: float = 1.0) -> None:
        self.policy = policy
        self.schedulers = dict(schedulers)
        self.check_interval_s = check_interval_s
        self.activity: dict[str, Activity] = {}
        self.records: list[FlipRecord] = []
        self._open: dict[str, FlipRecord] = {}  # instance -> its flip in progress
        self._sent: dict[str, float] = {}  # instance -> when SetRole was last sent
        self._last_check = float("-inf")

    def observe(self, rep: StepReport) -> None:
        act = self.activity.setdefault(rep.instance_id, Activity(rep.now, rep.now))
        end = rep.now + rep.elapsed
        if rep.stepped or rep.has_unfinished:
            act.last_busy = max(act.last_busy, end)
        if rep.stepped:
            act.steps.append((end, rep.elapsed))
            while act.steps and act.steps[0][0] < end - self.policy.window_s:
                act.steps.popleft()

    def flipped(self, inst: InstanceView, role: str, now: float) -> None:
        """``inst`` reported ``role``: the flip is complete."""
        rec = self._open.pop(inst.instance_id, None)
        self._sent.pop(inst.instance_id, None)
        inst.role, inst.draining = role, False
        self.activity[inst.instance_id] = Activity(now, now)
        if rec is not None:
            rec.done = now

    def tick(self, instances: Mapping[str, InstanceView], now: float) -> list[Action]:
        """The controller's instances (``Controller.instances``) at ``now``: the flips to send."""
        acts: list[Action] = []
        for iid, rec in self._open.items():  # drained instances flip now
            inst = instances[iid]
            if not inst.alive or inst.active:
                continue
            if rec.drained is None:
                rec.drained = now
            # (re)send: a SetRole that met a request still on the worker (an abort on its
            # way) is refused there and sent again at a later check
            if now - self._sent.get(iid, float("-inf")) >= self.check_interval_s:
                self._sent[iid] = now
                acts.append(Send(iid, SetRole(rec.to_role, self.schedulers[rec.to_role])))
        if now - self._last_check < self.check_interval_s or isinstance(self.policy, NoFlip):
            return acts
        self._last_check = now
        views = [i for i in instances.values() if i.alive and i.role in OTHER]
        for inst in views:
            if inst.draining:
                continue
            act = self.activity.setdefault(inst.instance_id, Activity(now, now))
            target = OTHER[inst.role]
            serving = [v for v in views if v.role == inst.role and not v.draining]
            if len(serving) < 2 or (self.policy.needs_backlog
                                    and not self._needed(views, target, now)):
                continue
            if self.policy.wants_flip(inst, act, now):
                inst.draining = True
                rec = FlipRecord(inst.instance_id, inst.role, target, now)
                self.records.append(rec)
                self._open[inst.instance_id] = rec
                if inst.active == 0:
                    rec.drained = now
                    self._sent[inst.instance_id] = now
                    acts.append(Send(inst.instance_id,
                                     SetRole(target, self.schedulers[target])))
                break  # one flip decision per check
        return acts

    def _needed(self, views: list[InstanceView], role: str, now: float) -> bool:
        """``role`` could use another instance: work waits for it (:func:`_backlog`), or every
        one of its instances was busy at least ``SATURATED`` of the last window."""
        if _backlog(views, role):
            return True
        mine = [v for v in views if v.role == role and not v.draining]
        w = self.policy.window_s
        return bool(mine) and all(
            v.instance_id in self.activity
            and now - self.activity[v.instance_id].since >= w
            and self.activity[v.instance_id].busy_share(now, w) >= SATURATED for v in mine)


SATURATED = 0.9  # busy share of the window at which a role counts as needing another instance


def _backlog(views: list[InstanceView], role: str) -> bool:
    """Work waiting for ``role``: prefill — requests not yet given their first token beyond
    one per instance; decode — KV routed to an instance beyond what its free blocks (last
    report) can take."""
    mine = [v for v in views if v.role == role and not v.draining]
    if role == "prefill":
        return sum(v.queued for v in mine) > len(mine)
    return any(v.stats is not None and v.pending_tokens > v.stats.num_free_blocks * v.block_size
               for v in mine)
