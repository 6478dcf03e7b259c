"""Controller and routers: hand-computed routing decisions and action sequences (no I/O)."""

import pytest

from pdserve.cluster.controller import Controller, Fail, Send, Transfer
from pdserve.cluster.routing import InstanceView
from pdserve.cluster.worker import Abort, AddRequest, AddTransfer, Release, TokenDelta
from pdserve.request import SamplingParams, Timeline

P = SamplingParams(max_tokens=4, ignore_eos=True)


def views(*spec):
    return [InstanceView(iid, role, num_kv_blocks=10, block_size=4) for iid, role in spec]


def delta(rid, toks, t, **kw):
    return TokenDelta(rid, toks, "", [t] * len(toks), **kw)


def test_disaggregated_flow_actions():
    c = Controller(views(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"),
                         ("d1", "decode")))
    [a] = c.on_arrival("r", [1, 2, 3, 4, 5], P, now=1.0)
    assert a == Send("p0", AddRequest("r", [1, 2, 3, 4, 5], P, 1.0, []))
    [b] = c.on_arrival("s", [9] * 30, P, now=1.1)
    assert b.instance_id == "p1"  # shortest queue: p0 has one queued request
    tl = Timeline(arrival=1.0, prefill_queued=1.0, prefill_start=1.2, prefill_end=1.5)
    [a] = c.on_report_delta("p0", delta("r", [7], 1.5, held=True, timeline=tl), now=1.5)
    assert a == Send("d0", AddTransfer("r", [1, 2, 3, 4, 5], [7], P, 1.0))
    assert c.instances["p0"].queued == 0 and c.instances["d0"].pending_tokens == 6
    # least load: 6 tokens are promised to d0, so s goes to d1
    [b] = c.on_report_delta("p1", delta("s", [8], 1.6, held=True), now=1.6)
    assert b.instance_id == "d1"
    [t] = c.on_pull("d0", "r", 1, now=1.7)
    assert t == Transfer("r", "p0", "d0", 1, 5 - 4)  # block 0 cached on d0: 1 token moves
    assert c.instances["d0"].pending_tokens == 0  # reserved: now counted in d0's own blocks
    assert c.on_imported("d0", "r", now=1.8) == [Send("p0", Release("r"))]
    assert c.instances["p0"].active == 0
    assert c.on_report_delta("d0", delta("r", [1, 2], 1.9), now=1.9) == []
    assert c.on_report_delta("d0", delta("r", [3], 2.0, finished=True, finish_reason="length"),
                             now=2.0) == []
    assert "r" not in c.requests and c.instances["d0"].active == 0
    # stale deltas from an instance the request left are ignored
    assert c.on_report_delta("p0", delta("s", [5], 2.1), now=2.1) == []


def test_colocated_shortest_queue_and_round_robin():
    c = Controller(views(("c0", "colocated"), ("c1", "colocated"), ("c2", "colocated")))
    got = [c.on_arrival(f"r{i}", [1], P, now=i)[0].instance_id for i in range(4)]
    assert got == ["c0", "c1", "c2", "c0"]  # every unfinished request counts on colocated
    c.on_report_delta("c1", delta("r1", [5], 5, finished=True, finish_reason="length"), now=5)
    assert c.on_arrival("r9", [1], P, now=6)[0].instance_id == "c1"
    rr = Controller(views(("c0", "colocated"), ("c1", "colocated")), prefill_router="round_robin")
    assert [rr.on_arrival(f"x{i}", [1], P, 0)[0].instance_id for i in range(3)] == ["c0", "c1",
                                                                                     "c0"]


def test_abort_reaches_every_instance_holding_the_request():
    c = Controller(views(("p0", "prefill"), ("d0", "decode")))
    c.on_arrival("r", [1, 2], P, 0)
    c.on_report_delta("p0", delta("r", [3], 1, held=True), 1)
    acts = c.on_abort("r", 2)
    assert sorted(a.instance_id for a in acts) == ["d0", "p0"]
    assert all(isinstance(a.command, Abort) for a in acts)
    assert all(v.active == 0 and v.pending_tokens == 0 for v in c.instances.values())


