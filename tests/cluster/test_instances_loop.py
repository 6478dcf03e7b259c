"""The instance's own step loop (StepLoop): commands applied in the order the driver numbered
them, steps back to back while there is work, reports collected by polls, sessions, failures.
The reference is the same worker stepped directly with ``handle`` (as the simulator does)."""

from __future__ import annotations

import pytest

from pdserve.cluster.instances import InstanceDeadError, StepLoop
from pdserve.cluster.worker import AddRequest, InstanceWorker, StepReport
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.request import SamplingParams
from tests.engine.fakes import FakeExecutor, reference_generate

VOCAB = 50


def worker() -> InstanceWorker:
    eng = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=32),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=128))
    return InstanceWorker("colocated-0", eng, executor=FakeExecutor(32, 4, VOCAB, 0.001))


def add(rid: str, prompt: list[int], n: int) -> AddRequest:
    return AddRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                      0.0)


def tokens(reports: list[StepReport]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rep in reports:
        for d in rep.deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return out


def collect(loop: StepLoop, epoch: int, n_finished: int) -> list[StepReport]:
    reps: list[StepReport] = []
    while sum(d.finished for r in reps for d in r.deltas) < n_finished:
        got = loop.next_reports(epoch, timeout=20)
        assert got, "no report within 20 s"
        reps += got
    return reps


def test_applies_batches_in_the_drivers_order_and_steps_until_done() -> None:
    loop = StepLoop(worker())
    try:
        epoch = loop.open()
        a, b = [1, 2, 3], list(range(5, 25))
        # batch 1 arrives first (Ray may run a threaded actor's calls out of order): it waits
        loop.submit(epoch, 1, [add("b", b, 5)])
        assert loop.next_reports(epoch, timeout=0.2) == []
        loop.submit(epoch, 0, [add("a", a, 7)])
        reps = collect(loop, epoch, 2)
        assert reps[0].applied == 2  # both batches went with the first step
        assert tokens(reps) == {"a": reference_generate(a, 7, VOCAB),
                                "b": reference_generate(b, 5, VOCAB)}
        # the loop stepped on its own: one report per step, the same steps as the reference
        ref = worker()
        ref_reps = [ref.handle([add("a", a, 7), add("b", b, 5)], 0.0)]
        while ref_reps[-1].stepped and ref_reps[-1].has_work:
            ref_reps.append(ref.handle([], 0.0))
        assert [r.batch for r in reps] == [r.batch for r in ref_reps]
        assert all(r.applied == 2 for r in reps)
        assert [r.now for r in reps] == sorted(r.now for r in reps)
    finally:
        loop.stop()


def test_a_new_session_drops_the_old_ones_commands_and_polls() -> None:
    loop = StepLoop(worker())
    try:
        old = loop.open()
        new = loop.open()
        loop.submit(old, 0, [add("x", [1, 2], 3)])  # a stale driver's command: ignored
        assert loop.next_reports(old, timeout=0.01) == []
        loop.submit(new, 0, [add("y", [3, 4], 2)])
        reps = collect(loop, new, 1)
        assert set(tokens(reps)) == {"y"}
        assert loop.next_reports(old, timeout=0.01) == []
    finally:
        loop.stop()


def test_a_failing_worker_reaches_the_poll_and_stop_ends_it() -> None:
    w = worker()

    def broken(cmds, now, step=True):
        raise RuntimeError("executor crashed")

    w.handle = broken  # type: ignore[method-assign]
    loop = StepLoop(w)
    epoch = loop.open()
    loop.submit(epoch, 0, [add("a", [1, 2], 2)])
    with pytest.raises(RuntimeError, match="executor crashed"):
        loop.next_reports(epoch, timeout=20)
    ok = StepLoop(worker())
    epoch = ok.open()
    ok.stop()
    with pytest.raises(InstanceDeadError):
        ok.next_reports(epoch, timeout=20)


def test_a_failed_kv_pull_leaves_no_per_request_state() -> None:
    """A decode instance whose KV pull failed forgets the request (no ``_reported`` entry per
    failed pull: a slow leak under a flaky link)."""
    from pdserve.cluster.worker import AddTransfer, ImportKV, PullFailed
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig

    eng = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=32),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=128,
                                                 role="decode"))
    w = InstanceWorker("decode-0", eng, executor=FakeExecutor(32, 4, VOCAB, 0.001))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(5):
        rid = f"r{i}"
        rep = w.handle([AddTransfer(rid, [1, 2, 3, 4, 5], [6], params, 0.0)], float(i))
        rep = w.handle([ImportKV(rid, PullFailed("source died"))], float(i) + 0.5)
        assert rep.transfer_failures and rep.transfer_failures[0][0] == rid, rep
    assert w._reported == {}
    assert w.check_integrity()["used_blocks"] == 0


def test_a_direct_pull_that_fails_on_a_rank_is_a_failed_transfer() -> None:
    """``KVPullError`` from the executor's import (a source rank died mid-pull) fails the
    transfer like a failed object-store pull: the request is forgotten here, its blocks are
    free, and the instance serves the next one."""
    from pdserve.cluster.worker import AddTransfer, ImportKV
    from pdserve.engine.engine import KVPayload
    from pdserve.engine.executor import KVPullError

    class DyingSource(FakeExecutor):
        def import_kv(self, block_ids: list[int], payload: object) -> None:
            raise KVPullError("ranks [1] failed to pull their KV slices")

    eng = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=32),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=128,
                                                 role="decode"))
    w = InstanceWorker("decode-0", eng, executor=DyingSource(32, 4, VOCAB, 0.001))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    rep = w.handle([AddTransfer("r0", [1, 2, 3, 4, 5], [6], params, 0.0)], 0.0)
    rep = w.handle([ImportKV("r0", KVPayload("r0", 0, 1, {"sources": ["rank-0"]}))], 0.5)
    assert rep.imported == []
    assert rep.transfer_failures == [
        ("r0", "KV transfer failed: ranks [1] failed to pull their KV slices")]
    assert w._reported == {}
    assert w.check_integrity()["used_blocks"] == 0
