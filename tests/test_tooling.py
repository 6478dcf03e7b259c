"""The habits CI enforces, as tests (so `python -m pytest` is the one command): the lint is
clean (ruff, configured in pyproject.toml) and the type checker passes over the packages
pyproject.toml's ``[tool.mypy] files`` names (engine/ and cluster/ at least). Both tools are in
the ``test`` extra: a missing tool is a failure, not a skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_check_is_clean():
    r = _run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean():
    r = _run("mypy")  # files and settings: [tool.mypy] in pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
