"""Per-instance statistics of a simulated run (issue 27): hand-worked windows, the simulator's
own accounting against the engines' counters, and ``pdserve simulate --per-instance``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.request import Timeline
from pdserve.sim.instance_stats import instance_windows, markdown
from pdserve.sim.simulator import SimRecord, SimResult


def rec(rid: str, inst: str, arrival: float, first: float, prompt: int, cached: int) -> SimRecord:
    return SimRecord(rid, prompt, 1, Timeline(arrival=arrival, token_times=[first], finish=first),
                     "length", None, cached, inst)


def test_windows_by_hand() -> None:
    """Two 10-s windows. a: r1 waits 2→6 (first token in w0, 100 tokens, 60 cached), r2 waits
    8→13 (first token in w1: 2 s of its wait in w0, 3 s in w1; 50 tokens, none cached).
    b: r3 waits 11→12 (200 tokens, 150 cached). Busy: a 4 s in second 3, 0.5 s in second 12;
    b 1 s in second 11."""
    res = SimResult([rec("r1", "a", 2, 6, 100, 60), rec("r2", "a", 8, 13, 50, 0),
                     rec("r3", "b", 11, 12, 200, 150)], duration=20.0, num_events=0,
                    busy={"a": {3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0, 12: 0.5}, "b": {11: 1.0}})
    rows = {(r.start, r.instance): r for r in instance_windows(res, 10)}
    a0, b0, a1, b1 = rows[0, "a"], rows[0, "b"], rows[10, "a"], rows[10, "b"]
    assert (a0.requests, a0.prompt_tokens, a0.computed) == (1, 100, 40)
    assert a0.hit_rate == pytest.approx(0.6)
    assert a0.queue == pytest.approx((4 + 2) / 10)  # r1's 4 s and r2's first 2 s
    assert a0.busy == pytest.approx(0.4)
    assert (a1.requests, a1.computed, a1.hit_rate) == (1, 50, 0.0)
    assert a1.queue == pytest.approx(3 / 10) and a1.busy == pytest.approx(0.05)
    assert (b0.requests, b0.queue, b0.busy, b0.hit_rate) == (0, 0.0, 0.0, 0.0)
    assert (b1.requests, b1.computed) == (1, 50)
    assert b1.hit_rate == pytest.approx(0.75) and b1.queue == pytest.approx(0.1)
    (wa, wb) = instance_windows(res)  # the whole run: one window of 20 s
    assert (wa.requests, wa.computed, wa.queue, wa.busy) == (2, 90, pytest.approx(9 / 20),
                                                            pytest.approx(4.5 / 20))
    assert "| b | 1 | 75.0% | 50 | 0.05 | 5.0% |" in markdown([wa, wb], "t")
    with pytest.raises(ValueError, match="window must be >= 1"):
        instance_windows(res, 0.5)


def test_simulated_busy_and_computed_tokens_match_the_engines() -> None:
    """The simulator's per-second busy time adds up to each engine's busy time, and the prompt
    tokens computed per instance to its prefix-cache queries minus hits (no preemption here)."""
    from pdserve.bench.workloads import make_workload
    from pdserve.config import ClusterConfig
    from pdserve.sim.target import SimulationConfig, simulate

    w = make_workload("prefix:num_prefixes=3,shared_len=512,unique_len=64,output_len=16", 60,
                      rate=20.0, max_model_len=2048)
    sim = SimulationConfig(ClusterConfig.from_dict(
        {"model": "opt-13b", "num_instances": 2, "prefill_router": "prefix_aware"}),
        hardware="A100-80GB")
    _, res, built = simulate(sim, w.requests, vocab_size=50272)
    rows = {r.instance: r for r in instance_windows(res)}
    assert sum(r.requests for r in rows.values()) == 60
    for iid, inst in built.simulator.insts.items():
        st = inst.worker.stats()
        assert st.num_preemptions == 0
        assert sum(res.busy[iid].values()) == pytest.approx(st.busy_time, rel=1e-9)
        assert rows[iid].computed == st.prefix_queries - st.prefix_hits
        assert rows[iid].prompt_tokens == st.prefix_queries


def test_simulate_per_instance_flag(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    main(["simulate", "--hardware", "A100-80GB", "--num-instances", "2", "--prefill-router",
          "prefix_aware", "--workload", "prefix:num_prefixes=2,shared_len=256,unique_len=32,"
          "output_len=4", "--num-requests", "20", "--rate", "10", "--per-instance", "1",
          "--output-json", str(out), "--plot", str(tmp_path), "--no-progress"])
    text = capsys.readouterr().out
    assert "per instance, whole run" in text and "per instance, 1-second windows" in text
    data = json.loads(out.read_text())["instances"]
    assert sum(r["requests"] for r in data["whole"]) == 20
    assert sum(r["requests"] for r in data["windows"]) == 20 and data["window_s"] == 1
    assert (tmp_path / "instances.png").stat().st_size > 0
    assert main(["simulate", "--per-instance", "0.5", "--num-requests", "2",
                 "--no-progress"]) == 2
    assert "--per-instance window must be >= 1 second" in capsys.readouterr().err
