"""benchmarks/fidelity.py's deployments by name: a ``-tpN`` suffix makes every instance N ranks,
``-ppN`` a pipeline of N stages (served live and simulated from the same spec, priced by a
profile measured at that layout)."""

from __future__ import annotations

import pytest

from pdserve.bench.experiments.fidelity import deployment
from pdserve.config import ClusterConfig


@pytest.mark.parametrize("name,roles", [
    ("colocated", [("colocated", 1, 1)]),
    ("colocated-tp2", [("colocated", 2, 1)]),
    ("disaggregated-tp2", [("prefill", 2, 1), ("decode", 2, 1)]),
    ("colocated-pp2", [("colocated", 1, 2)]),
    ("colocated-tp2-pp2", [("colocated", 2, 2)]),
])
def test_deployment_names(name: str, roles: list[tuple[str, int, int]]) -> None:
    entries, layout = deployment(name)
    assert layout == max((tp, pp) for _, tp, pp in roles)
    spec = ClusterConfig.from_dict({**entries, "backend": "inproc"})
    assert [(s.role, s.tp, s.pp) for s in spec.instance_specs(1024)] == roles


@pytest.mark.parametrize("name", ["colocated-tp0", "colocated-tpx", "coloc", "colocated-tp",
                                  "colocated-pp0", "colocated-xx2", "colocated-"])
def test_bad_deployment_names(name: str) -> None:
    with pytest.raises(SystemExit, match=f"unknown deployment {name!r}"):
        deployment(name)
