"""How many torch threads a CPU step uses, chosen from the machine's load before each step.

A CPU forward is hundreds of small parallel ops, each ending in a barrier: with ``T`` threads,
every op waits for the slowest one. The premise: when another process wants a core, our second
thread gets half of a shared core in time slices and every barrier waits for its next slice, so
one thread alone on the free core would be faster. Under that premise the executor runs
``cores - others`` threads (at least 1, at most the configured count), where ``others`` is the
number of runnable tasks that are not ours, read from ``/proc/loadavg`` between steps (when our
OpenMP workers sleep) and smoothed as the median of the last :data:`WINDOW` samples. Threads
are not pinned: a pinned thread whose core becomes busy cannot move to the free one.

Opt-in (``PDSERVE_ADAPTIVE_THREADS=1``): it wins under heavy load from other processes but
loses at light load and beside a single busy process, where the premise does not hold with the
passive OpenMP wait policy (measurements: docs/benchmarks.md, "pdserve vs vLLM CPU").
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable

WINDOW = 9  # steps; the median of a window ignores a burst of one or two samples


def runnable_tasks() -> int | None:
    """Runnable tasks on the whole machine now (the ``a`` of ``a/b`` in ``/proc/loadavg``),
    the reading thread included; ``None`` where that file does not exist."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ThreadGovernor:
    """Chooses the thread count of the next step: ``max(1, min(max_threads, cores - others))``.

    ``sample`` returns the runnable tasks now, ourselves included (:func:`runnable_tasks` by
    default; tests pass a fake). ``own`` is how many of those are this process between steps
    (the thread that calls :meth:`threads`)."""

    def __init__(self, max_threads: int, cores: int | None = None,
                 sample: Callable[[], int | None] = runnable_tasks, own: int = 1,
                 window: int = WINDOW) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.cores = cores if cores is not None else usable_cores()
        self._sample = sample
        self._own = own
        self._others: deque[int] = deque(maxlen=window)

    def threads(self) -> int:
        """Sample the load once and return the thread count for the next step."""
        n = self._sample()
        if n is not None:
            self._others.append(max(n - self._own, 0))
        if not self._others:
            return self.max_threads
        others = int(statistics.median_low(self._others))
        return max(1, min(self.max_threads, self.cores - others))
