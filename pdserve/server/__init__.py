"""OpenAI-compatible HTTP front end: :func:`build_app` over a ``ServingRuntime``.

``build_app`` is imported lazily so that ``pdserve.server.cli`` (the ``serve`` flags) loads
without FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.server.app import build_app

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from pdserve.server.app import build_app  # lazy: FastAPI (the serve flags load without)

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
