"""``pdserve profile --tp 2`` times the sharded executor (two gloo ranks) and writes a profile
for tp=2 instances with the share of each step spent in collectives; ``pdserve simulate`` uses it
for tp=2 instances and refuses it, in one line, for any other degree. The reference for the
collectives is the TP1 profile of the same grid, which has none."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from pdserve.cli import main
from pdserve.sim import profiler
from pdserve.sim.latency import FittedProfile

# 3 prefill, 3 decode and 1 mixed shape, one timed run each
TINY_GRID = profiler.ProfileGrid(prefill_lens=(16, 32, 64), prefill_batches=(1,),
                                 decode_batches=(1, 2, 4), decode_ctx=(32,),
                                 mixed=((0, 16, 2, 32),), max_prefill_tokens=64, repeats=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdserve.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def live_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}


LEFT_OVER: set[int] = set()  # processes the profile run started and did not stop


def quick_profile(model_dir: str, out: Path, *flags: str) -> set[int]:
    """``pdserve profile --quick`` of ``model_dir`` over :data:`TINY_GRID` into ``out``; the
    processes it started and did not stop."""
    before = live_children()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profiler, "QUICK_GRID", TINY_GRID)
        assert main(["profile", "--model", model_dir, *flags, "--quick",
                     "--out", str(out)]) == 0
    return live_children() - before


@pytest.fixture(scope="module")
def tp2_profile(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "tp2.json"
    LEFT_OVER.update(quick_profile(model_dir, out, "--tp", "2"))
    return out


def test_profile_tp2_carries_its_tp_and_collectives(model_dir: str, tp2_profile: Path) -> None:
    data = json.loads(tp2_profile.read_text())
    assert data["tp"] == 2 and "--tp 2" in data["source"]
    assert {k: c["n"] for k, c in data["collectives"].items()} == {
        "prefill": 3, "decode": 3, "mixed": 1}
    assert all(0 < c["mean"] <= c["max"] < 1 for c in data["collectives"].values())
    prof = FittedProfile.load(tp2_profile)  # the extra entry does not get in the way
    assert prof.tp == 2 and prof.fit_error["prefill"]["n"] == 3
    assert not LEFT_OVER  # the other rank stopped

    tp1 = profiler.profile_instance(model_dir, grid=TINY_GRID, progress=False)
    assert tp1.profile.tp == 1
    assert all(c["max"] == 0 for c in tp1.collectives.values())


def test_simulate_uses_the_tp2_profile_for_tp2_instances(model_dir: str, tp2_profile: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    common = ["simulate", "--profile", str(tp2_profile), "--model", model_dir,
              "--workload", "fixed:input=32,output=4", "--num-requests", "6", "--rate", "4",
              "--no-progress"]
    assert main([*common, "--strategy", "disaggregated", "--prefill-tp", "2", "--decode-tp",
                 "2", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    roles = data["deployment"]["roles"]
    assert roles["prefill"]["tp"] == roles["decode"]["tp"] == 2
    assert all("tp=2" in r["latency_model"] for r in roles.values())
    assert data["num_gpus"] == 4 and data["summary"]["num_ok"] == 6


def test_simulate_refuses_the_profile_at_another_tp(model_dir: str, tp2_profile: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    rc = main(["simulate", "--profile", str(tp2_profile), "--model", model_dir,
               "--strategy", "disaggregated", "--prefill-tp", "2", "--workload",
               "fixed:input=32,output=4", "--num-requests", "2", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == (f"pdserve simulate: error: profile {str(tp2_profile)!r} was measured at "
                       f"tp=2, not tp=1; measure both with `pdserve profile --tp 1,2` "
                       "(one file)")


@pytest.mark.parametrize("tp,cpus,says", [
    ("3", None, "tp=3"),  # 4 heads, 2 KV heads: 3 divides neither
    ("4", 2, "tp=4 x pp=1 needs 4 ranks, more than the 2 CPUs available"),
])
def test_profile_refuses_a_tp_it_cannot_run(model_dir: str, tmp_path: Path, tp: str,
                                            cpus: int | None, says: str,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    if cpus is not None:
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    rc = main(["profile", "--model", model_dir, "--tp", tp, "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("pdserve profile: error: ") and says in err[0]
    assert not (tmp_path / "p.json").exists()


def test_one_file_prices_each_instance_at_its_own_tp(model_dir: str, tp2_profile: Path,
                                                     tmp_path: Path) -> None:
    """DistServe's layout from measured profiles: a file of the TP1 and TP2 profiles (what
    ``pdserve profile --tp 1,2`` writes) prices prefill TP2 with the TP2 entry and decode TP1
    with the TP1 entry; a tp it lacks is refused with the degrees it has."""
    tp1 = profiler.profile_instance(model_dir, grid=TINY_GRID, progress=False)
    both = tmp_path / "tp1-2.json"
    profiler.save_profiles(str(both), [tp1, _measured(tp2_profile)])
    doc = json.loads(both.read_text())
    assert sorted(doc["by_tp"]) == ["1", "2"] and "collectives" in doc["by_tp"]["2"]
    assert FittedProfile.load(both, tp=2) == FittedProfile.load(tp2_profile)
    assert FittedProfile.load(both, tp=1) == tp1.profile
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(both), "--model", model_dir, "--strategy",
                 "disaggregated", "--prefill-tp", "2", "--decode-tp", "1", "--workload",
                 "fixed:input=32,output=4", "--num-requests", "6", "--rate", "4",
                 "--no-progress", "--output-json", str(out)]) == 0
    roles = json.loads(out.read_text())["deployment"]["roles"]
    assert "tp=2" in roles["prefill"]["latency_model"]
    assert "tp=1" in roles["decode"]["latency_model"]
    with pytest.raises(ValueError, match=r"has no tp=4 profile; measured at tp=1, 2 "
                       r"\(`pdserve profile --tp 1,2,4` measures them all into one file\)"):
        FittedProfile.load(both, tp=4)


def _measured(path: Path) -> profiler.MeasuredProfile:
    data = json.loads(path.read_text())
    return profiler.MeasuredProfile(FittedProfile.load(path), data["collectives"])


def test_profile_checks_every_tp_before_measuring_any(model_dir: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[int] = []
    monkeypatch.setattr("pdserve.sim.cli.profile_instance",
                        lambda *a, tp=1, **kw: measured.append(tp))
    rc = main(["profile", "--model", model_dir, "--tp", "1,3", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "tp=3" in err[0]
    assert measured == [] and not (tmp_path / "p.json").exists()
