"""Mitosis scaling of macro instances (EcoServe §4.2.4), as pure bookkeeping (sans-IO).

Macro instances are ordered lists of instance ids, each holding between N_l (``lower``) and N_u
(``upper``) instances once there are two or more:

- **expansion** adds an instance to the first macro instance below N_u; when all are full it
  goes to the last one, which past N_u splits: its last N_l instances move to a new macro
  instance (Figure 7: 4 + 1 → 3 | 2, then 4 | 2, 4 | 3, 4 | 4, 4 | 4 + 1 → 4 | 3 | 2);
- **contraction** removes an instance from the smallest macro instance while it has more than
  N_l; otherwise from the largest other one, and when the two then hold N_u or fewer they merge
  (4 | 2 → 3 | 2 → 2 | 2 → 4). A lone macro instance keeps N_l.

Instances change macro instance as :class:`InstanceHandle` values — small serializable records
carrying, in the live runtime on Ray, the instance's Ray actor handle (pickled through Ray's own
reducer and rebuilt on the other side; the runtime then reaches the actor through the rebuilt
handle); :func:`migrate` pickles one across and times it (the paper: < 100 ms). No instance
restarts, reloads or interrupts a request: membership only decides where new prompts go.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InstanceHandle:
    """What a macro-instance scheduler needs of an instance to route to it."""

    instance_id: str
    num_kv_blocks: int = 0
    block_size: int = 16
    actor: Any = None  # the instance's Ray actor handle, if it runs in one


@dataclass(frozen=True)
class Move:
    """``instance_id`` left macro instance ``src`` (``None``: the parked pool) for ``dst``
    (``None``: parked); ``seconds`` the handle's serialization round trip."""

    instance_id: str
    src: int | None
    dst: int | None
    seconds: float = 0.0


def migrate(handle: InstanceHandle) -> tuple[InstanceHandle, float]:
    """Send a handle to another macro-instance scheduler: pickle, unpickle (rebuild), timed."""
    t0 = time.perf_counter()
    out = pickle.loads(pickle.dumps(handle))
    return out, time.perf_counter() - t0


def check_bounds(lower: int, upper: int) -> None:
    if not (isinstance(lower, int) and isinstance(upper, int) and lower >= 1):
        raise ValueError(f"mitosis N_l must be an integer >= 1, got {lower!r}")
    if lower > upper:
        raise ValueError(f"mitosis N_l={lower} must be <= N_u={upper}")
    if upper < 2 * lower - 1:
        raise ValueError(f"mitosis N_u={upper} must be >= 2*N_l - 1 = {2 * lower - 1}: a split "
                         f"past N_u leaves two macro instances of at least N_l")


class Mitosis:
    """The macro instances' membership under expansion and contraction."""

    def __init__(self, lower: int, upper: int, groups: list[list[str]] | None = None) -> None:
        check_bounds(lower, upper)
        self.lower, self.upper = lower, upper
        self.groups: list[list[str]] = [list(g) for g in groups or []]

    @property
    def members(self) -> list[str]:
        return [i for g in self.groups for i in g]

    def sizes(self) -> list[int]:
        return [len(g) for g in self.groups]

    def expand(self, instance_id: str) -> list[Move]:
        """Add ``instance_id``; returns every move (the addition first, then a split's)."""
        if not self.groups:
            self.groups.append([instance_id])
            return [Move(instance_id, None, 0)]
        k = next((j for j, g in enumerate(self.groups) if len(g) < self.upper),
                 len(self.groups) - 1)
        self.groups[k].append(instance_id)
        moves = [Move(instance_id, None, k)]
        if len(self.groups[k]) > self.upper:  # split: N_l instances form a new macro instance
            moved = self.groups[k][-self.lower:]
            del self.groups[k][-self.lower:]
            self.groups.append(moved)
            moves += [Move(i, k, len(self.groups) - 1) for i in moved]
        return moves

    def contract(self, pick: Callable[[list[str]], str] | None = None) -> list[Move]:
        """Remove one instance (``pick`` chooses it within a macro instance; default: its last);
        returns the moves (the removal first, then a merge's), or ``[]`` when nothing can go."""
        pick = pick or (lambda g: g[-1])
        if not self.groups:
            return []
        if len(self.groups) == 1:
            g = self.groups[0]
            if len(g) <= self.lower:
                return []
            iid = pick(g)
            g.remove(iid)
            return [Move(iid, 0, None)]
        s = min(range(len(self.groups)), key=lambda j: (len(self.groups[j]), -j))
        if len(self.groups[s]) > self.lower:
            iid = pick(self.groups[s])
            self.groups[s].remove(iid)
            return [Move(iid, s, None)]
        f = max((j for j in range(len(self.groups)) if j != s),
                key=lambda j: (len(self.groups[j]), -j))
        iid = pick(self.groups[f])
        self.groups[f].remove(iid)
        moves = [Move(iid, f, None)]
        if len(self.groups[s]) + len(self.groups[f]) <= self.upper:  # merge s into f
            moves += [Move(i, s, f if f < s else f - 1) for i in self.groups[s]]
            self.groups[f] += self.groups[s]
            del self.groups[s]
        return moves
