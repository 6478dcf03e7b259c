"""Per-request records and the metrics computed from their timelines (DESIGN.md "Goodput
definitions").

- TTFT = first token − arrival; TPOT = (last − first token) / (tokens − 1), met by one-token
  outputs; ITL = gaps between consecutive tokens; E2E = finish (else last token) − arrival.
- A request *attains* when it succeeded, TTFT ≤ SLO_TTFT and TPOT ≤ SLO_TPOT. Failed or aborted
  requests never attain. Attainment = attaining requests / all requests.
- DistServe's variant (labelled ``distserve``): the target percentile (P90 for a 90 % target) of
  TTFT and of TPOT are checked separately; its attainment value is
  ``min(share meeting TTFT, share meeting TPOT)``, which is ≥ target exactly when both
  nearest-rank percentiles are within their SLOs.
- Latency breakdown (DistServe §6.3): prefill queue, prefill, transfer, decode queue, decode,
  from server-side timelines when the target provides them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pdserve.request import Timeline

CRITERIA = ("both", "distserve")
STAGES = ("prefill_queue", "prefill", "transfer", "decode_queue", "decode")


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds: time to first token and time per output token."""

    ttft: float
    tpot: float

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {v!r}")

    def scaled(self, scale: float) -> SLO:
        """Both objectives multiplied by ``scale`` (DistServe's "SLO Scale", §6.2)."""
        return SLO(self.ttft * scale, self.tpot * scale)


_TIMELINE_FIELDS = set(Timeline.__dataclass_fields__)


def timeline_from_dict(d: dict[str, Any]) -> Timeline:
    """``Timeline.from_dict`` that ignores unknown keys (servers may send more)."""
    return Timeline.from_dict({k: v for k, v in d.items() if k in _TIMELINE_FIELDS})


@dataclass
class RequestRecord:
    """What happened to one request. ``timeline`` is on the benchmark's clock (arrival = the
    scheduled send time); ``server_timeline`` is the server's own timeline when it sent one
    (its clock; used for the latency breakdown). ``output_len`` counts tokens received."""

    request_id: str
    prompt_len: int
    output_len: int
    timeline: Timeline
    ok: bool = True
    error: str | None = None
    server_timeline: Timeline | None = None
    expected_output_len: int | None = None
    sent_time: float | None = None
    note: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.timeline.ttft

    @property
    def tpot(self) -> float | None:
        return self.timeline.tpot

    @property
    def e2e(self) -> float | None:
        tl = self.timeline
        end = tl.finish if tl.finish is not None else (tl.token_times or [None])[-1]
        return None if end is None or tl.arrival is None else end - tl.arrival

    @property
    def itls(self) -> list[float]:
        t = self.timeline.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["timeline"] = self.timeline.to_dict()
        d["server_timeline"] = self.server_timeline.to_dict() if self.server_timeline else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        d = dict(d)
        d["timeline"] = timeline_from_dict(d["timeline"])
        if d.get("server_timeline"):
            d["server_timeline"] = timeline_from_dict(d["server_timeline"])
        return cls(**d)


def meets(record: RequestRecord, slo: SLO) -> tuple[bool, bool]:
    """(TTFT met, TPOT met); both ``False`` for a failed request or one without tokens."""
    if not record.ok or record.ttft is None:
        return False, False
    tpot = record.tpot
    return record.ttft <= slo.ttft, tpot is None or tpot <= slo.tpot


def attains(record: RequestRecord, slo: SLO) -> bool:
    ttft_ok, tpot_ok = meets(record, slo)
    return ttft_ok and tpot_ok


def attainment(records: Sequence[RequestRecord], slo: SLO, criterion: str = "both") -> float:
    """Share of requests attaining ``slo``; ``criterion='distserve'`` gives
    ``min(share meeting TTFT, share meeting TPOT)`` (module docstring)."""
    if not records:
        return 0.0
    flags = [meets(r, slo) for r in records]
    if criterion == "both":
        return sum(a and b for a, b in flags) / len(flags)
    if criterion == "distserve":
        return min(sum(a for a, _ in flags), sum(b for _, b in flags)) / len(flags)
    raise ValueError(f"unknown attainment criterion {criterion!r}; choose one of {CRITERIA}")


def required_scales(records: Sequence[RequestRecord], slo: SLO) -> tuple[np.ndarray, np.ndarray]:
    """Per request, the smallest SLO scale meeting TTFT and the smallest meeting TPOT (``inf``
    for failed requests, 0 for the TPOT of one-token outputs)."""
    ttft = np.full(len(records), np.inf)
    tpot = np.full(len(records), np.inf)
    for i, r in enumerate(records):
        if r.ok and r.ttft is not None:
            ttft[i] = max(r.ttft, 0.0) / slo.ttft
            tpot[i] = 0.0 if r.tpot is None else max(r.tpot, 0.0) / slo.tpot
    return ttft, tpot


def tightest_slo_scale(records: Sequence[RequestRecord], slo: SLO, target: float,
                       criterion: str = "both") -> float:
    """The smallest SLO scale at which attainment reaches ``target`` (``inf`` if none does):
    exact, from each request's required scale."""
    if not records:
        return math.inf
    ttft, tpot = required_scales(records, slo)
    k = max(1, math.ceil(target * len(records) - 1e-9))  # requests that must attain
    if criterion == "both":
        return float(np.sort(np.maximum(ttft, tpot))[k - 1])
    if criterion == "distserve":
        return float(max(np.sort(ttft)[k - 1], np.sort(tpot)[k - 1]))
    raise ValueError(f"unknown attainment criterion {criterion!r}; choose one of {CRITERIA}")


