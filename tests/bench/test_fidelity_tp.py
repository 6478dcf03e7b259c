"""benchmarks/fidelity.py's deployments by name: a ``-tpN`` suffix makes every instance N ranks
(served live and simulated from the same spec, priced by a profile measured at N)."""

from __future__ import annotations

import pytest

from pdserve.bench.experiments.fidelity import deployment
from pdserve.config import ClusterConfig


@pytest.mark.parametrize("name,roles", [
    ("colocated", [("colocated", 1)]),
    ("colocated-tp2", [("colocated", 2)]),
    ("disaggregated-tp2", [("prefill", 2), ("decode", 2)]),
])
def test_deployment_names(name: str, roles: list[tuple[str, int]]) -> None:
    entries, tp = deployment(name)
    assert tp == max(n for _, n in roles)
    spec = ClusterConfig.from_dict({**entries, "backend": "inproc"})
    assert [(s.role, s.tp) for s in spec.instance_specs(1024)] == roles


@pytest.mark.parametrize("name", ["colocated-tp0", "colocated-tpx", "coloc", "colocated-tp"])
def test_bad_deployment_names(name: str) -> None:
    with pytest.raises(SystemExit, match=f"unknown deployment {name!r}"):
        deployment(name)
