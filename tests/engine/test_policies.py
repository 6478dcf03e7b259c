"""Local waiting-queue policies: Preble's priority groups (hand-worked order), wiring, bad input."""

from collections import deque

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.policies import PriorityGroups, make_policy
from pdserve.request import Request, SamplingParams
from tests.engine.fakes import FakeExecutor, reference_generate

P = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def req(rid, n=10):
    return Request(rid, list(range(n)), P)


def test_group_of_hit_ratio():
    pol = PriorityGroups()
    hits = {"0": 0, "1": 1, "2": 2, "10": 10, "5": 5}
    groups = {r: pol.group(req(r), lambda q: hits[q.request_id]) for r in hits}
    # ceil(ratio * 10) - 1, no hit -> 0: Preble's local scheduler
    assert groups == {"0": 0, "1": 0, "2": 1, "10": 9, "5": 4}


def test_group_quotas_hand_worked_order():
    """P = 3 groups, quota k = 1: group i admits at most i + 1 requests per turn, groups served
    from the highest down in turn. Hit shares: A* 100 % (group 2), B* 50 % (group 1), C* none.

    turn 1: group 2 -> A1 A2 A3   turn 2: group 1 -> B1 B2   turn 3: group 0 -> C1
    turn 4: group 2 -> A4         turn 5: group 1 -> B3      turn 6: group 0 -> C2"""
    pol = PriorityGroups(num_groups=3, quota=1)
    hit = {"A": 10, "B": 5, "C": 0}
    cached = lambda r: hit[r.request_id[0]]  # noqa: E731
    waiting = deque(req(r) for r in ["C1", "B1", "A1", "A2", "C2", "B2", "A3", "B3", "A4"])
    order = []
    while waiting:
        for _ in range(pol.arrange(waiting, cached)):  # the step admits what the policy allows
            order.append(waiting.popleft().request_id)
    assert order == ["A1", "A2", "A3", "B1", "B2", "C1", "A4", "B3", "C2"]


def test_resumed_requests_stay_first():
    pol = PriorityGroups(num_groups=2, quota=1)
    pre = req("pre")
    pre.num_preemptions = 1
    waiting = deque([req("miss"), pre, req("hit")])
    limit = pol.arrange(waiting, lambda r: 10 if r.request_id == "hit" else 0)
    assert [r.request_id for r in waiting] == ["pre", "hit", "miss"] and limit == 1 + 1


def make_engine(policy):
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_kv_blocks=32),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64,
                                  policy=policy))
    return Engine(cfg, executor=FakeExecutor(32, 4))


@pytest.mark.parametrize("policy", ["fcfs", "preble"])
def test_cache_hits_go_first_in_the_engine(policy):
    """One sequence at a time: after `warm` finishes, `miss` (earlier) and `hit` (shares warm's
    12-token prefix) wait; Preble's policy admits the hit first, FCFS the earlier one."""
    eng = make_engine(policy)
    shared = list(range(1, 13))
    eng.add_request("warm", shared + [40], P, 0.0)
    while eng.has_unfinished():
        eng.step(0.0)
    eng.add_request("miss", list(range(20, 33)), P, 1.0)
    eng.add_request("hit", shared + [50], P, 1.0)
    admitted = []
    while eng.has_unfinished():
        res = eng.step(2.0)
        eng.check_integrity()
        for s in res.batch.seqs:
            if s.start == 0 or s.request_id == "hit" and s.start == 12:
                admitted.append(s.request_id)
        for o in res.outputs:
            if o.finished:
                assert o.token_ids == reference_generate(
                    shared + [50] if o.request_id == "hit" else list(range(20, 33)), 2)
    assert admitted == (["hit", "miss"] if policy == "preble" else ["miss", "hit"])


def test_bad_policy_names_and_parameters():
    with pytest.raises(ValueError, match="'sjf-ish'"):
        make_engine("sjf-ish")
    with pytest.raises(ValueError, match="num_groups"):
        make_policy("preble", num_groups=0)
    with pytest.raises(ValueError, match="bad parameters.*'preble'"):
        make_policy("preble", groups=3)
