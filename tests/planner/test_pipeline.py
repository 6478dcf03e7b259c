"""Pipeline parallelism in the simulator: micro-batches really in flight (DistServe §3.1 Eq. 2,
§3.2 Fig. 5). With equal stages a PP = k instance finishes a saturating burst k times faster
than PP = 1, while each batch still takes one full pass."""

from __future__ import annotations

import pytest

from pdserve.bench.workloads import WorkloadRequest
from pdserve.config import ClusterConfig
from pdserve.sim.hardware import get_link
from pdserve.sim.target import SimulationConfig, simulate

D = 0.1  # one whole-model prefill step (s)
PROMPT = 512
N = 60


def _burst(n: int) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r{i}", 0.0, PROMPT, 1, list(range(4 + i, 4 + i + PROMPT)))
            for i in range(n)]


def _run(profile: str, pp: int, n: int = N):
    dep = ClusterConfig.from_dict({
        "model": "opt-13b", "strategy": "colocated", "pp": pp,
        "engine": {"dtype": "float16", "enable_chunked_prefill": False,
                   "max_num_batched_tokens": 600, "max_model_len": 600,
                   "enable_prefix_caching": False,
                   "max_num_seqs": 8}})
    recs, res, _ = simulate(SimulationConfig(dep, profile=profile), _burst(n), None, 50272)
    return recs, res


def _send(pp: int) -> float:
    """Activation hand-off between two stages: 512 tokens x hidden 5120 x 2 bytes on NVLink 3."""
    return get_link("nvlink3").min_time(PROMPT * 5120 * 2) if pp > 1 else 0.0


@pytest.mark.parametrize("pp", [2, 4])
def test_equal_stages_give_k_times_the_throughput(const_profile, pp):
    prof = const_profile({1: D * 1000})
    one, _ = _run(prof, 1)
    many, _ = _run(prof, pp)
    makespan1 = max(r.timeline.first_token for r in one)
    makespan = max(r.timeline.first_token for r in many)
    assert makespan1 == pytest.approx(N * D)  # one batch at a time
    s, send = D / pp, _send(pp)
    # steady state: a stage takes a new batch every s; the first needs a full pass to fill
    assert makespan == pytest.approx(N * s + (pp - 1) * (s + send), rel=0.02)
    assert makespan1 / makespan == pytest.approx(pp, rel=0.05)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_batch_still_waits_one_full_pass(const_profile, pp):
    recs, _ = _run(const_profile({1: D * 1000}), pp, n=1)
    assert recs[0].timeline.first_token == pytest.approx(D + (pp - 1) * _send(pp))
