"""The planner's workload cache is bounded by prompt tokens, not by a count of entries: a
steady-state probe's request count differs with its rate, and each workload holds every
prompt's token ids (64 cached 4,000-token workloads grew a plan worker past 10 GB)."""

from __future__ import annotations

import pytest

from pdserve.planner import problem as problem_mod
from pdserve.planner.problem import Problem, base_workload


def test_the_cache_keeps_recent_workloads_within_its_token_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(problem_mod, "_workloads", type(problem_mod._workloads)())
    monkeypatch.setattr(problem_mod, "WORKLOAD_CACHE_TOKENS", 2_500)  # 100-token prompts
    p = Problem(workload="fixed:input=100,output=4", num_requests=10)
    first = base_workload(p, 10)
    assert base_workload(p, 10) is first  # cached
    for n in (11, 12, 13):  # 1,000 + 1,100 + 1,200 + 1,300 tokens: the oldest ones go
        base_workload(p, n)
    kept = {n: tokens for (_, n), (_, tokens) in problem_mod._workloads.items()}
    assert kept == {12: 1_200, 13: 1_300}
    assert base_workload(p, 10) is not first  # made again, the same requests
    assert [r.prompt_token_ids for r in base_workload(p, 10).requests] == \
        [r.prompt_token_ids for r in first.requests]
    big = base_workload(p, 40)  # alone over the budget: still kept, as the newest
    assert list(problem_mod._workloads) == [(p, 40)] and base_workload(p, 40) is big
