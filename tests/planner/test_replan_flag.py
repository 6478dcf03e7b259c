"""``pdserve serve --replan``: the flags build a live replanner (DistServe §4.4) that searches each
role's goodput at the deployed TP × PP for the window's pattern and resizes the running
deployment; bad settings fail before any model loads."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest

from pdserve.bench.metrics import SLO
from pdserve.config import ClusterConfig
from pdserve.planner.problem import Problem
from pdserve.planner.replan import WindowStats, deployed_planner, replanner_from_args
from pdserve.planner.units import Unit, evaluate_unit
from pdserve.server.cli import register
from tests.cluster.test_live_scaling import pools_clean, prompt, run, runtime


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_no_replanner_without_the_flag():
    args = _args("--model", "opt-13b")
    assert replanner_from_args(args, ClusterConfig.from_dict({"model": "opt-13b"})) is None


def test_replanning_settings_without_the_flag_are_refused():
    # they were ignored: a server without a replanner, nothing said
    args = _args("--model", "opt-13b", "--replan-window", "5", "--replan-slo-ttft", "1")
    with pytest.raises(ValueError, match=r"^--replan-window, --replan-slo-ttft: settings of "
                                         r"live replanning; add --replan$"):
        replanner_from_args(args, ClusterConfig.from_dict({"model": "opt-13b"}))


@pytest.mark.parametrize(("argv", "spec", "needle"), [
    (["--replan-profile", "no-such-profile"], {}, "no-such-profile"),
    (["--replan-model", "gpt-nonexistent"], {}, "gpt-nonexistent"),
    (["--replan-profile", "p", "--replan-hardware", "A100-80GB"], {}, "not both"),
    (["--replan-hardware", "no-such-gpu"], {}, "unknown device 'no-such-gpu'"),  # was lazy
    ([], {"strategy": "partial", "num_instances": 2}, "'partial'"),
])
def test_bad_replanning_settings_fail_before_the_model_loads(argv, spec, needle):
    args = _args("--model", "opt-13b", "--replan", *argv)
    cfg = ClusterConfig.from_dict({"model": "opt-13b", **spec})
    with pytest.raises((ValueError, FileNotFoundError), match=needle):
        replanner_from_args(args, cfg)



def test_the_replanner_prices_steps_with_the_plans_serving_path(monkeypatch):
    # the plan's --step-overhead-ms / --seq-overhead-ms / --request-overhead-ms, given to
    # serve as --replan-..., reach the replanning search: its latency source is the plan's
    import pdserve.planner.replan as replan_mod
    from pdserve.planner.cli import problem_from_args
    from pdserve.planner.cli import register as register_plan

    seen = {}
    monkeypatch.setattr(replan_mod, "deployed_planner",
                        lambda problem, config: seen.setdefault("problem", problem))
    terms = ("step-overhead-ms", "1.5", "seq-overhead-ms", "0.09", "request-overhead-ms", "8")
    serve_args = [f"--replan-{t}" if i % 2 == 0 else t for i, t in enumerate(terms)]
    args = _args("--model", "opt-13b", "--replan", "--replan-hardware", "H100", *serve_args)
    assert replanner_from_args(args, ClusterConfig.from_dict({"model": "opt-13b"})) is not None
    got = seen["problem"]
    assert (got.step_overhead_ms, got.seq_overhead_ms, got.request_overhead_ms) == \
        (1.5, 0.09, 8.0)
    parser = argparse.ArgumentParser()
    register_plan(parser.add_subparsers(dest="command"))
    plan_args = [f"--{t}" if i % 2 == 0 else t for i, t in enumerate(terms)]
    planned = problem_from_args(parser.parse_args(
        ["plan", "--model", "opt-13b", "--hardware", "H100", "--rate", "1", *plan_args]))
    assert got.sim_settings() == planned.sim_settings()
    assert got.latency_source() == planned.latency_source()
    # unset: no serving-path terms, as plan's default
    seen.clear()
    replanner_from_args(_args("--model", "opt-13b", "--replan"),
                        ClusterConfig.from_dict({"model": "opt-13b"}))
    assert seen["problem"].latency_source().endswith("no serving-path terms")


def test_the_serve_flag_rejects_a_bad_window(capsys):
    from pdserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--demo", "--replan", "--replan-window", "-1"])
    assert e.value.code == 2
    assert "--replan-window: must be > 0" in capsys.readouterr().err


def test_deployed_planner_replicates_each_role_at_its_tp_pp(const_profile):
    """Alg. 1's last step at the deployed units: ``n = ⌈R / g⌉`` per role, each ``g`` the
    unit's goodput on the window's lengths."""
    prof = const_profile({1: 20.0, 2: 12.0}, decode_ms=10.0)
    p = Problem(model="opt-13b", profile=prof, slo=SLO(0.2, 0.05), num_requests=100,
                horizon=0.5)
    cfg = ClusterConfig.from_dict({"model": "opt-13b", "strategy": "disaggregated",
                                   "num_prefill": 1, "num_decode": 1, "prefill_tp": 2})
    w = WindowStats(rate=200.0, mean_prompt=600.0, mean_output=6.0, num_requests=600)
    got = deployed_planner(p, cfg)(w)
    fixed = Problem(model="opt-13b", profile=prof, slo=SLO(0.2, 0.05), num_requests=100,
                    horizon=0.5, rate=200.0, workload="fixed:input=600,output=6")
    g_p = evaluate_unit(fixed, Unit("prefill", 2)).goodput_rps
    g_d = evaluate_unit(fixed, Unit("decode", 1)).goodput_rps
    assert g_p > 0 and g_d > 0
    assert got == {"prefill": math.ceil(200 / g_p), "decode": math.ceil(200 / g_d)}
    assert got["prefill"] > 1  # 200 req/s of 600-token prompts is beyond one prefill instance


async def test_serve_replan_resizes_a_live_runtime(const_profile):
    """The replanner the flags build, on an in-process runtime with a virtual clock: a rate
    step up and down again is detected, the planned counts are ⌈R / g⌉ of the colocated TP1
    unit on each window's lengths, and every request is served while instances come and go."""
    # one chunked TP1 unit: ~7.6 req/s at steady state here (a decode step that costs the same
    # whatever its batch would batch without limit: its steady state serves hundreds per second)
    prof = const_profile({1: 100.0}, decode_ms=40.0, decode_per_seq_ms=1.0)
    now = [0.0]
    rt = runtime("colocated", n=1, router="round_robin", clock=lambda: now[0])
    args = _args("--replan", "--replan-window", "2", "--replan-min-requests", "5",
                 "--replan-model", "opt-13b", "--replan-profile", prof,
                 "--replan-slo-ttft", "0.3", "--replan-slo-tpot", "0.1",
                 "--replan-num-requests", "40")
    rp = replanner_from_args(args, rt.config)(rt)
    await rt.start()
    try:
        tasks, k = [], 0
        for rate, seconds in ((5, 4.0), (40, 3.0), (5, 6.0)):
            for _ in range(int(rate * seconds)):
                now[0] += 1 / rate
                tasks.append(asyncio.create_task(run(rt, f"r{k}", prompt(k), 8)))
                k += 1
                await asyncio.sleep(0.001)
                if rp.replans and rp.replans[-1].applied is None:
                    await rp.wait()
        res = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await rp.wait()
        assert len(res) == k and all(len(toks) == 8 for toks, _ in res)
        assert len(rp.replans) >= 2
        for r in rp.replans:  # each plan is ⌈R / g⌉ for the window it saw
            w = r.shift.after
            p = Problem(model="opt-13b", profile=prof, slo=SLO(0.3, 0.1), num_requests=40,
                        rate=w.rate, nodes=1, gpus_per_node=1,
                        workload=f"fixed:input={round(w.mean_prompt)},"
                                 f"output={round(w.mean_output)}")
            g = evaluate_unit(p, Unit("colocated", 1, chunked=True)).goodput_rps  # as deployed
            assert r.planned == {"colocated": max(1, math.ceil(w.rate / g - 1e-9))}, (w, g)
        assert max(r.planned["colocated"] for r in rp.replans) > 1  # it grew...
        assert rp.counts() == rp.replans[-1].planned  # ...and ends at the last plan
        await pools_clean(rt)
    finally:
        await rt.shutdown()


def test_serve_hands_the_replanner_to_the_server(monkeypatch):
    """``pdserve serve --replan``: the server loop gets the attach function (and none without
    the flag); attaching it to a runtime registers the monitor on the runtime's arrivals."""
    import pdserve.server.cli as serve_cli
    from pdserve.cli import main

    calls = []

    async def fake_serve(config, *args, **kw):  # noqa: ANN001, ANN202
        calls.append(kw)

    monkeypatch.setattr(serve_cli, "serve", fake_serve)
    assert main(["serve", "--demo", "--backend", "inproc", "--replan", "--replan-model",
                 "opt-13b", "--replan-profile", "distserve_profiler-a100-80g.distserve"]) == 0
    assert main(["serve", "--demo", "--backend", "inproc"]) == 0
    attach = calls[0]["replan"]
    assert "replan" not in calls[1]
    rt = runtime("colocated", n=1)
    rp = attach(rt)
    assert rt.arrival_hooks == [rp.observe] and rp.detector.window_s == 60.0
