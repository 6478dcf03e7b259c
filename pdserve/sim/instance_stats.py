"""Per-instance statistics of a simulated run, over time: what a routing decision did to each
instance (``pdserve simulate --per-instance``).

For each instance (the one that computed a request's prefill) and each window of ``window``
virtual seconds:

* ``requests``: requests whose first token came in the window;
* ``hit_rate``: prompt tokens of those requests served from the instance's prefix cache /
  their prompt tokens;
* ``computed``: prompt tokens those requests computed (prompt − cached);
* ``queue``: mean number of requests routed to the instance and not yet at their first token
  (time average over the window: its prefill queue, the running prefill included);
* ``busy``: share of the window the instance spent computing steps (the simulator keeps it
  per virtual second, so a window of a few seconds or less is coarse).

The whole run (one window from 0 to the end) is the summary row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.sim.simulator import SimResult


@dataclass
class InstanceWindow:
    instance: str
    start: float
    end: float
    requests: int
    prompt_tokens: int
    computed: int
    queue: float
    busy: float

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.computed / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


def instance_windows(result: SimResult, window: float | None = None) -> list[InstanceWindow]:
    """One row per instance and window (``window`` seconds from 0; ``None``: the whole run),
    windows in time order, instances in their order within each."""
    if window is not None and not window >= 1:
        raise ValueError(f"window must be >= 1 second, got {window}")
    end = max(result.duration, 1e-9)
    width = end if window is None else window
    n = max(1, math.ceil(end / width))
    ids = list(dict.fromkeys([*result.instance_stats, *result.busy,
                              *(r.instance for r in result.records if r.instance)]))
    k = {iid: j for j, iid in enumerate(ids)}
    zero = [[0.0] * len(ids) for _ in range(n)]
    reqs, prompt, computed, queue, busy = (
        [row[:] for row in zero] for _ in range(5))

    def win(t: float) -> int:
        return min(int(t / width), n - 1)

    for r in result.records:
        if r.instance is None or r.instance not in k:
            continue
        j = k[r.instance]
        tl = r.timeline
        arrival = tl.arrival if tl.arrival is not None else 0.0
        first = tl.token_times[0] if tl.token_times else None
        if first is not None:
            w = win(first)
            reqs[w][j] += 1
            prompt[w][j] += r.prompt_len
            computed[w][j] += r.prompt_len - r.num_cached_tokens
        stop = first if first is not None else end
        t = arrival
        while t < stop:  # its time in the instance's queue, window by window
            w = win(t)
            edge = stop if w == n - 1 else min(stop, (w + 1) * width)
            queue[w][j] += edge - t
            t = edge
    for iid, secs in result.busy.items():
        j = k[iid]
        for sec, s in secs.items():  # (1-second resolution: a second counts to its window)
            busy[win(sec)][j] += s
    out = []
    for w in range(n):
        start, stop = w * width, min((w + 1) * width, end)
        span = max(stop - start, 1e-12)
        for iid, j in k.items():
            out.append(InstanceWindow(iid, start, stop, int(reqs[w][j]), int(prompt[w][j]),
                                      int(computed[w][j]), queue[w][j] / span,
                                      min(busy[w][j] / span, 1.0)))
    return out


def markdown(rows: Sequence[InstanceWindow], title: str) -> str:
    """The rows as a markdown table (with a window column when there are several windows)."""
    timed = len({r.start for r in rows}) > 1
    head = ["window (s)"] if timed else []
    lines = [f"### {title}", "",
             "| " + " | ".join([*head, "instance", "requests", "prefix-cache hit",
                                "prompt tokens computed", "mean queue", "busy"]) + " |",
             "|" + "---|" * (len(head) + 1) + "---:|" * 5]
    for r in rows:
        cells = [f"{r.start:g}–{r.end:g}"] if timed else []
        cells += [r.instance, str(r.requests), f"{r.hit_rate:.1%}", f"{r.computed:,}",
                  f"{r.queue:.2f}", f"{r.busy:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[InstanceWindow], path: str, title: str) -> str:
    """Four panels over time, one line per instance: hit rate, prompt tokens computed per
    second, mean queue, busy share. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    panels = (("hit_rate", "prefix-cache hit rate"), ("computed", "prompt tokens computed / s"),
              ("queue", "mean prefill queue (requests)"), ("busy", "busy share"))
    for iid in dict.fromkeys(r.instance for r in rows):
        mine = [r for r in rows if r.instance == iid]
        xs = [(r.start + r.end) / 2 for r in mine]
        for ax, (key, _) in zip(axes, panels):
            if key == "computed":
                ys = [r.computed / max(r.end - r.start, 1e-12) for r in mine]
            else:
                ys = [getattr(r, key) for r in mine]
            ax.plot(xs, ys, marker=".", label=iid)
    for ax, (_, label) in zip(axes, panels):
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=4)
    axes[-1].set_xlabel("virtual time (s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
