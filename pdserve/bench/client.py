"""Open-loop streaming client for OpenAI-compatible ``/v1/completions`` servers (pdserve, vLLM,
SGLang), built on ``httpx``.

Each request is sent at its arrival time whatever the state of earlier ones (open loop), with
``max_tokens`` = its output length and ``ignore_eos: true`` so that output lengths are forced;
``stream_options.include_usage`` asks for the token count at the end. The timeline's
``arrival`` is the *scheduled* send time, so any delay on the client side — including the
concurrency cap, a safety limit on open connections (``max_concurrency``) — counts against
TTFT like a server queue would; raise the cap if the progress bar shows requests waiting for it.

Token times: each stream chunk's receive time. A server may put several tokens in one chunk (or
send a final chunk with no token); when the chunk count differs from ``usage.completion_tokens``
the token times are spread evenly between the first and the last token chunk, which keeps TTFT
and TPOT exact, and the record's ``note`` says so. Errors (HTTP 4xx/5xx, error chunks, dropped
connections, timeouts) become ``ok=False`` records; a read that sees no data for ``timeout``
seconds fails the request, so a run never hangs.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.bench.metrics import RequestRecord, timeline_from_dict
from pdserve.bench.workloads import WorkloadRequest
from pdserve.request import Timeline


@dataclass
class ClientConfig:
    """``timeout``: seconds a connect or a read may wait for data; ``total_timeout``: optional
    cap on a whole request. ``request_timeline`` sends ``return_timeline: true`` (servers that
    do not know it ignore it). ``extra_body`` is merged into every request body."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int = 1024
    timeout: float = 300.0
    total_timeout: float | None = None
    request_timeline: bool = True
    send_min_tokens: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


class SSEDecoder:
    """Server-sent events as the WHATWG spec parses them: bytes in (UTF-8, decoded across
    chunk boundaries), the ``data`` of each complete event out. Only CR, LF and CRLF end a line
    (not U+0085, U+2028 or U+2029, which Python's ``str.splitlines`` and so httpx's
    ``aiter_lines`` also split on); a blank line dispatches the event; ``data:`` loses one
    leading space and several ``data`` lines join with LF; comments and other fields are
    skipped; an event without a ``data`` field is not dispatched, nor is one cut off by the end
    of the stream."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._bom_checked = False

    def feed(self, chunk: bytes) -> list[str]:
        text = self._buf + self._utf8.decode(chunk)
        if not self._bom_checked and text:
            text = text.removeprefix("\ufeff")
            self._bom_checked = True
        out: list[str] = []
        start = 0
        while True:
            cr, lf = text.find("\r", start), text.find("\n", start)
            if cr < 0 and lf < 0:
                break
            if cr >= 0 and (lf < 0 or cr < lf):
                if cr + 1 == len(text):  # a CR at the end: wait to see whether LF follows
                    break
                end, nxt = cr, cr + 2 if text[cr + 1] == "\n" else cr + 1
            else:
                end, nxt = lf, lf + 1
            self._line(text[start:end], out)
            start = nxt
        self._buf = text[start:]
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if not line:
            if self._data:
                out.append("\n".join(self._data))
            self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from ``http://host:port/``, ``.../v1`` or ``.../v1/``."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"target URL must start with http:// or https://, got {url!r}")
    return url[:-3] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(status: int, raw: bytes) -> str:
    """``HTTP 400: <message>`` from an OpenAI-style error body (or the start of any body)."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        d = json.loads(text)
        e = d.get("error", d) if isinstance(d, dict) else d
        msg = e.get("message") or e.get("detail") if isinstance(e, dict) else e
        text = str(msg if msg is not None else d)
    except (json.JSONDecodeError, AttributeError):
        pass
    return f"HTTP {status}: {text[:300]}"


async def fetch_model_info(base_url: str, api_key: str | None = None, timeout: float = 10.0
                           ) -> tuple[str, int | None, int | None, int | None]:
    """The first served model's id, its ``max_model_len``, ``vocab_size`` and the deployment's
    ``num_gpus`` where the server reports them (vLLM reports the first, pdserve all three)."""
    url = normalize_base_url(base_url) + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=timeout) as c:
            r = await c.get(url, headers=_headers(api_key))
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ConnectionError(f"{url} answered {error_message(r.status_code, r.content)}")
    try:
        card = r.json()["data"][0]
        return (str(card["id"]), card.get("max_model_len"), card.get("vocab_size"),
                card.get("num_gpus"))
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConnectionError(f"{url} did not list any model") from None


