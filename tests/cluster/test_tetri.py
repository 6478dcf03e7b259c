"""TetriInfer at the cluster level: length-aware decode dispatch in hand-made load states
(§3.3.4, seeded randomness), the controller's predicted-length bookkeeping, and instance flips
under load in the simulator that lose no request and leak no block (§3.5)."""

import random

import pytest

from pdserve.cluster.controller import ClusterRequest, Controller, Send
from pdserve.cluster.decode_dispatch import decode_demand
from pdserve.cluster.flip import FlipPolicy, IdleFlip, LowLoadFlip, TransitionWatcher
from pdserve.cluster.routing import InstanceView, make_router
from pdserve.cluster.worker import AddTransfer, TokenDelta
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.predict import LengthPrediction, Oracle
from pdserve.request import SamplingParams, Timeline
from pdserve.sim.simulator import SimInstance, SimRequest, Simulator


def dview(iid, predicted=0, heavy=0, light=0, active=0):
    v = InstanceView(iid, "decode", num_kv_blocks=100, block_size=4)  # 400 tokens
    v.predicted_tokens, v.num_heavy, v.num_light, v.active = predicted, heavy, light, active
    return v


def creq(prompt_len=20, bucket=0, g=100, max_tokens=1000):
    return ClusterRequest("r", [1] * prompt_len, SamplingParams(max_tokens=max_tokens),
                          Timeline(arrival=0.0), predicted=LengthPrediction(bucket, g))


# ------------------------------------------------------------------ dispatch (§3.3.4)
def test_demand_heavy_light_and_predicted_usage():
    # bucket 1 of 100: [100, 200), midpoint 150 > 128 -> heavy; usage 20 + 200 tokens
    assert decode_demand(creq(bucket=1)) == (True, 220)
    assert decode_demand(creq(bucket=0)) == (False, 120)  # midpoint 50: light
    assert decode_demand(creq(bucket=5, max_tokens=60)) == (False, 80)  # capped by max_tokens


def test_power_of_two_keeps_the_heavy_share_lowest_among_instances_with_room():
    """d0 has no room (390 + 220 > 400); of d1 (2 heavy, 2 light, 4 active) and d2 (1 heavy,
    0 light, 1 active) a heavy request goes to d1 (heavy share 3/5 < 2/2) although d1 is the
    busier one; a light one too (2/5 < 1/2)."""
    r = make_router("power_of_two_length")
    d0, d1, d2 = dview("d0", 390), dview("d1", 100, 2, 2, 4), dview("d2", 50, 1, 0, 1)
    assert r.select(creq(bucket=1), [d0, d1, d2]) is d1
    assert r.select(creq(bucket=0), [d0, d1, d2]) is d1
    # d1 with 3 heavy, 1 light: heavy share 4/5 vs d2's 2/2 -> still d1; with 1 heavy on d1
    # and none on an idle d2, a light request goes to d2 (0/1 < 1/3)
    d1.num_heavy, d1.num_light = 1, 1
    d2.num_heavy = 0
    assert r.select(creq(bucket=0), [d0, d1, d2]) is d2


def test_power_of_two_samples_two_of_alpha_with_its_seed():
    cands = [dview(f"d{i}", heavy=i, light=4 - i) for i in range(5)]
    r = make_router("power_of_two_length", seed=7)
    ref = random.Random(7)
    for _ in range(20):
        pair = ref.sample(cands, 2)
        want = min(pair, key=lambda v: (v.num_heavy + 1) / (v.num_heavy + v.num_light + 1))
        assert r.select(creq(bucket=2), cands) is want  # heavy, 320 tokens: all have room


def test_power_of_two_without_room_anywhere_takes_the_least_predicted_load():
    r = make_router("power_of_two_length")
    cands = [dview("d0", 300), dview("d1", 250), dview("d2", 390)]
    assert r.select(creq(bucket=3), cands).instance_id == "d1"  # needs 420 > 400 everywhere


def test_random_and_imbalanced():
    cands = [dview(f"d{i}") for i in range(3)]
    r, ref = make_router("random", seed=3), random.Random(3)
    assert [r.select(creq(), cands).instance_id for _ in range(10)] == \
        [ref.choice(cands).instance_id for _ in range(10)]
    imb = make_router("imbalanced")
    got = [imb.select(creq(bucket=b), cands).instance_id for b in (1, 0, 0, 1, 0)]
    assert got == ["d0", "d1", "d2", "d0", "d1"]  # heavy ones all on d0


