"""The driver core's pipelining, in the core itself and in both drivers that use it: a step's
report is processed only after the instance's next step has started (with the commands queued
before), so commands produced by the report go with the step after. Live, the instance runs
that rule in its own loop (the core's loop mode)."""

from __future__ import annotations

import threading

import pytest

from pdserve.cluster.controller import Controller, Send
from pdserve.cluster.driver import Deliver, DriverCore, StartStep
from pdserve.cluster.routing import InstanceView
from pdserve.cluster.worker import Abort, AddRequest, StepReport
from pdserve.config import ClusterConfig
from pdserve.request import SamplingParams
from pdserve.sim.simulator import SimInstance, SimRequest, Simulator
from tests.cluster.test_runtime_fake import MODEL, cluster
from tests.sim.test_parity import FixedStep


def _core() -> DriverCore:
    ctrl = Controller([InstanceView("colocated-0", "colocated", 64, 4)])
    return DriverCore(ctrl, ["colocated-0"])


def test_core_starts_the_next_step_before_processing_the_report() -> None:
    core = _core()
    add = AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=4), 0.0)
    (start,) = core.dispatch([Send("colocated-0", add)])
    assert start == StartStep("colocated-0", [add]) and core.busy["colocated-0"]
    # while the step runs, a command queues (no second step in flight)
    late = Abort("z")
    assert core.dispatch([Send("colocated-0", late)]) == []
    rep = StepReport("colocated-0", "colocated", 0.0, 0.01, stepped=True, has_work=True)
    effects: list = []
    log: list[str] = []
    _order_probe(core.controller, log)

    def run(batch: list) -> None:
        log.extend("start" for e in batch if isinstance(e, StartStep))
        effects.extend(batch)

    core.step_done("colocated-0", rep, run)
    # first the next step, carrying the command queued during the last one, is handed to the
    # driver before the controller sees the report; then the report's effects
    assert log == ["start", "report colocated-0 0.000000"]
    assert effects[0] == StartStep("colocated-0", [late])
    assert isinstance(effects[1], Deliver) and effects[1].report is rep
    assert core.busy["colocated-0"] and not core.queues["colocated-0"]


def test_core_without_more_work_processes_first_and_idles() -> None:
    core = _core()
    core.dispatch([Send("colocated-0", Abort("x"))])
    rep = StepReport("colocated-0", "colocated", 0.0, 0.0, stepped=False, has_work=False)
    effects: list = []
    core.step_done("colocated-0", rep, effects.extend)
    assert [type(e) for e in effects] == [Deliver] and core.idle("colocated-0")


def _order_probe(controller: Controller, log: list[str]) -> None:
    on_report = controller.on_report

    def traced(rep: StepReport):
        log.append(f"report {rep.instance_id} {rep.now:.6f}")
        return on_report(rep)

    controller.on_report = traced  # type: ignore[method-assign]


def test_simulator_pipelines() -> None:
    cfg = ClusterConfig.from_dict({"engine": {"max_num_batched_tokens": 16,
                                              "max_model_len": 128, "num_kv_blocks": 64,
                                              "block_size": 4}, "backend": "inproc"})
    (spec,) = cfg.instance_specs()
    sim = Simulator([SimInstance(spec.instance_id, spec.engine, FixedStep(0.01), 64)], MODEL)
    log: list[str] = []
    _order_probe(sim.controller, log)
    worker = sim.insts["colocated-0"].worker
    handle = worker.handle

    def traced(cmds, now, step=True):
        log.append(f"start {now:.6f}")
        return handle(cmds, now, step)

    worker.handle = traced  # type: ignore[method-assign]
    sim.run([SimRequest("a", 0.0, list(range(5, 25)), 6)])
    # step k+1 starts (at the end time of step k) before step k's report is processed
    i = log.index("start 0.010000")
    assert log[i + 1] == "report colocated-0 0.000000", log[:6]


@pytest.mark.asyncio
async def test_live_instance_steps_without_the_driver() -> None:
    """The live instance runs its own loop: while the driver is stuck in processing the first
    report (its event loop blocked), the instance goes on stepping (a driver that starts each
    step itself could start only one more)."""
    rt = cluster()
    client = rt.instances["colocated-0"].client
    worker = client.worker  # type: ignore[attr-defined]
    handle = worker.handle
    starts: list[int] = []
    three_more = threading.Event()

    def traced(cmds, now, step=True):
        starts.append(len(starts))
        if len(starts) == 4:  # steps 1, 2 and 3 began after step 0's report was out
            three_more.set()
        return handle(cmds, now, step)

    worker.handle = traced  # type: ignore[method-assign]
    on_report = rt.controller.on_report
    seen: list[bool] = []

    def blocking(rep: StepReport):
        if not seen:  # blocks the event loop, hence the whole driver
            seen.append(three_more.wait(timeout=20))
        return on_report(rep)

    rt.controller.on_report = blocking  # type: ignore[method-assign]
    await rt.start()
    try:
        outs = [o async for o in rt.generate("a", list(range(5, 25)),
                                             SamplingParams(max_tokens=6, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].token_ids) == 6
    finally:
        await rt.shutdown()
    assert seen == [True]


def test_core_loop_mode_sends_at_once_and_tracks_what_was_applied() -> None:
    ctrl = Controller([InstanceView("colocated-0", "colocated", 64, 4)])
    core = DriverCore(ctrl, ["colocated-0"], loop=True)
    add = AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=4), 0.0)
    assert core.dispatch([Send("colocated-0", add)]) == [StartStep("colocated-0", [add])]
    # a second batch goes at once too, though the instance is busy
    late = Abort("z")
    assert core.dispatch([Send("colocated-0", late)]) == [StartStep("colocated-0", [late])]
    assert core.sent["colocated-0"] == 2 and not core.idle("colocated-0")

    def report(applied: int, stepped: bool, more: bool) -> list:
        effects: list = []
        rep = StepReport("colocated-0", "colocated", 0.0, 0.01, stepped=stepped,
                         has_work=more, applied=applied)
        core.step_done("colocated-0", rep, effects.extend)
        return effects

    # the instance starts its next step itself: the core starts none
    effects = report(1, stepped=True, more=True)
    assert [type(e) for e in effects] == [Deliver] and core.busy["colocated-0"]
    # no more work, but the second batch has not been applied yet: still busy
    report(1, stepped=True, more=False)
    assert not core.idle("colocated-0")
    report(2, stepped=False, more=False)
    assert core.idle("colocated-0")