def test_abort_during_the_transfer_discards_what_the_decode_side_pulled():
    """The prefill copy is freed at once, maybe before a direct pull has read all of it: the
    decode instance is told not to keep what it pulled in its prefix cache. After the import
    (the prefill copy released only then) a plain abort suffices."""
    c = Controller(views(("p0", "prefill"), ("d0", "decode")))
    for rid in ("r", "s"):
        c.on_arrival(rid, [1, 2], P, 0)
        c.on_report_delta("p0", delta(rid, [3], 1, held=True), 1)
        c.on_pull("d0", rid, 0, 1.5)
    c.on_imported("d0", "s", 1.6)
    assert sorted(c.on_abort("r", 2), key=lambda a: a.instance_id) == [
        Send("d0", Abort("r", discard_kv=True)), Send("p0", Abort("r"))]
    assert c.on_abort("s", 2) == [Send("d0", Abort("s"))]


def test_instance_failure_recomputes_with_generated_tokens():
    c = Controller(views(("c0", "colocated"), ("c1", "colocated")))
    c.on_arrival("r", [1, 2], P, 0)
    c.on_report_delta("c0", delta("r", [3, 4], 1), 1)
    [a] = c.on_instance_failed("c0", 2)
    assert a == Send("c1", AddRequest("r", [1, 2], P, 0, [3, 4]))  # resumes after 2 tokens
    assert c.on_instance_failed("c0", 3) == []
    [f] = c.on_instance_failed("c1", 4)
    assert isinstance(f, Fail) and "no live colocated" in f.message


