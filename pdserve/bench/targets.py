"""What a benchmark runs against: a served endpoint (``HttpTarget``) or a registered factory
(``sim``: :mod:`pdserve.sim.target` registers the simulator when imported; tests register
fakes).

A target runs a list of :class:`~pdserve.bench.workloads.WorkloadRequest` (arrival times are
offsets in seconds from the start of the run) and returns one
:class:`~pdserve.bench.metrics.RequestRecord` per request, in order. ``num_gpus`` is what
per-GPU numbers divide by.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from pdserve.bench.client import (
    ClientConfig,
    fetch_metrics,
    fetch_model_info,
    normalize_base_url,
    run_requests,
)
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import WorkloadRequest


@runtime_checkable
class Target(Protocol):
    name: str
    num_gpus: int

    async def run(self, requests: list[WorkloadRequest]) -> list[RequestRecord]: ...


UNKNOWN_GPUS = "assumed: the server does not report its GPU count; give --num-gpus"


class HttpTarget:
    """An OpenAI-compatible server (pdserve, vLLM, SGLang) driven by the streaming client.

    ``prepare()`` asks ``/v1/models`` for the model name (unless given), ``max_model_len`` and
    ``vocab_size`` (vLLM and pdserve report it; the CLI scales workloads to it) and, unless
    ``num_gpus`` is given, the deployment's GPU count (pdserve reports it; for other servers
    per-GPU numbers assume 1 and :attr:`num_gpus_note` says so).
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 max_concurrency: int = 1024, timeout: float = 300.0, *,
                 num_gpus: int | None = None,
                 name: str | None = None, request_timeline: bool = True,
                 progress: bool = True, extra_body: dict[str, Any] | None = None,
                 scrape_metrics: str | None = None, scrape_interval: float = 0.5) -> None:
        if num_gpus is not None and num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
        if scrape_interval <= 0:
            raise ValueError(f"scrape_interval must be > 0, got {scrape_interval}")
        self.config = ClientConfig(normalize_base_url(base_url), model, api_key, max_concurrency,
                                   timeout, request_timeline=request_timeline,
                                   progress=progress, extra_body=dict(extra_body or {}))
        self.name = name or self.config.base_url
        self.num_gpus = num_gpus or 1
        self.num_gpus_note: str | None = None if num_gpus else UNKNOWN_GPUS
        self.max_model_len: int | None = None
        self.vocab_size: int | None = None
        self.scrape_metrics, self.scrape_interval = scrape_metrics, scrape_interval

    async def prepare(self) -> None:
        model, self.max_model_len, self.vocab_size, gpus = await fetch_model_info(
            self.config.base_url, self.config.api_key)
        if self.num_gpus_note is not None and isinstance(gpus, int) and gpus >= 1:
            self.num_gpus, self.num_gpus_note = gpus, "reported by the server"
        if self.config.model is None:
            self.config = replace(self.config, model=model)

    async def run(self, requests: list[WorkloadRequest]) -> list[RequestRecord]:
        if self.scrape_metrics is None:
            return await run_requests(requests, self.config, description=self.name)
        scrapes: list[str] = []
        await self._scrape_once(scrapes)  # fails fast on a server without /metrics
        task = asyncio.create_task(self._scrape(scrapes))
        try:
            records = await run_requests(requests, self.config, description=self.name)
        finally:
            task.cancel()
            failed = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(failed, Exception) and not isinstance(failed, asyncio.CancelledError):
            raise failed
        await self._scrape_once(scrapes)  # the state after the last request
        with open(self.scrape_metrics, "a") as f:
            f.writelines(scrapes)
        return records

    async def _scrape(self, out: list[str]) -> None:
        """Scrape ``/metrics`` every ``scrape_interval`` s into ``out`` (JSON lines
        ``{"time", "metrics"}``, what ``pdserve calibrate --metrics-log`` reads)."""
        while True:
            await self._scrape_once(out)
            await asyncio.sleep(self.scrape_interval)

    async def _scrape_once(self, out: list[str]) -> None:
        text = await fetch_metrics(self.config.base_url, self.config.api_key)
        out.append(json.dumps({"time": time.time(), "metrics": text}) + "\n")


TargetFactory = Callable[[Any], Target]
_FACTORIES: dict[str, TargetFactory] = {}


def register_target(name: str, factory: TargetFactory) -> None:
    """Make ``--target NAME`` build ``factory(args)`` (``args``: the CLI namespace; its
    ``target_options`` dict holds ``--target-option KEY=VALUE`` pairs)."""
    _FACTORIES[name] = factory


def target_names() -> list[str]:
    return sorted(_FACTORIES)


def make_target(spec: str, args: Any, name: str | None = None) -> Target:
    """``http(s)://...`` → :class:`HttpTarget` configured from ``args`` (``model``,
    ``api_key``, ``max_concurrency``, ``timeout``, ``num_gpus``, ``no_timeline``,
    ``no_progress``); a registered name → its factory."""
    if (getattr(args, "scrape_interval", None) is not None
            and getattr(args, "scrape_metrics", None) is None):  # else ignored
        raise ValueError("--scrape-interval is the period of --scrape-metrics; add "
                         "--scrape-metrics FILE")
    if spec.startswith(("http://", "https://")):
        return HttpTarget(
            spec, getattr(args, "model", None), getattr(args, "api_key", None),
            getattr(args, "max_concurrency", 1024), getattr(args, "timeout", 300.0),
            num_gpus=getattr(args, "num_gpus", None), name=name,
            request_timeline=not getattr(args, "no_timeline", False),
            progress=not getattr(args, "no_progress", False),
            scrape_metrics=getattr(args, "scrape_metrics", None),
            scrape_interval=getattr(args, "scrape_interval", None) or 0.5)
    if spec in _FACTORIES:
        if getattr(args, "scrape_metrics", None) is not None:  # else never written
            raise ValueError(f"--scrape-metrics scrapes a live server's /metrics; target "
                             f"{spec!r} has none")
        target = _FACTORIES[spec](args)
        if name is not None:
            target.name = name
        return target
    raise ValueError(f"unknown target {spec!r}: give an http(s):// URL or one of "
                     f"{', '.join(target_names())}")
