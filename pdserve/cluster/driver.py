"""The driver core: instance command queues, the pipelined-step policy and action dispatch,
written once (sans-IO) for both drivers — the live runtime (:mod:`pdserve.cluster.runtime`)
and the simulator (:mod:`pdserve.sim.simulator`).

A driver feeds it events (a step's report came back, an instance failed, a KV transfer ended,
controller actions) and carries out the effects it returns:

- :class:`StartStep` — send these commands to the instance (and, for the simulator, run one step
  there now);
- :class:`~pdserve.cluster.controller.Transfer` — move a request's KV between two instances;
- :class:`~pdserve.cluster.controller.Fail` — end a request with an error;
- :class:`Deliver` — the token deltas the controller accepted from a report (streams).

**Pipelining.** When a report says its instance has more work, the instance's next step starts
at once with the commands queued so far, *before* the report is processed; commands that
processing the report produces for the same instance go with the step after. So an instance
never idles while the driver runs the controller, streams tokens or writes SSE.

**Instance loops** (``loop=True``, the live runtime). A live instance runs this same rule itself
(:class:`pdserve.cluster.instances.StepLoop`): it steps again as soon as a step leaves it with
work, applying the commands that reached it during the step, and otherwise waits for commands.
The core then sends commands as soon as the controller produces them (a :class:`StartStep`
whether or not a step is in flight) and starts no step itself. What an instance applies with
each step is what the simulator's pipelining gives it: commands sent while step k runs go with
step k+1, and those produced by processing report k go with step k+2, because step k+1 was
under way before report k reached the driver. The core still keeps the accounting: an instance
is busy while its last report said it has more work or it has not yet applied every batch of
commands sent to it (each report counts the batches it has applied).

**Scaling** (live add/remove, replanning, DistServe §4.4): :meth:`DriverCore.add_instance`
registers a started instance with the core and the controller; :meth:`DriverCore.remove_instance`
stops routing to one, which then drains — its requests run to the end there — and once
:meth:`DriverCore.drained` (no request on it, no step in flight, no command waiting) the driver
calls :meth:`DriverCore.forget` and shuts the instance down. Both drivers call these, so a
simulated removal drains exactly as a live one does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.cluster.controller import Action, ClusterRequest, Controller, Fail, Send, Transfer
from pdserve.cluster.routing import InstanceView
from pdserve.cluster.worker import Command, ImportKV, StepReport, TokenDelta


@dataclass(slots=True)
class StartStep:
    instance_id: str
    commands: list[Command]


@dataclass(slots=True)
class Deliver:
    report: StepReport
    accepted: list[tuple[TokenDelta, ClusterRequest]]


Effect = StartStep | Transfer | Fail | Deliver


class DriverCore:
    """At most one step in flight per instance; commands queue while it runs."""

    def __init__(self, controller: Controller, instance_ids: Iterable[str],
                 loop: bool = False) -> None:
        self.controller = controller
        self.loop = loop  # the instances run their own loops (module docstring)
        self.queues: dict[str, list[Command]] = {iid: [] for iid in instance_ids}
        self.busy: dict[str, bool] = dict.fromkeys(self.queues, False)
        # loop mode: command batches sent to each instance, and how many its last report had
        # applied, and whether that report said it steps again
        self.sent: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.applied: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.more: dict[str, bool] = dict.fromkeys(self.queues, False)

    def idle(self, instance_id: str) -> bool:
        """No step in flight and no command waiting."""
        return not self.busy[instance_id] and not self.queues[instance_id]

    def dispatch(self, actions: Iterable[Action]) -> list[Effect]:
        """Queue the controller's commands; idle instances that got one start a step."""
        out: list[Effect] = []
        kicks: dict[str, None] = {}
        for a in actions:
            if isinstance(a, Send):
                self.queues[a.instance_id].append(a.command)
                kicks[a.instance_id] = None
            else:
                out.append(a)
        for iid in kicks:
            out += self.kick(iid)
        return out

    def kick(self, instance_id: str) -> list[Effect]:
        """Start a step on ``instance_id`` if it is idle and has commands (loop mode: send the
        commands now, busy or not)."""
        if not self.queues[instance_id] or (self.busy[instance_id] and not self.loop):
            return []
        return [self._start(instance_id)]

    def start(self, instance_id: str) -> StartStep:
        """Start a step now (the instance must be idle), with whatever commands are queued."""
        assert not self.busy[instance_id], f"{instance_id} already has a step in flight"
        return self._start(instance_id)

    def _start(self, instance_id: str) -> StartStep:
        self.busy[instance_id] = True
        self.sent[instance_id] += 1
        cmds, self.queues[instance_id] = self.queues[instance_id], []
        return StartStep(instance_id, cmds)

    def step_done(self, instance_id: str, report: StepReport,
                  run: Callable[[list[Effect]], None]) -> None:
        """A step's report came back (module docstring: pipelining). ``run`` carries out
        effects; it is called first with the next step (if the instance has more work), so that
        the step is under way before the report is processed, then with the report's effects.
        Loop mode: the instance started that step itself."""
        more = report.stepped and report.has_work
        if self.loop:
            self.applied[instance_id] = report.applied
            self.more[instance_id] = more
            self.busy[instance_id] = more or self.sent[instance_id] > report.applied
        else:
            self.busy[instance_id] = False
            if more:
                run([self._start(instance_id)])
        actions, accepted = self.controller.on_report(report)
        out: list[Effect] = [Deliver(report, accepted)]
        out += self.dispatch(actions)
        out += self.kick(instance_id)
        run(out)

    def transfer_done(self, request_id: str, dst: str, payload: object, now: float | None,
                      ) -> list[Effect]:
        """The KV of ``request_id`` arrived for ``dst``: hand it over with the next step.
        ``now`` dates the end of the move; ``None`` when the driver reports it separately."""
        if now is not None:
            self.controller.on_transfer_done(request_id, now)
        if dst not in self.queues:  # removed meanwhile (the request had been aborted)
            return []
        self.queues[dst].append(ImportKV(request_id, payload))
        return self.kick(dst)

    # ------------------------------------------------------------------ scaling
    def add_instance(self, view: InstanceView, now: float) -> list[Effect]:
        """A started instance joins; requests the router held may go to it at once."""
        if view.instance_id in self.queues:
            raise ValueError(f"instance id {view.instance_id!r} is already in use")
        actions = self.controller.add_instance(view, now)
        self.queues[view.instance_id] = []
        self.busy[view.instance_id] = False
        self.sent[view.instance_id] = self.applied[view.instance_id] = 0
        self.more[view.instance_id] = False
        return self.dispatch(actions)

    def remove_instance(self, instance_id: str, now: float) -> list[Effect]:
        """Stop routing to ``instance_id``; it drains (``ValueError`` for an unknown, dead or
        last instance of its role)."""
        return self.dispatch(self.controller.remove_instance(instance_id, now))

    def drained(self, instance_id: str) -> bool:
        """Removal may complete: no request left on it, no step in flight, no command queued."""
        return self.controller.drained(instance_id) and (
            self.idle(instance_id) or not self.controller.instances[instance_id].alive)

    def forget(self, instance_id: str) -> None:
        """Drop a drained or dead instance (the driver then shuts it down)."""
        if self.controller.instances[instance_id].alive and not self.drained(instance_id):
            raise ValueError(f"instance {instance_id!r} has not drained")
        self.controller.forget(instance_id)
        del self.queues[instance_id], self.busy[instance_id], self.sent[instance_id]
        del self.applied[instance_id], self.more[instance_id]

    def instance_failed(self, instance_id: str, now: float) -> list[Effect]:
        """The instance is gone: its requests are recomputed elsewhere (or fail)."""
        self.busy[instance_id] = False
        self.queues[instance_id].clear()
        return self.dispatch(self.controller.on_instance_failed(instance_id, now))
