"""One registry type for the named policy classes (routers, waiting-queue policies, decode
admission): a ``name -> class`` dict with a decorator to register and a checked constructor.

A registry is filled where its package is imported (``pdserve/engine/__init__.py``,
``pdserve/cluster/__init__.py``, ``pdserve/predict/__init__.py``); one whose names a config
validates is given that config's name table, so the two cannot drift apart."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, type[T]], Generic[T]):
    """``kind`` names the registered things in errors (``unknown router 'x'; available: ...``)."""

    def __init__(self, kind: str, names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.names = names  # the only names allowed (a config's table), or any

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: register ``cls`` under its ``name`` (one of ``names``, when
        given: the configs validate names against that table)."""
        name = cls.name  # type: ignore[attr-defined]
        if self.names is not None and name not in self.names:
            raise ValueError(f"{self.kind} {name!r} is not in its name table {self.names} "
                             f"(pdserve.config): add it there first")
        self[name] = cls
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
