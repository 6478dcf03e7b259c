"""A short run of pdserve.bench.experiments.soak (benchmarks/soak.py): mixed requests with random
client cancels against the colocated and disaggregated in-process deployments; every request
ends with a result or an explicit error, and no KV block leaks."""

from __future__ import annotations

import importlib

import pytest

from tests.cluster.realstack import tiny_model


@pytest.fixture(scope="module")
def soak_module():
    return importlib.import_module("pdserve.bench.experiments.soak")


async def test_short_soak(soak_module, tmp_path_factory: pytest.TempPathFactory) -> None:
    results = await soak_module.run_strategies(
        tiny_model(tmp_path_factory), ["colocated", "disaggregated"], requests=40,
        concurrency=10, cancel=0.35, time_limit=8.0, seed=1)
    for strategy, r in results.items():
        assert r["ok"], (strategy, r["broken"], r["leaked_blocks"])
        assert r["outcomes"].get("ok", 0) >= 10, r["outcomes"]
        assert r["outcomes"].get("cancelled by client", 0) >= 3, r["outcomes"]
        assert all(s["used_blocks"] == 0 for s in r["pools"].values())


async def test_short_soak_with_an_instance_crash(soak_module,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two of three decode instances crash, 0.4 s apart: their requests are recomputed on the
    survivor or end with an explicit error; both are restarted in place (the role is back at
    full strength) and every pool is clean."""
    results = await soak_module.run_strategies(
        tiny_model(tmp_path_factory), ["disaggregated"], requests=30, concurrency=10,
        cancel=0.2, time_limit=8.0, seed=2, kills=2, kill_every=0.4)
    r = results["disaggregated"]
    assert r["killed"] == ["decode-2", "decode-1"]
    assert r["ok"], (r["broken"], r["leaked_blocks"])
    assert r["full_strength"] and len(r["recovery_s"]) == 2
    assert set(r["pools"]) == {"prefill-0", "decode-0", "decode-1", "decode-2"}
    assert all(s["used_blocks"] == 0 for s in r["pools"].values())
