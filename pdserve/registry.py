"""One registry type for the named policy classes (routers, waiting-queue policies, decode
admission): a ``name -> class`` dict with a decorator to register and a checked constructor."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, type[T]], Generic[T]):
    """``kind`` names the registered things in errors (``unknown router 'x'; available: ...``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: register ``cls`` under its ``name``."""
        self[cls.name] = cls  # type: ignore[attr-defined]
        return cls

    def make(self, name: str, **params: Any) -> T:
        """The class registered as ``name`` built with ``params``; a ``ValueError`` names an
        unknown name or bad parameters."""
        try:
            cls = self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {sorted(self)}") from None
        try:
            return cls(**params)
        except TypeError as e:
            raise ValueError(f"bad parameters for {self.kind} {name!r}: {e}") from None