# ------------------------------------------------------------------ controller bookkeeping
def test_controller_predicts_at_arrival_and_counts_decodes_per_instance():
    vs = [InstanceView("p0", "prefill", 100, 4), InstanceView("d0", "decode", 100, 4)]
    c = Controller(vs, decode_router="power_of_two_length", predictor=Oracle(100, 1.0))
    p = SamplingParams(max_tokens=250, ignore_eos=True)
    c.on_arrival("r", [1, 2, 3], p, now=0.0)
    assert c.requests["r"].predicted == LengthPrediction(2, 100)
    [a] = c.on_report_delta("p0", TokenDelta("r", [9], "", [0.1], held=True), now=0.1)
    assert a == Send("d0", AddTransfer("r", [1, 2, 3], [9], p, 0.0, LengthPrediction(2, 100)))
    d0 = c.instances["d0"]
    assert (d0.num_heavy, d0.num_light, d0.predicted_tokens) == (1, 0, 3 + 250)
    c.on_report_delta("d0", TokenDelta("r", [1] * 249, "", [1.0] * 249, finished=True,
                                       finish_reason="length"), now=1.0)
    assert (d0.num_heavy, d0.num_light, d0.predicted_tokens) == (0, 0, 0)


# ------------------------------------------------------------------ flips (§3.5)
MODEL = ModelConfig(family="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=4096)


class Linear:
    """prefill: 0.01 + 0.001 s/token; decode step 0.01 s."""

    def batch_time(self, batch):
        prefills, _ = batch.shape()
        toks = sum(n for _, n in prefills)
        return 0.01 + 0.001 * toks if toks else 0.01


def sched(role):
    return SchedulerConfig(max_num_batched_tokens=2048, max_model_len=2048, role=role,
                           enable_chunked_prefill=role != "prefill")


def cluster(flips, decode_blocks=40):
    def inst(iid, role, blocks):
        eng = EngineConfig(cache=CacheConfig(block_size=16, num_kv_blocks=blocks),
                           scheduler=sched(role))
        return SimInstance(iid, eng, Linear(), blocks)

    return Simulator([inst("p0", "prefill", 200), inst("p1", "prefill", 200),
                      inst("d0", "decode", decode_blocks)], MODEL,
                     controller_kw={"flips": flips})


def workload(n=30, gap=0.2, out=200):
    return [SimRequest(f"r{i}", i * gap, [(i * 31 + j) % 1000 for j in range(32)], out)
            for i in range(n)]


def check_nothing_lost(sim, res, n, out):
    assert len(res.records) == n
    for r in res.records:
        assert r.error is None and r.finish_reason == "length" and r.output_len == out
    for i in sim.insts.values():
        i.worker.check_integrity()
        s = i.worker.engine.scheduler
        assert s.pool.num_used_blocks == 0 and not s.requests  # no leaked block or request


def test_idle_prefill_instance_flips_to_decode_when_decodes_back_up():
    """p1 never gets a request (shortest queue prefers p0 on ties) and idles; the decode
    instance's memory (40 blocks, ~3 requests of 232 tokens) backs up: after 1 idle second p1
    becomes a decode instance and serves decodes; every request completes."""
    w = TransitionWatcher(IdleFlip(1.0), {"prefill": sched("prefill"), "decode": sched("decode")})
    sim = cluster(w)
    res = sim.run(workload())
    check_nothing_lost(sim, res, 30, 200)
    [rec] = w.records
    assert (rec.instance_id, rec.from_role, rec.to_role) == ("p1", "prefill", "decode")
    assert rec.decided >= 1.0 and rec.drained == rec.decided and rec.done >= rec.decided
    assert sim.controller.instances["p1"].role == "decode"
    assert sim.insts["p1"].worker.engine.scheduler.role == "decode"
    assert sim.insts["p1"].worker.engine.stats().busy_time > 0


class FlipAt(FlipPolicy):
    """Flip ``iid`` at ``t`` whatever its load (to drain an instance under load)."""

    name = "test"
    window_s = 1.0

    def __init__(self, iid, t):
        self.iid, self.t = iid, t

    def wants_flip(self, inst, act, now):
        return inst.instance_id == self.iid and inst.role == "prefill" and now >= self.t


def test_flip_under_load_drains_first_and_loses_nothing():
    """p0 is told to flip at t = 1 s while it has requests queued: new requests go to p1, p0
    finishes its queue and hands its KV over, then flips; no request is lost, no block leaks,
    and every prefill after the decision ran on p1."""
    w = TransitionWatcher(FlipAt("p0", 1.0), {"prefill": sched("prefill"),
                                              "decode": sched("decode")})
    sim = cluster(w)
    reqs = workload(40, gap=0.05)
    res = sim.run(reqs)
    check_nothing_lost(sim, res, 40, 200)
    [rec] = w.records
    assert rec.instance_id == "p0" and rec.to_role == "decode"
    assert rec.decided < rec.drained <= rec.done  # it had to drain
    routed = {r.request_id: r for r in sim.controller.history.values()}
    late = [r for r in routed.values() if r.timeline.arrival > rec.decided]
    assert late and all(r.prefill_instance == "p1" for r in late)
    assert sim.insts["p0"].worker.engine.scheduler.role == "decode"


def test_no_flip_without_a_backlog_and_never_the_last_instance_of_a_role():
    w = TransitionWatcher(IdleFlip(0.5), {"prefill": sched("prefill"), "decode": sched("decode")})
    sim = cluster(w, decode_blocks=2000)  # decode never backs up
    res = sim.run(workload(10, gap=0.3, out=20))
    check_nothing_lost(sim, res, 10, 20)
    assert w.records == []


def test_low_load_policy_busy_share():
    from pdserve.cluster.flip import Activity

    act = Activity(since=0.0, last_busy=0.0)
    act.steps.extend([(10.0, 2.0), (30.0, 1.0), (59.5, 1.0)])  # 4 s busy in [0, 60]
    pol = LowLoadFlip(0.1, 60.0)
    assert act.busy_share(60.0, 60.0) == pytest.approx(4 / 60)
    v = InstanceView("p0", "prefill", 10, 4)
    assert pol.wants_flip(v, act, 60.0)
    assert not pol.wants_flip(v, act, 50.0)  # not watched for a whole window yet
    act.steps.append((60.0, 3.0))
    assert not pol.wants_flip(v, act, 60.0)  # 6.5 / 60 >= 10 %


# ------------------------------------------------------------------ the command line
TETRI_FLAGS = ["--strategy", "disaggregated", "--num-prefill", "2", "--policy", "sjf",
               "--prefill-sched-batch", "16", "--prefill-chunk-size", "512",
               "--decode-router", "power_of_two_length", "--admission", "reserve-dynamic",
               "--length-predictor", "oracle", "--predictor-accuracy", "0.749",
               "--flip", "idle:60", "--kv-link", "300"]


def test_simulate_with_tetriinfer_flags(tmp_path, capsys):
    import json

    from pdserve.cli import main as pdserve_main

    out = tmp_path / "t.json"
    rc = pdserve_main(["simulate", "--hardware", "A100-80GB", "--model", "opt-13b",
                       *TETRI_FLAGS, "--workload", "fixed:input=300,output=20",
                       "--num-requests", "20", "--rate", "5", "--no-progress",
                       "--output-json", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    spec = data["deployment"]["spec"]
    assert spec["flip"] == "idle:60" and spec["predictor"]["name"] == "oracle"
    assert spec["engine"]["prefill_chunk_size"] == 512
    assert spec["engine"]["admission"] == "reserve-dynamic"
    assert data["summary"]["num_ok"] == 20


@pytest.mark.parametrize("flags, bad", [
    (["--flip", "sometimes"], "sometimes"),
    (["--predictor-granularity", "0"], "'0'"),
    (["--length-predictor", "psychic"], "psychic"),
    (["--admission", "lazy"], "lazy"),
    (["--policy", "shortest"], "shortest"),
    (["--predictor-accuracy", "1.5"], "1.5"),
    (["--prefill-chunk-size", "0"], "'0'"),
])
def test_bad_tetriinfer_flags_exit_2_with_one_line(flags, bad, capsys):
    from pdserve.cli import main as pdserve_main

    args = ["simulate", "--strategy", "disaggregated", "--workload", "fixed:input=8,output=2",
            "--num-requests", "2", "--rate", "1", "--no-progress", *flags]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(pdserve_main(args))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and bad in err, err


def test_a_saturated_role_needs_an_instance_without_a_backlog():
    """No transfer waits for memory, but both decode instances were busy 95 % of the last
    window: an idle prefill instance may flip to decode; at 50 % busy it may not."""
    from pdserve.cluster.flip import Activity

    w = TransitionWatcher(IdleFlip(10.0), {"prefill": sched("prefill"), "decode": sched("decode")})
    views = [InstanceView("p0", "prefill", 10, 4), InstanceView("d0", "decode", 10, 4),
             InstanceView("d1", "decode", 10, 4)]
    for v in views[1:]:
        act = w.activity[v.instance_id] = Activity(since=0.0, last_busy=20.0)
        act.steps.extend([(15.0, 5.0), (19.5, 4.5)])  # 9.5 s of [10, 20]
    assert w._needed(views, "decode", 20.0)
    w.activity["d1"].steps.popleft()  # d1: 4.5 s busy
    assert not w._needed(views, "decode", 20.0)


def test_set_role_is_refused_while_the_worker_holds_a_request():
    from pdserve.cluster.worker import AddRequest, InstanceWorker, SetRole
    from tests.engine.fakes import FakeExecutor

    eng = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=16),
                       scheduler=sched("prefill"))
    w = InstanceWorker("p0", eng, FakeExecutor(16, 4))
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    rep = w.handle([AddRequest("r", [1, 2, 3], p, 0.0), SetRole("decode", sched("decode"))],
                   0.0, step=False)
    assert rep.role == "prefill" and "drain it first" in rep.errors[0][1]
    w.handle([], 0.0)  # prefill -> held
    w.engine.release("r")
    rep = w.handle([SetRole("decode", sched("decode"))], 1.0)
    assert rep.role == "decode" and not rep.errors
    assert w.engine.scheduler.role == "decode"
