"""Tests' shorthand for a deployment's instance counts: only the counts its strategy has (a
count of a role the deployment lacks is refused, :meth:`pdserve.config.ClusterConfig.from_dict`)."""

from __future__ import annotations

from typing import Any


def role_counts(strategy: str, n: int = 1, p: int = 1, d: int = 1) -> dict[str, Any]:
    """``strategy`` and its counts: ``n`` colocated or temporal instances, or ``p`` prefill and
    ``d`` decode ones."""
    if strategy == "disaggregated":
        return {"strategy": strategy, "num_prefill": p, "num_decode": d}
    return {"strategy": strategy, "num_instances": n}