async def fetch_metrics(base_url: str, api_key: str | None = None,
                        timeout: float = 10.0) -> str:
    """The server's Prometheus ``/metrics`` text (pdserve and vLLM serve it)."""
    url = normalize_base_url(base_url) + "/metrics"
    try:
        async with httpx.AsyncClient(timeout=timeout) as c:
            r = await c.get(url, headers=_headers(api_key))
    except httpx.HTTPError as e:
        raise RuntimeError(f"scraping {url} failed: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"scraping {url} failed: HTTP {r.status_code}")
    return r.text


def reconcile_token_times(chunk_times: Sequence[float], chunk_texts: Sequence[str],
                          last_finished: bool,
                          usage_tokens: int | None) -> tuple[list[float], str | None]:
    """Token times from chunk receive times (module docstring); returns (times, note)."""
    times = list(chunk_times)
    n = usage_tokens
    trailing_empty = len(times) > 1 and last_finished and chunk_texts[-1] == ""
    if n is None:
        return (times[:-1] if trailing_empty else times), None
    if n == len(times):
        return times, None
    if trailing_empty and n == len(times) - 1:
        return times[:-1], None
    if n <= 0 or not times:
        return [], None if not times else f"{len(times)} chunks but usage reports {n} tokens"
    if trailing_empty:
        times = times[:-1]
    first, last = times[0], times[-1]
    spread = [first] if n == 1 else [first + (last - first) * i / (n - 1) for i in range(n)]
    return spread, (f"{len(chunk_times)} chunks for {n} tokens: token times spread evenly "
                    "between the first and the last chunk")


def build_body(req: WorkloadRequest, model: str, cfg: ClientConfig) -> dict[str, Any]:
    prompt: Any = req.prompt if req.prompt is not None else req.prompt_token_ids
    if prompt is None:
        raise ValueError(f"request {req.request_id} has neither prompt text nor token ids")
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": req.output_len, "ignore_eos": True,
        "temperature": cfg.temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.send_min_tokens:
        body["min_tokens"] = req.output_len
    if cfg.request_timeline:
        body["return_timeline"] = True
    body.update(cfg.extra_body)
    return body


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            req: WorkloadRequest, clock: Callable[[], float],
                            headers: dict[str, str] | None = None) -> RequestRecord:
    """Send one streaming request; every time is ``clock()`` (the run's relative clock)."""
    tl = Timeline(arrival=req.arrival_time)
    rec = RequestRecord(req.request_id, req.prompt_len, 0, tl, ok=False,
                        expected_output_len=req.output_len, sent_time=clock())
    times: list[float] = []
    texts: list[str] = []
    finish_reason: str | None = None
    usage_tokens: int | None = None
    done = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = error_message(resp.status_code, await resp.aread())
                return rec
            events = SSEDecoder()
            async for raw in resp.aiter_bytes():
                now = clock()
                for data in events.feed(raw):
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        err = obj["error"]
                        msg = err.get("message") if isinstance(err, dict) else err
                        rec.error = f"error in stream: {msg}"
                        break
                    choices = obj.get("choices") or []
                    if choices:
                        times.append(now)
                        texts.append(choices[0].get("text") or "")
                        finish_reason = choices[0].get("finish_reason") or finish_reason
                    usage = obj.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                    if obj.get("timeline"):
                        rec.server_timeline = timeline_from_dict(obj["timeline"])
                if done or rec.error is not None:
                    break
            tl.finish = clock()
    except httpx.TimeoutException as e:
        rec.error = f"timed out ({type(e).__name__}): no data within the read timeout"
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        rec.error = f"connection dropped: {type(e).__name__}: {e}"
    except httpx.ConnectError as e:
        rec.error = f"cannot connect: {e}"
    except json.JSONDecodeError as e:
        rec.error = f"bad stream chunk (not JSON): {e}"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    tokens, rec.note = reconcile_token_times(times, texts, finish_reason is not None,
                                             usage_tokens)
    tl.token_times = tokens
    rec.output_len = len(tokens)
    if rec.error is None:
        if not done and finish_reason is None:
            rec.error = "connection closed before the stream finished"
        elif not tokens:
            rec.error = "the server returned no tokens"
        else:
            rec.ok = True
            if rec.output_len != req.output_len:
                extra = f"server returned {rec.output_len} of {req.output_len} tokens"
                rec.note = f"{rec.note}; {extra}" if rec.note else extra
    return rec


def _failed(req: WorkloadRequest, error: str, sent: float | None) -> RequestRecord:
    return RequestRecord(req.request_id, req.prompt_len, 0, Timeline(arrival=req.arrival_time),
                         ok=False, error=error, expected_output_len=req.output_len,
                         sent_time=sent)


async def run_requests(requests: Sequence[WorkloadRequest], cfg: ClientConfig,
                       description: str = "requests") -> list[RequestRecord]:
    """Send ``requests`` open-loop at their arrival times; records come back in order."""
    base = normalize_base_url(cfg.base_url)
    if cfg.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {cfg.max_concurrency}")
    model = cfg.model
    if model is None:
        model = (await fetch_model_info(base, cfg.api_key, min(cfg.timeout, 30.0)))[0]
    url, headers = base + "/v1/completions", _headers(cfg.api_key)
    sem = asyncio.Semaphore(cfg.max_concurrency)
    limits = httpx.Limits(max_connections=cfg.max_concurrency,
                          max_keepalive_connections=cfg.max_concurrency)
    timeout = httpx.Timeout(cfg.timeout, pool=None)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                        console=Console(stderr=True), disable=not cfg.progress)
    t0 = 0.0
    clock = lambda: time.perf_counter() - t0

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        with progress:
            task = progress.add_task(description, total=len(requests), failed=0)
            failed = 0
            t0 = time.perf_counter()  # after the client's (slow) set-up

            async def one(req: WorkloadRequest) -> RequestRecord:
                nonlocal failed
                await asyncio.sleep(max(0.0, req.arrival_time - clock()))
                async with sem:
                    sent = clock()
                    try:
                        coro = stream_completion(client, url, build_body(req, model, cfg), req,
                                                 clock, headers)
                        rec = await asyncio.wait_for(coro, cfg.total_timeout)
                    except asyncio.TimeoutError:
                        rec = _failed(req, f"timed out after {cfg.total_timeout:g} s", sent)
                    except ValueError as e:
                        rec = _failed(req, str(e), sent)
                failed += not rec.ok
                progress.update(task, advance=1, failed=failed)
                return rec

            return list(await asyncio.gather(*(one(r) for r in requests)))
