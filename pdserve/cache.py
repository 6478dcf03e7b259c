"""pdserve's on-disk cache: ``$PDSERVE_CACHE`` (or ``~/.cache/pdserve``), filled atomically."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable


def cache_root() -> str:
    return os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdserve")


def build_once(path: str, build: Callable[[str], None],
               done_marker: str = "tokenizer_config.json") -> str:
    """``path``, built by ``build(tmp_dir)`` the first time (when ``done_marker`` is missing)
    and moved into place atomically: an interrupted build leaves no half-written ``path``, and
    of two processes building at once one wins and the other's copy is dropped."""
    if os.path.isfile(os.path.join(path, done_marker)):
        return path
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(path):  # left half-written by an interrupted run
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path
