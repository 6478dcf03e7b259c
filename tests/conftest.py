"""Fixtures shared across test areas."""

from __future__ import annotations

import importlib.metadata

import pytest


@pytest.fixture
def aic_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """aiconfigurator-core looks uninstalled (its version lookup fails), installed or not."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "aiconfigurator-core":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