@dataclass
class Stats:
    """Distribution summary in seconds (``count`` values)."""

    count: int
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if len(values) == 0:
            return cls(0)
        a = np.asarray(values, dtype=float)
        return cls(len(a), float(a.mean()), float(np.median(a)), float(np.percentile(a, 90)),
                   float(np.percentile(a, 99)), float(a.max()))


def error_kind(message: str | None) -> str:
    """An error message with its numbers replaced by ``N``: errors that differ only in a
    token id, a length or a request id count as one kind."""
    return re.sub(r"\d+(\.\d+)?", "N", message or "unknown error")[:160]


def stage_durations(tl: Timeline) -> dict[str, float] | None:
    """One request's five stages: :meth:`pdserve.request.Timeline.stages`."""
    return tl.stages()


def latency_breakdown(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Mean seconds per stage and each stage's share of the total, over successful requests
    with a server (or simulator) timeline; ``None`` when no request has one."""
    rows, waits = [], []
    for r in records:
        if not r.ok:
            continue
        tl = r.server_timeline or r.timeline
        d = stage_durations(tl)
        if d is not None:
            rows.append(d)
            w = tl.switch_wait
            if w is not None:
                waits.append(w)
    if not rows:
        return None
    mean = {s: float(np.mean([d[s] for d in rows])) for s in STAGES}
    total = sum(sum(d.values()) for d in rows)
    share = {s: (sum(d[s] for d in rows) / total if total > 0 else 0.0) for s in STAGES}
    # EcoServe §4.2.2: first token → decoding starts (transfer + decode queue), every strategy
    switch = float(np.mean(waits)) if waits else None
    return {"count": len(rows), "mean_s": mean, "share": share, "switch_wait_mean_s": switch}


@dataclass
class Summary:
    """Everything one run reports. Rates are per second of the run; ``per_gpu`` divides the
    throughputs by ``num_gpus``."""

    num_requests: int
    num_ok: int
    num_failed: int
    duration_s: float
    offered_rate_rps: float | None
    throughput_rps: float
    output_tokens_per_s: float
    num_gpus: int
    per_gpu_throughput_rps: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    slo: dict[str, float] | None = None
    target: float | None = None
    attainment: float | None = None
    attainment_distserve: float | None = None
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None
    ttft_percentile: float | None = None
    tpot_percentile: float | None = None
    tightest_slo_scale: float | None = None
    breakdown: dict[str, Any] | None = None
    errors: dict[str, int] = field(default_factory=dict)
    num_gpus_note: str | None = None  # where num_gpus came from, when not from the user

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))


def json_safe(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become ``None``."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None, target: float = 0.9,
              num_gpus: int = 1) -> Summary:
    """Latency distributions over successful requests; attainment over all requests."""
    ok = [r for r in records if r.ok]
    arrivals = [r.timeline.arrival for r in records if r.timeline.arrival is not None]
    ends = [r.timeline.arrival + r.e2e for r in ok
            if r.e2e is not None and r.timeline.arrival is not None]
    start = min(arrivals) if arrivals else 0.0
    duration = max([*ends, *arrivals, start]) - start
    span = (max(arrivals) - start) if arrivals else 0.0
    offered = (len(arrivals) - 1) / span if span > 0 else None
    out_tokens = sum(r.output_len for r in ok)
    tput = len(ok) / duration if duration > 0 else 0.0
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = error_kind(r.error)
            errors[key] = errors.get(key, 0) + 1
    s = Summary(
        num_requests=len(records), num_ok=len(ok), num_failed=len(records) - len(ok),
        duration_s=duration, offered_rate_rps=offered, throughput_rps=tput,
        output_tokens_per_s=out_tokens / duration if duration > 0 else 0.0,
        num_gpus=num_gpus, per_gpu_throughput_rps=tput / max(num_gpus, 1),
        ttft=Stats.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Stats.of([r.tpot for r in ok if r.tpot is not None]),
        itl=Stats.of([g for r in ok for g in r.itls]),
        e2e=Stats.of([r.e2e for r in ok if r.e2e is not None]),
        breakdown=latency_breakdown(records), errors=errors)
    if slo is not None and records:
        flags = [meets(r, slo) for r in records]
        n = len(records)
        ttft_s, tpot_s = required_scales(records, slo)
        k = max(1, math.ceil(target * n - 1e-9))
        s.slo = {"ttft": slo.ttft, "tpot": slo.tpot}
        s.target = target
        s.attainment = sum(a and b for a, b in flags) / n
        s.ttft_attainment = sum(a for a, _ in flags) / n
        s.tpot_attainment = sum(b for _, b in flags) / n
        s.attainment_distserve = min(s.ttft_attainment, s.tpot_attainment)
        s.ttft_percentile = float(np.sort(ttft_s)[k - 1] * slo.ttft)
        s.tpot_percentile = float(np.sort(tpot_s)[k - 1] * slo.tpot)
        s.tightest_slo_scale = tightest_slo_scale(records, slo, target)
    return s