def test_failed_kv_pull_recomputes_the_request_elsewhere():
    """The prefill copy vanished (its actor died) before the decode instance pulled it: the
    request is prefilled again with its first token, not failed; after MAX_DISPATCHES tries
    it fails."""
    from pdserve.cluster.controller import MAX_DISPATCHES
    from pdserve.cluster.worker import StepReport

    c = Controller(views(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")))
    c.on_arrival("r", [1, 2, 3, 4, 5], P, 0)
    c.on_report_delta("p0", delta("r", [7], 1, held=True), 1)
    c.on_pull("d0", "r", 0, 2)
    rep = StepReport("d0", "decode", 3.0, transfer_failures=[("r", "KV transfer failed: x")])
    acts, _ = c.on_report(rep)
    assert acts == [Send("p0", Abort("r")),
                    Send("p1", AddRequest("r", [1, 2, 3, 4, 5], P, 0, [7]))]
    assert c.requests["r"].stage == "prefill" and c.instances["d0"].active == 0
    for k in range(2, MAX_DISPATCHES):  # keeps failing: re-dispatched until the cap
        c.on_report_delta(c.requests["r"].instance, delta("r", [8], 4 + k, held=True), 4 + k)
        c.on_pull("d0", "r", 0, 4 + k)
        acts, _ = c.on_report(rep)
        assert isinstance(acts[-1], Send) and isinstance(acts[-1].command, AddRequest)
    c.on_report_delta(c.requests["r"].instance, delta("r", [8], 9, held=True), 9)
    c.on_pull("d0", "r", 0, 9)
    acts, _ = c.on_report(rep)
    assert isinstance(acts[-1], Fail) and "KV transfer failed" in acts[-1].message
    assert "r" not in c.requests


def test_bad_cluster_shapes():
    with pytest.raises(ValueError, match="at least one"):
        Controller([])
    with pytest.raises(ValueError, match="all colocated or prefill"):
        Controller(views(("p0", "prefill"), ("c0", "colocated")))
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        Controller(views(("c0", "colocated")), prefill_router="nope")


def test_least_load_uses_reported_blocks_plus_promised_tokens():
    from pdserve.engine.engine import EngineStats

    c = Controller(views(("p0", "prefill"), ("d0", "decode"), ("d1", "decode")))

    def stats(used):
        return EngineStats(0, 0, 0, 0, 10, 10 - used, used, used / 10, 0, 0, 0, 0)

    c.on_stats("d0", stats(3))  # 12 tokens of 40 in use
    c.on_stats("d1", stats(1))  # 4 tokens
    c.on_arrival("a", [1] * 9, P, 0)
    [a] = c.on_report_delta("p0", delta("a", [2], 1, held=True), 1)
    assert a.instance_id == "d1"  # d1: (4 + 0) / 40 < d0: 12 / 40
    c.on_arrival("b", [1] * 3, P, 1)
    [b] = c.on_report_delta("p0", delta("b", [2], 2, held=True), 2)
    assert b.instance_id == "d0"  # d1 now has 10 promised: (4 + 10) / 40 > 12 / 40


def test_instance_failures_stop_redispatching_after_max_dispatches():
    from pdserve.cluster.controller import MAX_DISPATCHES

    c = Controller(views(*[(f"c{i}", "colocated") for i in range(MAX_DISPATCHES + 1)]))
    [a] = c.on_arrival("r", [1, 2, 3], P, now=0.0)
    where = a.instance_id
    for n in range(1, MAX_DISPATCHES):  # each failure re-dispatches to a live instance
        assert c.requests["r"].num_dispatches == n
        [again] = c.on_instance_failed(where, now=float(n))
        assert isinstance(again, Send) and again.instance_id != where
        where = again.instance_id
    # the MAX_DISPATCHES-th failure ends the request with an explicit error instead
    (fail,) = c.on_instance_failed(where, now=9.0)
    assert isinstance(fail, Fail) and fail.request_id == "r" and "dispatched" in fail.message
    assert "r" not in c.requests


def test_debug_log_follows_a_request_through_the_controller(caplog):
    """DEBUG lines of pdserve.cluster.controller trace one request's life: arrival, routing,
    hand-off to decode, KV transfer and import, finish."""
    c = Controller(views(("p0", "prefill"), ("d0", "decode")))
    with caplog.at_level("DEBUG", logger="pdserve.cluster.controller"):
        c.on_arrival("r", [1, 2, 3, 4, 5], P, now=1.0)
        c.on_report_delta("p0", delta("r", [7], 1.5, held=True), now=1.5)
        c.on_pull("d0", "r", 0, now=1.7)
        c.on_imported("d0", "r", now=1.8)
        c.on_report_delta("d0", delta("r", [1, 2, 3], 2.0, finished=True,
                                      finish_reason="length"), now=2.0)
    assert [r.getMessage() for r in caplog.records] == [
        "r arrived at 1.000000: 5 prompt tokens, max_tokens 4",
        "r routed to p0",
        "r prefilled on p0, routed to decode on d0",
        "r KV transfer p0 -> d0 from block 0 (5 tokens)",
        "r KV imported on d0",
        "r finished (length): 4 output tokens",
    ]


def test_debug_log_follows_a_request_through_a_worker(caplog):
    """DEBUG lines of pdserve.cluster.worker: each command, a prefill request's first token and
    hold for transfer, a refused command."""
    from pdserve.cluster.worker import Abort, InstanceWorker
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from tests.engine.fakes import FakeExecutor

    eng = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=16),
                       scheduler=SchedulerConfig(role="prefill", max_model_len=64,
                                                 enable_chunked_prefill=False))
    w = InstanceWorker("p0", eng, FakeExecutor(16, 4))
    with caplog.at_level("DEBUG", logger="pdserve.cluster.worker"):
        w.handle([AddRequest("r", [1, 2, 3], P, 0.0)], 0.0)
        w.handle([AddRequest("r", [1], P, 0.0)], 1.0)  # a duplicate id is refused
        w.handle([Abort("r")], 2.0, step=False)
    got = [r.getMessage() for r in caplog.records]
    assert got[0] == "AddRequest r on p0 at 0.000000"
    assert got[1] == "r on p0: held for transfer after 1 tokens"
    assert got[2] == "AddRequest r on p0 at 1.000000"
    assert got[3].startswith("AddRequest on p0 refused: ")
    assert got[4:] == ["Abort r on p0 at 2.000000"]
