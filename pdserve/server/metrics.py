"""Prometheus metrics of the API server, named after vLLM's with pdserve's prefix (``vllm:`` →
``pdserve:``; no ``vllm:`` series is served).

Per-request histograms and token counters are fed by a :class:`RequestTracker` from each
request's output deltas and observed from its final timeline; per-instance gauges and counters
are read from ``runtime.instance_status()`` at scrape time. Every app has its own
:class:`~prometheus_client.CollectorRegistry`, so several apps can live in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.cluster.serving_api import ServingRuntime
from pdserve.request import RequestOutput

log = logging.getLogger("pdserve.server")

# the instance label of a request no instance has produced output for (aborted, refused or
# failed while queued): counted, but under no instance
NO_INSTANCE = "none"

# Bucket choices follow vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# KV transfers are milliseconds on a fast link; vLLM has no such histogram.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)

_LABELS = ("model_name", "instance")


class ServerMetrics:
    """All metrics of one app, in their own registry."""

    def __init__(self, runtime: ServingRuntime, model_name: str,
                 logs: dict[str, Any] | None = None) -> None:
        """``logs``: the server's own log files by name (objects with an ``errors`` count:
        :class:`~pdserve.predict.train.PairLog`), whose failed writes are exported."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pdserve:{name}", doc, _LABELS, registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds",
                         "Time to first token (arrival to first token).", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Gap between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "End-to-end request latency (arrival to finish).", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Time from arrival to the start of prefill.", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "Prefill execution time (prefill start to end).", REQUEST_BUCKETS)
        self.transfer = hist("request_kv_transfer_time_seconds",
                             "KV cache transfer time from prefill to decode instance.",
                             TRANSFER_BUCKETS)
        self.decode = hist("request_decode_time_seconds",
                           "Decode time (from the end of prefill, transfer and decode queue "
                           "to the last token).", REQUEST_BUCKETS)
        self.decode_queue = hist("request_decode_queue_time_seconds",
                                 "Time between the end of prefill and the start of decode, less "
                                 "the KV transfer.",
                                 REQUEST_BUCKETS)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prefilled prompt tokens.",
                                     _LABELS, registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens.",
                                         _LABELS, registry=r)
        self.request_success = Counter("pdserve:request_success",
                                       "Finished requests by finish reason.",
                                       (*_LABELS, "finished_reason"), registry=r)
        r.register(_InstanceCollector(runtime, model_name))
        r.register(_LogCollector(model_name, dict(logs or {})))

    def tracker(self, num_prompt_tokens: int) -> RequestTracker:
        """A tracker for one new request."""
        return RequestTracker(self, num_prompt_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTracker:
    """Follows one request's output deltas into the metrics.

    Prompt tokens count when the first token arrives (labelled with the instance that produced
    it), generated tokens as they stream. At the final delta the timeline is observed: TTFT,
    queue and prefill time under the first token's instance, the rest under the last delta's.
    """

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self.m = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.first_instance: str | None = None
        self.last_instance: str | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        """Feed one delta (in order)."""
        if self.done:
            return
        m = self.m
        if out.instance_id:
            self.last_instance = out.instance_id
        if out.new_token_ids:
            inst = out.instance_id or self.last_instance or NO_INSTANCE
            if self.first_instance is None:
                self.first_instance = inst
                m.prompt_tokens.labels(m.model_name, inst).inc(self.num_prompt_tokens)
            m.generation_tokens.labels(m.model_name, inst).inc(len(out.new_token_ids))
        if out.finished:
            self._finish(out)

    def close(self, reason: str = "abort") -> None:
        """The request ended without a final delta (by default: the client went away)."""
        if not self.done:
            self.done = True
            inst = self.last_instance or NO_INSTANCE
            self.m.request_success.labels(self.m.model_name, inst, reason).inc()

    def _finish(self, out: RequestOutput) -> None:
        self.done = True
        m, name = self.m, self.m.model_name
        reason = out.finish_reason or "stop"
        last = self.last_instance or NO_INSTANCE
        first = self.first_instance or last
        m.request_success.labels(name, last, reason).inc()
        if reason not in ("stop", "length"):
            return
        tl = out.timeline
        times = tl.token_times

        def obs(h: Histogram, inst: str, start: float | None, end: float | None) -> None:
            if start is not None and end is not None:
                h.labels(name, inst).observe(max(end - start, 0.0))

        obs(m.ttft, first, tl.arrival, tl.first_token)
        stages = tl.stages()  # the benchmark breakdown's definition (DistServe §6.3)
        if stages is not None:
            for stage, h in (("prefill_queue", m.queue), ("prefill", m.prefill)):
                h.labels(name, first).observe(stages[stage])
            for stage, h in (("transfer", m.transfer), ("decode_queue", m.decode_queue),
                             ("decode", m.decode)):
                if stage != "transfer" or tl.transfer_start is not None:
                    h.labels(name, last).observe(stages[stage])
        itl = m.itl.labels(name, last)
        for a, b in zip(times, times[1:]):
            itl.observe(max(b - a, 0.0))
        obs(m.e2e, last, tl.arrival, tl.finish if tl.finish is not None else
            (times[-1] if times else None))


class _InstanceCollector:
    """Per-instance state read from the runtime at scrape time."""

    def __init__(self, runtime: ServingRuntime, model_name: str) -> None:
        self.runtime = runtime
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "instance", "role"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"pdserve:{name}", doc, labels=labels)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"pdserve:{name}", doc, labels=labels)

        alive = gauge("instance_alive", "1 if the instance is alive, else 0.")
        running = gauge("num_requests_running", "Requests in the instance's running batch.")
        waiting = gauge("num_requests_waiting",
                        "Requests waiting for the instance (queued, or awaiting their KV).")
        held = gauge("num_requests_held",
                     "Prefilled requests whose KV awaits a pull by a decode instance.")
        usage = gauge("kv_cache_usage_perc", "Share of KV cache blocks in use (0-1).")
        queries = counter("prefix_cache_queries", "Prefix cache queries, in tokens.")
        hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.")
        preempt = counter("num_preemptions", "Preemptions by recompute.")
        step_log = counter("step_log_write_errors",
                           "Step-log lines the instance could not write (full disk, ...).")
        # what a routing decision did to each instance (issue 27): its prefix-cache hit rate,
        # the prompt tokens it computed rather than read from its cache, its busy time
        hit_rate = gauge("prefix_cache_hit_rate",
                         "Prefix-cache hits / queries, in tokens, since the instance started "
                         "(0 before any query).")
        computed = counter("prompt_tokens_computed",
                           "Prompt tokens looked up in the prefix cache and not found there, "
                           "so computed by prefill (queries - hits).")
        busy = counter("busy_seconds",
                       "Seconds the instance spent computing steps (its rate is the busy "
                       "share).")
        try:
            statuses = self.runtime.instance_status()
        except Exception:  # a scrape must not fail because the runtime is shutting down
            log.exception("reading instance status failed")
            statuses = []
        for st in statuses:
            lv = [self.model_name, st.instance_id, st.role]
            alive.add_metric(lv, 1.0 if st.alive else 0.0)
            s = st.stats
            if s is None:
                continue
            running.add_metric(lv, s.num_running)
            waiting.add_metric(lv, s.num_waiting + s.num_pending_kv)
            held.add_metric(lv, s.num_held)
            usage.add_metric(lv, s.kv_usage)
            queries.add_metric(lv, s.prefix_queries)
            hits.add_metric(lv, s.prefix_hits)
            preempt.add_metric(lv, s.num_preemptions)
            step_log.add_metric(lv, s.step_log_errors)
            hit_rate.add_metric(lv, s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
            computed.add_metric(lv, s.prefix_queries - s.prefix_hits)
            busy.add_metric(lv, s.busy_time)
        yield from (alive, running, waiting, held, usage, queries, hits, preempt, step_log)
        yield from (hit_rate, computed, busy)


class _LogCollector:
    """Failed writes of the server's own log files (``--log-length-pairs``)."""

    def __init__(self, model_name: str, logs: dict[str, Any]) -> None:
        self.model_name = model_name
        self.logs = logs

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily("pdserve:log_write_errors",
                                "Lines the server could not write to its log files.",
                                labels=["model_name", "log"])
        for name, f in self.logs.items():
            c.add_metric([self.model_name, name], f.errors)
        yield c
