"""Joining or starting Ray: refusals say what to check, Ray's own warnings stay quiet (issue 15's
traps). ``ray.init`` is replaced, so these run without starting Ray."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pdserve.cluster import instances


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    ray = pytest.importorskip("ray")
    seen: dict[str, Any] = {}

    def init(**kw: Any) -> None:
        seen.update(kw)
        if seen.get("fail"):
            raise seen["fail"]

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    return seen


def test_a_refused_connection_says_what_to_check(fake_ray: dict[str, Any]) -> None:
    fake_ray["fail"] = ConnectionError("Token authentication is required")
    with pytest.raises(RuntimeError) as e:
        instances.init_ray("head-node.example:6379", 2)
    msg = str(e.value)
    for part in ("'head-node.example:6379'", "ConnectionError: Token authentication is required",
                 "ray status", "RAY_AUTH_TOKEN", "runs Ray"):
        assert part in msg, msg


def test_ray_warnings_are_silenced_and_a_local_cluster_fits_the_instances(
        fake_ray: dict[str, Any]) -> None:
    instances.init_ray(None, 64)
    assert fake_ray["logging_level"] >= logging.ERROR and fake_ray["log_to_driver"] is False
    assert fake_ray["num_cpus"] >= 64  # one CPU slot per instance actor
    fake_ray.clear()
    instances.init_ray("127.0.0.1:6379", 2)
    assert fake_ray["address"] == "127.0.0.1:6379" and fake_ray["logging_level"] >= logging.ERROR


def test_a_local_ray_runs_instance_actors_at_normal_priority_unless_told_otherwise(
        fake_ray: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    instances.init_ray(None, 2)
    assert fake_ray["_system_config"] == {"worker_niceness": 0}
    fake_ray.clear()
    monkeypatch.setenv("RAY_worker_niceness", "15")  # Ray's own variable: Ray reads it
    instances.init_ray(None, 2)
    assert "_system_config" not in fake_ray
    fake_ray.clear()
    instances.init_ray("127.0.0.1:6379", 2)  # a cluster's nodes keep their own setting
    assert "_system_config" not in fake_ray
